"""The emulated benchmarks' plumbing, without launching ranks: configs, the quick modes' JSON, the inverted
intervals of the checkpoint stall."""
from __future__ import annotations

import json

import pytest
from benchmarks import ablation_emulated as emu
from benchmarks import bench_ablation as ab
from benchmarks import checkpoint_stall_emulated as cse
from benchmarks.bench_checkpoint_stall import _ratio_of_medians

from megatronapp.config import RunConfig, validate


@pytest.mark.parametrize("layout", list(ab.LAYOUTS))
def test_emulated_rows_validate_and_differ_only_as_the_cpu_rows_do(layout):
    configs = emu.emulated_configs(ab.ROWS, ab.LAYOUTS[layout], emu.EMU_FULL, emu.SPEC, ab.row_configs)
    for c in configs:
        cfg = RunConfig.from_dict(c)
        validate(cfg, 4)
        assert cfg.emulate_device == emu.SPEC and cfg.parallel.grad_bucket_mb == emu.EMU_FULL["bucket_mb"]
    quick = [c for r, c in zip(ab.ROWS, configs) if r[0] in emu.QUICK_ROWS]
    off, on = (RunConfig.from_dict(c).parallel for c in quick)
    assert not off.dp_overlap and not off.pp_overlap and on.dp_overlap and on.pp_overlap


def test_ablation_quick_line_is_the_overlap_rows_paired_ratio():
    rows = [{"row": "+ parallel block + sliding window", "host_share": 0.2},
            {"row": "+ communication overlap", "host_share": 0.3,
             "vs_previous": {"ratio": 1.1234567, "ci95": [1.05, 1.2]}}]
    line = emu.quick_line({"layouts": [{"rows": rows}]})
    assert json.loads(json.dumps(line)) == {"overlap_ratio": 1.1235, "overlap_ci": [1.05, 1.2],
                                            "host_share_max": 0.3}


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
