"""Multi-host supervision on one machine: two torchrun agents on localhost form one job (--nnodes 2
--nproc-per-node 2, c10d rendezvous, tp2 x pp2) with `train --heartbeat-dir`, watched by `resilience watch`.
An injected hang is named (the hung rank, not a victim, with the waits tree), and so is a SIGSTOPped rank (its
heartbeat stopped); the driver's decision makes every rank exit with code 75 (the stopped one is ended by its
agent), both agents restart their workers, round 1 resumes from the newest checkpoint with the drill off, the
run completes, and the final weights and every step's loss equal an uninterrupted run bit for bit. About 60 s
per case on 2 cores: run with MEGATRONAPP_LONG=1."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from megatronapp.launch import free_port
from megatronapp.train import checkpoint as ckpt
from megatronapp.train.metrics import read_metrics
from tests.jobs import tiny_flags

STEPS = 6
FLAGS = tiny_flags("--tp", "2", "--pp", "2", "--steps", str(STEPS), "--save-interval", "1")

pytestmark = pytest.mark.skipif(os.environ.get("MEGATRONAPP_LONG") != "1",
                                reason="two torchrun agents and a driver: ~40-60 s; set MEGATRONAPP_LONG=1")


def _env() -> dict[str, str]:
    root = Path(__file__).resolve().parents[1]  # src for megatronapp, the root for tests.plugin_probe
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(root / "src"), str(root),
                                                         os.environ.get("PYTHONPATH", "")]),
            "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


def _params(out: Path) -> list[list[dict[str, torch.Tensor]]]:
    d = ckpt.step_dir(out / "checkpoints", STEPS)
    return [ckpt.load_rank(d, r)["chunks"] for r in range(4)]


@pytest.fixture(scope="module")
def baseline(uninterrupted) -> Path:
    """The same job, uninterrupted (trained once per session: tests/conftest.py)."""
    return uninterrupted(["--nproc", "4", *FLAGS])


def _stop_rank_at(hb: Path, rank: int, step: int, deadline_s: float = 300.0) -> int | None:
    """SIGSTOP `rank` once its heartbeat shows `step` done; its pid (None if the run never got there)."""
    end = time.time() + deadline_s
    while time.time() < end:
        try:
            beat = json.loads((hb / f"rank{rank:05d}.json").read_text())
        except (OSError, ValueError):
            beat = {}
        if beat.get("round") == 0 and beat.get("step", -1) >= step:
            os.kill(beat["pid"], signal.SIGSTOP)
            return beat["pid"]
        time.sleep(0.05)
    return None


@pytest.mark.parametrize("fault", ["hang", "sigstop"])
def test_two_torchrun_hosts_recover_a_fault_named_by_the_driver_bit_identically(tmp_path, baseline, fault):
    base = baseline
    # hang: the drill (rank 2 blocks at the start of step 4); sigstop: rank 1 stopped after step 2, paced steps
    # (a plug-in that changes no number) so the signal lands mid-run
    extra = ["--inject", "hang=2:3"] if fault == "hang" else ["--attach", "tests.plugin_probe:paced_steps"]
    out, hb, port = tmp_path / "run", tmp_path / "hb", free_port()
    agents = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
         "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--max-restarts", "2",
         "--monitor-interval", "0.5", "-m", "megatronapp", "train", *FLAGS, "--out", str(out),
         "--heartbeat-dir", str(hb), "--heartbeat-interval", "0.3", *extra],
        stdout=(tmp_path / f"agent{i}.log").open("w"), stderr=subprocess.STDOUT, env=_env()) for i in range(2)]
    stopped = None
    try:
        driver = subprocess.Popen(
            [sys.executable, "-m", "megatronapp", "resilience", "watch", "--heartbeat-dir", str(hb), "--world", "4",
             "--hang-timeout", "4", "--heartbeat-interval", "0.3", "--give-up-after", "120"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())
        if fault == "sigstop":
            stopped = _stop_rank_at(hb, 1, 2)
            assert stopped is not None, "the run never reached step 2"
        stdout, err = driver.communicate(timeout=400)
        for a in agents:  # (their output goes to files: a full pipe must not block an agent)
            a.wait(timeout=120)
        logs = [(tmp_path / f"agent{i}.log").read_text() for i in range(2)]
    finally:
        for p in [*agents, driver]:
            if p.poll() is None:
                p.kill()
        if stopped is not None:
            try:
                os.kill(stopped, signal.SIGKILL)  # its agent should have ended it; never leave it behind
            except ProcessLookupError:
                pass
    assert driver.returncode == 0, err[-3000:] + "\n".join(log[-2000:] for log in logs)
    assert "completed at step 6 in round 1, 1 restart(s) decided" in stdout
    text = "\n".join(logs)
    if fault == "hang":  # the hung rank is named, not one of its victims, with who waits for it
        assert "the job waits for rank 2 (DP0-PP1-TP0): not in a communication op: in phase 'step 4'" in err, err
        assert re.search(r"^rank 2 \(DP0-PP1-TP0\): .*<- the cause$", err, re.M), err
        assert re.search(r"rank 3 \(DP0-PP1-TP1\) waits in \w+ tp\[2, 3\] #\d+ \(rank 2 never entered it\)",
                         err), err
        obeyed, culprit = 4, 2
    else:  # the stopped rank cannot poll; its heartbeat stopped, which names it whatever its frozen recorder says
        assert ("the job waits for rank 1 (DP0-PP0-TP1): heartbeat stopped (the process is stopped or dead)"
                in err), err
        obeyed, culprit = 3, 1
    assert all(a.returncode == 0 for a in agents), "\n".join(log[-2000:] for log in logs)
    # ranks obeyed the decision (exit 75; a rank whose peer left first may fail on the broken connection before
    # its next poll, which stops it all the same); round 1 resumed from the newest checkpoint, drills off
    assert 1 <= len(re.findall(r"the driver restarts round 0: .*exiting with 75", text)) <= obeyed, text[-4000:]
    assert "failed (exitcode: 75)" in text
    assert re.search(r"round 1 \(torchrun restart counts \[.*\]\): resuming from step_0000000\d; fault drills "
                     r"off", text), text[-4000:]
    decision = json.loads((hb / "restart-0.json").read_text())
    assert decision["round"] == 0 and decision["culprit"] == culprit
    for mine, ref in zip(_params(out), _params(base)):
        for c_mine, c_ref in zip(mine, ref):
            for name in c_ref:
                assert torch.equal(c_mine[name], c_ref[name]), name
    ref = {r["step"]: r["loss"] for r in read_metrics(base / "metrics.jsonl")}
    records = read_metrics(out / "metrics.jsonl")
    assert {r["step"]: r["loss"] for r in records} == ref
    assert [r["step"] for r in records if not r.get("replayed")] == list(range(1, STEPS + 1))
    # (saved every step: a fault between steps loses nothing; whether a step is replayed depends on timing)
