"""Calibrate the pipeline simulator from a real run: task costs, per-task overhead and link latency from spans.

Input is what every rank's executor emits through `megatronapp.tracing`: a "forward"/"backward" compute span per
task (chunk, microbatch in its meta), and the moment the following send was issued. The time between the end of
a task's compute and its send is *blocked* time: the stage cannot start another task (building the payload, and
any delay an interceptor such as `faults` slow-link sleeps before the send is issued). All ranks of one machine
share `time.perf_counter` (CLOCK_MONOTONIC), so their spans compare directly; across machines align them first
(`megatronapp.scan.detect.align`).

Two ways to feed the simulator:
  `Calibration.sim_config()`  the public `SimConfig` model: per-chunk forward/backward times shared by all
                              stages, a per-stage factor (its total busy time relative to the mean), one latency.
  `replay(schedule, step, ...)` every task's own measured cost (compute + blocked + overhead), which isolates the
                              simulator's scheduling and dependency model from its cost model.
"""
from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from megatronapp.dpp import simulator
from megatronapp.dpp.simulator import SimConfig, SimResult
from megatronapp.pipeline.tasks import Policy


class TaskTiming(NamedTuple):
    stage: int
    kind: str  # F, B or W (weight gradient of a split backward)
    chunk: int
    microbatch: int
    start: float  # compute span, seconds on the shared clock
    end: float
    blocked: float  # seconds the stage stayed blocked after the compute (send issue, injected link delay)


@dataclass
class StepTimings:
    """One real pipeline step: every task of every stage, and per stage its executor window and input waits."""

    pp: int
    vpp: int
    microbatches: int
    tasks: list[TaskTiming]
    executor_s: list[float]  # per stage: wall seconds inside the executor's step
    wait_s: list[float]  # per stage: seconds the executor waited for inputs (its own measure)

    def validate(self) -> None:
        """Every stage must report each of its 2 (3 with a split backward) * vpp * microbatches tasks once."""
        want = (3 if self.split else 2) * self.vpp * self.microbatches
        for s in range(self.pp):
            keys = {(t.kind, t.chunk, t.microbatch) for t in self.tasks if t.stage == s}
            if len(keys) != want:
                raise ValueError(f"stage {s} reported {len(keys)} distinct tasks, expected {want} (vpp={self.vpp}, "
                                 f"microbatches={self.microbatches}): were its compute spans recorded?")

    @property
    def split(self) -> bool:
        return any(t.kind == "W" for t in self.tasks)

    def makespan(self) -> float:
        """Seconds from the first task's start to the last task's end (blocked time included)."""
        return max(t.end + t.blocked for t in self.tasks) - min(t.start for t in self.tasks)

    def overhead(self) -> float:
        """Median over stages of the executor's own time per task: neither compute, blocked nor input wait."""
        per_stage = []
        for s in range(self.pp):
            mine = [t for t in self.tasks if t.stage == s]
            spent = sum(t.end - t.start + t.blocked for t in mine)
            per_stage.append(max(0.0, (self.executor_s[s] - spent - self.wait_s[s]) / max(1, len(mine))))
        return statistics.median(per_stage)

    def latency(self, overhead: float) -> float | None:
        """Median delay from a send to the start of its consumer, over consumers whose stage was idle waiting
        for it, less the per-task overhead; None when no consumer waited."""
        pp, vpp = self.pp, self.vpp
        last_v = pp * vpp - 1
        by_key = {(t.stage, t.kind, t.chunk, t.microbatch): t for t in self.tasks}
        free_at: dict[tuple, float] = {}  # when the consumer's stage finished its previous task
        for s in range(pp):
            prev = None
            for t in sorted((t for t in self.tasks if t.stage == s), key=lambda t: t.start):
                if prev is not None:
                    free_at[(s, t.kind, t.chunk, t.microbatch)] = prev.end + prev.blocked
                prev = t
        gaps = []
        for t in self.tasks:
            v = t.chunk * pp + t.stage
            if t.kind == "F" and v > 0:
                pv = v - 1
            elif t.kind == "B" and v < last_v:
                pv = v + 1
            else:
                continue  # input made here (first virtual stage, or the loss)
            src = by_key.get((pv % pp, t.kind, pv // pp, t.microbatch))
            key = (t.stage, t.kind, t.chunk, t.microbatch)
            if src is None or src.stage == t.stage or key not in free_at:
                continue
            sent = src.end + src.blocked
            if free_at[key] < sent:  # the stage was idle when the message left: it waited for this input
                gaps.append(t.start - sent - overhead)
        return max(0.0, statistics.median(gaps)) if gaps else None

    def task_costs(self, overhead: float) -> tuple[list, list, list]:
        """Per [stage][chunk][microbatch] F, B and W seconds: compute + blocked + overhead (W all zero when the
        backward was not split)."""
        tables = {k: [[[0.0] * self.microbatches for _ in range(self.vpp)] for _ in range(self.pp)] for k in "FBW"}
        for t in self.tasks:
            tables[t.kind][t.stage][t.chunk][t.microbatch] = t.end - t.start + t.blocked + overhead
        return tables["F"], tables["B"], tables["W"]


@dataclass
class Calibration:
    """Median task costs per (stage, chunk), the executor's overhead per task and the link latency."""

    pp: int
    vpp: int
    microbatches: int
    fwd: list[list[float]]  # [stage][chunk] seconds per forward: compute + blocked + overhead
    bwd: list[list[float]]  # a whole backward (B + W when split)
    overhead: float
    latency: float
    wgrad: list[list[float]] | None = None  # [stage][chunk] seconds per W task of a split backward

    def sim_config(self, max_inflight: int | None = None) -> SimConfig:
        """The public SimConfig model of these costs: per-chunk means over stages, and a per-stage factor that
        keeps each stage's total busy time (so a stage blocked on a slow link is a slow stage)."""
        pp, vpp = self.pp, self.vpp
        fwd = [statistics.fmean(self.fwd[s][c] for s in range(pp)) for c in range(vpp)]
        bwd = [statistics.fmean(self.bwd[s][c] for s in range(pp)) for c in range(vpp)]
        mean_stage = sum(fwd) + sum(bwd)
        factors = [(sum(self.fwd[s]) + sum(self.bwd[s])) / mean_stage for s in range(pp)]
        w_fraction = 0.5  # the simulator's default when no split backward was measured
        if self.wgrad is not None:
            w_fraction = sum(map(sum, self.wgrad)) / max(1e-12, sum(map(sum, self.bwd)))
        return SimConfig(pp=pp, vpp=vpp, microbatches=self.microbatches, fwd=fwd, bwd=bwd, stage_factors=factors,
                         latency=self.latency, max_inflight=max_inflight, w_fraction=w_fraction)

    def to_dict(self) -> dict:
        """JSON-ready."""
        return {k: getattr(self, k) for k in ("pp", "vpp", "microbatches", "fwd", "bwd", "overhead", "latency",
                                              "wgrad")}


def calibrate(steps: Sequence[StepTimings]) -> Calibration:
    """Medians over `steps` (same shape) of per-(stage, chunk) task costs, overhead and latency."""
    if not steps:
        raise ValueError("calibrate needs at least one measured step")
    first = steps[0]
    pp, vpp, m = first.pp, first.vpp, first.microbatches
    for st in steps:
        st.validate()
        if (st.pp, st.vpp, st.microbatches) != (pp, vpp, m):
            raise ValueError("calibrate: every step must have the same pp, vpp and microbatches")
    overhead = statistics.median(st.overhead() for st in steps)
    lats = [x for x in (st.latency(overhead) for st in steps) if x is not None]
    costs = [st.task_costs(overhead) for st in steps]
    def med(i: int) -> list[list[float]]:
        return [[statistics.median(statistics.fmean(c[i][s][ch]) for c in costs) for ch in range(vpp)]
                for s in range(pp)]

    fwd, b_in, w = med(0), med(1), med(2)
    split = first.split
    bwd = [[b_in[s][c] + w[s][c] for c in range(vpp)] for s in range(pp)]
    return Calibration(pp, vpp, m, fwd, bwd, overhead, statistics.median(lats) if lats else 0.0,
                       w if split else None)


def replay(schedule: str | Callable[[], Policy], step: StepTimings, overhead: float, latency: float,
           max_inflight: int | None = None) -> SimResult:
    """Simulate `schedule` with every task costing what it cost in `step` (compute + blocked + overhead)."""
    step.validate()
    if isinstance(schedule, str) and schedule in simulator.ONE_CHUNK and step.vpp > 1:
        raise ValueError(f"replay of {schedule!r} needs vpp=1 timings (it would merge chunks); got vpp={step.vpp}")
    cfg = SimConfig(pp=step.pp, vpp=step.vpp, microbatches=step.microbatches, latency=latency,
                    max_inflight=max_inflight, task_costs=step.task_costs(overhead))
    return simulator.simulate(schedule, cfg, timeline=False)
