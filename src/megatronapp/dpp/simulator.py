"""Discrete-event simulation of one pipeline step, driven by the same policy objects as the real executor.

Each stage runs one task at a time. When a stage is idle it asks its policy for the next task among the ready
ones, with a `StageView` whose counters (done, inflight, peak_inflight, wait_f, wait_b) are kept exactly as
`pipeline.executor.PipelineExecutor` keeps them. A finished forward sends its activation to the next virtual
stage, a finished backward its input gradient to the previous one, over directed links with latency,
bandwidth (one message on the wire at a time) and optional jitter.

Jitter is drawn per task and per message before the run (common random numbers), so every schedule compared
on one configuration and seed sees the same slow tasks and slow messages. Schedules that run one chunk per
stage (1f1b, zb-h1) on a `vpp > 1` configuration run the same model merged into one chunk per stage: a merged
task costs the sum of its chunks' jittered costs.

Policies with a split backward (static ZB-H1, the dynamic `dpp-zb`) run B (input gradient, sent upstream at
once) and W (weight gradient, local, ready when its B is done) as separate tasks; the executor runs the very
same orders and policies. A backward costs `bwd` in total; a split one spends `w_fraction` of it in W, unless
`task_costs` gives every F, B and W its own time (measured runs: `dpp.calibrate.replay`).
"""
from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from megatronapp.dpp.policies import STATIC_SCHEDULES, policy_by_name
from megatronapp.pipeline.schedules import StaticPolicy, stage_orders
from megatronapp.pipeline.tasks import Policy, StageView, Task

ONE_CHUNK = ("1f1b", "zb-h1")  # schedules that need vpp == 1; run merged on vpp > 1 configurations
SCHEDULE_NAMES = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "dpp-dfs", "dpp-bfs", "dpp-adaptive", "dpp-zb")


def parse_jitter(spec: str) -> Callable[[np.random.Generator, tuple[int, ...]], np.ndarray]:
    """A sampler of multiplicative slow-down factors (mean 1 for lognormal/uniform) from a spec string:
    none | lognormal:SIGMA | uniform:A (factor in [1-A, 1+A]) | spike:P:F (factor F with probability P)."""
    kind, _, rest = (spec or "none").partition(":")
    try:
        args = [float(a) for a in rest.split(":")] if rest else []
    except ValueError:
        raise ValueError(f"jitter {spec!r}: parameters must be numbers, e.g. lognormal:0.3") from None
    if kind == "none" and not args:
        return lambda rng, shape: np.ones(shape)
    if kind == "lognormal" and len(args) == 1 and args[0] >= 0:
        s = args[0]
        return lambda rng, shape: rng.lognormal(-s * s / 2, s, shape)
    if kind == "uniform" and len(args) == 1 and 0 <= args[0] < 1:
        a = args[0]
        return lambda rng, shape: 1 + a * (2 * rng.random(shape) - 1)
    if kind == "spike" and len(args) == 2 and 0 <= args[0] <= 1 and args[1] > 0:
        p, f = args
        return lambda rng, shape: np.where(rng.random(shape) < p, f, 1.0)
    raise ValueError(f"jitter {spec!r}: use none, lognormal:SIGMA, uniform:A (0<=A<1) or spike:P:FACTOR")


@dataclass
class SimConfig:
    """One pipeline step to simulate: shape, costs (seconds), links and jitter."""

    pp: int
    vpp: int = 1
    microbatches: int = 8
    fwd: float | Sequence[float] = 1.0  # forward time of one chunk for one microbatch (per chunk if a list)
    bwd: float | Sequence[float] = 2.0  # backward time (input + weight gradients)
    stage_factors: Sequence[float] | None = None  # per-stage slow-down of compute (a slow GPU: 1.3)
    latency: float = 0.0  # per message, seconds
    # Extra seconds per message on each link (entry s: stages s and s+1 mod pp, both directions), jittered like
    # `latency`: a slow or late wire between two stages (faults' slow-wire and jitter on real runs).
    link_latency: Sequence[float] | None = None
    bandwidth: float | None = None  # bytes/s per directed link; None: unlimited
    act_bytes: float = 0.0  # bytes of one activation (or its gradient) between stages
    compute_jitter: str = "none"
    link_jitter: str = "none"
    seed: int = 0
    max_inflight: int | None = None  # cap given to the policies through StageView.max_inflight
    w_fraction: float = 0.5  # split backward: share of backward time spent on weight gradients (W)
    # Measured per-task seconds ([stage][chunk][microbatch] for F, B and W; an unsplit backward costs B + W).
    # When given, they replace fwd/bwd/w_fraction/stage_factors and compute jitter.
    task_costs: tuple[list, list, list] | None = None

    def validate(self) -> None:
        """Refuse impossible settings, naming the field."""
        for name in ("pp", "vpp", "microbatches"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        for name in ("fwd", "bwd"):
            v = getattr(self, name)
            costs = list(v) if isinstance(v, Sequence) else [v]
            if isinstance(v, Sequence) and len(costs) != self.vpp:
                raise ValueError(f"{name} has {len(costs)} per-chunk costs; vpp={self.vpp} needs {self.vpp}")
            if any(c < 0 for c in costs):
                raise ValueError(f"{name} costs must be >= 0")
        if self.stage_factors is not None and len(self.stage_factors) != self.pp:
            raise ValueError(f"stage_factors has {len(self.stage_factors)} entries; pp={self.pp} needs {self.pp}")
        if self.link_latency is not None and (len(self.link_latency) != self.pp or min(self.link_latency) < 0):
            raise ValueError(f"link_latency needs pp={self.pp} entries >= 0 (entry s: the link between stages s "
                             f"and s+1 mod pp), got {list(self.link_latency)}")
        if self.bandwidth is not None and self.bandwidth <= 0:
            raise ValueError(f"bandwidth={self.bandwidth} must be > 0 (or None for unlimited)")
        if not 0 <= self.w_fraction < 1:
            raise ValueError(f"w_fraction={self.w_fraction} must be in [0, 1)")
        parse_jitter(self.compute_jitter)
        parse_jitter(self.link_jitter)
        if self.task_costs is not None:
            shape = (self.pp, self.vpp, self.microbatches)
            for name, table in zip("FBW", self.task_costs):
                got = np.shape(np.asarray(table, dtype=float))
                if got != shape:
                    raise ValueError(f"task_costs for {name} has shape {got}; pp, vpp, microbatches need {shape}")


class Span(NamedTuple):
    stage: int
    kind: str  # F, B, or W (weight gradient of a split backward)
    chunk: int
    microbatch: int
    start: float
    end: float


@dataclass
class SimResult:
    schedule: str
    pp: int
    vpp: int  # chunks per stage as run (1 for merged one-chunk schedules)
    microbatches: int
    step_time: float
    bubble: float  # idle share of pp * step_time
    busy: list[float]  # compute seconds per stage
    peak_inflight: list[int]  # per stage, in chunk activations of the run's own chunk size
    peak_activation: list[float]  # per stage, in units of a full stage's activations (chunks merged)
    timeline: list[Span] = field(repr=False, default_factory=list)

    def to_dict(self, timeline: bool = False) -> dict[str, Any]:
        """JSON-ready summary (timeline included on request)."""
        d = {k: getattr(self, k) for k in ("schedule", "pp", "vpp", "microbatches", "step_time", "bubble",
                                           "busy", "peak_inflight", "peak_activation")}
        if timeline:
            d["timeline"] = [list(s) for s in self.timeline]
        return d


class _SharedOrders(StaticPolicy):
    """StaticPolicy whose stage orders are computed (and deadlock-checked) once for all stages of a run."""

    def __init__(self, schedule: str, orders: list[list[Task]]):
        super().__init__(schedule)
        self._orders = orders

    def reset(self, view: StageView) -> None:
        self.order, self.pos = self._orders[view.stage], 0


class _PolicyStage:
    """One stage driven by a Policy, with the executor's bookkeeping of the StageView."""

    def __init__(self, policy: Policy, view: StageView):
        self.policy, self.view = policy, view
        view.split = bool(getattr(policy, "split_backward", False))
        self.total = view.total_tasks()
        policy.reset(view)

    def pick(self, ready: dict, waited: float) -> Any:
        task = self.policy.next_task(list(ready), self.view)
        if task is None:
            return None
        if task not in ready:
            raise RuntimeError(f"policy {self.policy.name} on stage {self.view.stage} chose {task}, "
                               f"which is not ready (ready: {[str(t) for t in ready]})")
        self.view.note_wait(task.kind, waited)  # as the executor does
        return task

    def done(self, task: Task) -> None:
        v = self.view
        if task.kind == "F":
            v.inflight += 1
            v.peak_inflight = max(v.peak_inflight, v.inflight)
        elif task.kind == "B" and v.split:
            v.pending_w += 1
        else:  # a microbatch's memory is released by its backward, or with a split backward by its W
            v.inflight -= 1
            v.pending_w -= task.kind == "W"
        v.done.add(task)
        self.policy.on_done(task, v)

    def finished(self) -> bool:
        return len(self.view.done) == self.total

    @property
    def peak(self) -> int:
        return self.view.peak_inflight


def _costs(cfg: SimConfig, merged: bool) -> tuple[list, list, list]:
    """Per (stage, chunk, microbatch) F, B and W times (B + W: a whole backward) with compute jitter drawn up
    front, or the measured `task_costs`."""
    if cfg.task_costs is not None:
        f, b, w = (np.asarray(t, dtype=float) for t in cfg.task_costs)
    else:
        pp, vpp, m = cfg.pp, cfg.vpp, cfg.microbatches
        fwd = np.broadcast_to(np.asarray(cfg.fwd, dtype=float), (vpp,))
        bwd = np.broadcast_to(np.asarray(cfg.bwd, dtype=float), (vpp,))
        factor = np.asarray(cfg.stage_factors if cfg.stage_factors is not None else [1.0] * pp, dtype=float)
        rng = np.random.default_rng([cfg.seed, 0])
        jit = parse_jitter(cfg.compute_jitter)(rng, (2, pp, vpp, m))
        f = factor[:, None, None] * fwd[None, :, None] * jit[0]
        full = factor[:, None, None] * bwd[None, :, None] * jit[1]
        b, w = full * (1.0 - cfg.w_fraction), full * cfg.w_fraction
    if merged:
        f, b, w = (x.sum(axis=1, keepdims=True) for x in (f, b, w))
    return f.tolist(), b.tolist(), w.tolist()


def simulate(schedule: str | Callable[[], Policy], cfg: SimConfig, timeline: bool = True) -> SimResult:
    """Simulate one step of `schedule` (a name from SCHEDULE_NAMES, or a factory of Policy objects, one per
    stage) on `cfg`. Raises RuntimeError if the schedule deadlocks."""
    cfg.validate()
    name = schedule if isinstance(schedule, str) else "policy"
    if isinstance(schedule, str) and schedule not in SCHEDULE_NAMES:
        raise ValueError(f"unknown schedule {schedule!r}; choose from {', '.join(SCHEDULE_NAMES)}")
    merged = name in ONE_CHUNK and cfg.vpp > 1
    pp, m = cfg.pp, cfg.microbatches
    vpp = 1 if merged else cfg.vpp
    V = pp * vpp
    fcost, bcost, wcost = _costs(cfg, merged)
    link_rng = np.random.default_rng([cfg.seed, 1])
    ljit = parse_jitter(cfg.link_jitter)(link_rng, (2, pp, cfg.vpp, m)).tolist()
    wire = cfg.act_bytes / cfg.bandwidth if cfg.bandwidth else 0.0
    lat = cfg.latency
    extra = list(cfg.link_latency) if cfg.link_latency is not None else [0.0] * pp

    if isinstance(schedule, str) and schedule in STATIC_SCHEDULES:
        orders = stage_orders(schedule, pp, vpp, m)
        def factory() -> Policy:
            return _SharedOrders(schedule, orders)
    elif isinstance(schedule, str):
        def factory() -> Policy:
            return policy_by_name(schedule)
    else:
        factory = schedule
    stages = [_PolicyStage(factory(), StageView(stage=s, pp=pp, vpp=vpp, microbatches=m,
                                                max_inflight=cfg.max_inflight)) for s in range(pp)]
    name = getattr(stages[0].policy, "name", name)
    split = stages[0].view.split

    # Microbatches enter the first virtual stage in order, one offered at a time (a data loader yields them in
    # order; every policy here starts them in order anyway), which keeps stage 0's ready set small.
    ready: list[dict] = [{} for _ in range(pp)]
    ready[0][Task("F", 0, 0)] = None
    busy = [False] * pp
    busy_time = [0.0] * pp
    idle_since = [0.0] * pp
    link_free = [[0.0] * pp, [0.0] * pp]  # [direction][source stage]: when the wire is free again
    heap: list[tuple] = []
    seq = 0
    spans: list[Span] = []

    def send(direction: int, src: int, chunk: int, mb: int, task: Task, now: float) -> None:
        nonlocal seq
        dst = (src + 1) % pp if direction == 0 else (src - 1) % pp
        if pp == 1:  # chunks of one stage hand over in memory
            arrive = now
        else:
            j = ljit[direction][src][chunk][mb]
            start = max(now, link_free[direction][src])
            link_free[direction][src] = start + wire * j
            arrive = start + (wire + lat + extra[src if direction == 0 else dst]) * j
        seq += 1
        heapq.heappush(heap, (arrive, seq, dst, task, -1.0))

    def dispatch(s: int, now: float) -> None:
        nonlocal seq
        r = ready[s]
        if not r:
            return
        task = stages[s].pick(r, now - idle_since[s])
        if task is None:
            return
        r.pop(task, None)
        busy[s] = True
        kind, c, i = task.kind, task.chunk, task.microbatch
        if kind == "F":
            dur = fcost[s][c][i]
        elif kind == "B":
            dur = bcost[s][c][i] if split else bcost[s][c][i] + wcost[s][c][i]
        else:
            dur = wcost[s][c][i]
        seq += 1
        heapq.heappush(heap, (now + dur, seq, s, task, now))

    def complete(s: int, task: Any, start: float, now: float) -> None:
        busy[s] = False
        idle_since[s] = now
        busy_time[s] += now - start
        if timeline:
            spans.append(Span(s, task.kind, task.chunk, task.microbatch, start, now))
        stages[s].done(task)
        kind, c, i = task.kind, task.chunk, task.microbatch
        v = c * pp + s
        if kind == "F":
            if v == 0 and i + 1 < m:
                ready[s][Task("F", 0, i + 1)] = None
            if v == V - 1:
                ready[s][Task("B", c, i)] = None  # the loss is here: backward can start at once
            else:
                send(0, s, c, i, Task("F", c + 1 if s == pp - 1 else c, i), now)
        elif kind == "B":
            if split:
                ready[s][Task("W", c, i)] = None
            if v > 0:
                send(1, s, c, i, Task("B", c - 1 if s == 0 else c, i), now)

    for s in range(pp):
        dispatch(s, 0.0)
    now = 0.0
    while heap:
        now = heap[0][0]
        tol = now + 1e-9 * max(1.0, abs(now))
        touched = set()
        while heap and heap[0][0] <= tol:  # apply everything that happens at this instant, then decide
            _, _, s, task, start = heapq.heappop(heap)
            if start >= 0:
                complete(s, task, start, now)
            else:
                ready[s][task] = None
            touched.add(s)
        for s in sorted(touched):
            if not busy[s]:
                dispatch(s, now)

    stuck = [s for s in range(pp) if not stages[s].finished()]
    if stuck:
        s = stuck[0]
        raise RuntimeError(f"{name} deadlocked on pp={pp} vpp={vpp} microbatches={m}: stage {s} waits with ready "
                           f"{[str(t) for t in ready[s]]}; stages not finished: {stuck}")
    step = now
    bubble = 1.0 - sum(busy_time) / (pp * step) if step > 0 else 0.0
    peaks = [st.peak for st in stages]
    per_chunk = 1.0 / cfg.vpp if not merged else 1.0
    return SimResult(schedule=name, pp=pp, vpp=vpp, microbatches=m, step_time=step, bubble=bubble,
                     busy=busy_time, peak_inflight=peaks, peak_activation=[p * per_chunk for p in peaks],
                     timeline=spans)


def compare(names: Sequence[str], cfg: SimConfig, timeline: bool = True) -> list[SimResult]:
    """Simulate several schedules on one configuration (same jitter draws for all)."""
    return [simulate(n, cfg, timeline=timeline) for n in names]
