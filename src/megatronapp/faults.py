"""Fault injection for `--inject`: make a rank slow, a link slow, a rank pause like GC, or a rank hang.

Specs (one per `--inject`):
  slow-compute=RANK:FACTOR   compute spans on RANK take FACTOR times longer (sleep (FACTOR-1)*work at close, the
                             span's work being its elapsed time less what its thread waited for a CPU), and so do
                             the layer spans inside them: a slow device is slow at every op it runs;
                             with --emulate-device, RANK's device time is multiplied by FACTOR instead
  slow-link=A-B:DELAY_MS     each send between A and B, and each collective holding both, waits DELAY_MS on A and B
  pause=RANK:MS:EVERY        RANK pauses MS milliseconds at the start of every EVERY-th iteration
  hang=RANK:STEP             RANK blocks at the start of iteration STEP until the injector is removed
  slow-wire=A-B:FACTOR       every message between A and B takes FACTOR times its nominal wire time; the wire is
                             slow, not the sender (delivery is late, in order, and the sender goes on)
  jitter=A-B:lognormal:SIGMA every message between A and B gets a nominal wire time times a lognormal draw (mean 1)
  kill-save=RANK:STEP:STAGE[:RESTART]  RANK SIGKILLs itself when its save of step STEP reaches STAGE (copy, write,
                             sum, marker, commit: `checkpoint.SAVE_STAGES`; marker and commit are rank 0's, the
                             committer's); with RESTART, only in that torchrun restart (TORCHELASTIC_RESTART_COUNT),
                             so one torchrun job with --max-restarts can drill every stage in turn
  kill=RANK:STEP:PHASE       RANK SIGKILLs itself in iteration STEP (0-based, as hang) when it enters PHASE:
                             forward, backward (its first such task), reduce (its first DP collective: the
                             gradient reduction), optimizer (the update, after the step's commit point)
  stop=RANK:STEP:PHASE       the same with SIGSTOP: the process freezes (a hang a supervisor must name)
The nominal wire time of a message is its bytes at WIRE_GBPS (the loopback wire of one machine is otherwise
far faster than any real link, so a factor of it would change nothing).
Faults act through the engine's seams only: span sinks (`megatronapp.tracing`) and comm interceptors
(`megatronapp.parallel.comm`). Install the tracer first so an injected sleep falls inside the traced span.
In a training run `--inject` attaches `plugin` by import path (the engine never imports this file).
"""
from __future__ import annotations

import os
import random
import signal
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

from megatronapp import tracing
from megatronapp.config import ConfigError
from megatronapp.parallel import comm, emulation
from megatronapp.train import checkpoint as ckpt
from megatronapp.train.checkpoint import SAVE_STAGES

KINDS = {
    "slow-compute": "slow-compute=RANK:FACTOR (e.g. slow-compute=5:1.3)",
    "slow-link": "slow-link=A-B:DELAY_MS (e.g. slow-link=0-4:20)",
    "pause": "pause=RANK:MS:EVERY (e.g. pause=3:200:5)",
    "hang": "hang=RANK:STEP (e.g. hang=2:10)",
    "slow-wire": "slow-wire=A-B:FACTOR (e.g. slow-wire=1-2:4)",
    "jitter": "jitter=A-B:lognormal:SIGMA (e.g. jitter=1-2:lognormal:0.5)",
    "kill-save": "kill-save=RANK:STEP:STAGE[:RESTART] (e.g. kill-save=1:4:sum)",
    "kill": "kill=RANK:STEP:PHASE (e.g. kill=5:3:backward)",
    "stop": "stop=RANK:STEP:PHASE (e.g. stop=2:4:forward)",
}
PHASES = ("forward", "backward", "reduce", "optimizer")  # where a kill or stop drill fires in its step
WIRE_GBPS = 1.0  # nominal link bandwidth for slow-wire and jitter, GB/s


@dataclass(frozen=True)
class Fault:
    """One parsed fault: `ranks` it concerns and its numbers (factor, delay_ms, ms, every, step)."""

    kind: str
    ranks: tuple[int, ...]
    factor: float = 1.0
    delay_ms: float = 0.0
    ms: float = 0.0
    every: int = 0
    step: int = -1
    sigma: float = 0.0
    stage: str = ""
    restart: int = 0
    spec: str = ""


def _num(spec: str, field: str, text: str, kind: type, minimum: float) -> Any:
    try:
        value = kind(text)
    except ValueError:
        raise ConfigError(f"--inject {spec!r}: {field} must be a{'n integer' if kind is int else ' number'}, "
                          f"got {text!r}; expected {KINDS[spec.split('=')[0]]}") from None
    if value < minimum:
        raise ConfigError(f"--inject {spec!r}: {field}={value} must be >= {minimum}")
    return value


def parse(spec: str) -> Fault:
    """Parse one `--inject` spec; raise ConfigError naming the spec and the expected form."""
    kind, eq, rest = spec.strip().partition("=")
    if kind not in KINDS:
        raise ConfigError(f"--inject {spec!r}: unknown fault {kind!r}; choose one of: " + "; ".join(KINDS.values()))
    parts = rest.split(":")
    want = {"slow-compute": 2, "slow-link": 2, "pause": 3, "hang": 2, "slow-wire": 2, "jitter": 3, "kill-save": 3,
            "kill": 3, "stop": 3}[kind]
    if kind == "kill-save" and len(parts) == 4:
        want = 4
    if not eq or len(parts) != want or not all(parts):
        raise ConfigError(f"--inject {spec!r}: expected {KINDS[kind]}")
    if kind == "kill-save":
        if parts[2] not in SAVE_STAGES:
            raise ConfigError(f"--inject {spec!r}: unknown save stage {parts[2]!r}; choose one of: "
                              + ", ".join(SAVE_STAGES))
        rank = _num(spec, "RANK", parts[0], int, 0)
        if parts[2] in ("marker", "commit") and rank != 0:
            raise ConfigError(f"--inject {spec!r}: stage {parts[2]} is reached by rank 0 only (the committer)")
        return Fault(kind, (rank,), step=_num(spec, "STEP", parts[1], int, 1), stage=parts[2],
                     restart=_num(spec, "RESTART", parts[3], int, 0) if want == 4 else 0, spec=spec)
    if kind in ("kill", "stop"):
        if parts[2] not in PHASES:
            raise ConfigError(f"--inject {spec!r}: unknown phase {parts[2]!r}; choose one of: " + ", ".join(PHASES))
        return Fault(kind, (_num(spec, "RANK", parts[0], int, 0),), step=_num(spec, "STEP", parts[1], int, 0),
                     stage=parts[2], spec=spec)
    if kind == "slow-compute":
        factor = _num(spec, "FACTOR", parts[1], float, 1.0)
        return Fault(kind, (_num(spec, "RANK", parts[0], int, 0),), factor=factor, spec=spec)
    if kind in ("slow-link", "slow-wire", "jitter"):
        a, dash, b = parts[0].partition("-")
        if not dash:
            raise ConfigError(f"--inject {spec!r}: the link is two ranks joined by '-'; expected {KINDS[kind]}")
        ra, rb = _num(spec, "A", a, int, 0), _num(spec, "B", b, int, 0)
        if ra == rb:
            raise ConfigError(f"--inject {spec!r}: a link needs two different ranks")
        if kind == "slow-wire":
            return Fault(kind, (ra, rb), factor=_num(spec, "FACTOR", parts[1], float, 1.0), spec=spec)
        if kind == "jitter":
            if parts[1] != "lognormal":
                raise ConfigError(f"--inject {spec!r}: the only jitter law is lognormal; expected {KINDS[kind]}")
            return Fault(kind, (ra, rb), sigma=_num(spec, "SIGMA", parts[2], float, 0.0), spec=spec)
        return Fault(kind, (ra, rb), delay_ms=_num(spec, "DELAY_MS", parts[1], float, 0.0), spec=spec)
    if kind == "pause":
        return Fault(kind, (_num(spec, "RANK", parts[0], int, 0),), ms=_num(spec, "MS", parts[1], float, 0.0),
                     every=_num(spec, "EVERY", parts[2], int, 1), spec=spec)
    return Fault(kind, (_num(spec, "RANK", parts[0], int, 0),), step=_num(spec, "STEP", parts[1], int, 0),
                 spec=spec)


class _OpenCompute(threading.local):
    """Per thread: the already-stretched time and the CPU wait of the layers inside each open compute span
    (innermost last)."""

    def __init__(self) -> None:
        self.stack: list[list[float]] = []


def _cpu_wait_s() -> float:
    """Seconds this thread has waited runnable for a CPU so far (Linux schedstat's run-queue delay); 0 unknown.
    A slow device is slow at its work, not at waiting for a core: sleeping (F-1) x a span's elapsed time on a host
    where a third of it was that wait made a 2x drill read 2.43x once detection took the wait out."""
    try:
        with open("/proc/thread-self/schedstat", "rb") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return 0.0


class Injector:
    """The faults that concern this rank, hooked into span sinks and comm interceptors until `remove()`."""

    def __init__(self, faults: list[Fault], rank: int):
        self.rank = rank
        self.faults = faults
        self._slow = [f.factor for f in faults if f.kind == "slow-compute" and f.ranks[0] == rank]
        emulated = emulation.active()
        if emulated is not None and self._slow:  # a slow emulated device: its device time grows, not host time
            for factor in self._slow:
                emulated.slow_down(factor)
            self._slow = []
        self._links = [f for f in faults if f.kind == "slow-link" and rank in f.ranks]
        self._wires = [f for f in faults if f.kind in ("slow-wire", "jitter") and rank in f.ranks]
        self._rng = random.Random(rank)  # jitter draws: reproducible per rank
        self._pauses = [f for f in faults if f.kind == "pause" and f.ranks[0] == rank]
        self._hangs = {f.step for f in faults if f.kind == "hang" and f.ranks[0] == rank}
        restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
        self._kills = {(f.step, f.stage) for f in faults
                       if f.kind == "kill-save" and f.ranks[0] == rank and f.restart == restart}
        if self._kills:
            ckpt.on_save_stage(self._save_stage)
        # kill/stop drills: (iteration, phase) -> signal, fired once
        self._signals = {(f.step, f.stage): signal.SIGKILL if f.kind == "kill" else signal.SIGSTOP
                         for f in faults if f.kind in ("kill", "stop") and f.ranks[0] == rank}
        self.iteration = -1
        self._release = threading.Event()
        self._open = _OpenCompute()
        self.hung_at: int | None = None
        self.installed_sink = bool(self._slow or self._pauses or self._hangs or self._signals)
        if self.installed_sink:
            tracing.install(self)
        if self._links or self._wires or any(phase == "reduce" for _, phase in self._signals):
            comm.add_interceptor(self.intercept)

    # SpanSink: only compute and layer spans are timed, everything else costs one comparison. A layer span is
    # stretched at its own close; the compute span around it then stretches only its time outside layers (each
    # thread keeps a stack of its open compute spans' already-stretched time).
    def open(self, name: str, cat: str, meta: dict[str, Any]) -> Any:
        if self._signals and name in ("forward", "backward", "optimizer"):
            self._drill(name)
        if not self._slow or cat not in ("compute", "layer"):
            return None
        inner = None
        if cat == "compute":
            inner = [0.0, 0.0]  # layers' elapsed (stretch included) and CPU wait
            self._open.stack.append(inner)
        return time.perf_counter(), _cpu_wait_s(), inner

    def close(self, token: Any) -> None:
        if token is None:
            return
        t0, w0, inner = token
        elapsed = time.perf_counter() - t0
        waited = _cpu_wait_s() - w0
        own = elapsed - (inner[0] if inner is not None else 0.0)
        own_wait = waited - (inner[1] if inner is not None else 0.0)
        stretch = sum(factor - 1.0 for factor in self._slow) * max(own - max(own_wait, 0.0), 0.0)
        time.sleep(stretch)
        stack = self._open.stack
        if inner is not None:
            if stack and stack[-1] is inner:
                stack.pop()
        elif stack:  # a layer: its stretched time is already paid inside the enclosing compute span
            stack[-1][0] += elapsed + stretch
            stack[-1][1] += waited

    def _drill(self, phase: str) -> None:
        """A kill or stop drill of this iteration and phase: signal this process, once."""
        sig = self._signals.pop((self.iteration, phase), None)
        if sig is not None:
            print(f"megatronapp: fault drill: rank {self.rank} sends itself {signal.Signals(sig).name} in iteration "
                  f"{self.iteration} at '{phase}'", file=sys.stderr, flush=True)
            os.kill(os.getpid(), sig)

    def step(self, iteration: int, begin: bool) -> None:
        if not begin:
            return
        self.iteration = iteration
        if iteration in self._hangs and not self._release.is_set():
            self.hung_at = iteration
            self._release.wait()  # a hang drill: only remove() (or the process dying) ends it
        for f in self._pauses:
            if iteration % f.every == 0:
                time.sleep(f.ms / 1000.0)

    def intercept(self, op: comm.CommOp) -> float | None:
        """Delay sends over a slow link, and collectives whose group holds both of its ends (the caller stalls);
        return the late delivery of a send over a slow or jittery wire (the caller goes on)."""
        if self._signals and op.group == "dp" and op.peer is None:  # the step's first DP collective: reduction
            self._drill("reduce")
        late = 0.0
        if op.name == "send":
            for f in self._wires:
                if op.peer in f.ranks and op.peer != self.rank:
                    nominal = op.nbytes / (WIRE_GBPS * 1e9)
                    if f.kind == "slow-wire":
                        late += (f.factor - 1.0) * nominal
                    else:
                        late += nominal * self._rng.lognormvariate(-f.sigma * f.sigma / 2, f.sigma)
        for f in self._links:
            if op.peer is not None:
                hit = op.name == "send" and op.peer in f.ranks
            else:
                hit = f.ranks[0] in op.group_ranks and f.ranks[1] in op.group_ranks
            if hit:
                time.sleep(f.delay_ms / 1000.0)
        return late or None

    def remove(self) -> None:
        """Unhook every fault and release a hung rank."""
        self._release.set()
        if self.installed_sink:
            tracing.uninstall(self)
        comm.remove_interceptor(self.intercept)
        ckpt.off_save_stage(self._save_stage)

    def _save_stage(self, stage: str, step: int, rank: int) -> None:
        """A kill-save drill: die as a kill -9 would, at this point of the save (any thread)."""
        if (step, stage) in self._kills:
            print(f"megatronapp: fault drill kill-save: rank {rank} SIGKILLs itself at stage '{stage}' of the save "
                  f"of step {step} ({SAVE_STAGES[stage]})", file=sys.stderr, flush=True)
            os.kill(os.getpid(), signal.SIGKILL)


def armed_in_restart(specs: list[str], restart: int) -> list[str]:
    """The drills of a torchrun restart after the first start: only kill-save drills that name that restart (every
    other drill fires once, in the first start)."""
    out = []
    for s in specs:
        f = parse(s)
        if f.kind == "kill-save" and f.restart == restart and restart > 0:
            out.append(s)
    return out


def install(specs: list[str], topo: Any) -> Injector:
    """Parse `specs`, check their ranks against the topology and hook the faults of this rank."""
    faults = [parse(s) for s in specs]
    world = topo.world_size
    for f in faults:
        bad = [r for r in f.ranks if r >= world]
        if bad:
            raise ConfigError(f"--inject {f.spec!r}: rank {bad[0]} does not exist in a world of {world} "
                              f"(ranks 0..{world - 1})")
    return Injector(faults, topo.rank)


def plugin(trainer: Any) -> None:
    """Plug-in entry for `--inject`: hook this rank's faults into the run; unhook them (and release a hang) at
    shutdown."""
    injector = install(trainer.cfg.inject, trainer.topo)
    trainer.hooks.on("shutdown", injector.remove)
