"""Run one training step of a pipeline stage: Task(F|B, chunk, microbatch) chosen by a policy.

Why it cannot deadlock: every receive a stage will need in the step is posted up front with a tag unique to
(direction, chunk, microbatch), and every send is non-blocking. A stage therefore only ever waits for the
*input* of a task, never for a peer to be ready to talk; a static order is run only after
`schedules.check_orders` proved its dependency walk completes, and a dynamic policy runs any ready task.
Gloo handles report completion only through a blocking `wait()`, so each posted receive has a waiter thread
that sleeps in `wait()` and signals arrival: no busy polling, and the policy sees what is ready right now.

Tensor-parallel peers of a stage must run tasks in the same order (their collectives must match): for a
dynamic policy, TP rank 0 decides and broadcasts the choice to its peers.
"""
from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import nn

from megatronapp import tracing
from megatronapp.parallel import comm
from megatronapp.parallel.topology import Topology
from megatronapp.pipeline.schedules import StaticPolicy
from megatronapp.pipeline.tasks import Policy, StageView, Task, tag_of


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


class _WaiterPool:
    """Daemon threads that run blocking waits, kept across steps (daemon: a wait left pending by a failed step
    must not keep the process alive at exit, as concurrent.futures' workers would)."""

    def __init__(self) -> None:
        self.jobs: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self.size = 0

    def ensure(self, n: int) -> None:
        """At least `n` threads: one per receive a step can have outstanding, so a worker blocked on a late
        message never holds up an earlier one."""
        while self.size < n:
            threading.Thread(target=self._work, name=f"recv-waiter-{self.size}", daemon=True).start()
            self.size += 1

    def _work(self) -> None:
        while True:
            self.jobs.get()()

    def submit(self, job: Callable[[], None]) -> None:
        self.jobs.put(job)


class _Inbox:
    """Receives posted ahead of time. Threaded (dynamic policies): a waiter thread per receive marks its key
    as arrived, so the policy can see what is ready now. Not threaded (static orders): the executor waits on
    the one handle its next task needs, with no thread hop on the critical path."""

    def __init__(self, pool: _WaiterPool | None = None) -> None:
        self.pool = pool
        self.threaded = pool is not None
        self.handles: dict[tuple[str, int, int], comm.Handle] = {}
        self.cond = threading.Condition()
        self.arrived: set[tuple[str, int, int]] = set()
        self.log: list[tuple[str, int, int]] = []  # arrivals in order, read incrementally by the executor
        self.buffers: dict[tuple[str, int, int], torch.Tensor] = {}
        self.error: BaseException | None = None

    def post(self, key: tuple[str, int, int], buf: torch.Tensor, handle: comm.Handle) -> None:
        self.buffers[key] = buf
        if not self.threaded:
            self.handles[key] = handle
            return

        def waiter() -> None:
            try:
                handle.wait()
            except BaseException as e:  # surfaced in the main thread by wait_any
                with self.cond:
                    self.error = e
                    self.cond.notify_all()
                return
            with self.cond:
                self.arrived.add(key)
                self.log.append(key)
                self.cond.notify_all()

        self.pool.submit(waiter)

    def wait_key(self, key: tuple[str, int, int], what: Callable[[], str]) -> None:
        """Block on the receive of `key` in this thread (non-threaded mode)."""
        handle = self.handles.pop(key, None)
        if handle is None:
            return  # already arrived
        try:
            handle.wait()
        except RuntimeError as e:  # gloo's own timeout or a peer's death: say where the pipeline stood
            raise RuntimeError(f"pipeline receive failed ({e}); {what()}") from e
        self.arrived.add(key)
        self.log.append(key)

    def wait_for(self, pred: Callable[[], bool], timeout_s: float, what: Callable[[], str]) -> None:
        deadline = time.monotonic() + timeout_s
        with self.cond:
            while not pred():
                if self.error is not None:
                    raise RuntimeError(f"pipeline receive failed: {self.error}") from self.error
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"no input arrived for {timeout_s:.0f} s; {what()}")
                self.cond.wait(timeout=min(left, 5.0))


class PipelineExecutor:
    """Runs the F/B tasks of this rank's chunks for one step, with asynchronous P2P between stages."""

    def __init__(self, chunks: Sequence[nn.Module], topo: Topology, policy: Policy, *, microbatches: int,
                 act_shape: tuple[int, ...], act_dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", max_inflight: int | None = None,
                 grad_sync: GradSync | None = None, timeout_s: float = 600.0):
        self.chunks, self.topo, self.policy = list(chunks), topo, policy
        self.m, self.act_shape, self.act_dtype = microbatches, act_shape, act_dtype
        self.device, self.max_inflight, self.grad_sync = torch.device(device), max_inflight, grad_sync
        self.pp, self.vpp = topo.pp, len(self.chunks)
        self.stage = topo.coord.pp
        self.decide_on_tp0 = topo.tp > 1 and not isinstance(policy, StaticPolicy)
        self.timeout_s = timeout_s
        self._pool = _WaiterPool()

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

    # -- one step ---------------------------------------------------------------------------------------
    def step(self, microbatches: Sequence[tuple[torch.Tensor, torch.Tensor]], loss_scale: float) -> StepResult:
        """Run every F and B task of this stage; `microbatches` holds (input_ids, labels) per microbatch."""
        if len(microbatches) != self.m:
            raise ValueError(f"expected {self.m} microbatches, got {len(microbatches)}")
        pg = self.topo.pp_group
        prev_rank, next_rank = self.topo.prev_rank(), self.topo.next_rank()
        static = isinstance(self.policy, StaticPolicy)
        if not static:
            self._pool.ensure(2 * self.vpp * self.m)
        inbox = _Inbox(None if static else self._pool)
        # Post every receive of the step up front (unique tags make early posting safe).
        for c in range(self.vpp):
            for mb in range(self.m):
                if not self._first(c):
                    buf = torch.empty(self.act_shape, dtype=self.act_dtype, device=self.device)
                    inbox.post(("F", c, mb), buf, comm.irecv(buf, prev_rank, pg, tag_of("F", c, mb)))
                if not self._last(c):
                    buf = torch.empty(self.act_shape, dtype=self.act_dtype, device=self.device)
                    inbox.post(("B", c, mb), buf, comm.irecv(buf, next_rank, pg, tag_of("B", c, mb)))

        view = StageView(stage=self.stage, pp=self.pp, vpp=self.vpp, microbatches=self.m,
                         max_inflight=self.max_inflight, memory_headroom=self._headroom())
        self.policy.reset(view)
        stash: dict[tuple[int, int], tuple[torch.Tensor | None, torch.Tensor]] = {}
        sends: list[tuple[comm.Handle, torch.Tensor]] = []
        losses: dict[int, float] = {}
        backward_count = [0] * self.vpp
        order: list[Task] = []
        wait_total = 0.0

        # The ready set is kept incrementally (arrivals are folded in from the inbox's log), so choosing a
        # task costs O(ready) rather than a scan of every task of the step.
        ready: set[Task] = {Task("F", c, mb) for c in range(self.vpp) if self._first(c) for mb in range(self.m)}
        grad_here: set[tuple[int, int]] = set()
        seen = 0

        def fold_arrivals() -> None:
            nonlocal seen
            with inbox.cond:
                new_keys = inbox.log[seen:]
                seen = len(inbox.log)
            for kind, c, mb in new_keys:
                if kind == "F":
                    ready.add(Task("F", c, mb))
                elif Task("F", c, mb) in view.done:
                    ready.add(Task("B", c, mb))
                else:
                    grad_here.add((c, mb))

        def is_ready(t: Task) -> bool:
            fold_arrivals()
            return t in ready

        while not view.finished():
            task = None
            if not self.decide_on_tp0 or self.topo.coord.tp == 0:
                t0 = time.perf_counter()
                if static:  # wait on exactly the input the fixed order needs next
                    want = self.policy.upcoming()
                    if want.kind == "F" and not self._first(want.chunk):
                        inbox.wait_key(("F", want.chunk, want.microbatch),
                                       lambda t=want: self._stuck(view, inbox, f"input of {t}"))
                    elif want.kind == "B" and not self._last(want.chunk):
                        inbox.wait_key(("B", want.chunk, want.microbatch),
                                       lambda t=want: self._stuck(view, inbox, f"input of {t}"))
                while True:
                    fold_arrivals()
                    task = self.policy.next_task(sorted(ready), view)
                    if task is not None:
                        break
                    n_before = seen
                    inbox.wait_for(lambda n=n_before: len(inbox.log) > n, self.timeout_s,
                                   lambda: self._stuck(view, inbox, "any input"))
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
                inbox.wait_for(lambda t=task: is_ready(t), self.timeout_s,
                               lambda t=task: self._stuck(view, inbox, f"input of {t}"))
                wait_total += time.perf_counter() - t0
            if task.kind == "F":
                self._forward(task, microbatches, inbox, stash, sends, losses, loss_scale, next_rank)
                view.inflight += 1
                view.peak_inflight = max(view.peak_inflight, view.inflight)
            else:
                final = backward_count[task.chunk] == self.m - 1
                if final and self.grad_sync is not None:
                    self.grad_sync.before_final_backward(task.chunk)
                self._backward(task, inbox, stash, sends, prev_rank)
                backward_count[task.chunk] += 1
                if final and self.grad_sync is not None:
                    self.grad_sync.after_final_backward(task.chunk)
                view.inflight -= 1
            view.done.add(task)
            ready.discard(task)
            if task.kind == "F" and (self._last(task.chunk) or (task.chunk, task.microbatch) in grad_here):
                ready.add(Task("B", task.chunk, task.microbatch))
            order.append(task)
            self.policy.on_done(task, view)

        for handle, _keep in sends:
            handle.wait()
        return StepResult([losses[i] for i in sorted(losses)], order, view.peak_inflight, wait_total, view)

    def _forward(self, t: Task, microbatches, inbox: _Inbox, stash, sends, losses, loss_scale, next_rank) -> None:
        ids, labels = microbatches[t.microbatch]
        if self._first(t.chunk):
            x = ids
        else:
            x = inbox.buffers.pop(("F", t.chunk, t.microbatch)).requires_grad_(True)
        last = self._last(t.chunk)
        with tracing.span("forward", "compute", chunk=t.chunk, microbatch=t.microbatch):
            out = self.chunks[t.chunk](x, labels=labels if last else None)
        if last:
            losses[t.microbatch] = float(out.detach())
            out = out * loss_scale
        else:
            payload = out.detach().to(self.act_dtype).contiguous()
            tag = tag_of("F", self._next_chunk(t.chunk), t.microbatch)
            sends.append((comm.isend(payload, next_rank, self.topo.pp_group, tag), payload))
        stash[(t.chunk, t.microbatch)] = (None if self._first(t.chunk) else x, out)

    def _backward(self, t: Task, inbox: _Inbox, stash, sends, prev_rank) -> None:
        x, out = stash.pop((t.chunk, t.microbatch))
        with tracing.span("backward", "compute", chunk=t.chunk, microbatch=t.microbatch):
            if self._last(t.chunk):
                torch.autograd.backward(out)
            else:
                grad = inbox.buffers.pop(("B", t.chunk, t.microbatch)).to(out.dtype)
                torch.autograd.backward(out, grad)
        if x is not None:
            payload = x.grad.to(self.act_dtype).contiguous()
            tag = tag_of("B", self._prev_chunk(t.chunk), t.microbatch)
            sends.append((comm.isend(payload, prev_rank, self.topo.pp_group, tag), payload))

    def _stuck(self, view: StageView, inbox: _Inbox, what: str) -> str:
        """A diagnosis for a hang: who this stage waits for and what it has done."""
        missing = sorted(k for k in inbox.buffers if k not in inbox.arrived)  # posted, not yet consumed
        return (f"stage {self.stage} ({self.topo.coord.label()}, rank {self.topo.rank}) waits for {what}; "
                f"done {len(view.done)}/{view.total_tasks()} tasks; receives still pending: "
                f"{[f'{k}{c}.{m}' for k, c, m in missing][:8]} from ranks "
                f"prev={self.topo.prev_rank()} next={self.topo.next_rank()}")

    def _headroom(self) -> float | None:
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            return free / total
        return None
