"""The emulated benchmarks' plumbing, without launching ranks: configs, the quick modes' JSON, the inverted
intervals of the checkpoint stall."""
from __future__ import annotations

import json

import pytest
from benchmarks import ablation_emulated as emu
from benchmarks import ablation_rows as ab
from benchmarks import checkpoint_stall_emulated as cse
from benchmarks.bench_checkpoint_stall import _ratio_of_medians

from megatronapp.config import RunConfig, validate


@pytest.mark.parametrize("layout", list(ab.LAYOUTS))
def test_emulated_rows_validate_and_split_the_overlap_row(layout):
    pairs = emu.emulated_configs(emu.emulated_rows(ab.ROWS), ab.LAYOUTS[layout], emu.EMU_FULL, emu.SPEC)
    for _, c in pairs:
        cfg = RunConfig.from_dict(c)
        validate(cfg, 4)
        assert cfg.emulate_device == emu.SPEC and cfg.parallel.grad_bucket_mb == emu.EMU_FULL["bucket_mb"]
    names = [r[0] for r, _ in pairs]
    # the overlap row is split; the overlap that changes nothing on this layout is dropped
    assert "+ communication overlap" not in names and "+ DP overlap" in names
    assert ("+ PP overlap" in names) == (layout == "pp=2 x dp=2")
    assert ("+ TP overlap" in names) == (layout == "tp=2 x dp=2")
    # the last row is the same run as the CPU-bound ablation's last row (plus emulation; PP overlap with pp=1
    # is off here, a no-op there)
    cpu = ab.row_configs(ab.LAYOUTS[layout], emu.EMU_FULL)[-1]["parallel"]
    cpu["pp_overlap"] = cpu["pp"] > 1
    assert {k: v for k, v in pairs[-1][1]["parallel"].items() if k != "grad_bucket_mb"} == cpu
    if layout == "pp=2 x dp=2":
        off, dp, both = (RunConfig.from_dict(c).parallel for r, c in pairs if r[0] in emu.QUICK_ROWS)
        assert not off.dp_overlap and not off.pp_overlap
        assert dp.dp_overlap and not dp.pp_overlap
        assert both.dp_overlap and both.pp_overlap


def test_ablation_quick_line_is_dp_and_pp_overlap_together_over_none():
    pairs = [((n, "", {}), {"model": {}, "train": {"global_batch_size": 16, "seq_len": 64}})
             for n in emu.QUICK_ROWS]
    pairs = [(r, ab.row_configs(ab.LAYOUTS["pp=2 x dp=2"], emu.EMU_QUICK)[0]) for r, _ in pairs]
    # step times per repetition: none, DP alone (1.25x faster), DP + PP (another 1.1x)
    rec = {"times": [[2.0, 2.2, 2.1], [1.6, 1.76, 1.68], [1.6 / 1.1, 1.76 / 1.1, 1.68 / 1.1]],
           "host_share": [0.1, 0.2, 0.3], "optimizer_state_bytes": [0, 0, 0]}
    result = emu.summarise(pairs, "pp=2 x dp=2", rec, emu.SPEC, 4)
    line = json.loads(json.dumps(emu.quick_line({"layouts": [result]})))
    assert line["overlap_ratio"] == pytest.approx(1.375, abs=1e-4)
    assert line["overlap_ci"] == pytest.approx([1.375, 1.375], abs=1e-4)
    assert line["dp_overlap"][0] == pytest.approx(1.25, abs=1e-4)
    assert line["pp_overlap"][0] == pytest.approx(1.1, abs=1e-4)
    assert line["host_share_max"] == 0.3


def test_stall_ratios_are_inverted_and_an_interval_through_zero_has_no_upper_bound():
    sync = [1.0, 1.1, 0.9, 1.05, 0.95]
    ours = [0.01, 0.02, 0.015, 0.012, 0.018]
    inv = cse.inverse(_ratio_of_medians(ours, sync))
    assert inv["ratio"] == pytest.approx(1.0 / 0.015)
    lo, hi = inv["ci95"]
    assert lo <= inv["ratio"] <= hi
    noisy = cse.inverse(_ratio_of_medians([-0.002, 0.0005, 0.001, -0.001, 0.0002], sync))
    assert noisy["ratio"] == pytest.approx(1.0 / cse.FLOOR_S)  # a median stall below 1 ms counts as 1 ms
    assert noisy["ci95"][1] is None and noisy["ci95"][0] > 0


def test_a_slower_layout_keeps_the_ratio_of_wire_to_device_time():
    spec, links = emu.slowed("tflops=0.001,jitter=lognormal:0.5", {"tp": 0.06, "dp": 0.005}, 4.0)
    assert spec == "tflops=0.00025,jitter=lognormal:0.5"
    assert links == pytest.approx({"tp": 0.015, "dp": 0.00125})


def test_overlap_trace_counts_dp_reduces_in_backward_and_time_held_in_pipeline_sends():
    from benchmarks.overlap_trace_emulated import analyse

    dp, pp = {"group": "dp", "bytes": 4096}, {"group": "pp.act.up", "bytes": 4096}
    spans = [["forward", "compute", {}, 0.0, 1.0], ["send", "comm", pp, 1.0, 1.2],
             ["backward", "compute", {}, 1.2, 2.0], ["all_reduce", "comm", dp, 1.5, 2.5],
             ["all_reduce", "comm", dp, 2.1, 2.6], ["optimizer", "compute", {}, 2.7, 3.0]]
    a = analyse(spans)
    assert a["steps"] == 1 and a["dp_grad_all_reduces"] == 2 and a["issued_during_backward"] == 1
    assert a["median_backward_end_to_optimizer_s"] == pytest.approx(0.7)
    assert a["median_pp_send_span_s"] == pytest.approx(0.2) and a["median_step_span_s"] == pytest.approx(3.0)
