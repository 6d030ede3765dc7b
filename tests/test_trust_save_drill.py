"""kill -9 at each stage of an asynchronous save under torchrun with a fixed run id (issue 27, item 2's drill).

One torchrun job (c10d on loopback, `--rdzv-id` fixed: TORCHELASTIC_RUN_ID is the same in every restart, the
case that once mixed attempts), pp 2, a save after every step. Each start of the workers SIGKILLs one rank at one
stage of one save (`--inject kill-save=RANK:STEP:STAGE:RESTART`): the background copy, the partly written rank
file, the durable rank file without its .sum, every .sum there but nothing checked (the committer), meta.json and
COMPLETE written but not renamed into place. torchrun restarts the workers each time; each restart must resume
from the newest fully written step (the step before the killed save), no temporary directory of a failed attempt
may survive, and the run must equal an uninterrupted one bit for bit: every step's loss (replayed steps
included) and the final weights and optimizer state."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import torch

from megatronapp.launch import free_port
from megatronapp.train import checkpoint as ckpt
from megatronapp.train.metrics import read_metrics
from tests.jobs import tiny_flags

STEPS = 6
FLAGS = tiny_flags("--pp", "2", "--steps", str(STEPS), "--save-interval", "1", "--async-save", hidden=32)
# (rank, step, stage) killed in torchrun start 0, 1, 2, ...: marker and commit are the committer's (rank 0)
DRILLS = [(1, 1, "copy"), (1, 2, "write"), (0, 3, "sum"), (0, 4, "marker"), (0, 5, "commit")]


def _env() -> dict[str, str]:
    root = Path(__file__).resolve().parents[1]
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(root / "src"), str(root),
                                                         os.environ.get("PYTHONPATH", "")]),
            "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


def _state(out: Path) -> list[dict]:
    d = ckpt.step_dir(out / "checkpoints", STEPS)
    return [{k: v for k, v in ckpt.load_rank(d, r).items() if k in ("chunks", "optimizer")} for r in range(2)]


def _assert_equal(a, b, where: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            _assert_equal(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_equal(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def test_kill_9_at_each_stage_of_an_async_save_under_torchrun_resumes_the_newest_full_step_bit_identically(
        tmp_path, uninterrupted):
    out = tmp_path / "run"
    drills = [f"--inject=kill-save={r}:{s}:{stage}:{i}" for i, (r, s, stage) in enumerate(DRILLS)]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--rdzv-id", "fixed-run-id",
           "--max-restarts", str(len(DRILLS)), "--monitor-interval", "0.1", "-m", "megatronapp", "train", *FLAGS,
           "--out", str(out), "--heartbeat-dir", str(tmp_path / "hb"), *drills]
    res = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=900, check=False)
    log = res.stdout + res.stderr
    assert res.returncode == 0, log[-4000:]
    for rank, step, stage in DRILLS:
        assert f"rank {rank} SIGKILLs itself at stage '{stage}' of the save of step {step}" in log, log[-4000:]
    # every restart resumed from the newest fully written step: the one before the killed save (none: scratch)
    resumed = re.findall(r"torchrun restart counts \[(\d+)\]\): resuming from (step_\d+|scratch)", log)
    expect = [(str(i + 1), f"step_{s - 1:08d}" if s > 1 else "scratch") for i, (_, s, _) in enumerate(DRILLS)]
    assert resumed == expect, log[-4000:]
    root = out / "checkpoints"
    assert not [p.name for p in root.iterdir() if p.name.startswith((".step_", ".trash"))]  # leftovers removed
    assert all(ckpt.verify(ckpt.step_dir(root, s)) is None for s in range(1, STEPS + 1))

    base = uninterrupted(["--nproc", "2", *FLAGS])
    _assert_equal(_state(out), _state(base), "state")
    ref = {r["step"]: r["loss"] for r in read_metrics(base / "metrics.jsonl")}
    records = read_metrics(out / "metrics.jsonl")
    assert all(r["loss"] == ref[r["step"]] for r in records)  # replayed steps reproduce their losses exactly
    assert sorted(r["step"] for r in records if not r.get("replayed")) == list(range(1, STEPS + 1))
    assert sum(1 for r in records if r.get("replayed")) >= len(DRILLS)


def test_kill_save_drills_are_checked_fire_at_their_stage_and_stay_armed_only_in_their_restart(monkeypatch):
    from types import SimpleNamespace

    import pytest

    from megatronapp import faults
    from megatronapp.config import ConfigError

    for bad, why in [("kill-save=1:4:commit", "rank 0 only"), ("kill-save=0:4:flush", "unknown save stage"),
                     ("kill-save=0:0:sum", "STEP=0"), ("kill-save=0:4", "expected kill-save=")]:
        with pytest.raises(ConfigError, match=why):
            faults.parse(bad)
    specs = ["hang=1:2", "kill-save=1:2:copy", "kill-save=0:3:commit:2"]
    assert faults.armed_in_restart(specs, 2) == ["kill-save=0:3:commit:2"]
    assert faults.armed_in_restart(specs, 1) == []
    killed: list[int] = []
    monkeypatch.setattr(faults.os, "kill", lambda pid, sig: killed.append(sig))
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    injector = faults.install(specs, SimpleNamespace(world_size=2, rank=0))
    try:
        ckpt.save_stage("commit", 2, 0)  # another step
        ckpt.save_stage("marker", 3, 0)  # another stage
        assert killed == []
        ckpt.save_stage("commit", 3, 0)
        assert len(killed) == 1
    finally:
        injector.remove()
    ckpt.save_stage("commit", 3, 0)  # unhooked
    assert len(killed) == 1
