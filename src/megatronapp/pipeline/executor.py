"""Run one training step of a pipeline stage: Task(F|B, chunk, microbatch) chosen by a policy.

Communication goes through `p2p.StageLinks`: one-way ordered channels with a header per message, correct under
NCCL's rules (tags ignored, one stream per pair); its docstring says why it cannot deadlock. A static order is
run only after `schedules.check_orders` proved its dependency walk completes, and waits for exactly the input its
next task needs; a dynamic policy sees which inputs have arrived (`Handle.is_completed()`, the only readiness
signal that means the same on NCCL and gloo) and runs any ready task.

Tensor-parallel peers of a stage must run tasks in the same order (their collectives must match): for a
dynamic policy, TP rank 0 decides and broadcasts the choice to its peers.

A policy with `split_backward` (zero-bubble schedules) gets W tasks too: B(c, m) computes only input gradients
and files the linear layers' weight-gradient work (`parallel/weight_grad.py`); W(c, m) computes it. A stage then
holds a microbatch's memory from F until W, and a chunk's gradients are complete after its last W.
"""
from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn

from megatronapp import tracing
from megatronapp.parallel import comm, weight_grad
from megatronapp.parallel.device_emulation import EmulatedDevice
from megatronapp.parallel.topology import Topology
from megatronapp.pipeline.p2p import StageLinks
from megatronapp.pipeline.schedules import StaticPolicy
from megatronapp.pipeline.tasks import Policy, StageView, Task


class GradSync(Protocol):
    """Told when a chunk's last backward starts and ends, so gradient reduction can overlap with it."""

    def before_final_backward(self, chunk: int) -> None: ...

    def after_final_backward(self, chunk: int) -> None: ...


@dataclass
class StepResult:
    losses: list[float]  # per microbatch, on the stage holding the last virtual stage (else empty)
    order: list[Task]  # tasks in the order this stage ran them
    peak_inflight: int
    wait_s: float  # time spent waiting for inputs
    view: StageView = field(repr=False, default=None)  # type: ignore[assignment]
    peak_recv_buffers: int = 0  # receive buffers held at once (posted or arrived, not yet consumed)
    peak_pending_w_bytes: int = 0  # split backward: memory held by weight-gradient work waiting for its W


def _peak_inflight(order: Sequence[Task]) -> int:
    split = any(t.kind == "W" for t in order)
    live = peak = 0
    for t in order:
        if t.kind == "F":
            live += 1
        elif t.kind == ("W" if split else "B"):
            live -= 1
        peak = max(peak, live)
    return peak


class PipelineExecutor:
    """Runs the F/B tasks of this rank's chunks for one step, with asynchronous P2P between stages."""

    def __init__(self, chunks: Sequence[nn.Module], topo: Topology, policy: Policy, *, microbatches: int,
                 act_shape: tuple[int, ...], act_dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", max_inflight: int | None = None,
                 grad_sync: GradSync | None = None, timeout_s: float = 600.0, pp_overlap: bool = True,
                 emulated: EmulatedDevice | None = None):
        self.chunks, self.topo, self.policy = list(chunks), topo, policy
        self.m, self.act_shape, self.act_dtype = microbatches, act_shape, act_dtype
        self.device, self.max_inflight, self.grad_sync = torch.device(device), max_inflight, grad_sync
        self.pp, self.vpp = topo.pp, len(self.chunks)
        self.stage = topo.coord.pp
        self.decide_on_tp0 = topo.tp > 1 and not isinstance(policy, StaticPolicy)
        self.timeout_s = timeout_s
        self.links = StageLinks(topo, act_shape, act_dtype, self.device, overlap=pp_overlap) if topo.pp > 1 else None
        self.steps = 0
        self.emulated = emulated  # --emulate-device: each task sleeps out its modelled device time

    def _device(self, kind: str, t: Task) -> Any:
        """Context of task `t`'s compute on an emulated device (a no-op on a real one)."""
        if self.emulated is None:
            return contextlib.nullcontext()
        return self.emulated.task(kind, t.chunk, t.microbatch)

    # -- geometry ---------------------------------------------------------------------------------------
    def _v(self, chunk: int) -> int:
        return chunk * self.pp + self.stage

    def _first(self, chunk: int) -> bool:
        return self._v(chunk) == 0

    def _last(self, chunk: int) -> bool:
        return self._v(chunk) == self.pp * self.vpp - 1

    def _next_chunk(self, chunk: int) -> int:
        """Chunk index on the next stage that continues virtual stage v (wraps to the next chunk at the end)."""
        return chunk + 1 if self.stage == self.pp - 1 else chunk

    def _prev_chunk(self, chunk: int) -> int:
        return chunk - 1 if self.stage == 0 else chunk

    def _input_key(self, t: Task) -> tuple[str, int, int] | None:
        """The message task `t` waits for, or None when its input is local."""
        if (t.kind == "F" and self._first(t.chunk)) or (t.kind == "B" and self._last(t.chunk)) or t.kind == "W":
            return None
        return (t.kind, t.chunk, t.microbatch)

    def _window(self) -> int:
        """Receives outstanding per channel: as many activations as the schedule lets the stage hold."""
        if isinstance(self.policy, StaticPolicy):
            cap = _peak_inflight(self.policy.order)
        else:
            cap = self.max_inflight or self.pp * self.vpp
        return max(2, cap)

    # -- one step ---------------------------------------------------------------------------------------
    def step(self, microbatches: Sequence[tuple[torch.Tensor, torch.Tensor]], loss_scale: float) -> StepResult:
        """Run every F and B task of this stage; `microbatches` holds (input_ids, labels) per microbatch."""
        if len(microbatches) != self.m:
            raise ValueError(f"expected {self.m} microbatches, got {len(microbatches)}")
        static = isinstance(self.policy, StaticPolicy)
        split = bool(getattr(self.policy, "split_backward", False))
        weight_grad.set_split(split)
        view = StageView(stage=self.stage, pp=self.pp, vpp=self.vpp, microbatches=self.m,
                         max_inflight=self.max_inflight, memory_headroom=self._headroom(), split=split)
        self.policy.reset(view)
        links = self.links
        if links is not None:
            expected = {"F": sum(self.m for c in range(self.vpp) if not self._first(c)),
                        "B": sum(self.m for c in range(self.vpp) if not self._last(c))}
            links.peak_buffers = 0
            links.start(self.steps, expected, self._window())
        self.steps += 1
        stash: dict[tuple[int, int], tuple[torch.Tensor | None, torch.Tensor]] = {}
        wstash: dict[tuple[int, int], weight_grad.WeightWork] = {}  # B done, W not yet
        losses: dict[int, float] = {}
        backward_count = [0] * self.vpp  # the chunk's last B (or, split, last W) completes its gradients
        order: list[Task] = []
        wait_total = 0.0

        # The ready set is kept incrementally (arrivals are folded in as they are taken), so choosing a task
        # costs O(ready) rather than a scan of every task of the step.
        ready: set[Task] = {Task("F", c, mb) for c in range(self.vpp) if self._first(c) for mb in range(self.m)}
        grad_here: set[tuple[int, int]] = set()

        def fold_arrivals() -> None:
            if links is None:
                return
            for kind, c, mb in links.drain_new():
                if kind == "F":
                    ready.add(Task("F", c, mb))
                elif Task("F", c, mb) in view.done:
                    ready.add(Task("B", c, mb))
                else:
                    grad_here.add((c, mb))

        def wait_input(t: Task) -> None:
            key = self._input_key(t)
            if key is not None and key not in links.arrived:
                links.wait_for(key, self.timeout_s, lambda: self._stuck(view, f"input of {t}"))
            fold_arrivals()

        while not view.finished():
            task = None
            if not self.decide_on_tp0 or self.topo.coord.tp == 0:
                t0 = time.perf_counter()
                if static:  # wait on exactly the input the fixed order needs next
                    wait_input(self.policy.upcoming())
                while True:
                    if not static and links is not None:
                        links.poll()
                    fold_arrivals()
                    task = self.policy.next_task(sorted(ready), view)
                    if task is not None:
                        break
                    links.wait_any(self.timeout_s, lambda: self._stuck(view, "any input"))
                waited = time.perf_counter() - t0
                wait_total += waited
                if waited > 0:  # moving averages of idle time, by the kind of task that ended the wait
                    if task.kind == "F":
                        view.wait_f = 0.7 * view.wait_f + 0.3 * waited
                    else:
                        view.wait_b = 0.7 * view.wait_b + 0.3 * waited
            if self.decide_on_tp0:
                src = self.topo.tp_group.ranks[0]
                task = comm.broadcast_object(task, src, self.topo.tp_group)
                t0 = time.perf_counter()
                wait_input(task)
                wait_total += time.perf_counter() - t0
            if task.kind == "F":
                self._forward(task, microbatches, stash, losses, loss_scale)
                view.inflight += 1
                view.peak_inflight = max(view.peak_inflight, view.inflight)
            elif task.kind == "B" and split:
                work = self._backward(task, stash, split=True)
                wstash[(task.chunk, task.microbatch)] = work
                view.pending_w += 1
                view.pending_w_bytes += work.nbytes
                view.peak_pending_w_bytes = max(view.peak_pending_w_bytes, view.pending_w_bytes)
            else:  # B (unsplit) or W: completes this microbatch's share of the chunk's weight gradients
                final = backward_count[task.chunk] == self.m - 1
                if final and self.grad_sync is not None:
                    self.grad_sync.before_final_backward(task.chunk)
                if task.kind == "W":
                    work = wstash.pop((task.chunk, task.microbatch))
                    view.pending_w -= 1
                    view.pending_w_bytes -= work.nbytes
                    with tracing.span("weight_grad", "compute", chunk=task.chunk, microbatch=task.microbatch), \
                            self._device("W", task):
                        weight_grad.run(work)
                else:
                    self._backward(task, stash)
                backward_count[task.chunk] += 1
                if final and self.grad_sync is not None:
                    self.grad_sync.after_final_backward(task.chunk)
                view.inflight -= 1
            view.done.add(task)
            ready.discard(task)
            if task.kind == "F" and (self._last(task.chunk) or (task.chunk, task.microbatch) in grad_here):
                ready.add(Task("B", task.chunk, task.microbatch))
            elif task.kind == "B" and split:
                ready.add(Task("W", task.chunk, task.microbatch))
            order.append(task)
            self.policy.on_done(task, view)

        peak_buffers = 0
        if links is not None:
            links.finish()
            peak_buffers = links.peak_buffers
        weight_grad.set_split(False)
        return StepResult([losses[i] for i in sorted(losses)], order, view.peak_inflight, wait_total, view,
                          peak_buffers, view.peak_pending_w_bytes)

    def forward_only(self, microbatches: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> list[float]:
        """Evaluation: forward every microbatch through every chunk, no graph, no backward; returns the
        per-microbatch losses on the stage holding the last virtual stage (else an empty list).

        Whatever the training schedule, every stage runs its forwards in (microbatch, chunk) order: a task's
        input comes from the previous virtual stage, which runs the same microbatch's earlier chunk, so by
        induction every wait is answered (no policy, no TP broadcast of choices: TP peers run the same fixed
        order). Messages use the training channels and headers with a step number of their own."""
        if len(microbatches) != self.m:
            raise ValueError(f"expected {self.m} microbatches, got {len(microbatches)}")
        links = self.links
        if links is not None:
            expected = sum(self.m for c in range(self.vpp) if not self._first(c))
            links.start(self.steps, {"F": expected, "B": 0}, self.vpp)
        self.steps += 1
        losses: list[float] = []
        with torch.no_grad():
            for mb, (ids, labels) in enumerate(microbatches):
                for c in range(self.vpp):
                    if self._first(c):
                        x = ids
                    else:
                        key = ("F", c, mb)
                        links.wait_for(key, self.timeout_s, lambda k=key: f"evaluation: stage {self.stage} "
                                       f"waits for the activation of chunk {k[1]}, microbatch {k[2]}")
                        links.drain_new()
                        x = links.take(key)
                    last = self._last(c)
                    with tracing.span("eval_forward", "compute", chunk=c, microbatch=mb):
                        out = self.chunks[c](x, labels=labels if last else None)
                    if last:
                        losses.append(float(out))
                    else:
                        links.send("F", self._next_chunk(c), mb, out)
        if links is not None:
            links.finish()
        return losses

    def _forward(self, t: Task, microbatches, stash, losses, loss_scale) -> None:
        ids, labels = microbatches[t.microbatch]
        if self._first(t.chunk):
            x = ids
        else:
            x = self.links.take(("F", t.chunk, t.microbatch)).requires_grad_(True)
        last = self._last(t.chunk)
        with tracing.span("forward", "compute", chunk=t.chunk, microbatch=t.microbatch), self._device("F", t):
            out = self.chunks[t.chunk](x, labels=labels if last else None)
        if last:
            # on a GPU the loss stays on the device: one sync per step (trainer.global_loss), not per microbatch
            losses[t.microbatch] = out.detach() if out.is_cuda else float(out.detach())
            out = out * loss_scale
        else:
            self.links.send("F", self._next_chunk(t.chunk), t.microbatch, out)
        stash[(t.chunk, t.microbatch)] = (None if self._first(t.chunk) else x, out)

    def _backward(self, t: Task, stash, split: bool = False) -> weight_grad.WeightWork | None:
        """B: input gradients, sent to the previous stage; with `split`, the weight-gradient work is returned
        for a later W task instead of being done now."""
        x, out = stash.pop((t.chunk, t.microbatch))
        work = None
        with tracing.span("backward", "compute", chunk=t.chunk, microbatch=t.microbatch), \
                self._device("B" if split else "BW", t):
            with weight_grad.defer() if split else contextlib.nullcontext() as work:
                if self._last(t.chunk):
                    torch.autograd.backward(out)
                else:
                    grad = self.links.take(("B", t.chunk, t.microbatch)).to(out.dtype)
                    torch.autograd.backward(out, grad)
        if x is not None:
            self.links.send("B", self._prev_chunk(t.chunk), t.microbatch, x.grad)
        return work

    def _stuck(self, view: StageView, what: str) -> str:
        """A diagnosis for a hang: who this stage waits for and what it has done."""
        links = self.links
        return (f"stage {self.stage} ({self.topo.coord.label()}, rank {self.topo.rank}) waits for {what}; "
                f"done {len(view.done)}/{view.total_tasks()} tasks; messages still expected "
                f"{links.expected_from()} (activations from rank {self.topo.prev_rank()}, gradients from rank "
                f"{self.topo.next_rank()}); arrived, not yet used: "
                f"{[f'{k}{c}.{m}' for k, c, m in links.pending()][:8]}")

    def _headroom(self) -> float | None:
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            return free / total
        return None
