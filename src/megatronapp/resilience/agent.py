"""The in-rank half of the supervisor: a heartbeat every few seconds, over files, independent of the process groups.

Attached by the supervisor as a plug-in (`megatronapp.resilience.agent:plugin`); it reads where to write from
`MEGATRONAPP_HEARTBEAT_DIR` (and the period from `MEGATRONAPP_HEARTBEAT_S`) and does nothing without it. A daemon
thread writes `rank00003.json` atomically: step, phase and since when, tokens/s, memory, and the flight
recorder's snapshot (the open and last completed comm ops with group and sequence number). The thread keeps
beating while the training thread is blocked in a collective or an injected hang (both release the GIL), so the
driver sees a hung rank's state; a rank that stops beating is stopped or dead.

Under the local supervisor the heartbeat starts earlier, first thing in the rank (`early_start`, the launcher's
prelude, before torch is imported), and tells each part of the start-up (`megatronapp.startup.phase`) as its phase
`start-up: <what>` with step -1; the plug-in then takes that heartbeat over once the trainer is built.

In a multi-host job (`train --heartbeat-dir` under torchrun, `elastic.py`) the rank also knows its round
(`MEGATRONAPP_ROUND`) and the same thread polls for the driver's restart decision of that round (`decision.py`):
a valid one ends the process with `decision.RESTART_EXIT_CODE`; a bad one is reported once and ignored, so a
stray or half-copied file never stops a healthy rank. Before each beat it also checks that its start of the
workers is still the job's current one (`fence.py`): a rank whose start torchrun replaced (its host was cut off and
a standby took its place) exits the same way, without another beat, so it never writes over the heartbeat of the
rank that now holds its number. Its beats carry its host's address and torchrun node (`MEGATRONAPP_HOST_ADDR`,
`MEGATRONAPP_NODE`), by which the watcher names a host.
"""
from __future__ import annotations

import dataclasses
import json
import os
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

from megatronapp import startup
from megatronapp.files import write_exclusive
from megatronapp.parallel.flight_recorder import RECORDER
from megatronapp.resilience import decision, fence

DIR_ENV, PERIOD_ENV, ROUND_ENV = "MEGATRONAPP_HEARTBEAT_DIR", "MEGATRONAPP_HEARTBEAT_S", "MEGATRONAPP_ROUND"
START_ENV = "MEGATRONAPP_WORKER_START"  # one id per start of a multi-host job's workers (elastic.py)
ADDR_ENV, NODE_ENV = "MEGATRONAPP_HOST_ADDR", "MEGATRONAPP_NODE"  # this rank's host in a multi-host job


class Heartbeat:
    """This rank's state, written to `<dir>/rank%05d.json` every `period_s` by a daemon thread."""

    def __init__(self, directory: Path, trainer: Any, period_s: float, round_: int | None = None,
                 exit_fn: Any = os._exit, rank: int | None = None):
        """`trainer` None: an early heartbeat (`early_start`), of `rank`, before the trainer exists; `bind` adds
        the trainer's part later."""
        rank = trainer.rank if trainer is not None else rank
        self.directory = directory
        self.path = directory / f"rank{rank:05d}.json"
        self.period_s = period_s
        self.round = round_  # None: a local supervisor stops this rank itself; no decision to poll
        self._exit = exit_fn
        self._bad_decision: str | None = None
        start = os.environ.get(START_ENV)
        self.fence = fence.Fence(directory, round_, start) if round_ is not None and start else None
        node = os.environ.get(NODE_ENV, "")
        # step -1 and a "start-up: ..." phase until the trainer is built: a watcher takes no step from it
        self.state: dict[str, Any] = {
            "round": round_, "start": start, "host": socket.gethostname(), "addr": os.environ.get(ADDR_ENV),
            "node": int(node) if node.isdigit() else None, "layout": None,
            "failed": False, "rank": rank, "pid": os.getpid(), "coord": None, "label": None, "step": -1,
            "phase": "start-up: spawn", "phase_since": time.time(), "tokens_per_s": None, "step_time_s": None,
            "mem_bytes": None, "checkpoint": None, "started_at": time.time(), "spawned_at": time.time(),
            "load_s": 0.0}
        self._stop = threading.Event()
        self._write_lock = threading.Lock()  # the beat thread and the training thread both write: in order
        self._thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)
        if trainer is not None:
            self.bind(trainer)

    def bind(self, trainer: Any) -> None:
        """The trainer is built (process groups, model, resume): its rank's place, step and load time."""
        p = trainer.cfg.parallel
        # started_at: when the trainer was built (benchmarks/recovery_emulated.py splits a restart with it and
        # load_s); an early heartbeat's spawned_at keeps when the process began
        self.state.update(layout=[p.tp, p.pp, p.dp], coord=dataclasses.asdict(trainer.topo.coord),
                          label=trainer.topo.coord.label(), step=trainer.step, started_at=time.time(),
                          load_s=getattr(trainer, "load_s", 0.0))
        self._phase("start")

    def startup_phase(self, what: str) -> None:
        """`startup.phase` listener: the part of its start-up this rank is in, for the watcher to name."""
        self._phase(f"start-up: {what}")
        self._beat()

    def start(self, _trainer: Any = None) -> None:
        self._beat()
        if not self._thread.is_alive():  # an early heartbeat already beats
            self._thread.start()

    def _beat(self) -> None:
        try:
            self.write()
        except OSError:  # the driver removed the directory: the run is being torn down
            pass

    def _phase(self, phase: str) -> None:
        self.state.update(phase=phase, phase_since=time.time())

    def step_start(self, step: int) -> None:
        self._phase(f"step {step + 1}")

    def step_end(self, step: int, record: dict[str, Any]) -> None:
        self.state.update(step=step, tokens_per_s=record.get("tokens_per_s"), step_time_s=record.get("step_time"),
                          mem_bytes=record.get("mem_bytes"))
        self._phase("after step")

    def saved(self, step: int, path: Path) -> None:
        self.state["checkpoint"] = str(path)

    def write(self) -> None:
        with self._write_lock:
            flight = RECORDER.snapshot()
            beat = {**self.state, "time": time.time(), "flight": flight,
                    "open_op": flight["open"][0] if flight["open"] else None,
                    "last_op": flight["recent"][-1] if flight["recent"] else None}
            write_exclusive(self.path, json.dumps(beat).encode())

    def failed(self, _error: BaseException | None = None) -> None:
        self.state["failed"] = True

    def poll_decision(self) -> decision.Decision | None:
        """The driver's decision for this rank's round, or None (none yet, or a bad file: reported once)."""
        if self.round is None:
            return None
        try:
            return decision.read(self.directory, self.round)
        except decision.DecisionError as e:
            if str(e) != self._bad_decision:  # once per distinct problem: a half-copied file may still complete
                self._bad_decision = str(e)
                print(f"megatronapp heartbeat (rank {self.state['rank']}): ignoring a restart decision: {e}",
                      file=sys.stderr, flush=True)
            return None

    def obey(self, d: decision.Decision) -> None:
        """Leave at once: the training thread may be blocked in a collective, so nothing may wait for it."""
        print(f"megatronapp heartbeat (rank {self.state['rank']}): the driver restarts round {d.round}: "
              f"{d.reason} (cause: rank {d.culprit} ({d.label})); exiting with {decision.RESTART_EXIT_CODE}",
              file=sys.stderr, flush=True)
        self._exit(decision.RESTART_EXIT_CODE)

    def fenced(self) -> fence.Start | None:
        """The start that replaced this rank's (None while this rank's start is current, or outside torchrun)."""
        return self.fence.check() if self.fence is not None else None

    def leave_fenced(self, current: fence.Start) -> None:
        """Leave at once and silently: this rank's number now belongs to a rank of the current start."""
        print(f"megatronapp heartbeat (rank {self.state['rank']}, {self.state.get('addr')}): this start "
              f"({self.fence.start if self.fence else '?'}) was replaced by {fence.describe(current)}: this host "
              f"left the job (cut off, or late); exiting with {decision.RESTART_EXIT_CODE} without training on",
              file=sys.stderr, flush=True)
        self._exit(decision.RESTART_EXIT_CODE)

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            current = self.fenced()
            if current is not None:
                self.leave_fenced(current)
                return
            try:
                self.write()
            except OSError:  # the driver removed the directory: the run is being torn down
                return
            d = self.poll_decision()
            if d is not None:
                self.obey(d)
                return

    def stop(self) -> None:
        self._phase("shutdown")
        self._stop.set()
        self._beat()


_EARLY: Heartbeat | None = None  # this process's heartbeat started by `early_start`, taken over by `plugin`


def early_start(rank: int) -> None:
    """The launcher's prelude (`launch.start(prelude=...)`): beat first thing in the rank, before torch is
    imported, and name each part of the start-up as it begins (`megatronapp.startup`). A rank stopped or stuck
    during its start-up is then seen, with what it was doing, while its peers wait for it."""
    global _EARLY
    directory = os.environ.get(DIR_ENV)
    if not directory or _EARLY is not None:
        return
    round_ = os.environ.get(ROUND_ENV)
    hb = Heartbeat(Path(directory), None, float(os.environ.get(PERIOD_ENV, "1.0")),
                   int(round_) if round_ is not None else None, rank=rank)
    startup.on_phase(hb.startup_phase)
    hb.start()
    _EARLY = hb


def plugin(trainer: Any) -> None:
    """Plug-in entry: beat to the supervisor's directory, if this rank was started by one (taking over the
    heartbeat `early_start` began, if it did)."""
    directory = os.environ.get(DIR_ENV)
    if not directory:
        return
    round_ = os.environ.get(ROUND_ENV)
    hb = _EARLY
    if hb is not None and hb.state["rank"] == trainer.rank and hb.directory == Path(directory):
        startup.off_phase(hb.startup_phase)
        hb.bind(trainer)
    else:
        hb = Heartbeat(Path(directory), trainer, float(os.environ.get(PERIOD_ENV, "1.0")),
                       int(round_) if round_ is not None else None)
    trainer.hooks.on("rank_start", hb.start)
    trainer.hooks.on("failure", hb.failed)
    trainer.hooks.on("step_start", hb.step_start)
    trainer.hooks.on("step_end", hb.step_end)
    trainer.hooks.on("checkpoint_saved", hb.saved)
    trainer.hooks.on("shutdown", hb.stop)
