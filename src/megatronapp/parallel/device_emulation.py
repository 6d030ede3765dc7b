"""Emulated devices (`--emulate-device SPEC`): put CPU ranks in the accelerator regime.

On a GPU the host launches a task's kernels and then mostly waits for the device; a rank idle in a pipeline
bubble leaves its GPU idle and nobody else's faster. On a CPU host whose ranks share cores, a rank idle in a
bubble gives its core to another rank, so schedules that fill bubbles buy nothing there. This module models the
device: every compute task (forward, backward or its B and W halves, recompute inside backward, optimizer step)
still computes its real tensors -- losses and gradients are exactly those of a normal run -- and then the rank
sleeps (its core is free) until the task's modelled device time, measured from the task's start, has passed.
Host time thus counts against device time, as a GPU's launch overhead hides behind its kernels. A task that
follows the previous one at once (its input was ready) starts on the device where the previous one ended, as
queued kernels do, even if a loaded host woke the rank late from that one's sleep (`late_s` records how late).

The cost model: device time = FLOPs / rate * jitter / speed * slow.
  * FLOPs are counted as MFU counts them, by the one FLOP model (flops.py: 6N + 12*L*H*Q*T per token): per layer
    and token a forward is 2n + 4HQT (n: the layer's matmul weights), an input-gradient backward (B) 2n + 8HQT,
    a weight-gradient backward (W) 2n; the output layer adds 2hV to each. Recompute is work the device does:
    full recompute adds the layers' forward to B, selective the attention core (4HQT). TP ranks do 1/tp of it.
    An optimizer step costs OPTIMIZER_FLOPS_PER_PARAM per local parameter (AdamW's element-wise work).
  * jitter: a multiplier with mean 1 per forward and per backward, a pure function of (seed, step, dp, stage,
    F or backward, chunk, microbatch): every schedule compared on one seed sees the same slow tasks (common
    random numbers), TP peers of a stage draw alike, and `cost_tables` hands the very same draws to
    `dpp simulate`. A split backward's B and W halves share their backward's draw: they are the same layers'
    kernels on the same device state moments apart, so what slows one (clocks, contention, memory layout)
    slows the other -- the model `dpp simulate` uses by default (one draw per whole backward). Independent
    draws would average a backward's slowness away across its halves and understate jitter per backward.
  * per-rank speed factors for heterogeneous devices, and `--inject slow-compute` (which, with emulation on,
    multiplies device time instead of stretching host time).

SPEC (tflops, jitter, speed, seed, host_share) is parsed and bounded by device_spec.py, in the launching process
when the config is validated. Communication stays real.

Honesty: each rank keeps, per task kind, the host wall time (compute before the sleep), host CPU time and
device time, and counts overruns (tasks whose host time exceeded their device time: the device time was not
honoured). When a rank's host share exceeds `host_share`, the run is not in the accelerator regime: the trainer
warns and summary.json says so; benchmarks must not quote such a run.
"""
from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from megatronapp.config import RunConfig, micro_batch_size
from megatronapp.device_spec import DeviceSpec, parse_spec
from megatronapp.flops import OPTIMIZER_FLOPS_PER_PARAM, virtual_stage_flops
from megatronapp.parallel.topology import Coord, rank_of

# forward, backward (input gradients; whole backward unsplit), weight gradients, recompute (MegaFBD), optimizer
KINDS = ("F", "B", "W", "R", "O")
FIELDS = ("count", "host_s", "cpu_s", "device_s", "overruns", "late_s")  # late_s: woken after the device time
_KEY_CODE = {"F": 1, "B": 2, "W": 2, "R": 4}  # W shares B's code: one jitter draw per whole backward
QUEUE_GAP_S = 0.002  # host time between two tasks below which the second was queued behind the first


# -- FLOPs of each task, from the one FLOP model (flops.py) -------------------------------------------
def virtual_flops(cfg: RunConfig) -> list[tuple[float, float, float]]:
    """(F, B, W) FLOPs of one microbatch on each virtual stage v = chunk * pp + stage, on one TP rank."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    return virtual_stage_flops(m, t.seq_len, micro_batch_size(cfg) * t.seq_len, p.pp, p.vpp, p.tp, t.recompute)


def chunk_flops(cfg: RunConfig, stage: int) -> list[tuple[float, float, float]]:
    """(F, B, W) FLOPs of one microbatch on each chunk of pipeline `stage`, on one TP rank."""
    virtual, p = virtual_flops(cfg), cfg.parallel
    return [virtual[c * p.pp + stage] for c in range(p.vpp)]


def jitter(spec: DeviceSpec, step: int, dp: int, stage: int, kind: str, chunk: int, microbatch: int) -> float:
    """The seeded mean-1 multiplier of one task: a pure function of its identity, not of when it runs. The B and
    W halves of one backward get the same multiplier (see the module docstring)."""
    if spec.sigma <= 0:
        return 1.0
    rng = np.random.default_rng([spec.seed, step, dp, stage, _KEY_CODE[kind], chunk, microbatch])
    s = spec.sigma
    return float(rng.lognormal(-s * s / 2, s))


def stage_speed(spec: DeviceSpec, cfg: RunConfig, stage: int, dp: int = 0) -> float:
    """Speed of a pipeline stage: its slowest TP rank's (TP peers wait for each other in every collective)."""
    p = cfg.parallel
    return min(spec.speed_of(rank_of(Coord(dp=dp, pp=stage, tp=tp), p.tp, p.dp)) for tp in range(p.tp))


def cost_tables(spec: DeviceSpec, cfg: RunConfig, step: int, dp: int = 0,
                slow: dict[int, float] | None = None) -> tuple[list, list, list]:
    """Device seconds of every F, B and W task of one step ([stage][chunk][microbatch] each), exactly as the
    emulated ranks of DP replica `dp` will sleep them: the `task_costs` of `dpp.simulator.SimConfig`. `slow`
    maps a stage to a `--inject slow-compute` factor. An unsplit backward costs B + W."""
    p = cfg.parallel
    tables: tuple[list, list, list] = ([], [], [])
    for stage in range(p.pp):
        scale = (slow or {}).get(stage, 1.0) / (spec.rate * stage_speed(spec, cfg, stage, dp))
        flops = chunk_flops(cfg, stage)
        for k, kind in enumerate("FBW"):
            tables[k].append([[flops[c][k] * scale * jitter(spec, step, dp, stage, kind, c, mb)
                               for mb in range(p.microbatches)] for c in range(p.vpp)])
    return tables


# -- the device of one rank ------------------------------------------------------------------------------
@dataclass
class _Stats:
    """Per task kind: count, host wall s, host CPU s, device s, overruns, seconds woken late."""

    rows: dict[str, list[float]] = field(default_factory=lambda: {k: [0.0] * len(FIELDS) for k in KINDS})

    def add(self, kind: str, host: float, cpu: float, device: float, late: float) -> None:
        row = self.rows[kind]
        row[0] += 1
        row[1] += host
        row[2] += cpu
        row[3] += device
        row[4] += host > device
        row[5] += late


class _Task:
    """Context of one compute task: times the host, then sleeps until the task's modelled end on the device.

    The device runs queued work back to back, whatever the host thread does: when this task follows the previous
    one at once (its input was ready, the host only picked it), it starts on the device where the previous task
    ended there, not when a loaded host happened to wake the rank up. Otherwise (the rank waited for an input)
    it starts now."""

    __slots__ = ("dev", "kind", "device_s", "t0", "c0", "start")

    def __init__(self, dev: EmulatedDevice, kind: str, device_s: float):
        self.dev, self.kind, self.device_s = dev, kind, device_s

    def __enter__(self) -> _Task:
        self.t0, self.c0 = time.perf_counter(), time.thread_time()
        dev = self.dev
        gap = self.t0 - dev.woke_at
        self.start = dev.free_at + gap if gap <= QUEUE_GAP_S and dev.free_at < dev.woke_at else self.t0
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        now = time.perf_counter()
        host = now - self.t0
        cpu = time.thread_time() - self.c0
        if exc_type is not None:
            return
        dev = self.dev
        end = max(self.start + self.device_s, now)  # a host that overran the device time pushes the device too
        if end > now:
            time.sleep(end - now)
        dev.woke_at = time.perf_counter()
        dev.free_at = end
        late = dev.woke_at - end  # a loaded host wakes the rank late
        dev.stats_for_step().add(self.kind, host, cpu, self.device_s, late)


class EmulatedDevice:
    """The modelled accelerator of one rank: device time per task, and the host-vs-device record."""

    def __init__(self, spec: DeviceSpec, cfg: RunConfig, rank: int, dp: int, stage: int, local_params: int):
        self.spec, self.rank, self.dp, self.stage = spec, rank, dp, stage
        self.flops = chunk_flops(cfg, stage)
        self.virtual = virtual_flops(cfg)  # MegaFBD ranks run whole virtual stages
        self.speed = spec.speed_of(rank)
        self.slow = 1.0  # --inject slow-compute
        self.optimizer_flops = OPTIMIZER_FLOPS_PER_PARAM * local_params
        self.step = 0
        self.steps_seen = 0
        self.free_at = self.woke_at = 0.0  # modelled end of the last task on the device; when the host woke
        self.first, self.rest = _Stats(), _Stats()  # the first step of a process includes warm-up

    def slow_down(self, factor: float) -> None:
        """Multiply this rank's device times by `factor` (`--inject slow-compute` on an emulated device)."""
        self.slow *= factor

    def begin_step(self, step: int) -> None:
        """Tell the device the optimizer step it is in (the jitter draws depend on it)."""
        self.step = step
        self.steps_seen += 1

    def stats_for_step(self) -> _Stats:
        return self.first if self.steps_seen <= 1 else self.rest

    def seconds(self, flops: float) -> float:
        """Device seconds of `flops` on this rank, before jitter."""
        return flops * self.slow / (self.spec.rate * self.speed)

    def task_seconds(self, kind: str, chunk: int, microbatch: int) -> float:
        """Device seconds of task `kind` ("F", "B", "W", or "BW": an unsplit backward) of (chunk, microbatch)."""
        f, b, w = self.flops[chunk]
        spec, step, dp, stage = self.spec, self.step, self.dp, self.stage
        if kind == "F":
            flops = f * jitter(spec, step, dp, stage, "F", chunk, microbatch)
        elif kind == "B":
            flops = b * jitter(spec, step, dp, stage, "B", chunk, microbatch)
        elif kind == "W":
            flops = w * jitter(spec, step, dp, stage, "W", chunk, microbatch)
        else:
            flops = (b * jitter(spec, step, dp, stage, "B", chunk, microbatch)
                     + w * jitter(spec, step, dp, stage, "W", chunk, microbatch))
        return self.seconds(flops)

    def task(self, kind: str, chunk: int, microbatch: int) -> _Task:
        """Context manager around one pipeline task's real compute; on exit sleeps until its device time."""
        return _Task(self, "B" if kind == "BW" else kind, self.task_seconds(kind, chunk, microbatch))

    def segment(self, kind: str, v: int, microbatch: int) -> _Task:
        """MegaFBD: context manager around virtual stage `v`'s "F" (a forward instance's forward, no autograd),
        "R" (its recompute on a backward rank) or "BW" (its whole backward) of one microbatch."""
        f, b, w = self.virtual[v]
        spec, step, dp = self.spec, self.step, self.dp
        if kind in ("F", "R"):
            flops = f * jitter(spec, step, dp, v, kind, 0, microbatch)
        else:
            flops = (b * jitter(spec, step, dp, v, "B", 0, microbatch)
                     + w * jitter(spec, step, dp, v, "W", 0, microbatch))
        return _Task(self, "B" if kind == "BW" else kind, self.seconds(flops))

    def optimizer(self) -> _Task:
        """Context manager around the optimizer step."""
        return _Task(self, "O", self.seconds(self.optimizer_flops))

    def record(self) -> list[list[float]]:
        """[kind][field] totals of the steps after the first (all steps if only one ran)."""
        stats = self.rest if self.steps_seen > 1 else self.first
        return [list(stats.rows[k]) for k in KINDS]


def summarize(spec_text: str, per_rank: Sequence[Sequence[Sequence[float]]]) -> dict[str, Any]:
    """summary.json's `emulation` entry from every rank's `record()`: per rank and kind the host, CPU and
    device seconds, the host share (host over device time) and whether the run stayed in the accelerator
    regime (every rank's host share at most the spec's host_share)."""
    spec = parse_spec(spec_text)
    ranks = []
    for r, rows in enumerate(per_rank):
        kinds = {k: dict(zip(FIELDS, (int(v) if i in (0, 4) else round(v, 6) for i, v in enumerate(row))))
                 for k, row in zip(KINDS, rows) if row[0]}
        late = sum(row[5] for row in rows)
        host = sum(row[1] for row in rows)
        cpu = sum(row[2] for row in rows)
        device = sum(row[3] for row in rows)
        ranks.append({"rank": r, "host_share": host / device if device else 0.0,
                      "cpu_share": cpu / device if device else 0.0,
                      "late_share": late / device if device else 0.0,
                      "overruns": int(sum(row[4] for row in rows)), "tasks": int(sum(row[0] for row in rows)),
                      "kinds": kinds})
    worst = max((x["host_share"] for x in ranks), default=0.0)
    return {"spec": spec_text, "host_share_limit": spec.host_share, "host_share": worst,
            "in_accelerator_regime": worst <= spec.host_share, "ranks": ranks}


def warning(summary: dict[str, Any]) -> str | None:
    """The warning of a run that left the accelerator regime, or None."""
    if summary["in_accelerator_regime"]:
        return None
    bad = [x for x in summary["ranks"] if x["host_share"] > summary["host_share_limit"]]
    worst = max(bad, key=lambda x: x["host_share"])
    return (f"emulated devices: host time is {100 * worst['host_share']:.0f}% of device time on rank "
            f"{worst['rank']} (limit {100 * summary['host_share_limit']:.0f}%, {len(bad)} rank(s) over it, "
            f"{worst['overruns']}/{worst['tasks']} of its tasks overran their device time): this run is not in "
            f"the accelerator regime; lower tflops= so device time dominates, and do not quote its timings")
