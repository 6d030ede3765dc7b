"""MegaDPP dynamic pipeline policies: each stage picks its next task at run time from what is ready.

Depth-first (DFS) pushes the same microbatch through further chunks (its activations are freed sooner);
breadth-first (BFS) pushes more microbatches through the same chunk (more work queued, more memory). Both run
backwards first once activations pile up. `AdaptivePolicy` follows interleaved 1F1B's order out of order (the
first ready task in it), turns backward-first under memory pressure and runs further ahead when gradients lag.

Memory cap (`StageView.max_inflight`, from `parallel.dpp_max_inflight`): a forward is *allowed* only if the stage
stays in a safe state, in the banker's-algorithm sense, with one resource (activation slots) and the microbatches
started on this stage as clients. A microbatch needs one slot per chunk on a stage before its first backward
there, so the cap must be at least `vpp`. With the cap set, microbatches also start (chunk-0 forward) on a stage
in microbatch order; together these rules make the dynamic policies deadlock-free (see docs/megadpp.md).
Backwards are always allowed: they only free memory.

Policies are deterministic functions of (ready, view) and of the tasks reported through `on_done`, so
tensor-parallel peers that replay tp-rank 0's choices stay in step.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from megatronapp.pipeline.schedules import StaticPolicy, interleaved_order, one_f_one_b_order
from megatronapp.pipeline.tasks import Policy, StageView, Task

STATIC_SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1")
DPP_POLICIES = ("dfs", "bfs", "adaptive", "zb")


def min_inflight_cap(vpp: int) -> int:
    """Smallest `dpp_max_inflight` that lets a pipeline finish: one activation per chunk of one microbatch."""
    return vpp


def default_target(view: StageView) -> int:
    """Activations interleaved 1F1B (or 1F1B) holds at most on this stage: the memory a full pipeline needs."""
    total = view.vpp * view.microbatches
    if view.vpp == 1:
        return min(total, view.pp - view.stage)
    return min(total, 2 * (view.pp - view.stage - 1) + (view.vpp - 1) * view.pp + 1)


class _DynamicPolicy:
    """Shared bookkeeping: which forwards the memory cap allows, and the pick among allowed tasks."""

    name = "dpp"

    def __init__(self) -> None:
        self._cap: int | None = None
        self._vpp = 1
        self._next_start = 0  # with a cap, microbatches start on this stage in order
        # started, unfinished microbatch -> [forwards done here, activations held here]; insertion order is
        # microbatch order because starts are in order (an existing key keeps its place when updated)
        self._active: dict[int, list[int]] = {}
        self._partial = 0  # active microbatches with forwards still to run here

    def reset(self, view: StageView) -> None:
        cap, low = view.max_inflight, min_inflight_cap(view.vpp)
        if cap is not None and cap < low:
            raise ValueError(
                f"dpp_max_inflight={cap} is below the minimum {low} for vpp={view.vpp}: a microbatch holds one "
                f"activation per chunk on a stage before its first backward there; set dpp_max_inflight >= {low} "
                f"(--dpp-max-inflight {low}) or leave it unset")
        self._cap, self._vpp = cap, view.vpp
        self._next_start = 0
        self._active = {}
        self._partial = 0

    # -- what may run -------------------------------------------------------------------------------------
    def allowed(self, task: Task, view: StageView) -> bool:
        """True when running `task` now keeps the stage within its memory cap and deadlock-free."""
        if task.kind == "B" or self._cap is None:
            return True
        # In-order starts (the deadlock argument needs them), and at most pp microbatches part-way through
        # their forwards here (interleaved 1F1B's window): new starts cannot crowd out deeper chunks.
        if task.chunk == 0 and (task.microbatch != self._next_start or self._partial >= view.pp):
            return False
        return self._safe_after(task, view)

    def _safe_after(self, task: Task, view: StageView) -> bool:
        """Banker's check after running forward `task`: taking the started microbatches in microbatch order,
        each one's remaining forwards here fit in the free slots plus those freed by the earlier ones."""
        vpp, m = self._vpp, task.microbatch
        avail = self._cap - view.inflight - 1
        if avail < 0:
            return False
        for mb, (fdone, held) in self._active.items():
            if avail >= vpp - 1:  # every remaining need is at most vpp - 1
                return True
            if mb == m:
                fdone, held = fdone + 1, held + 1
            if vpp - fdone > avail:
                return False
            avail += held
        return task.chunk != 0 or vpp - 1 <= avail  # a new microbatch comes last in microbatch order

    # -- the pick ---------------------------------------------------------------------------------------
    def _order(self, view: StageView) -> Callable[[Task], tuple]:
        raise NotImplementedError

    def next_task(self, ready: Sequence[Task], view: StageView) -> Task | None:
        """The best allowed ready task by this policy's order; None only when none is allowed."""
        key = self._order(view)
        best, best_key = None, None
        for t in ready:
            if not self.allowed(t, view):
                continue
            k = key(t)
            if best_key is None or k < best_key:
                best, best_key = t, k
        return best

    def on_done(self, task: Task, view: StageView) -> None:
        m = task.microbatch
        if task.kind == "B":
            entry = self._active[m]
            entry[1] -= 1
            if entry[1] == 0:  # its last backward here: the microbatch is finished on this stage
                del self._active[m]
            return
        if task.chunk == 0:
            self._next_start = max(self._next_start, m + 1)
            self._active[m] = [0, 0]
            self._partial += 1
        entry = self._active[m]
        entry[0] += 1
        entry[1] += 1
        if entry[0] == self._vpp:
            self._partial -= 1

    def _pressed(self, view: StageView, limit: int | None = None) -> bool:
        """Activations are piling up: at the level a full pipeline needs (bounded by the cap), or device memory
        is short."""
        target = default_target(view) if limit is None else limit
        if view.max_inflight is not None:
            target = min(target, view.max_inflight)
        if view.inflight >= target:
            return True
        return view.memory_headroom is not None and view.memory_headroom < 0.1


def _dfs_key(t: Task) -> tuple:
    return (1, t.microbatch, 0) if t.kind == "B" else (0, -t.chunk, t.microbatch)


def _bfs_key(t: Task) -> tuple:
    return (1, t.microbatch, 0) if t.kind == "B" else (0, t.chunk, t.microbatch)


def _backward_first(key: Callable[[Task], tuple]) -> Callable[[Task], tuple]:
    return lambda t: (0 if t.kind == "B" else 1, key(t))


class DFSPolicy(_DynamicPolicy):
    """Depth-first: among forwards the highest chunk, then the lowest microbatch; backwards first once
    activations pile up."""

    name = "dpp-dfs"

    def _order(self, view: StageView) -> Callable[[Task], tuple]:
        return _backward_first(_dfs_key) if self._pressed(view) else _dfs_key


class BFSPolicy(_DynamicPolicy):
    """Breadth-first: among forwards the lowest chunk, then the lowest microbatch; backwards first once
    activations pile up."""

    name = "dpp-bfs"

    def _order(self, view: StageView) -> Callable[[Task], tuple]:
        return _backward_first(_bfs_key) if self._pressed(view) else _bfs_key


class AdaptivePolicy(_DynamicPolicy):
    """Interleaved 1F1B's order as a preference, run out of order: the first allowed ready task in that order.

    With no delays this is interleaved 1F1B (its next task is always among the ready ones); when an input is
    late the stage runs the next ready task instead of idling. Memory pressure switches to backward-first
    (depth-first: finish microbatches, free activations). The stage runs further ahead (up to the cap) while it
    mostly waits for gradients (`wait_b` > ratio * `wait_f`: a slow link or stage downstream), and keeps to
    interleaved 1F1B's activation count while it waits for forward inputs."""

    name = "dpp-adaptive"

    def __init__(self, ratio: float = 1.5) -> None:
        super().__init__()
        self.ratio = ratio
        self._rank: dict[Task, int] = {}

    def reset(self, view: StageView) -> None:
        super().reset(view)
        if view.vpp == 1:
            plan = one_f_one_b_order(view.stage, view.pp, 1, view.microbatches)
        else:
            plan = interleaved_order(view.stage, view.pp, view.vpp, view.microbatches)
        self._rank = {t: i for i, t in enumerate(plan)}

    def _order(self, view: StageView) -> Callable[[Task], tuple]:
        rank = self._rank
        limit = default_target(view)
        if view.wait_b > self.ratio * view.wait_f:
            limit = view.max_inflight if view.max_inflight is not None else limit + view.pp
        if self._pressed(view, limit):
            return lambda t: (0 if t.kind == "B" else 1, rank[t])
        return lambda t: (0, rank[t])


class ZBPolicy(AdaptivePolicy):
    """Dynamic zero-bubble: the backward is split into B (input gradient, which the previous stage waits for)
    and W (weight gradient, which nobody waits for). Among F and B the choice is the adaptive policy's; W runs
    whenever no F or B is allowed and ready, so the stage never idles while a W is pending. At the cap (a
    microbatch's memory is held from F until its W) no F is allowed, so W runs then unless a B is ready: B goes
    first because the previous stage waits for it.

    Memory: unless the user sets `dpp_max_inflight`, the cap is interleaved 1F1B's peak (its first stage's, the
    largest), on every stage: later stages may hold W work longer than in 1F1B, which is where zero-bubble
    schedules find their slack (ZB-H1 does the same with 1F1B's peak). Deadlock-freedom: B and W are always
    allowed and W needs nothing from other stages, so every slot a B releases is freed by its W; the banker's
    check on forwards is the other policies' (docs/megadpp.md)."""

    name = "dpp-zb"
    split_backward = True

    def reset(self, view: StageView) -> None:
        super().reset(view)
        if view.max_inflight is None:
            first = StageView(stage=0, pp=view.pp, vpp=view.vpp, microbatches=view.microbatches)
            self._cap = max(default_target(first), min_inflight_cap(view.vpp))

    def allowed(self, task: Task, view: StageView) -> bool:
        return task.kind == "W" or super().allowed(task, view)

    def next_task(self, ready: Sequence[Task], view: StageView) -> Task | None:
        fb = [t for t in ready if t.kind != "W"]
        best = super().next_task(fb, view) if fb else None
        if best is not None:
            return best
        ws = [t for t in ready if t.kind == "W"]
        return min(ws, key=lambda t: (t.microbatch, -t.chunk)) if ws else None  # oldest first: frees memory

    def on_done(self, task: Task, view: StageView) -> None:
        if task.kind == "B":
            return  # its memory stays until W
        # W releases what B releases for the other policies
        super().on_done(Task("B", task.chunk, task.microbatch) if task.kind == "W" else task, view)


def make_policy(schedule: str, dpp_policy: str = "adaptive") -> Policy:
    """The policy object for `parallel.schedule` (and `parallel.dpp_policy` when the schedule is "dpp")."""
    if schedule in STATIC_SCHEDULES:
        return StaticPolicy(schedule)
    if schedule != "dpp":
        raise ValueError(f"schedule={schedule!r}: choose one of {', '.join((*STATIC_SCHEDULES, 'dpp'))}")
    if dpp_policy == "dfs":
        return DFSPolicy()
    if dpp_policy == "bfs":
        return BFSPolicy()
    if dpp_policy == "adaptive":
        return AdaptivePolicy()
    if dpp_policy == "zb":
        return ZBPolicy()
    raise ValueError(f"dpp_policy={dpp_policy!r}: choose one of {', '.join(DPP_POLICIES)}")


def policy_by_name(name: str) -> Policy:
    """A policy from a comparison name: gpipe, 1f1b, interleaved-1f1b, zb-h1, dpp-dfs, dpp-bfs, dpp-adaptive,
    dpp-zb."""
    if name.startswith("dpp-"):
        return make_policy("dpp", name[len("dpp-"):])
    return make_policy(name)


def schedule_policy(cfg: Any) -> Policy:
    """The trainer's factory for `--schedule dpp` (registered by import path in `train.plugins`)."""
    return make_policy(cfg.parallel.schedule, cfg.parallel.dpp_policy)
