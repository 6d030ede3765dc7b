"""Smoke test of benchmarks/bench_engine.py: every case runs on real ranks and yields a ratio; no timing asserted."""
from __future__ import annotations

import math

from benchmarks import bench_engine


def test_quick_run_produces_ratios_and_equal_losses():
    result = bench_engine.run(quick=True, steps=1)
    names = [r["case"] for r in result["cases"]]
    assert names == [c[0] for c in bench_engine.CASES]
    for r in result["cases"]:
        assert len(r["times_s"]["ours"]) == len(r["times_s"]["peer"]) == 1, r["case"]
        assert r["median_s"]["ours"] > 0 and r["median_s"]["peer"] > 0, r["case"]
        assert math.isfinite(r["ratio"]) and r["ratio"] > 0, r["case"]
        assert math.isfinite(r["paired_ratio"]) and r["paired_ratio"] > 0, r["case"]
        assert r["cpu_median_s"]["ours"] > 0 and r["cpu_median_s"]["peer"] > 0, r["case"]
        # Two optimizer steps (warm-up + measured) on both sides: equal losses mean the peer does our work.
        assert len(r["losses"]["ours"]) == len(r["losses"]["peer"]) == 2, r["case"]
        assert r["losses_match"], f"{r['case']}: ours {r['losses']['ours']} vs peer {r['losses']['peer']}"
    text = bench_engine.table(result)
    assert all(name in text for name in names)
    assert result["machine"]["torch"] and result["config"]["params"] > 0


def test_write_docs_replaces_only_its_section(tmp_path):
    doc = tmp_path / "benchmarks.md"
    doc.write_text("# Benchmarks\n\n## Other benchmark\n\nkeep me\n\n## Engine vs PyTorch peers\n\nold table\n\n"
                   "## Later section\n\nkeep me too\n")
    fake = {"timestamp": "T", "config": {"size": dict(bench_engine.QUICK)}, "target_ratio": 1.05,
            "machine": {"cpus": 2, "processor": "x", "torch": "t", "load_avg_at_end": (1.0, 1.0, 1.0)},
            "cases": [{"case": "tp=2", "peer": "p", "median_s": {"ours": 1.0, "peer": 2.0}, "ratio": 0.5,
                       "paired_ratio": 0.5, "cpu_ratio": 0.9, "losses_match": True, "first_losses_max_abs_diff": 0.0,
                       "times_s": {"ours": [1.0, 1.0, 1.0], "peer": [2.0, 2.0, 2.0]},
                       "cpu_s": {"ours": [0.9, 0.9, 0.9], "peer": [1.0, 1.0, 1.0]}}]}
    bench_engine.write_docs(fake, doc)
    bench_engine.write_docs(fake, doc)  # idempotent: the section is replaced, not appended twice
    text = doc.read_text()
    assert "old table" not in text and text.count(bench_engine.SECTION) == 1
    assert "keep me\n" in text and "keep me too" in text
    assert ("| tp=2 | p | 1.0000 | 2.0000 | 0.500 | 0.500 [0.500, 0.500] better | 0.900 [0.900, 0.900] better "
            "| met / met | yes |") in text
    assert "interval within one run (blocks: 1)" in text
    assert text.index("## Other benchmark") < text.index(bench_engine.SECTION) < text.index("## Later section")


def test_blocks_pool_into_one_interval_that_widens_when_launches_disagree():
    recs = [{"times": {"ours": [s * 1.0] * 4, "peer": [1.0] * 4}, "cpu": {"ours": [1.0] * 4, "peer": [1.0] * 4},
             "losses": {"ours": [1.0], "peer": [1.0]}} for s in (0.98, 1.0, 1.1)]
    pooled = bench_engine._pool(recs)
    assert pooled["times"]["ours"] == [0.98] * 4 + [1.0] * 4 + [1.1] * 4
    row = bench_engine.summarise("dp=2", "p", {"dp": 2}, pooled, recs)
    iv = bench_engine.ratio_intervals(row)
    assert iv["paired"]["blocks"] == 3 and iv["paired"]["n"] == 12
    assert iv["paired"]["ci95"] == [0.98, 1.1] and iv["paired"]["verdict"] == "within noise"
    assert iv["paired"]["claim"] == "unresolved" and iv["cpu"]["claim"] == "met"
