"""The in-place recovery jobs of the tests and of the formation drills (tests/test_resilience_inplace.py,
tests/form_kill_drills.py): the tp2 x pp2 x dp2 job, the supervisor's options, the checks that a recovered run kept
its healthy ranks and equals an uninterrupted one bit for bit, and the saboteurs that kill or stop a process at a
chosen moment of a generation, watching the supervisor's store (the supervisor runs in the test's process)."""
from __future__ import annotations

import datetime
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist

from megatronapp.cli import build_parser, config_from_args
from megatronapp.config import RunConfig
from megatronapp.resilience import generation_protocol as gp
from megatronapp.resilience import generations
from megatronapp.resilience.supervisor import Options
from tests import inplace_checks
from tests.inplace_checks import assert_healthy_ranks_kept, events  # noqa: F401  (re-exported)

STEPS = 12
WORLD = 8
# the every-phase test's drills (tests/test_resilience_inplace.py), also run as drills by tests/form_kill_drills.py
EVERY_PHASE = ["kill=1:1:forward",      # rank 1, DP0-PP0-TP1: a TP peer of stage 0, in its forward
               "kill=4:3:backward",     # rank 4, DP0-PP1-TP0: the last pipeline stage, in its backward
               "kill=2:5:reduce",       # rank 2, DP1-PP0-TP0: DP replica 1, in the gradient reduction
               "kill=7:6:optimizer",    # rank 7, DP1-PP1-TP1: in the update, after the step committed
               "kill-save=3:8:copy",    # rank 3, DP1-PP0-TP1: during the background copy of checkpoint 8
               "stop=6:10:backward"]    # rank 6, DP1-PP1-TP0: SIGSTOPped in its backward


def flags(steps: int = STEPS) -> list[str]:
    return ["--nproc", "8", "--tp", "2", "--pp", "2", "--dp", "2", "--steps", str(steps), "--save-interval", "2",
            "--async-save", "--layers", "2", "--hidden", "32", "--heads", "4", "--global-batch", "4",
            "--microbatches", "2", "--seq-len", "16", "--no-progress", "--peak-tflops", "1"]


def cfg(out: Path, inject: list[str] = (), steps: int = STEPS) -> RunConfig:
    c = config_from_args(build_parser().parse_args(["train", *flags(steps), "--out", str(out)]))
    c.inject = list(inject)
    return c


def opts(**over: Any) -> Options:
    return Options(**{"heartbeat_s": 0.3, "max_restarts": 8, "diagnose_on_restart": False, "spares": 1,
                      "hang_timeout_s": 30.0, "form_timeout_s": 60.0, **over})


def assert_bit_identical(out: Path, baseline: Path, steps: int = STEPS) -> None:
    """`inplace_checks.assert_bit_identical` for this job's world, no step computed again."""
    inplace_checks.assert_bit_identical(out, baseline, steps, WORLD)


def spy_store_port(monkeypatch: Any) -> list[int]:
    """The port of the supervisor's store once it exists (a list the saboteurs poll), through `monkeypatch` (a
    pytest MonkeyPatch)."""
    ports: list[int] = []
    real_store = generations._store

    def spied_store(*args: Any) -> Any:
        store, sock = real_store(*args)
        ports.append(store.port)
        return store, sock

    monkeypatch.setattr(generations, "_store", spied_store)
    return ports


def _connect(port: int) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", port, None, False, timeout=datetime.timedelta(seconds=30))


def kill_first_newcomer(out: Path, ports: list[int], killed: list[dict], stop: threading.Event,
                        moment: Callable[[Any, int, int], bool]) -> None:
    """SIGKILL the spare that takes over in the first recovery once `moment(store, generation, rank)` holds (the
    supervisor's store, the generation it joins, the rank it takes over); `killed` gets its pid, rank, generation
    and the time of the kill."""
    store = None
    while not stop.is_set():
        gens = [e for e in events(out) if e["event"] == "generation" and e["replaced"]]
        if gens and ports:
            g, (rank, swap) = gens[0]["generation"], next(iter(gens[0]["replaced"].items()))
            store = store or _connect(ports[0])
            if moment(store, g, int(rank)) or gens[-1]["generation"] > g:
                os.kill(swap["new_pid"], signal.SIGKILL)
                killed.append({"pid": swap["new_pid"], "rank": int(rank), "generation": g, "time": time.time()})
                return
        time.sleep(0.002)


def assigned(store: Any, g: int, rank: int) -> bool:
    """The moment a spare is assigned (the supervisor published its generation): before its groups exist."""
    return True


def has_mark(what: str) -> Callable[[Any, int, int], bool]:
    """The moment the newcomer reached mark `what` of its generation (`gp.MARKS`)."""
    return lambda store, g, rank: bool(store.check([gp.mark_key(g, what, rank)]))


def stop_a_survivor_as_generation_1_starts(out: Path, ports: list[int], rank: int, after: str | None, seen: dict,
                                           stop: threading.Event) -> None:
    """SIGSTOP survivor `rank` once the supervisor names generation 1 (`ctl/gen`) and, with `after`, once the rank
    has reached that mark of it ("plan": it is forming the generation's groups, gloo connecting its pairs). `seen`
    records its marks of generation 1 at that moment, for the failure message."""
    store = None
    while not stop.is_set():
        if ports and (out / "resilience.jsonl").is_file():
            store = store or _connect(ports[0])
            if store.get(gp.GEN) == b"1" and (after is None or store.check([gp.mark_key(1, after, rank)])):
                pid = next(e for e in events(out) if e["event"] == "generation")["pids"][str(rank)]
                os.kill(pid, signal.SIGSTOP)
                seen.update(pid=pid, marks=[m for m in gp.MARKS if store.check([gp.mark_key(1, m, rank)])])
                return
        time.sleep(0.002)
