"""Eviction and `--allow-shrink` (resilience/recovery.py, shrink.py): a supervised dp=2 run whose replica 1 hangs
is diagnosed, rank 1 is evicted, and the run finishes on dp=1 from the newest checkpoint with the same global
batch, so every step's loss and the final weights match an uninterrupted dp=2 run to fp32 rounding; what cannot
shrink (ZeRO-1 state, a global batch that does not split) is refused naming the field."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from megatronapp.cli import build_parser, config_from_args
from megatronapp.config import ConfigError
from megatronapp.resilience import recovery, shrink
from megatronapp.resilience.supervisor import Options, supervise
from megatronapp.train import checkpoint as ckpt
from megatronapp.train.metrics import read_metrics
from tests.jobs import tiny_flags

STEPS = 6
FLAGS = tiny_flags("--nproc", "2", "--dp", "2", "--steps", str(STEPS), "--save-interval", "2", "--heads", "2",
                   "--data-prefetch", "0", hidden=32)


def _cfg(*extra: str):
    return config_from_args(build_parser().parse_args(["train", *FLAGS, *extra]))


def test_shrunk_layout_keeps_the_global_batch_and_the_microbatch_size():
    new = shrink.shrunk_config(_cfg(), 1)
    assert (new.parallel.dp, new.parallel.microbatches, new.train.global_batch_size) == (1, 4, 4)
    assert shrink.survivors(4, {1}) == [0, 2, 3]


@pytest.mark.parametrize("extra, field", [(["--zero", "1"], "parallel.zero=1"),
                                          (["--global-batch", "4", "--microbatches", "1", "--dp", "4"],
                                           "train.global_batch_size=4")])
def test_what_cannot_shrink_is_refused_naming_the_field(extra, field):
    cfg = _cfg(*extra)
    with pytest.raises(shrink.ShrinkRefused, match=field.replace(".", r"\.")):
        shrink.shrunk_config(cfg, cfg.parallel.dp - 1)


def test_zero1_with_allow_shrink_is_refused_before_any_rank_starts(tmp_path):
    cfg = _cfg("--zero", "1", "--out", str(tmp_path / "r"))
    with pytest.raises(shrink.ShrinkRefused, match=r"parallel\.zero=1.*--allow-shrink"):
        supervise(cfg, Options(allow_shrink=True), log=lambda _: None)
    assert not (tmp_path / "r" / "metrics.jsonl").exists()


def test_memory_errors_are_evicted_with_the_named_rank_and_perf_outliers_only_reported():
    cfg = _cfg()
    diag = {"outliers": {"memory_errors": [0], "gemm": [{"who": 1}]}}
    got = recovery.evictions(cfg, 1, "killed by signal SIGKILL", diag)
    assert [(e.rank, e.dp, e.label) for e in got] == [(0, 0, "DP0-PP0-TP0"), (1, 1, "DP1-PP0-TP0")]
    assert recovery.evictions(cfg, 1, "hang", {"outliers": {"gemm": [{"who": 0}]}})[0].rank == 1


def test_a_hung_replica_is_diagnosed_evicted_and_the_run_finishes_on_dp1(tmp_path, uninterrupted):
    base = uninterrupted(FLAGS)  # the same job, uninterrupted, on dp=2
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "megatronapp", "train", *FLAGS, "--out", str(out), "--supervise", "--inject",
           "hang=1:3", "--hang-timeout", "6", "--heartbeat-interval", "0.3", "--allow-shrink"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
    err = res.stderr
    assert res.returncode == 0, err[-3000:]
    assert "the job waits for rank 1 (DP1-PP0-TP0)" in err, err[-3000:]
    assert "diagnosing 2 rank(s) before the restart" in err and "diagnostics (" in err, err[-3000:]
    assert "evicted: rank 1 (DP1-PP0-TP0, DP replica 1)" in err and "shrinking: dp 2 -> 1" in err, err[-3000:]
    assert f"after {STEPS} steps, 1 restart(s); evicted rank 1 (DP1-PP0-TP0); finished on dp=1" in res.stdout
    events = [json.loads(line) for line in (out / "resilience.jsonl").read_text().splitlines()]
    assert [e["event"] for e in events] == ["failure", "evicted", "recovered", "completed"]
    ev = events[1]
    assert ev["dp"] == 1 and ev["replicas"] == [0] and [e["rank"] for e in ev["evicted"]] == [1]
    assert ev["diagnosis"]["error"] is None and ev["diagnosis"]["report"]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["dp"] == 1 and [e["rank"] for e in summary["evicted"]] == [1] and summary["diagnoses"]
    final = ckpt.step_dir(out / "checkpoints", STEPS)
    assert ckpt.load_meta(final)["config"]["parallel"]["dp"] == 1 and ckpt.load_meta(final)["world_size"] == 1
    # the same samples per step: losses and weights follow the uninterrupted dp=2 run up to summation order
    ref = {r["step"]: r["loss"] for r in read_metrics(base / "metrics.jsonl")}
    got = {r["step"]: r["loss"] for r in read_metrics(out / "metrics.jsonl") if not r.get("replayed")}
    assert got.keys() == ref.keys()
    for s in ref:
        assert abs(got[s] - ref[s]) <= 1e-5 * abs(ref[s]), (s, got[s], ref[s])
    mine = ckpt.load_rank(final, 0)["chunks"]
    theirs = ckpt.load_rank(ckpt.step_dir(base / "checkpoints", STEPS), 0)["chunks"]
    for c_mine, c_ref in zip(mine, theirs):
        for name in c_ref:
            torch.testing.assert_close(c_mine[name], c_ref[name], rtol=1e-5, atol=1e-6)


def test_supervise_under_torchrun_is_refused_naming_the_way_out(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")  # what torchrun's elastic agent sets in its workers
    with pytest.raises(ConfigError, match="does not run under torchrun"):
        supervise(_cfg("--out", str(tmp_path / "r")), Options(), log=lambda _: None)
