"""Where a job's newcomers come from: warm spares, a fork server with torch preloaded, else nobody (full restart).

A warm spare (`inplace.spare_main`) is a process that has imported torch and the trainer and waits; it says so
through the store key `ctl/spare/<id>/ready`. Importing torch takes seconds (much more on a loaded host), so a
failure that finds no ready spare would wait for one that far. Hence a fork server: multiprocessing's
"forkserver", the one `launch.start` uses for gloo ranks, with torch, torch.distributed, the trainer and this
module preloaded. It is warmed in a background thread when the job starts (its preload costs one torch import,
paid while generation 0 starts, never delaying it), and then

- the pool's background refill (after a spare was taken, or died while waiting) is forked from it: a refill is
  ready in a fraction of a second instead of seconds;
- a failure that finds fewer ready spares than lost ranks forks the missing ones on demand; they say ready
  through the same key and are taken like spares (whichever is ready first: a spare that was still starting, or
  the forked one).

Only when that also fails (no fork server, none ready within `spare_wait_s`, the process died) does the job fall
back to the full restart. Each newcomer records which path supplied it: "warm spare" (ready when the failure
came), "starting spare" (a pool spare that became ready during the wait), "fork server" (forked on demand).

Which processes are forked, which spawned (NCCL jobs must never fork a CUDA-initialised parent):
- gloo: forked from the server. The server is a fresh interpreter (multiprocessing spawns it; nothing of the
  supervisor's state is inherited) that imports modules and runs no torch op: no intra-op thread pool exists to
  be broken by the fork, and CUDA is never initialised (a probe forked from it checks that before it is used).
- NCCL: spawned, as `launch.start` does: a rank of a CUDA job initialises CUDA itself in a fresh interpreter.
  There is then no fork server: refills are spawned and a failure without a ready spare waits for a starting
  one, else restarts every rank.
- `MEGATRONAPP_START_METHOD=spawn` (the launcher's opt-out) turns the fork server off the same way.
The initial K spares are spawned as before, so a broken fork server never leaves the job without a spare, and
the ranks of generation 0 start as before (spawned, the heartbeat's prelude first).
"""
from __future__ import annotations

import dataclasses
import multiprocessing as std_mp
import multiprocessing.forkserver
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from megatronapp import launch
from megatronapp.resilience import generation_protocol as gp
from megatronapp.resilience import inplace
from megatronapp.resilience.watch import process_state

# launch's preload plus this module (which imports the in-place ranks' code: member, handover, the run loop).
# An import that fails is only skipped by multiprocessing: the forked process then imports it itself.
PRELOAD = [*launch.FORKSERVER_PRELOAD, "megatronapp.resilience.spare_pool"]
PROBE_TIMEOUT_S = 600.0  # the server's preload on a loaded host (torch alone took 57 s at load 30 here)
PROBE_CUDA, PROBE_NO_TORCH = 3, 2  # a probe's exit codes: CUDA initialised in the server; torch not preloaded


def _probe() -> None:
    """Forked from the server before it is used: the server must not have initialised CUDA (a fork would inherit
    a context it cannot use) and must hold torch already (else every fork imports it and nothing is gained)."""
    torch = sys.modules.get("torch")
    if torch is None:
        sys.exit(PROBE_NO_TORCH)
    if torch.cuda.is_initialized():
        sys.exit(PROBE_CUDA)


def forked_spare(stdio: Any, env: dict[str, str], *args: Any) -> None:
    """A spare forked from the server: the supervisor's stdout, stderr and environment of now (the server's are
    those of its own start, see `launch._Stdio`), then a spare as a spawned one is."""
    stdio.install()
    os.environ.clear()
    os.environ.update(env)
    inplace.spare_main(*args)


def fork_refusal(backend: str) -> str | None:
    """Why this job's spares are not forked (None: they are)."""
    chosen = os.environ.get("MEGATRONAPP_START_METHOD", "")
    if chosen == "spawn":
        return "MEGATRONAPP_START_METHOD=spawn"
    if backend != "gloo":
        return f"a {backend} job: a CUDA process starts from a fresh interpreter, never from a fork"
    if launch.start_method(backend) != "forkserver":
        return "this platform has no fork server"
    return None


class ForkServer:
    """multiprocessing's fork server with the spares' code preloaded, warmed in a background thread."""

    def __init__(self, backend: str, force_off: str | None = None):
        self.why_not = force_off or fork_refusal(backend)  # set: unusable, and why
        self.started_at = time.time()
        self.ready_at: float | None = None
        self.reported = False  # the supervisor logged its state
        self.ctx: Any = None
        self._done = threading.Event()
        if self.why_not is not None:
            self._done.set()
            return
        self.ctx = std_mp.get_context("forkserver")
        threading.Thread(target=self._warm, name="forkserver-warm", daemon=True).start()

    def _warm(self) -> None:
        try:
            self.ctx.set_forkserver_preload(PRELOAD)  # read when the server starts; a running one keeps its own
            probe = self.ctx.Process(target=_probe, name="forkserver-probe")
            probe.start()  # returns once the server has done its preload and forked
            probe.join(PROBE_TIMEOUT_S)
            if probe.exitcode is None:
                probe.kill()
                self.why_not = f"its probe did not finish within {PROBE_TIMEOUT_S:.0f} s"
            elif probe.exitcode == PROBE_CUDA:
                self.why_not = "CUDA was initialised in the server: forking it is not safe"
            elif probe.exitcode == PROBE_NO_TORCH:
                self.why_not = "the server did not preload torch"
            elif probe.exitcode != 0:
                self.why_not = f"its probe exited with {probe.exitcode}"
            else:
                self.ready_at = time.time()
        except Exception as e:  # noqa: BLE001 - no fork server: spares are spawned, as without one
            self.why_not = f"it did not start: {type(e).__name__}: {e}"
        finally:
            self._done.set()

    def settled(self) -> bool:
        """Its warm-up is over (ready, or not usable)."""
        return self._done.is_set()

    def usable(self) -> bool:
        if self.why_not is not None or self.ready_at is None:
            return False
        pid = getattr(getattr(multiprocessing.forkserver, "_forkserver", None), "_forkserver_pid", None)
        if pid is not None and process_state(pid) in (None, "Z"):
            # a dead server would be started again inside Process.start, which would then wait for its preload
            self.why_not = f"the server (pid {pid}) died"
            return False
        return True

    def state(self) -> str:
        if self.why_not is not None:
            return f"unavailable ({self.why_not})"
        return "ready" if self.ready_at is not None else "still starting (preloading torch)"


@dataclasses.dataclass
class Spare:
    sid: int
    process: Any
    method: str  # "spawn" | "forkserver"
    reason: str  # "pool" (the job's start), "refill", "on demand"
    started_at: float
    ready_at: float | None = None  # the spare's own time.time() when it said ready
    path: str = ""  # set when taken: "warm spare", "starting spare" or "fork server"


class SparePool:
    """The job's spares: started, noted ready, replaced when they die, taken by a failure's newcomers."""

    def __init__(self, size: int, store: Any, args: tuple, server: ForkServer, log: Callable[[str], None],
                 event: Callable[[dict[str, Any]], None]):
        self.size, self.store, self.args, self.server, self.log, self.event = size, store, args, server, log, event
        self.spawn_ctx = std_mp.get_context("spawn")
        self.spares: dict[int, Spare] = {}
        self.next_sid = 0
        self.shortfall = ""  # why the last `take` found too few

    @property
    def processes(self) -> list[Any]:
        return [s.process for s in self.spares.values()]

    def start(self, reason: str) -> Spare:
        """A new spare: forked from the server when it is usable (refills and on-demand ones), else spawned."""
        sid, self.next_sid = self.next_sid, self.next_sid + 1
        fork = reason != "pool" and self.server.usable()
        if fork:
            env = {**os.environ, **self.args[-1]}  # the supervisor's environment now, the job's on top
            p = self.server.ctx.Process(target=forked_spare, name=f"spare{sid}",
                                        args=(launch._Stdio(), env, sid, *self.args))  # noqa: SLF001
        else:
            p = self.spawn_ctx.Process(target=inplace.spare_main, name=f"spare{sid}", args=(sid, *self.args))
        spare = Spare(sid, p, "forkserver" if fork else "spawn", reason, time.time())
        p.start()
        self.spares[sid] = spare
        self.event({"event": "spare_started", "sid": sid, "pid": p.pid, "method": spare.method, "reason": reason})
        return spare

    def refill(self) -> None:
        """Top the pool up to its size (in the background: the new ones say ready when they are)."""
        while len(self.spares) < self.size:
            self.start("refill")

    def tend(self) -> None:
        """Note the spares that became ready; replace the ones that died while waiting; report the server."""
        if not self.server.reported and self.server.settled():
            self.server.reported = True
            ok = self.server.ready_at is not None and self.server.why_not is None
            self.event({"event": "forkserver", "state": "ready" if ok else "unavailable", "why": self.server.why_not,
                        "ready_s": self.server.ready_at - self.server.started_at if ok else None})
            self.log(f"fork server ready {self.server.ready_at - self.server.started_at:.2f} s after the job "
                     "started: refills and on-demand newcomers are forked from it" if ok else
                     f"no fork server ({self.server.why_not}): spares are spawned")
        for sid, s in list(self.spares.items()):
            if s.process.exitcode is not None:
                del self.spares[sid]
                self.log(f"spare {sid} (pid {s.process.pid}, {s.reason}, {s.method}) died while waiting "
                         f"(exit {s.process.exitcode})")
                self.event({"event": "spare_died", "sid": sid, "method": s.method, "reason": s.reason,
                            "exitcode": s.process.exitcode})
            elif s.ready_at is None and self.store.check([gp.spare_ready_key(sid)]):
                key = gp.spare_ready_key(sid)
                s.ready_at = gp.number(self.store.get(key), key)
                self.event({"event": "spare_ready", "sid": sid, "pid": s.process.pid, "method": s.method,
                            "reason": s.reason, "ready_s": s.ready_at - s.started_at})
        self.refill()

    def take(self, n: int, wait_s: float, pause: Callable[[float], None]) -> list[Spare] | None:
        """`n` ready spares, removed from the pool, each with its `path`; None (and `shortfall`) when fewer than
        `n` are ready within `wait_s`. Those missing at the start are forked from the server at once (or once it
        is ready, if it is still preloading); spares still starting may be taken too, whichever is ready first."""
        deadline = time.monotonic() + wait_s
        self.tend()
        warm = {s.sid for s in self._usable()}
        forked: set[int] = set()
        while True:
            usable = self._usable()
            if len(usable) >= n:
                chosen = sorted(usable, key=lambda s: (s.sid not in warm, s.ready_at, s.sid))[:n]
                for s in chosen:
                    s.path = "warm spare" if s.sid in warm else "fork server" if s.sid in forked else "starting spare"
                    del self.spares[s.sid]
                return chosen
            if not forked and self.server.usable():
                for _ in range(n - len(usable)):
                    try:
                        forked.add(self.start("on demand").sid)
                    except Exception as e:  # noqa: BLE001 - the server is gone: wait for the pool, else restart
                        self.server.why_not = f"a fork failed: {type(e).__name__}: {e}"
                        break
                if forked:
                    self.log(f"{n - len(usable)} of {n} newcomers without a ready spare: {len(forked)} forked from "
                             "the fork server")
            if time.monotonic() > deadline or (not self.spares and self.server.settled()):  # nothing may come
                self.shortfall = self._why_short(n, len(usable), wait_s, forked)
                return None
            pause(0.05)
            self.tend()

    def _usable(self) -> list[Spare]:
        return [s for s in self.spares.values()
                if s.ready_at is not None and process_state(s.process.pid) not in ("T", "Z", None)]

    def _why_short(self, n: int, ready: int, wait_s: float, forked: set[int]) -> str:
        why = f"{ready} of {n} spares ready within {wait_s:.0f} s"
        lost = [sid for sid in forked if sid not in self.spares]
        if lost:
            return why + f"; the process forked on demand died (spare {', '.join(map(str, lost))})"
        if forked:
            return why + "; the process forked on demand was not ready in time"
        return why + f"; fork server {self.server.state()}"

    def close(self) -> list[Any]:
        """The pool's processes, to be ended by the caller."""
        procs = self.processes
        self.spares.clear()
        return procs
