"""The run loop (`train/loop.py`) in one process, around a scripted role: what it logs, when it evaluates and
saves, how it marks a resumed run's replayed steps, what a rank without a loss does, and the summary.

The real roles (the engine's Trainer, MegaFBD's ranks) are driven by tests/test_training.py and
tests/test_fbd_run.py with real processes; here the role is a stand-in whose every call is recorded.
"""
from __future__ import annotations

import io
import json
import math
from pathlib import Path

import pytest
import torch

from megatronapp.config import ModelConfig, RunConfig, TrainConfig
from megatronapp.parallel.emulation import Emulation
from megatronapp.parallel.topology import Group, Topology
from megatronapp.train import loop, plugins
from megatronapp.train.metrics import read_metrics


class _Role:
    """A rank of a one-rank job whose step, evaluation and saves are scripted and logged in `calls`."""

    role = "coupled"

    def __init__(self, cfg: RunConfig, step: int = 0, reports_loss: bool = True):
        self.cfg, self.rank, self.step, self.reports_loss = cfg, 0, step, reports_loss
        self.device, self.out = torch.device("cpu"), Path(cfg.train.out)
        self.topo = Topology(1, 1, 1, 0, groups={"world": Group("world", (0,))})
        self.hooks = plugins.Hooks()
        self.emulation = Emulation(cfg, 0, 0, 0, local_params=1)
        self.optimizer = None
        self.save_stalls: list[float] = []
        self.calls: list[tuple] = []

    def attach_plugins(self) -> None:
        self.calls.append(("attach",))

    def detach_plugins(self, raise_errors: bool = True) -> None:
        self.calls.append(("detach", raise_errors))

    def train_step(self) -> dict[str, float]:
        self.step += 1
        return {"loss": 10.0 - self.step, "grad_norm": 1.0, "lr": 0.1, "step_time": 0.5}

    def evaluate(self) -> float:
        self.calls.append(("evaluate", self.step))
        return 20.0 - self.step

    def save(self) -> Path:
        self.calls.append(("save", self.step))
        self.save_stalls.append(0.0)
        return self.out / f"step{self.step}"

    def finish_saves(self) -> None:
        self.calls.append(("finish_saves",))

    def close(self) -> None:
        self.calls.append(("close",))


def _cfg(out: Path, **train) -> RunConfig:
    return RunConfig(model=ModelConfig(family="gpt2", hidden_size=32, num_layers=2, num_heads=2, max_seq_len=16),
                     train=TrainConfig(global_batch_size=4, seq_len=16, out=str(out), peak_tflops=2.0, **train))


def test_the_loop_logs_evaluates_and_saves_on_their_intervals(tmp_path, monkeypatch):
    err = io.StringIO()
    monkeypatch.setattr("sys.stderr", err)
    cfg = _cfg(tmp_path, steps=5, log_interval=2, eval_interval=3, save_interval=2)
    role = _Role(cfg)
    summary = loop.run(role, world=4)
    # the progress line every log_interval steps and at the last
    assert [line.split()[1] for line in err.getvalue().splitlines() if line.startswith("step ")] == \
        ["2/5", "4/5", "5/5"]
    # validation every eval_interval steps and at the last; saves every save_interval steps and at the end
    assert [c for c in role.calls if c[0] in ("evaluate", "save")] == [
        ("save", 2), ("evaluate", 3), ("save", 4), ("evaluate", 5), ("save", 5)]
    assert role.calls[0] == ("attach",) and role.calls[-2:] == [("close",), ("detach", True)]
    recs = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in recs] == [1, 2, 3, 4, 5] and [r["loss"] for r in recs] == [9, 8, 7, 6, 5]
    assert {r["step"]: r["val_loss"] for r in recs if "val_loss" in r} == {3: 17.0, 5: 15.0}
    # MFU: tokens/s x model FLOPs per token over the peak of every rank of the job
    tps = 4 * 16 / 0.5
    assert all(r["tokens_per_s"] == tps for r in recs)
    assert recs[0]["mfu"] == pytest.approx(tps * cfg.model.flops_per_token(16) / (2e12 * 4), rel=1e-12)
    on_disk = json.loads((tmp_path / "summary.json").read_text())
    assert on_disk["steps"] == 5 and on_disk["role"] == "coupled" and on_disk["world_size"] == 4
    assert (on_disk["val_loss"], on_disk["best_val_loss"], on_disk["best_val_step"]) == (15.0, 15.0, 5)
    assert on_disk["losses"] == [9, 8, 7, 6, 5] and on_disk["save_stall_s"] == [0.0, 0.0, 0.0]
    assert on_disk["checkpoint"] == str(tmp_path / "step5") and on_disk["mfu"] == pytest.approx(recs[1]["mfu"])
    assert summary["loss_plot"] and (tmp_path / "loss.png").stat().st_size > 0


def test_a_resumed_run_marks_the_steps_it_repeats(tmp_path):
    loop.run(_Role(_cfg(tmp_path, steps=4, progress=False)), world=1)
    loop.run(_Role(_cfg(tmp_path, steps=6, progress=False), step=2), world=1)  # resumed from step 2
    recs = read_metrics(tmp_path / "metrics.jsonl")
    assert [(r["step"], r.get("replayed", False)) for r in recs] == [
        (1, False), (2, False), (3, False), (4, False), (3, True), (4, True), (5, False), (6, False)]


def test_a_rank_without_a_loss_fires_hooks_with_nan_and_writes_nothing(tmp_path):
    role = _Role(_cfg(tmp_path, steps=3, eval_interval=1), reports_loss=False)
    role.rank = 1  # not the lead: rank 0 writes the run's files
    ends: list[dict] = []
    role.hooks.on("step_end", lambda step, rec: ends.append(rec))
    summary = loop.run(role, world=1)
    # no evaluation; the final save is asked for, and is the role's to skip (an FBD forward rank saves nothing)
    assert [c[0] for c in role.calls if c[0] in ("evaluate", "save")] == ["save"]
    assert [r["step"] for r in ends] == [1, 2, 3]
    assert all(math.isnan(r["loss"]) and math.isnan(r["grad_norm"]) and math.isnan(r["lr"]) for r in ends)
    assert "mfu" not in ends[0] and not (tmp_path / "metrics.jsonl").exists()
    assert not (tmp_path / "summary.json").exists() and summary["losses"] == [] and math.isnan(summary["final_loss"])


def test_a_failing_step_fires_failure_then_shutdown_and_closes(tmp_path):
    role = _Role(_cfg(tmp_path, steps=3, progress=False))
    seen: list[str] = []
    role.hooks.on("failure", lambda e: seen.append(f"failure {e}"))

    def broken() -> dict:
        raise RuntimeError("boom")

    role.train_step = broken
    with pytest.raises(RuntimeError, match="boom"):
        loop.run(role, world=1)
    assert seen == ["failure boom"] and role.calls[-2:] == [("close",), ("detach", False)]


def test_a_recovered_step_runs_again_and_a_failed_save_is_redone_without_logging_twice(tmp_path):
    role = _Role(_cfg(tmp_path, steps=5, save_interval=2, progress=False))
    failures = {"step": [3], "save": [4]}  # the step after step 2 fails once; the save of step 4 fails once
    seen: list[tuple] = []
    step, save = role.train_step, role.save

    def flaky_step() -> dict:
        if role.step + 1 in failures["step"]:
            failures["step"].remove(role.step + 1)
            raise RuntimeError("a peer's connection closed")
        return step()

    def flaky_save() -> Path:
        if role.step in failures["save"]:
            failures["save"].remove(role.step)
            raise RuntimeError("a peer's connection closed in the checkpoint barrier")
        return save()

    def recover(e: BaseException, after: loop.AfterStep) -> loop.AfterStep:
        seen.append((str(e)[:6], after.step, after.done))
        return after

    role.train_step, role.save = flaky_step, flaky_save
    summary = loop.run(role, world=1, recover=recover)
    # the failed step left the rank after step 2, all done; the failed save after step 4, logged but not saved
    assert seen == [("a peer", 2, 2), ("a peer", 4, 1)]
    assert [c for c in role.calls if c[0] == "save"] == [("save", 2), ("save", 4), ("save", 5)]
    recs = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in recs] == [1, 2, 3, 4, 5] and not any(r.get("replayed") for r in recs)
    assert summary["steps"] == 5 and summary["losses"] == [9, 8, 7, 6, 5]


def test_an_unrecovered_error_fails_the_run(tmp_path):
    role = _Role(_cfg(tmp_path, steps=3, progress=False))

    def broken() -> dict:
        raise ValueError("a bug")

    role.train_step = broken
    with pytest.raises(ValueError, match="a bug"):
        loop.run(role, world=1, recover=lambda e, after: None)


def test_a_newcomer_resumes_its_sources_work_and_logs_only_what_the_lead_had_not(tmp_path):
    loop.run(_Role(_cfg(tmp_path, steps=4, progress=False)), world=1)  # the first lead logged steps 1-4
    rec = {"loss": 6.0, "grad_norm": 1.0, "lr": 0.1, "step_time": 0.5, "step": 4, "tokens_per_s": 1.0, "mfu": 0.0,
           "mem_bytes": 0}
    role = _Role(_cfg(tmp_path, steps=6, eval_interval=4, save_interval=4, progress=False), step=4)
    ends: list[int] = []
    role.hooks.on("step_end", lambda step, r: ends.append(step))
    # handed over while its source had not evaluated step 4 yet: the newcomer evaluates and saves it with the rest
    loop.run(role, world=1, resume=loop.AfterStep(4, dict(rec), done=0, ran_here=False))
    assert [c for c in role.calls if c[0] in ("evaluate", "save")] == [("evaluate", 4), ("save", 4), ("evaluate", 6),
                                                                       ("save", 6)]
    assert ends == [4, 5, 6]
    recs = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in recs] == [1, 2, 3, 4, 5, 6]  # step 4 was in the file: not logged again
