"""Static pipeline schedules as per-stage task orders, and the policy that walks such an order.

GPipe: all forwards, then all backwards. 1F1B: (pp - s - 1) warm-up forwards, then one forward / one backward,
then the remaining backwards. ZB-H1 (Zero Bubble, Qi et al. 2024): 1F1B's order of forwards and input-gradient
backwards (B), with the weight-gradient tasks (W) placed in the bubbles and a stage holding at most min(m, pp)
microbatches from F to W (1F1B's peak). Interleaved 1F1B (Megatron): microbatches go through the chunks in groups of pp,
with a longer warm-up. Every order is checked for deadlock by `check_orders` (a dependency walk with
unbounded buffers, which is what the ordered channels of p2p.py give the executor); an interleaved order that
would deadlock for an uneven microbatch count gets a longer warm-up until it does not.
"""
from __future__ import annotations

from collections.abc import Sequence

from megatronapp.pipeline.tasks import StageView, Task


def gpipe_order(stage: int, pp: int, vpp: int, m: int) -> list[Task]:
    fwd = [Task("F", c, i) for c in range(vpp) for i in range(m)]
    bwd = [Task("B", c, i) for c in reversed(range(vpp)) for i in range(m)]
    return fwd + bwd


def one_f_one_b_order(stage: int, pp: int, vpp: int, m: int) -> list[Task]:
    if vpp != 1:
        raise ValueError("1F1B runs one chunk per stage; use interleaved-1f1b for vpp > 1")
    warmup = min(pp - stage - 1, m)
    order = [Task("F", 0, i) for i in range(warmup)]
    f, b = warmup, 0
    while f < m:
        order += [Task("F", 0, f), Task("B", 0, b)]
        f, b = f + 1, b + 1
    order += [Task("B", 0, i) for i in range(b, m)]
    return order


def _interleaved_sequence(pp: int, vpp: int, m: int, backward: bool) -> list[tuple[int, int]]:
    """(chunk, microbatch) in Megatron's order: groups of pp microbatches through every chunk in turn."""
    seq = []
    for g0 in range(0, m, pp):
        group = range(g0, min(g0 + pp, m))
        chunks = reversed(range(vpp)) if backward else range(vpp)
        for c in chunks:
            seq += [(c, i) for i in group]
    return seq


def interleaved_order(stage: int, pp: int, vpp: int, m: int, extra_warmup: int = 0) -> list[Task]:
    fwd = [Task("F", c, i) for c, i in _interleaved_sequence(pp, vpp, m, backward=False)]
    bwd = [Task("B", c, i) for c, i in _interleaved_sequence(pp, vpp, m, backward=True)]
    total = len(fwd)
    warmup = min(total, (pp - stage - 1) * 2 + (vpp - 1) * pp + extra_warmup)
    order = fwd[:warmup]
    f, b = warmup, 0
    while f < total:
        order += [fwd[f], bwd[b]]
        f, b = f + 1, b + 1
    order += bwd[b:]
    return order


def zb_h1_orders(pp: int, m: int) -> list[list[Task]]:
    """ZB-H1 orders of every stage, by list scheduling with unit task times: each stage follows 1F1B's F/B
    sequence and runs a pending W whenever its next F or B is not ready yet (or an F would exceed min(m, pp)
    microbatches held from F to W); the remaining W tasks close the step."""
    seqs = [one_f_one_b_order(s, pp, 1, m) for s in range(pp)]
    pos, held, limit = [0] * pp, [0] * pp, min(m, pp)
    pending: list[list[Task]] = [[] for _ in range(pp)]
    done: dict[tuple[str, int, int], int] = {}  # (kind, stage, microbatch) -> tick it finished
    orders: list[list[Task]] = [[] for _ in range(pp)]
    tick = 0
    while any(pos[s] < len(seqs[s]) or pending[s] for s in range(pp)):
        tick += 1
        for s in range(pp):
            task = None
            if pos[s] < len(seqs[s]):
                t = seqs[s][pos[s]]
                ready = (done.get(("F", s - 1, t.microbatch), tick) < tick if s > 0 else True) if t.kind == "F" \
                    else (done.get(("B", s + 1, t.microbatch), tick) < tick if s < pp - 1 else True)
                if ready and not (t.kind == "F" and held[s] >= limit):
                    task = t
                    pos[s] += 1
            if task is None and pending[s]:
                task = pending[s].pop(0)
            if task is None:
                continue
            orders[s].append(task)
            done[(task.kind, s, task.microbatch)] = tick
            if task.kind == "F":
                held[s] += 1
            elif task.kind == "B":
                pending[s].append(Task("W", 0, task.microbatch))
            else:
                held[s] -= 1
    return orders


def check_orders(orders: Sequence[Sequence[Task]], pp: int, vpp: int, m: int) -> bool:
    """True when every stage can run its whole order: a walk in which a stage advances when its next
    task's inputs exist (F needs the previous virtual stage's F; B needs its own F and the next virtual
    stage's B; W needs its own B)."""
    V = pp * vpp
    done: set[tuple[str, int, int]] = set()  # (kind, virtual stage, microbatch)
    pos = [0] * pp
    progressed = True
    while progressed:
        progressed = False
        for s in range(pp):
            while pos[s] < len(orders[s]):
                t = orders[s][pos[s]]
                v = t.chunk * pp + s
                if t.kind == "F":
                    ok = v == 0 or ("F", v - 1, t.microbatch) in done
                elif t.kind == "W":
                    ok = ("B", v, t.microbatch) in done
                else:
                    ok = ("F", v, t.microbatch) in done and (v == V - 1 or ("B", v + 1, t.microbatch) in done)
                if not ok:
                    break
                done.add((t.kind, v, t.microbatch))
                pos[s] += 1
                progressed = True
    return all(pos[s] == len(orders[s]) for s in range(pp))


def stage_orders(schedule: str, pp: int, vpp: int, m: int) -> list[list[Task]]:
    """The order of every stage for a static schedule, proven deadlock-free by `check_orders`."""
    if schedule == "gpipe":
        orders = [gpipe_order(s, pp, vpp, m) for s in range(pp)]
    elif schedule == "1f1b":
        orders = [one_f_one_b_order(s, pp, vpp, m) for s in range(pp)]
    elif schedule == "zb-h1":
        if vpp != 1:
            raise ValueError("ZB-H1 runs one chunk per stage; use --dpp-policy zb for vpp > 1")
        orders = zb_h1_orders(pp, m)
    elif schedule == "interleaved-1f1b":
        for extra in range(0, vpp * m + 1):
            orders = [interleaved_order(s, pp, vpp, m, extra) for s in range(pp)]
            if check_orders(orders, pp, vpp, m):
                break
    else:
        raise ValueError(f"{schedule!r} is not a static schedule")
    if not check_orders(orders, pp, vpp, m):  # a bug here, not a user error
        raise RuntimeError(f"schedule {schedule} deadlocks for pp={pp} vpp={vpp} microbatches={m}")
    return orders


def arrival_orders(orders: Sequence[Sequence[Task]], stage: int, pp: int, vpp: int
                   ) -> dict[str, list[tuple[str, int, int]]]:
    """The messages `stage` receives on each incoming channel, as (kind, chunk here, microbatch), in the order their
    senders issue them: the activations of the previous stage's F tasks (all but the last virtual stage's) and the
    gradients of the next stage's B tasks (all but the first virtual stage's). A message's chunk moves on by one
    where the pipeline wraps (interleaving), as `PipelineExecutor._next_chunk` / `_prev_chunk` send it."""
    prev, nxt, last = (stage - 1) % pp, (stage + 1) % pp, pp * vpp - 1
    acts = [("F", t.chunk + 1 if prev == pp - 1 else t.chunk, t.microbatch) for t in orders[prev]
            if t.kind == "F" and t.chunk * pp + prev != last]
    grads = [("B", t.chunk - 1 if nxt == 0 else t.chunk, t.microbatch) for t in orders[nxt]
             if t.kind == "B" and t.chunk * pp + nxt != 0]
    return {"F": acts, "B": grads}


SPLIT_BACKWARD = ("zb-h1",)  # static schedules with W tasks


class StaticPolicy:
    """Walk a fixed order; wait (return None) until its next task is ready."""

    def __init__(self, schedule: str):
        self.name = schedule
        self.split_backward = schedule in SPLIT_BACKWARD
        self.order: list[Task] = []
        self.arrivals: dict[str, list[tuple[str, int, int]]] = {}  # what this stage receives, in arrival order
        self.pos = 0

    def reset(self, view: StageView) -> None:
        orders = stage_orders(self.name, view.pp, view.vpp, view.microbatches)
        self.order = orders[view.stage]
        self.arrivals = arrival_orders(orders, view.stage, view.pp, view.vpp) if view.pp > 1 else {}
        self.pos = 0

    def upcoming(self) -> Task:
        """The task the order runs next."""
        return self.order[self.pos]

    def next_task(self, ready: Sequence[Task], view: StageView) -> Task | None:
        want = self.order[self.pos]
        return want if want in ready else None

    def on_done(self, task: Task, view: StageView) -> None:
        assert task == self.order[self.pos], f"{self.name}: ran {task}, expected {self.order[self.pos]}"
        self.pos += 1
