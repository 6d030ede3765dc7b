"""Every benchmark's interval block renders from a small stored result, as `--from-json` does: no measuring, no
process launched. The figures come from the samples stored in the JSON, so the tests can check them exactly."""
from __future__ import annotations

import pytest
from benchmarks import (
    bench_dpp_real,
    bench_dpp_sim,
    bench_scan_detect,
    bench_scan_overhead,
    bench_scan_scale,
    bench_scope,
    bench_scope_training,
    harness,
    stats,
)


def _render(tmp_path, tag: str, body: str) -> str:
    doc = tmp_path / "benchmarks.md"
    doc.write_text(f"## S\n\nprose\n\n<!-- {tag} -->\n<!-- /{tag} -->\n\n## T\n")
    harness.write_block(doc, tag, body)
    text = doc.read_text()
    assert text.startswith("## S\n\nprose\n\n") and text.endswith(f"<!-- /{tag} -->\n\n## T\n")
    return text


def test_scan_overhead_pairs_steps_and_pools_blocks(tmp_path):
    one = {"off": [1.0, 1.0, 1.0, 1.0], "coarse": [1.01, 1.0, 1.02, 1.01], "full": [1.1, 1.1, 1.1, 1.1]}
    other = {"off": [2.0] * 4, "coarse": [2.0] * 4, "full": [2.2] * 4}
    result = {"target_ratio": 1.03, "load_avg_at_end": [1.0, 1.0, 1.0],
              "cases": [{"case": "dp=2", "steps_per_mode": 4, "raw_s": one, "blocks": [one, other]}]}
    rows = bench_scan_overhead.intervals(result)
    assert [r["value"] for r in rows] == pytest.approx([1.0, 1.1])
    assert rows[0]["basis"] == "pooled over 2 blocks of fresh processes" and rows[0]["n"] == 8
    assert rows[0]["claim"].startswith("met") and rows[1]["claim"] == "missed"
    text = _render(tmp_path, bench_scan_overhead.BLOCK, bench_scan_overhead.docs_block(result))
    assert "| whole steps, dp=2, full every iteration / untraced | 1.100 [1.100, 1.100] | 8 |" in text


def test_scan_detect_and_scale_use_wilson_intervals(tmp_path):
    res = {"true_positives": 19, "false_positives": 1, "missed": 1, "reference_recall": 0.5, "scenarios": 4,
           "grid": {"ranks": 64}, "rows": [{"faults": [], "found": []}, {"faults": [], "found": ["x"]},
                                          {"faults": ["a"], "found": ["a"]}]}
    rows = bench_scan_detect.intervals(res)
    lo, hi = stats.wilson_ci(19, 20)
    assert rows[0]["ci95"] == [lo, hi] and rows[0]["claim"] == "unresolved"  # 0.95 point, interval below 0.95
    assert rows[2]["value"] == 0.5 and rows[2]["claim"] == "missed"
    assert rows[3]["figure"] == "reference rule's recall (10/20)"
    _render(tmp_path, bench_scan_detect.BLOCK, bench_scan_detect.docs_block(res))
    scale = {"targets": {"total_s_at_12288": 30, "peak_mb_at_12288": 2048},
             "rows": [{"ranks": 12288, "healthy": False, "total_s": t, "peak_rss_mb": 900.0, "findings": 2}
                      for t in (20.0, 25.0, 28.0)] + [{"ranks": 12288, "healthy": True, "total_s": 9.0,
                                                        "peak_rss_mb": 900.0, "findings": 0}]}
    rows = bench_scan_scale.intervals(scale)
    assert rows[0]["value"] == 25.0 and rows[0]["claim"] == "met" and rows[0]["basis"] == "bootstrap over 3 blocks"
    assert rows[-1]["figure"].endswith("(0/1)")
    _render(tmp_path, bench_scan_scale.BLOCK, bench_scan_scale.docs_block(scale))


def test_dpp_sim_intervals_are_over_paired_seeds(tmp_path):
    shape = bench_dpp_sim.TARGET_SHAPES[0]
    per_seed = {"dpp-zb": [80.0, 85.0, 90.0], "interleaved-1f1b": [100.0, 100.0, 100.0], "zb-h1": [90.0, 95.0, 100.0]}
    result = {"seeds": [0, 1, 2], "rows": [{"pp": shape[0], "microbatches": shape[1], "jitter": "high",
                                            "step_per_seed": per_seed}]}
    rows = bench_dpp_sim.intervals(result)
    assert rows[0]["value"] == pytest.approx(0.85) and rows[0]["ci95"][1] <= 0.9 and rows[0]["claim"] == "met"
    assert rows[1]["value"] == pytest.approx(255 / 285) and rows[1]["ci95"][1] == pytest.approx(0.9)
    _render(tmp_path, bench_dpp_sim.BLOCK, bench_dpp_sim.docs_block(result))
    with pytest.raises(ValueError, match="per-seed"):
        bench_dpp_sim.intervals({"rows": [{"pp": shape[0], "microbatches": shape[1], "jitter": "high"}]})


def test_dpp_real_pools_blocks_and_renders_every_pair(tmp_path):
    def row(scale: float) -> dict:
        t = {"interleaved-1f1b": [1.0] * 3, "dpp-adaptive": [1.0] * 3, "dpp-zb": [scale] * 3, "zb-h1": [1.0] * 3}
        return {"case": "none", "times_s": t, "pipeline_s": t, "paired_ratio": {}, "paired_pipeline_ratio": {}}
    rows = bench_dpp_real._pool_blocks([[row(1.2)], [row(1.3)]])
    assert rows[0]["paired_ratio"]["dpp-zb/interleaved-1f1b"] == pytest.approx(1.25)
    iv = bench_dpp_real.intervals(rows[0])
    assert iv["dpp-zb/interleaved-1f1b"]["blocks"] == 2 and iv["dpp-zb/interleaved-1f1b"]["verdict"] == "worse"
    assert iv["dpp-adaptive/interleaved-1f1b"]["verdict"] == "within noise"
    result = {"blocks": 2, "machine": {"load_avg_at_end": [1.0, 1.0, 1.0]}, "cases": rows}
    text = _render(tmp_path, bench_dpp_real.BLOCK, bench_dpp_real.docs_block(result))
    assert "| none | 1.250 [1.200, 1.300] worse |" in text and "pooled over 2 blocks" in text


def test_scope_figures_render_or_say_why_not(tmp_path):
    reps = [{"off": {"seconds": 0.3, "cpu_s": 0.3}, "ours": {"seconds": 1.0, "cpu_s": 1.0},
             "reference": {"seconds": s, "cpu_s": 0.9}} for s in (2.0, 1.5, 1.2)]
    result = {"per_repeat": reps, "reference_vs_ours_bytes": 13.0}
    rows = bench_scope.intervals(result)
    assert [r["figure"].split(", ")[-1] for r in rows] == ["wall time", "CPU time"] * 2
    assert rows[0]["value"] == pytest.approx(1.5) and rows[0]["claim"] == "met"
    assert rows[1]["value"] == pytest.approx(0.9) and rows[1]["claim"] == "missed"
    assert rows[2]["value"] == pytest.approx(0.3)
    text = _render(tmp_path, bench_scope.BLOCK, bench_scope.docs_block(result))
    assert "13.0x fewer" in text
    assert "No interval yet" in bench_scope.docs_block({"reference_vs_ours_bytes": 13.0})
    runs = {"default_every": 50, "by_every": {"50": {"target": 0.02, "raw_s_per_step": {
        "off": [1.0, 1.0, 1.0], "scope": [1.01, 1.01, 1.01]}, "raw_cpu_s_per_step": {
        "off": [1.0, 1.0, 1.0], "scope": [1.03, 1.04, 1.05]}}}}
    rows = bench_scope_training.intervals(runs)
    assert [r["claim"] for r in rows] == ["missed", "met"]  # CPU first: the load-robust figure
    _render(tmp_path, bench_scope_training.BLOCK, bench_scope_training.docs_block(runs))
