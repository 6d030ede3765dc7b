"""Resume on another layout (`train/reshard.py`): model and optimizer state resharded, training continues as it
would have on the layout that saved it (losses and weights within the equivalence tolerance), the data position
carried over by the step.

Two launches: four ranks (tp2 x pp2 saved, resumed at pp4 and at pp2 x vpp2 x dp2 with ZeRO-1) and two ranks
(pp2 saved, resumed at tp2; dp2 ZeRO-1 saved); the dp2 ZeRO-1 checkpoint resumes at dp1 in this process.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from megatronapp.config import RunConfig
from megatronapp.launch import spawn
from megatronapp.train import checkpoint as ckpt
from megatronapp.train.consolidate import consolidate
from megatronapp.train.trainer import Trainer, run_rank
from tests.jobs import train_case as _cfg

TOL = 1e-5  # the equivalence harness's loss tolerance


def _run(root: Path, name: str, layout: dict, resume: Path | None = None) -> dict:
    d = _cfg(root / name, **{**layout, "train.steps": 4, "train.save_interval": 2})
    if resume is not None:
        d["train"]["resume"] = str(resume)
    return d


def _worker4(rank: int, world: int, root: str) -> None:
    r = Path(root)
    run_rank(rank, world, _run(r, "tp2pp2", {"parallel.tp": 2, "parallel.pp": 2}))
    mid = ckpt.step_dir(r / "tp2pp2" / "checkpoints", 2)
    run_rank(rank, world, _run(r, "as_pp4", {"parallel.pp": 4}, mid))
    run_rank(rank, world, _run(r, "as_pp2vpp2dp2zero", {"parallel.pp": 2, "parallel.vpp": 2, "parallel.dp": 2,
                                                        "parallel.zero": 1, "parallel.schedule": "interleaved-1f1b",
                                                        "parallel.microbatches": 2}, mid))


def _worker2(rank: int, world: int, root: str) -> None:
    r = Path(root)
    run_rank(rank, world, _run(r, "pp2", {"parallel.pp": 2}))
    run_rank(rank, world, _run(r, "pp2_as_tp2", {"parallel.tp": 2}, ckpt.step_dir(r / "pp2" / "checkpoints", 2)))
    run_rank(rank, world, _run(r, "dp2zero", {"parallel.dp": 2, "parallel.zero": 1}))


def _losses(run: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]


def _same_weights(a: Path, b: Path) -> None:
    wa, wb = consolidate(a)[1], consolidate(b)[1]
    assert wa.keys() == wb.keys()
    for name in wa:
        torch.testing.assert_close(wb[name], wa[name], atol=2e-5, rtol=1e-4, msg=lambda m, n=name: f"{n}: {m}")


def _check(root: Path, saved: str, resumed: str) -> None:
    """Steps 3 and 4 after a resume on another layout equal the run that saved at step 2 and went on."""
    want, got = _losses(root / saved)[2:], _losses(root / resumed)
    assert len(got) == 2 and all(abs(a - b) < TOL for a, b in zip(got, want)), f"{resumed}: {got} vs {saved}: {want}"
    _same_weights(ckpt.step_dir(root / saved / "checkpoints", 4), ckpt.step_dir(root / resumed / "checkpoints", 4))


@pytest.mark.slow
def test_resume_on_other_layouts_continues_like_the_saving_layout(tmp_path):
    spawn(_worker4, 4, str(tmp_path))
    spawn(_worker2, 2, str(tmp_path))
    _check(tmp_path, "tp2pp2", "as_pp4")
    _check(tmp_path, "tp2pp2", "as_pp2vpp2dp2zero")
    _check(tmp_path, "pp2", "pp2_as_tp2")
    # dp2 with ZeRO-1 (each rank saved half of the optimizer state) onto one process with the plain optimizer
    d = _run(tmp_path, "dp2zero_as_dp1", {}, ckpt.step_dir(tmp_path / "dp2zero" / "checkpoints", 2))
    tr = Trainer(RunConfig.from_dict(d))
    assert tr.step == 2
    got = [tr.train_step()["loss"] for _ in range(2)]
    want = _losses(tmp_path / "dp2zero")[2:]
    assert all(abs(a - b) < TOL for a, b in zip(got, want)), (got, want)


def test_optimizer_state_is_resharded_not_restarted(tmp_path):
    """ZeRO-1 <-> plain in one process: continuing equals the saving run bit for bit, and a run whose moments
    were dropped (a fresh optimizer on the loaded weights) does not, so the moments really came across."""
    runs = {}
    for zero in (0, 1):
        tr = Trainer(RunConfig.from_dict(_cfg(tmp_path / f"z{zero}", **{"parallel.zero": zero, "train.steps": 4})))
        losses = [tr.train_step()["loss"] for _ in range(2)]
        saved = tr.save()
        runs[zero] = (saved, losses + [tr.train_step()["loss"] for _ in range(2)])
    for src, dst in ((0, 1), (1, 0)):
        d = _cfg(tmp_path / f"r{src}{dst}", **{"parallel.zero": dst, "train.steps": 4})
        d["train"]["resume"] = str(runs[src][0])
        tr = Trainer(RunConfig.from_dict(d))
        assert [tr.train_step()["loss"] for _ in range(2)] == runs[src][1][2:]
    tr = Trainer(RunConfig.from_dict(d))
    tr.optimizer.state.clear()  # the same weights, no moments
    assert [tr.train_step()["loss"] for _ in range(2)][1] != runs[1][1][3]


def test_a_resume_that_changes_the_global_batch_is_refused(tmp_path):
    tr = Trainer(RunConfig.from_dict(_cfg(tmp_path / "a", **{"train.steps": 2})))
    tr.train_step()
    saved = tr.save()
    d = _cfg(tmp_path / "b", **{"parallel.zero": 1, "train.global_batch_size": 4, "train.steps": 2})
    d["train"]["resume"] = str(saved)
    with pytest.raises(ckpt.CheckpointError, match="train.global_batch_size=8, this run has 4"):
        Trainer(RunConfig.from_dict(d))
