"""MegaFBD runs as the user starts them (`fbd.run.train`, real gloo processes under NCCL's rules: the traced run
under `--comm-semantics nccl-eager`, the checkpoint and validation runs under `nccl-lazy`):
plug-ins on both roles, faults on either role, checkpoints and `--resume`, validation, MFU and the progress line.

Layout: backward pp=2 (ranks 0, 1) and forward instances of tp_f = pp_f = 1 (ranks 2, 3, ...), a tiny GPT-2.
In traces a forward rank sits at (dp=instance, pp=pp+stage, tp): forward instances are each other's peers, never
a backward rank's (fbd/host.py). Detection assertions are about WHO and WHAT, never timings (a 3x slow rank on a
busy 2-core machine, as tests/test_scan_real.py does).
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from megatronapp.config import ModelConfig, ParallelConfig, RunConfig, TraceConfig, TrainConfig
from megatronapp.fbd.run import train
from megatronapp.scan.aggregate import aggregate
from megatronapp.scan.detect.analysis import analyse
from megatronapp.scan.read.format import read_dir
from megatronapp.train import checkpoint as ckpt
from megatronapp.train.metrics import read_metrics
from megatronapp.train.trainer import train as train_coupled


def _cfg(out: Path, steps: int, n_f: int = 1, semantics: str = "nccl-lazy", **train_over) -> RunConfig:
    return RunConfig(model=ModelConfig(family="gpt2", hidden_size=64, num_layers=4, num_heads=4, max_seq_len=32),
                     parallel=ParallelConfig(tp=1, pp=2, dp=1, microbatches=4, fbd=True, fbd_forward_instances=n_f,
                                             comm_semantics=semantics),
                     train=TrainConfig(steps=steps, global_batch_size=8, seq_len=32, warmup_steps=1, out=str(out),
                                       progress=False, **train_over))


@pytest.mark.slow
def test_traced_fbd_run_names_both_roles_and_the_slow_forward_rank(tmp_path):
    # Two forward instances (ranks 2, 3); rank 2 computes 3x slower. Every rank runs the probe plug-in.
    cfg = _cfg(tmp_path, steps=6, n_f=2, semantics="nccl-eager")
    cfg.trace = TraceConfig(enabled=True, dir=str(tmp_path / "trace"), interval=6, iterations=6)
    cfg.inject = ["slow-compute=2:3.0"]
    cfg.attach = ["tests.plugin_probe:plugin"]
    assert train(cfg)["steps"] == 6
    # lifecycle hooks fired on both roles, in the engine's order; only backward ranks announce checkpoints
    for rank in range(4):
        events = [json.loads(x)["event"] for x in (tmp_path / f"hooks.rank{rank}.jsonl").read_text().splitlines()]
        body = ["step_start", "step_end"] * 6
        tail = ["checkpoint_saved", "shutdown"] if rank < 2 else ["shutdown"]
        assert events == ["rank_start", *body, *tail], (rank, events)
    traces, problems = read_dir(tmp_path / "trace")
    assert problems == [] and len(traces) == 4
    roles = {t.rank: (t.header["fbd_role"], t.header["process_name"], t.coord) for t in traces}
    assert roles == {0: ("backward", "rank 0 backward dp0 pp0 tp0", (0, 0, 0)),
                     1: ("backward", "rank 1 backward dp0 pp1 tp0", (0, 1, 0)),
                     2: ("forward", "rank 2 forward k0 s0 t0", (0, 2, 0)),
                     3: ("forward", "rank 3 forward k1 s0 t0", (1, 2, 0))}
    assert all(t.world == 4 and len(t.header["handshake"]["group_ranks"]) == 4 for t in traces)
    merged = tmp_path / "merged.json"
    aggregate(tmp_path / "trace", merged)
    events = json.loads(merged.read_text())["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("name") == "process_name"}
    assert names == {r: roles[r][1] for r in range(4)}
    spans = {(e["pid"], e["name"]) for e in events if e.get("ph") == "X"}
    assert {(0, "recompute"), (1, "backward"), (2, "forward"), (3, "forward")} <= spans
    report = analyse(traces).report
    # Rank 2's slow compute must be found and every finding must involve rank 2. Which line comes first is not
    # asserted: since the pipeline links became 2-rank groups (issue 22), 1 of 5 runs here (the one inside the
    # full suite) ranked a sub-millisecond `slow-link` 2-1 (the slow rank's own sends) above it; folding such a
    # link into its slow end's finding is issue 25's "precision over every finding", still open.
    assert any((f.kind, f.ranks) == ("slow-compute", (2,)) for f in report.findings), report.to_text()
    assert all(2 in f.ranks for f in report.findings), report.to_text()


def _final_state(out: Path) -> dict[int, dict]:
    d = ckpt.resolve(out)
    return {r: ckpt.load_rank(d, r) for r in range(2)}


@pytest.mark.slow
def test_resumed_fbd_run_continues_bit_identically(tmp_path):
    # Run A: 4 steps, a checkpoint after step 2 (and the final one). Run B: a new process tree resumes A's step-2
    # checkpoint and trains steps 3-4. Forward ranks save nothing: the first hand-off brings the loaded weights.
    a, b = tmp_path / "a", tmp_path / "b"
    train(_cfg(a, steps=4, save_interval=2))
    step2 = a / "checkpoints" / "step_00000002"
    assert ckpt.load_meta(step2)["world_size"] == 2  # backward ranks only: the engine's pp=2 format
    assert sorted(p.name for p in step2.glob("rank*.pt")) == ["rank00000.pt", "rank00001.pt"]
    summary = train(_cfg(b, steps=4, resume=str(step2)))
    assert summary["steps"] == 4
    want = {r["step"]: r["loss"] for r in read_metrics(a / "metrics.jsonl")}
    got = {r["step"]: r["loss"] for r in read_metrics(b / "metrics.jsonl")}
    assert sorted(got) == [3, 4] and all(got[s] == want[s] for s in got), (got, want)
    sa, sb = _final_state(a), _final_state(b)
    for r in range(2):
        assert sa[r]["step"] == sb[r]["step"] == 4
        for ca, cb in zip(sa[r]["chunks"], sb[r]["chunks"]):
            for name in ca:
                assert torch.equal(ca[name], cb[name]), f"rank {r} {name} differs after resume"
        for pa, pb in zip(sa[r]["optimizer"]["state"].values(), sb[r]["optimizer"]["state"].values()):
            assert all(torch.equal(pa[k], pb[k]) for k in pa), f"rank {r}: optimizer state differs after resume"
    # another backward layout (tp 2 instead of pp 2) is resharded by the engine's own load (train/reshard.py)
    # and continues as the saving layout did, within the equivalence tolerance
    other = _cfg(tmp_path / "c", steps=4, resume=str(step2))
    other.parallel.tp, other.parallel.pp = 2, 1
    train(other)
    moved = {r["step"]: r["loss"] for r in read_metrics(tmp_path / "c" / "metrics.jsonl")}
    assert sorted(moved) == [3, 4] and all(abs(moved[s] - want[s]) < 1e-4 for s in moved), (moved, want)


@pytest.mark.slow
def test_fbd_run_validates_like_the_coupled_run_counts_mfu_and_logs_every_log_interval(tmp_path, capfd):
    # The engine's run loop around both: evaluated every 2 steps and at the last (steps 2 and 3), the progress
    # line every 2 steps and at the last, MFU against a vendor peak of 1 TFLOP/s per rank.
    over = {"eval_interval": 2, "eval_iters": 2, "log_interval": 2, "peak_tflops": 1.0}
    cfg = _cfg(tmp_path / "fbd", steps=3, **over)
    cfg.train.progress = True
    summary = train(cfg)
    err = capfd.readouterr().err
    assert re.findall(r"^step (\d+)/3 ", err, re.M) == ["2", "3"], err  # rank 0 only, log_interval honoured
    coupled = _cfg(tmp_path / "coupled", steps=3, **over)
    coupled.parallel.fbd = False
    train_coupled(coupled)
    got = read_metrics(tmp_path / "fbd" / "metrics.jsonl")
    want = read_metrics(tmp_path / "coupled" / "metrics.jsonl")
    assert [r["step"] for r in got] == [1, 2, 3]
    # validation: the same forward-only pass of the same layout, on weights equal to fp32 rounding
    assert [r["step"] for r in got if "val_loss" in r] == [r["step"] for r in want if "val_loss" in r] == [2, 3]
    for g, w in zip(got, want):
        assert abs(g["loss"] - w["loss"]) < 1e-5, (g, w)
        if "val_loss" in w:
            assert abs(g["val_loss"] - w["val_loss"]) < 1e-5, (g, w)
    assert summary["val_loss"] == got[-1]["val_loss"] and summary["role"] == "backward"
    # MFU: model FLOPs per token x tokens/s over the peak of every rank of the job (2 backward + 1 forward)
    flops = cfg.model.flops_per_token(cfg.train.seq_len)
    for r in got:
        assert r["mfu"] > 0 and r["mfu"] == pytest.approx(r["tokens_per_s"] * flops / (1e12 * 3), rel=1e-9)
    assert summary["mfu"] > 0 and summary["world_size"] == 3
