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
from typing import Protocol

import torch
from torch import nn

from megatronapp import tracing
from megatronapp.parallel import comm, emulation, weight_grad
from megatronapp.parallel.topology import Topology
from megatronapp.pipeline.evaluation import forward_only
from megatronapp.pipeline.p2p import StageLinks
from megatronapp.pipeline.schedules import StaticPolicy
from megatronapp.pipeline.tasks import Policy, StageView, Task


class GradSync(Protocol):
    """Told when a chunk's last backward starts and ends, so gradient reduction can overlap with it."""

    def before_final_backward(self, chunk: int) -> None: ...

    def after_final_backward(self, chunk: int) -> None: ...


_KINDS = "FBW"  # a task's kind as the int TP peers exchange


@dataclass
class StepResult:
    losses: list[torch.Tensor]  # per microbatch (0-dim, on the device), on the last virtual stage (else empty)
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


@dataclass
class _StepState:
    """One step in progress on this stage: what the policy has seen, what is ready, and what is held."""

    microbatches: Sequence[tuple[torch.Tensor, torch.Tensor]]
    loss_scale: float
    view: StageView
    static: bool  # a fixed order: wait for exactly its next task's input
    split: bool  # the backward is split into B and W tasks
    backward_count: list[int]  # per chunk: B (or, split, W) done; its last completes the chunk's gradients
    # The ready set is kept incrementally (arrivals are folded in as they are taken), so choosing a task costs
    # O(ready) rather than a scan of every task of the step.
    ready: set[Task]
    grad_here: set[tuple[int, int]] = field(default_factory=set)  # output gradients here before their F ran
    stash: dict[tuple[int, int], tuple[torch.Tensor | None, torch.Tensor]] = field(default_factory=dict)
    wstash: dict[tuple[int, int], weight_grad.WeightWork] = field(default_factory=dict)  # B done, W not yet
    losses: dict[int, float] = field(default_factory=dict)  # per microbatch, on the last virtual stage
    order: list[Task] = field(default_factory=list)
    wait_s: float = 0.0  # waiting for inputs


class PipelineExecutor:
    """Runs the F/B tasks of this rank's chunks for one step, with asynchronous P2P between stages."""

    def __init__(self, chunks: Sequence[nn.Module], topo: Topology, policy: Policy, *, microbatches: int,
                 act_shape: tuple[int, ...], act_dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", max_inflight: int | None = None,
                 grad_sync: GradSync | None = None, timeout_s: float = 600.0, pp_overlap: bool = True):
        self.chunks, self.topo, self.policy = list(chunks), topo, policy
        self.m, self.act_shape, self.act_dtype = microbatches, act_shape, act_dtype
        self.device, self.max_inflight, self.grad_sync = torch.device(device), max_inflight, grad_sync
        self.pp, self.vpp = topo.pp, len(self.chunks)
        self.stage = topo.coord.pp
        self.decide_on_tp0 = topo.tp > 1 and not isinstance(policy, StaticPolicy)
        self.timeout_s = timeout_s
        self.links = StageLinks(topo, act_shape, act_dtype, self.device, overlap=pp_overlap) if topo.pp > 1 else None
        self.steps = 0

    def reset(self) -> None:
        """Drop a step that will not finish (a failed generation): fresh pipeline links (no receive posted on the
        old groups, nothing arrived), a split backward switched off, and the message step counter back to 0,
        as every member of the new generation sets it (a newcomer's executor starts there)."""
        self.links = StageLinks(self.topo, self.act_shape, self.act_dtype, self.device,
                                overlap=self.links.overlap) if self.links is not None else None
        weight_grad.set_split(False)
        self.steps = 0

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
        st = self._begin(microbatches, loss_scale)
        while not st.view.finished():
            task = self._next_task(st)
            self._run(st, task)
            self._done(st, task)
        return self._end(st)

    def _begin(self, microbatches: Sequence[tuple[torch.Tensor, torch.Tensor]], loss_scale: float) -> _StepState:
        """Reset the policy, post the step's first receives, and seed the ready set."""
        if len(microbatches) != self.m:
            raise ValueError(f"expected {self.m} microbatches, got {len(microbatches)}")
        split = bool(getattr(self.policy, "split_backward", False))
        weight_grad.set_split(split)
        view = StageView(stage=self.stage, pp=self.pp, vpp=self.vpp, microbatches=self.m,
                         max_inflight=self.max_inflight, memory_headroom=self._headroom(), split=split)
        self.policy.reset(view)
        if self.links is not None:
            expected = {"F": sum(self.m for c in range(self.vpp) if not self._first(c)),
                        "B": sum(self.m for c in range(self.vpp) if not self._last(c))}
            self.links.peak_buffers = 0
            # a static schedule fixes each channel's arrival order: the links need not read headers per message
            order = self.policy.arrivals if isinstance(self.policy, StaticPolicy) else None
            self.links.start(self.steps, expected, self._window(), order)
        self.steps += 1
        return _StepState(microbatches, loss_scale, view, static=isinstance(self.policy, StaticPolicy),
                          split=split, backward_count=[0] * self.vpp,
                          ready={Task("F", c, mb) for c in range(self.vpp) if self._first(c) for mb in range(self.m)})

    def _fold_arrivals(self, st: _StepState) -> None:
        """File the messages that arrived since the last look: an activation readies its F; a gradient readies
        its B once that microbatch's F is done (else it waits in `grad_here`)."""
        if self.links is None:
            return
        for kind, c, mb in self.links.drain_new():
            if kind == "F":
                st.ready.add(Task("F", c, mb))
            elif Task("F", c, mb) in st.view.done:
                st.ready.add(Task("B", c, mb))
            else:
                st.grad_here.add((c, mb))

    def _wait_input(self, st: _StepState, t: Task) -> None:
        """Wait for exactly the message task `t` needs (if any), then file arrivals."""
        key = self._input_key(t)
        if key is not None and key not in self.links.arrived:
            self.links.wait_for(key, self.timeout_s, lambda: self._stuck(st.view, f"input of {t}"))
        self._fold_arrivals(st)

    def _next_task(self, st: _StepState) -> Task:
        """The task this stage runs next: the policy's choice, or with TP peers and a dynamic policy TP rank 0's
        choice, broadcast (each peer then waits for that task's input itself)."""
        task = None
        if not self.decide_on_tp0 or self.topo.coord.tp == 0:
            task = self._choose(st)
        if self.decide_on_tp0:
            task = self._share_choice(task)
            t0 = time.perf_counter()
            self._wait_input(st, task)
            st.wait_s += time.perf_counter() - t0
        return task

    def _share_choice(self, task: Task | None) -> Task:
        """TP rank 0's choice, on every TP peer: three ints broadcast on the host control group (gloo when the TP
        group is NCCL's), so a decision per task costs no pickling and no host-device synchronisation."""
        ctl = self.topo.tp_control_group
        msg = torch.tensor([_KINDS.index(task.kind), task.chunk, task.microbatch] if task is not None else [0, 0, 0],
                           dtype=torch.int64, device=self.device if comm.CONTEXT.backend(ctl) == "nccl" else "cpu")
        comm.broadcast(msg, ctl.ranks[0], ctl)
        kind, chunk, microbatch = msg.tolist()
        return Task(_KINDS[kind], chunk, microbatch)

    def _choose(self, st: _StepState) -> Task:
        """Ask the policy until it picks a ready task, waiting for arrivals in between; the wait is timed."""
        t0 = time.perf_counter()
        if st.static:  # wait on exactly the input the fixed order needs next
            self._wait_input(st, self.policy.upcoming())
        while True:
            if not st.static and self.links is not None:
                self.links.poll()
            self._fold_arrivals(st)
            task = self.policy.next_task(sorted(st.ready), st.view)
            if task is not None:
                break
            self.links.wait_any(self.timeout_s, lambda: self._stuck(st.view, "any input"))
        waited = time.perf_counter() - t0
        st.wait_s += waited
        st.view.note_wait(task.kind, waited)
        return task

    def _run(self, st: _StepState, task: Task) -> None:
        """Compute `task` and update the stage's counters the policy reads."""
        view = st.view
        if task.kind == "F":
            self._forward(st, task)
            view.inflight += 1
            view.peak_inflight = max(view.peak_inflight, view.inflight)
        elif task.kind == "B" and st.split:
            work = self._backward(st, task, split=True)
            st.wstash[(task.chunk, task.microbatch)] = work
            view.pending_w += 1
            view.pending_w_bytes += work.nbytes
            view.peak_pending_w_bytes = max(view.peak_pending_w_bytes, view.pending_w_bytes)
        else:
            self._weight_gradients(st, task)
            view.inflight -= 1

    def _weight_gradients(self, st: _StepState, task: Task) -> None:
        """B (unsplit) or W: completes this microbatch's share of the chunk's weight gradients; the chunk's last
        one is announced to the gradient reducer so DP reduction overlaps with it."""
        final = st.backward_count[task.chunk] == self.m - 1
        if final and self.grad_sync is not None:
            self.grad_sync.before_final_backward(task.chunk)
        if task.kind == "W":
            work = st.wstash.pop((task.chunk, task.microbatch))
            st.view.pending_w -= 1
            st.view.pending_w_bytes -= work.nbytes
            with tracing.span("weight_grad", "compute", chunk=task.chunk, microbatch=task.microbatch), \
                    emulation.task("W", task.chunk, task.microbatch):
                weight_grad.run(work)
        else:
            self._backward(st, task)
        st.backward_count[task.chunk] += 1
        if final and self.grad_sync is not None:
            self.grad_sync.after_final_backward(task.chunk)

    def _done(self, st: _StepState, task: Task) -> None:
        """Mark `task` done, ready what it unblocks, and tell the policy."""
        st.view.done.add(task)
        st.ready.discard(task)
        key = (task.chunk, task.microbatch)
        if task.kind == "F" and (self._last(task.chunk) or key in st.grad_here):
            st.ready.add(Task("B", *key))
        elif task.kind == "B" and st.split:
            st.ready.add(Task("W", *key))
        st.order.append(task)
        self.policy.on_done(task, st.view)

    def _end(self, st: _StepState) -> StepResult:
        peak_buffers = 0
        if self.links is not None:
            self.links.finish()
            peak_buffers = self.links.peak_buffers
        weight_grad.set_split(False)
        view = st.view
        return StepResult([st.losses[i] for i in sorted(st.losses)], st.order, view.peak_inflight, st.wait_s, view,
                          peak_buffers, view.peak_pending_w_bytes)

    def forward_only(self, microbatches: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> list[float]:
        """Evaluation (`pipeline/evaluation.py`): every microbatch forward through every chunk, no graph;
        returns the per-microbatch losses on the stage holding the last virtual stage (else an empty list)."""
        if len(microbatches) != self.m:
            raise ValueError(f"expected {self.m} microbatches, got {len(microbatches)}")
        self.steps += 1
        return forward_only(self.chunks, self.links, self.stage, self.pp, microbatches, self.steps - 1,
                            self.timeout_s)

    def _forward(self, st: _StepState, t: Task) -> None:
        ids, labels = st.microbatches[t.microbatch]
        if self._first(t.chunk):
            x = ids
        else:
            x = self.links.take(("F", t.chunk, t.microbatch)).requires_grad_(True)
        last = self._last(t.chunk)
        with tracing.span("forward", "compute", chunk=t.chunk, microbatch=t.microbatch), \
                emulation.task("F", t.chunk, t.microbatch):
            out = self.chunks[t.chunk](x, labels=labels if last else None)
        if last:
            # the loss stays on the device: one host read per step (trainer.global_loss), not per microbatch; the
            # CPU takes the same path, so the tests hold the GPU's count of host reads (tests/test_sync_budget.py)
            st.losses[t.microbatch] = out.detach()
            out = out * st.loss_scale
        else:
            self.links.send("F", self._next_chunk(t.chunk), t.microbatch, out)
        st.stash[(t.chunk, t.microbatch)] = (None if self._first(t.chunk) else x, out)

    def _backward(self, st: _StepState, t: Task, split: bool = False) -> weight_grad.WeightWork | None:
        """B: input gradients, sent to the previous stage; with `split`, the weight-gradient work is returned
        for a later W task instead of being done now."""
        x, out = st.stash.pop((t.chunk, t.microbatch))
        work = None
        with tracing.span("backward", "compute", chunk=t.chunk, microbatch=t.microbatch), \
                emulation.task("B" if split else "BW", t.chunk, t.microbatch):
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
        return memory_headroom(self.device)


def memory_headroom(device: torch.device) -> float | None:
    """The fraction of the device's memory the next allocations can have (None off a GPU): free memory plus what
    PyTorch's caching allocator holds but does not use (reserved - allocated). `mem_get_info` alone counts the
    cache as used, so once the cache is warm a stage would read as under memory pressure for the whole run."""
    if device.type != "cuda":
        return None
    free, total = torch.cuda.mem_get_info(device)
    cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return min(1.0, (free + cached) / total)
