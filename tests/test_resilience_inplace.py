"""In-place recovery on real processes (gloo, tp2 x pp2 x dp2, `--spares`): a failed rank is replaced by a warm
spare, the healthy ranks keep their processes, and the run equals an uninterrupted one bit for bit (every step's
loss, the final weights and AdamW moments of every rank) with no step computed twice.

Each job survives a sequence of failures at different phases of a step (drills, `faults.py`), so one launch
covers many: job 1 kills a TP rank in forward, a PP rank in backward, a DP replica's rank in the gradient
reduction, a rank in the optimizer update (after the step's commit point: rolled forward), a rank during its
checkpoint's background copy, and SIGSTOPs a rank; job 2 kills two ranks of different DP replicas in the same
step, kills the spare that takes one of them over once the generation's groups exist and its state is on the
way, and hangs a rank (named by the hang timeout, killed, replaced); job 3 SIGSTOPs a survivor while the
generation a kill started forms. One uninterrupted run is the reference of all three.
"""
from __future__ import annotations

import datetime
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from megatronapp.cli import build_parser, config_from_args
from megatronapp.config import RunConfig
from megatronapp.resilience import generation_protocol as gp
from megatronapp.resilience import generations
from megatronapp.resilience.supervisor import Options, supervise
from megatronapp.train.trainer import train
from tests.inplace_checks import assert_bit_identical, assert_healthy_ranks_kept, events

STEPS = 12
WORLD = 8
FLAGS = ["--nproc", "8", "--tp", "2", "--pp", "2", "--dp", "2", "--steps", str(STEPS), "--save-interval", "2",
         "--async-save", "--layers", "2", "--hidden", "32", "--heads", "4", "--global-batch", "4",
         "--microbatches", "2", "--seq-len", "16", "--no-progress", "--peak-tflops", "1"]


def _cfg(out: Path, inject: list[str] = ()) -> RunConfig:
    cfg = config_from_args(build_parser().parse_args(["train", *FLAGS, "--out", str(out)]))
    cfg.inject = list(inject)
    return cfg


@pytest.fixture(scope="module")
def baseline(tmp_path_factory) -> Path:
    """The same job, uninterrupted and unsupervised."""
    out = tmp_path_factory.mktemp("inplace-baseline") / "run"
    train(_cfg(out))
    return out


def _opts(**over) -> Options:
    return Options(**{"heartbeat_s": 0.3, "max_restarts": 8, "diagnose_on_restart": False, "spares": 1,
                      "hang_timeout_s": 30.0, "form_timeout_s": 60.0, **over})


def test_kills_at_every_phase_and_a_stop_are_replaced_in_place_bit_identical(tmp_path, baseline):
    out = tmp_path / "run"
    drills = ["kill=1:1:forward",      # rank 1, DP0-PP0-TP1: a TP peer of stage 0, in its forward
              "kill=4:3:backward",     # rank 4, DP0-PP1-TP0: the last pipeline stage, in its backward
              "kill=2:5:reduce",       # rank 2, DP1-PP0-TP0: DP replica 1, in the gradient reduction
              "kill=7:6:optimizer",    # rank 7, DP1-PP1-TP1: in the update, after the step committed
              "kill-save=3:8:copy",    # rank 3, DP1-PP0-TP1: during the background copy of checkpoint 8
              "stop=6:10:backward"]    # rank 6, DP1-PP1-TP0: SIGSTOPped in its backward
    logs: list[str] = []
    summary = supervise(_cfg(out, drills), _opts(), logs.append)
    log = "\n".join(logs)
    assert summary["steps"] == STEPS and summary["restarts"] == 0, log
    assert sorted(r["rank"] for r in summary["replacements"]) == [1, 2, 3, 4, 6, 7], log
    failures = summary["failures"]
    assert [f["rank"] for f in failures] == [1, 4, 2, 7, 3, 6], log
    assert all(f["signal"] == "SIGKILL" for f in failures[:5]) and "stopped" in failures[5]["message"], log
    # no copy of a lost rank's state was missing: every newcomer took it from its DP peer, none from the disk
    assert {r["source"] for r in summary["inplace_recoveries"]} == {"peer"}, log
    assert_healthy_ranks_kept(out)
    assert_bit_identical(out, baseline, STEPS, WORLD)


def _kill_first_newcomer(out: Path, ports: list[int], killed: list[int], stop: threading.Event) -> None:
    """SIGKILL the spare that takes over in the first recovery while it takes over: once its generation's process
    groups exist (its `groups` mark in the supervisor's store) and its state is being sent to it. (Killed earlier,
    while gloo connects the generation's pairs, it can leave peers waiting in gloo's connect: docs/resilience.md.)"""
    store = None
    while not stop.is_set():
        path = out / "resilience.jsonl"
        gens = [e for e in events(out) if e["event"] == "generation" and e["replaced"]] if path.is_file() else []
        if gens and ports:
            g, (rank, swap) = gens[0]["generation"], next(iter(gens[0]["replaced"].items()))
            store = store or dist.TCPStore("127.0.0.1", ports[0], None, False,
                                           timeout=datetime.timedelta(seconds=30))
            if store.check([gp.mark_key(g, "groups", int(rank))]) or gens[-1]["generation"] > g:
                os.kill(swap["new_pid"], signal.SIGKILL)
                killed.append(swap["new_pid"])
                return
        time.sleep(0.01)


def test_two_replicas_at_once_a_spare_killed_while_taking_over_and_a_hang(tmp_path, baseline, monkeypatch):
    out = tmp_path / "run"
    drills = ["kill=0:2:backward", "kill=7:2:backward",  # DP replica 0 and DP replica 1, in the same step
              "hang=5:7"]  # rank 5 blocks at iteration 7, its heartbeat alive: named by the hang timeout
    ports: list[int] = []  # the supervisor's store (it runs in this process), for the saboteur to watch
    real_store = generations._store

    def spied_store(*args):
        store, sock = real_store(*args)
        ports.append(store.port)
        return store, sock

    monkeypatch.setattr(generations, "_store", spied_store)
    killed: list[int] = []
    stop = threading.Event()
    saboteur = threading.Thread(target=_kill_first_newcomer, args=(out, ports, killed, stop), daemon=True)
    saboteur.start()
    logs: list[str] = []
    try:
        summary = supervise(_cfg(out, drills), _opts(spares=2, hang_timeout_s=4.0), logs.append)
    finally:
        stop.set()
    log = "\n".join(logs)
    assert killed, "the first newcomer was never seen"
    assert summary["steps"] == STEPS and summary["restarts"] == 0, log
    # ranks 0 and 7 replaced, one of them twice: its first spare was killed while it joined
    replaced = sorted(r["rank"] for r in summary["replacements"])
    assert replaced in ([0, 0, 5, 7], [0, 5, 7, 7]), log
    failures = summary["failures"]
    assert all(f["kind"] == "exit" and f["signal"] == "SIGKILL" for f in failures[:-1]), log
    hang = failures[-1]
    assert hang["kind"] == "hang" and hang["rank"] == 5 and "waits for rank 5" in hang["message"], log
    gens = assert_healthy_ranks_kept(out)
    assert any(r["new_pid"] == killed[0] for g in gens for r in g["replaced"].values())
    assert_bit_identical(out, baseline, STEPS, WORLD)


def _stop_a_survivor_as_generation_1_starts(out: Path, ports: list[int], rank: int, after: str | None, seen: dict,
                                            stop: threading.Event) -> None:
    """SIGSTOP survivor `rank` once the supervisor names generation 1 (`ctl/gen`) and, with `after`, once the rank
    has reached that mark of it ("plan": it is forming the generation's groups, gloo connecting its pairs). `seen`
    records its marks of generation 1 at that moment, for the failure message."""
    store = None
    while not stop.is_set():
        if ports and (out / "resilience.jsonl").is_file():
            store = store or dist.TCPStore("127.0.0.1", ports[0], None, False, timeout=datetime.timedelta(seconds=30))
            if store.get(gp.GEN) == b"1" and (after is None or store.check([gp.mark_key(1, after, rank)])):
                pid = next(e for e in events(out) if e["event"] == "generation")["pids"][str(rank)]
                os.kill(pid, signal.SIGSTOP)
                seen.update(pid=pid, marks=[m for m in gp.MARKS if store.check([gp.mark_key(1, m, rank)])])
                return
        time.sleep(0.002)


@pytest.mark.parametrize("after", [None, "plan"], ids=["before-its-plan", "forming-groups"])
def test_a_survivor_stopped_while_a_generation_starts_is_replaced_and_the_run_stays_bit_identical(
        tmp_path, baseline, monkeypatch, after):
    """The generation a kill started loses a survivor to SIGSTOP while it forms: the supervisor names the stopped
    process (1 s in state T), kills it, and a second spare takes it over in the generation after; the job ends,
    never waiting on the stopped rank (a peer blocked in gloo's connect is released by the forming timeout)."""
    out = tmp_path / "run"
    ports: list[int] = []
    real_store = generations._store

    def spied_store(*args):
        store, sock = real_store(*args)
        ports.append(store.port)
        return store, sock

    monkeypatch.setattr(generations, "_store", spied_store)
    seen: dict = {}
    stop = threading.Event()
    saboteur = threading.Thread(target=_stop_a_survivor_as_generation_1_starts, args=(out, ports, 6, after, seen, stop),
                                daemon=True)
    saboteur.start()
    logs: list[str] = []
    try:  # rank 1 (DP0-PP0-TP1) killed in its forward of iteration 3; rank 6 (DP1-PP1-TP0) stopped in generation 1
        summary = supervise(_cfg(out, ["kill=1:3:forward"]), _opts(spares=2), logs.append)
    finally:
        stop.set()
    log = "\n".join(logs)
    assert seen, "generation 1 was never seen"
    print(f"rank 6 stopped having reached {seen['marks'] or 'none'} of generation 1's marks")  # shown with -s
    assert summary["steps"] == STEPS and summary["restarts"] == 0, log
    failures = summary["failures"]
    assert failures[0]["rank"] == 1 and failures[0]["signal"] == "SIGKILL", log
    stopped = [f for f in failures if f["rank"] == 6]
    assert stopped and "stopped" in stopped[0]["message"], f"rank 6 stopped with marks {seen['marks']}:\n{log}"
    assert {1, 6} <= {r["rank"] for r in summary["replacements"]}, log
    gens = assert_healthy_ranks_kept(out)
    assert any(r["old_pid"] == seen["pid"] for g in gens for r in g["replaced"].values())
    assert_bit_identical(out, baseline, STEPS, WORLD)
