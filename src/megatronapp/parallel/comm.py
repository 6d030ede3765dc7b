"""Every collective and point-to-point operation of the engine goes through here.

Each op gets a `CommOp` record (name, group, per-group sequence number, bytes, peer). It is recorded as a span
(category "comm") when tracing is on, and handed to interceptors (fault injection: slow links, hangs) before it
is issued. Nothing else in the engine calls torch.distributed for communication. Every op is also entered in
the flight recorder (`flight_recorder.py`) and stays in flight there until its completion is seen, so a hang can
be attributed to the rank everyone waits for.

Asynchronous ops return a `Handle`. Its readiness (`is_completed()`) means the same thing on every backend:
on NCCL it is the work's own `is_completed()` (its CUDA event), because `Work.wait()` there only orders streams
and returns at once; gloo's works report completion only through a blocking `wait()`, so a daemon thread sits in
it and signals. `wait_until()` sleeps on those signals and polls NCCL works with a short back-off, never a busy
spin. `set_semantics("nccl" | "nccl-lazy" | "nccl-eager")` turns on the strict mode of `nccl_semantics` on
any backend. On NCCL the flight recorder learns an op's completion from its work's `is_completed()` (its CUDA
event), never from `wait()` returning, which there only means queued.
"""
from __future__ import annotations

import itertools
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from megatronapp import tracing
from megatronapp.parallel.flight_recorder import RECORDER as _flight
from megatronapp.parallel.nccl_semantics import Strict
from megatronapp.parallel.topology import Group


@dataclass(frozen=True)
class CommOp:
    name: str  # all_reduce | all_gather | reduce_scatter | broadcast | send | recv | barrier
    group: str  # group name: tp, pp, dp, embd, world, pp.act.up, ...
    group_ranks: tuple[int, ...]
    seq: int  # sequence number of this op within its group on this rank (matches across the group's members)
    nbytes: int
    peer: int | None = None  # global rank of the other side for P2P
    tag: int = 0

    def meta(self) -> dict:
        return {"group": self.group, "group_ranks": list(self.group_ranks), "seq": self.seq,
                "bytes": self.nbytes, "peer": self.peer, "tag": self.tag}


# An interceptor sees every op before it is issued; it may sleep (the caller stalls: slow link, hang drill), or,
# for a send, return seconds by which the message is delivered late while the sender goes on (a slow wire).
Interceptor = Callable[[CommOp], float | None]
_interceptors: list[Interceptor] = []
_seq: dict[tuple, itertools.count] = {}
_seq_lock = threading.Lock()
_strict: Strict | None = None
_mode = "native"
_epoch = 0  # runs in this process so far (each `reset()` starts one)
_backends: dict[int, str] = {}


def add_interceptor(fn: Interceptor) -> None:
    _interceptors.append(fn)


def remove_interceptor(fn: Interceptor) -> None:
    if fn in _interceptors:
        _interceptors.remove(fn)


def reset() -> None:
    """Forget sequence numbers, interceptors and the strict mode (between runs in one process)."""
    global _strict, _epoch
    _seq.clear()
    _interceptors.clear()
    _flight.clear()
    _strict = None
    _epoch += 1


SEMANTICS = ("native", "nccl", "nccl-lazy", "nccl-eager")


STALL_TIMEOUT_S = 120.0  # how long the strict modes wait before naming a stall (tests lower it)


def set_semantics(mode: str, stall_timeout_s: float | None = None) -> None:
    """"native": the backend's own rules; "nccl": enforce the NCCL rules that always hold on any backend;
    "nccl-lazy" / "nccl-eager": those plus the rules of lazy or eager communicator creation (nccl_semantics)."""
    global _strict, _mode
    if mode not in SEMANTICS:
        raise ValueError(f"comm semantics {mode!r}: choose one of {', '.join(SEMANTICS)}")
    timeout = STALL_TIMEOUT_S if stall_timeout_s is None else stall_timeout_s
    _strict = Strict(timeout, _epoch, mode) if mode != "native" else None
    _mode = mode


def semantics() -> str:
    return _mode if _strict is not None else "native"


def _stream(group: Group) -> str:
    """The strict mode's name of a group: groups of one name may differ in members (a pair's link groups)."""
    return f"{group.name} {list(group.ranks)}"


def _next_seq(key: tuple) -> int:
    with _seq_lock:
        counter = _seq.setdefault(key, itertools.count())
        return next(counter)


def _backend(group: Group) -> str:
    b = _backends.get(id(group.pg))
    if b is None:
        b = _backends[id(group.pg)] = dist.get_backend(group.pg)
    return b


def _op(name: str, group: Group, t: torch.Tensor | None, peer: int | None = None, tag: int = 0,
        label: str = "", blocking: bool = False) -> CommOp:
    return _op_delayed(name, group, t, peer, tag, label, blocking)[0]


def _op_delayed(name: str, group: Group, t: torch.Tensor | None, peer: int | None = None, tag: int = 0,
                label: str = "", blocking: bool = False) -> tuple[CommOp, float]:
    """The op's record, after the interceptors ran; and the delivery delay they asked for (sends)."""
    # P2P ops are numbered per (direction, peer) so sender and receiver agree on the number.
    if peer is not None:
        me = dist.get_rank()
        key = (group.name, "p2p", me, peer) if name == "send" else (group.name, "p2p", peer, me)
    else:
        key = (group.name, group.ranks)
    nbytes = 0 if t is None else t.numel() * t.element_size()
    op = CommOp(name, group.name, group.ranks, _next_seq(key), nbytes, peer, tag)
    if t is not None and t.device.type != "cuda" and _backend(group) == "nccl":
        raise ValueError(f"{name} on group {group.name}: the tensor is on {t.device}, NCCL takes CUDA tensors only; "
                         f"create it on the rank's device")
    delay = 0.0
    for fn in _interceptors:
        d = fn(op)
        if d:
            delay = max(delay, float(d))
    if _strict is not None and peer is None:
        dtype = "" if t is None else str(t.dtype).removeprefix("torch.")
        signature = f"{name}[{label}]({nbytes} B {dtype})"
        _strict.first_use(group.name, group.ranks, None, f"{signature} on group {group.name}")
        _strict.check_collective(group.name, group.ranks, op.seq, signature)
        if blocking:  # an async collective queues behind the group's stream instead (_start)
            _strict.gate(_stream(group), f"{signature} on group {group.name}")
    _flight.issue(op)  # the flight recorder: done() when the op is seen to complete
    return op, delay


_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def _op_due(name: str, group: Group, t: torch.Tensor | None, label: str = "", blocking: bool = False
            ) -> tuple[CommOp, float]:
    """A collective's record, and the monotonic time before which it may not complete: an interceptor's delay
    is the time its bytes take on a modelled wire (parallel/link_model.py); 0.0 when none asked for one."""
    rec, delay = _op_delayed(name, group, t, label=label, blocking=blocking)
    return rec, (time.monotonic() + delay) if delay > 0 else 0.0


def _hold(due: float) -> None:
    """Block until `due` (a modelled wire still carrying the op's bytes); at once when `due` is 0 or past."""
    if due:
        left = due - time.monotonic()
        if left > 0:
            time.sleep(left)


def _complete(rec: CommOp, work: Any, group: Group) -> None:
    """A blocking collective: wait for it; on NCCL `wait()` only orders streams, so the flight recorder is told
    of its completion when the work's CUDA event says so."""
    work.wait()
    if _backend(group) == "nccl":
        _flight.done_when(rec, work.is_completed)
    else:
        _flight.done(rec)


def _start(group: Group, rec: CommOp, sp: object, start: Callable[[], Any], keep: torch.Tensor | None = None,
           due: float = 0.0) -> Handle:
    """Issue an async collective; under nccl-eager it queues behind the group's P2P ops on the group's stream.
    `due`: a modelled wire's end (the handle is not complete before it)."""
    if _strict is None or not _strict.eager:
        return Handle(start(), sp, keep=keep, nccl=_backend(group) == "nccl", op=rec, due=due)
    h = Handle(None, sp, keep=keep, driven=True, op=rec, due=due)
    h.desc = f"{rec.name} on group {group.name} (#{rec.seq})"
    _strict.submit([(_stream(group), None)], "collective", h.desc, lambda: [start()], h._finish)
    return h


def all_reduce(t: torch.Tensor, group: Group, op: str = "sum", label: str = "") -> torch.Tensor:
    """In-place all-reduce over `group`; a no-op for a group of one. `label` names the op for order checks."""
    if group.size == 1:
        return t
    rec, due = _op_due("all_reduce", group, t, label=label, blocking=True)
    with tracing.span("all_reduce", "comm", **rec.meta()):
        _complete(rec, dist.all_reduce(t, op=_REDUCE_OPS[op], group=group.pg, async_op=True), group)
        _hold(due)
    return t


def all_reduce_async(t: torch.Tensor, group: Group, op: str = "sum", label: str = "") -> Handle:
    """Start an in-place all-reduce; wait on the returned handle."""
    if group.size == 1:
        return Handle(None, None)
    rec, due = _op_due("all_reduce", group, t, label=label)
    sp = tracing.open_span("all_reduce", "comm", **rec.meta())
    return _start(group, rec, sp, lambda: dist.all_reduce(t, op=_REDUCE_OPS[op], group=group.pg, async_op=True),
                  due=due)


def reduce_scatter_inplace_async(t: torch.Tensor, group: Group, label: str = "") -> Handle:
    """Start summing the flat `t` over the group in place: once waited on, member i's slice i (of group.size
    equal slices) holds the sum; the other slices are left undefined. A no-op for a group of one."""
    if group.size == 1:
        return Handle(None, None)
    rec, due = _op_due("reduce_scatter", group, t, label=label)
    sp = tracing.open_span("reduce_scatter", "comm", **rec.meta())
    if _backend(group) == "gloo" and _strict is None:
        # gloo's reduce-scatter costs about twice its all-reduce (measured: 16 MiB, 2 ranks, 14 vs 8 ms of CPU);
        # an in-place all-reduce leaves the same sums in every slice, ours included. Under --comm-semantics nccl
        # gloo runs the op NCCL would run, so the tests cover both.
        return _start(group, rec, sp, lambda: dist.all_reduce(t, group=group.pg, async_op=True), keep=t, due=due)
    # in place (output = the input's own slice) as Megatron's distributed optimizer does
    mine = t.chunk(group.size)[group.rank_in(dist.get_rank())]
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor  # renamed in 2.13
    return _start(group, rec, sp, lambda: scatter(mine, t, group=group.pg, async_op=True), keep=t, due=due)


def all_gather_inplace_async(t: torch.Tensor, group: Group, label: str = "") -> Handle:
    """Start filling the flat `t` from every member's own slice (slice i from member i), in place."""
    if group.size == 1:
        return Handle(None, None)
    rec, due = _op_due("all_gather", group, t, label=label)
    sp = tracing.open_span("all_gather", "comm", **rec.meta())
    mine = t.chunk(group.size)[group.rank_in(dist.get_rank())]
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # renamed in torch 2.13
    return _start(group, rec, sp, lambda: gather(t, mine, group=group.pg, async_op=True), keep=t, due=due)


def all_gather(t: torch.Tensor, group: Group, dim: int = 0) -> torch.Tensor:
    """Concatenate every member's `t` along `dim`, in group-rank order."""
    if group.size == 1:
        return t
    rec, due = _op_due("all_gather", group, t, blocking=True)
    parts = [torch.empty_like(t) for _ in range(group.size)]
    with tracing.span("all_gather", "comm", **rec.meta()):
        _complete(rec, dist.all_gather(parts, t.contiguous(), group=group.pg, async_op=True), group)
        _hold(due)
    return torch.cat(parts, dim=dim)


def reduce_scatter(t: torch.Tensor, group: Group, dim: int = 0) -> torch.Tensor:
    """Sum over the group, then keep this member's slice of `dim`."""
    if group.size == 1:
        return t
    rec, due = _op_due("reduce_scatter", group, t, blocking=True)
    chunks = [c.contiguous() for c in t.chunk(group.size, dim=dim)]
    out = torch.empty_like(chunks[0])
    with tracing.span("reduce_scatter", "comm", **rec.meta()):
        # gloo has no reduce_scatter: emulate with all_reduce and a slice (same numbers, more bytes).
        if _backend(group) == "gloo":
            full = t.contiguous().clone()
            _complete(rec, dist.all_reduce(full, group=group.pg, async_op=True), group)
            out.copy_(full.chunk(group.size, dim=dim)[group.rank_in(dist.get_rank())])
        else:
            _complete(rec, dist.reduce_scatter(out, chunks, group=group.pg, async_op=True), group)
        _hold(due)
    return out


def all_gather_async(t: torch.Tensor, group: Group, label: str = "") -> tuple[list[torch.Tensor], Handle]:
    """Start gathering every member's `t`; once the handle is waited on, the list holds them in group-rank order."""
    if group.size == 1:
        return [t], Handle(None, None)
    rec, due = _op_due("all_gather", group, t, label=label)
    parts = [torch.empty_like(t) for _ in range(group.size)]
    sp = tracing.open_span("all_gather", "comm", **rec.meta())
    t = t.contiguous()
    return parts, _start(group, rec, sp, lambda: dist.all_gather(parts, t, group=group.pg, async_op=True), keep=t,
                         due=due)


def reduce_scatter_async(t: torch.Tensor, group: Group, dim: int = 0,
                         label: str = "") -> tuple[torch.Tensor, Handle]:
    """Start summing `t` over the group; once the handle is waited on, the tensor holds this member's slice of
    `dim` of the sum."""
    if group.size == 1:
        return t, Handle(None, None)
    rec, due = _op_due("reduce_scatter", group, t, label=label)
    sp = tracing.open_span("reduce_scatter", "comm", **rec.meta())
    if _backend(group) == "gloo":  # no reduce_scatter in gloo: all-reduce a copy, the slice is a view of it
        full = t.contiguous().clone()
        h = _start(group, rec, sp, lambda: dist.all_reduce(full, group=group.pg, async_op=True), keep=full, due=due)
        return full.chunk(group.size, dim=dim)[group.rank_in(dist.get_rank())], h
    chunks = [c.contiguous() for c in t.chunk(group.size, dim=dim)]
    out = torch.empty_like(chunks[0])
    return out, _start(group, rec, sp, lambda: dist.reduce_scatter(out, chunks, group=group.pg, async_op=True),
                       keep=t, due=due)


def broadcast(t: torch.Tensor, src: int, group: Group) -> torch.Tensor:
    """In-place broadcast from global rank `src`."""
    if group.size == 1:
        return t
    rec, due = _op_due("broadcast", group, t, label=f"src {src}", blocking=True)
    with tracing.span("broadcast", "comm", src=src, **rec.meta()):
        _complete(rec, dist.broadcast(t, src=src, group=group.pg, async_op=True), group)
        _hold(due)
    return t


def broadcast_object(obj: object, src: int, group: Group) -> object:
    """Broadcast a small picklable object (control decisions, not tensors)."""
    if group.size == 1:
        return obj
    rec = _op("broadcast", group, None, label=f"object from {src}", blocking=True)
    box = [obj]
    with tracing.span("broadcast_object", "comm", src=src, **rec.meta()):
        # NCCL moves the pickled bytes through a tensor on the current CUDA device; gloo through a CPU one.
        device = torch.device("cuda", torch.cuda.current_device()) if _backend(group) == "nccl" else None
        dist.broadcast_object_list(box, src=src, group=group.pg, device=device)
    _flight.done(rec)
    return box[0]


def barrier(group: Group) -> None:
    if group.size == 1:
        return
    rec = _op("barrier", group, None, blocking=True)
    with tracing.span("barrier", "comm", **rec.meta()):
        _complete(rec, dist.barrier(group=group.pg, async_op=True), group)


# -- completion --------------------------------------------------------------------------------------------
_progress = threading.Condition()  # notified whenever a watched op completes


class _Watchers:
    """Daemon threads that sit in gloo's blocking `wait()` and signal completion (daemon: an op left pending
    by a failed step must not keep the process alive at exit). Grows so no op waits for a free thread."""

    def __init__(self) -> None:
        self.jobs: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self.idle = 0
        self.lock = threading.Lock()

    def submit(self, job: Callable[[], None]) -> None:
        with self.lock:
            if self.idle == 0:
                threading.Thread(target=self._work, name="comm-watcher", daemon=True).start()
            else:
                self.idle -= 1
        self.jobs.put(job)

    def _work(self) -> None:
        while True:
            self.jobs.get()()
            with self.lock:
                self.idle += 1


_watchers = _Watchers()


class Handle:
    """An outstanding async op. `is_completed()` never blocks; `wait()` completes it (on NCCL: orders the current
    stream after it) and closes its span. Safe to use from several threads."""

    __slots__ = ("work", "span", "keep", "error", "desc", "_event", "_driven", "_closed", "_lock", "_nccl", "_op",
                 "_due")

    def __init__(self, work: object, sp: object, keep: torch.Tensor | None = None, driven: bool = False,
                 nccl: bool = False, op: CommOp | None = None, due: float = 0.0):
        self._op = op  # the flight recorder's record, completed with the handle
        self._due = due  # a modelled wire: the op is not complete before this monotonic time (0: no wire)
        self.work, self.span, self.keep = work, sp, keep  # keep: the buffer must live until the op completes
        self._nccl = nccl  # NCCL works answer is_completed() themselves, and wait() does not block the host
        self.error: BaseException | None = None
        self.desc = ""  # what the op is, for the strict mode's reports
        self._event = threading.Event()
        self._driven = driven  # completion is signalled by a thread (strict mode, gloo watcher)
        self._closed = False
        self._lock = threading.Lock()
        if work is None and not driven:
            self._event.set()

    def _finish(self, err: BaseException | None = None) -> None:
        """Completion seen by a driving thread: close the span now (its end is the op's end, not the moment
        someone looks), then wake whoever waits."""
        self.error = err
        self._close_span()
        self._set_done()
        with _progress:
            _progress.notify_all()

    def _set_done(self) -> None:
        if self._op is not None and self.error is None:
            _flight.done(self._op)
        self._event.set()

    def _close_span(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        tracing.close_span(self.span)

    def _watch(self) -> None:
        with self._lock:
            if self._driven:
                return
            self._driven = True
        work = self.work

        def job() -> None:
            try:
                work.wait()
            except BaseException as e:  # noqa: BLE001 - surfaced to the waiter
                self._finish(e)
                return
            self._finish()

        _watchers.submit(job)

    def is_completed(self) -> bool:
        """Has the op completed? (Starts a watcher on backends whose works cannot tell without blocking.)"""
        if self._due and time.monotonic() < self._due:
            if not self._driven and not self._nccl and self.work is not None:
                self._watch()  # gloo: learn the real completion meanwhile
            return False
        if self._event.is_set():
            return True
        if not self._driven:
            if self._nccl:
                if self.work.is_completed():
                    self._set_done()
                    return True
                return False
            self._watch()
        return self._event.is_set()

    def wait(self) -> None:
        if not self._event.is_set():
            if self._driven:
                start = time.monotonic()
                while not self._event.wait(0.5):
                    if _strict is None:
                        continue
                    if _strict.error is not None:
                        raise RuntimeError(f"communication failed under NCCL semantics: {_strict.error}") \
                            from _strict.error
                    # Twice the stall timeout: a stream stall (timed from the op's issue, naming the op it waits
                    # behind) is the cause and must report first; this wait started later but on a loaded host
                    # the stall's thread can be scheduled later still, and the race named the victim instead.
                    if self.desc and time.monotonic() - start > 2 * _strict.stall_timeout_s:
                        raise TimeoutError(f"{self.desc} did not complete within {2 * _strict.stall_timeout_s:.0f} s "
                                           f"under NCCL semantics: its peer never issued the matching op, or is "
                                           f"itself blocked (see that rank's error)")
            else:
                self.work.wait()
                if self._nccl:  # only queued: the flight recorder hears of completion from the CUDA event
                    self._event.set()
                    if self._op is not None:
                        _flight.done_when(self._op, self.work.is_completed)
                else:
                    self._set_done()
        if self.error is not None:
            raise RuntimeError(f"communication failed: {self.error}") from self.error
        _hold(self._due)
        if self.work is not None and self._driven and self._nccl:
            self.work.wait()  # NCCL: order the current stream after the op
        self.keep = None
        self._close_span()

    @property
    def blocks_host(self) -> bool:
        """True when `wait()` would block this thread on the op itself (gloo, no watcher): cheaper than a
        thread hop when the caller has nothing else to do."""
        return not self._driven and not self._nccl and not self._event.is_set()

    @property
    def done(self) -> bool:
        return self._event.is_set() and not (self._due and time.monotonic() < self._due)


def wait_until(pred: Callable[[], bool], timeout_s: float, what: Callable[[], str]) -> None:
    """Sleep until `pred()` (checked whenever an op completes, and by polling for NCCL works); raise
    TimeoutError with `what()` after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    delay = 5e-5
    with _progress:
        while not pred():
            if _strict is not None and _strict.error is not None:
                raise RuntimeError(f"communication failed under NCCL semantics: {_strict.error}") from _strict.error
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"nothing arrived for {timeout_s:.0f} s; {what()}")
            _progress.wait(min(left, delay))
            delay = min(delay * 2, 2e-3)


# -- point to point ----------------------------------------------------------------------------------------
@dataclass
class P2P:
    """One op of a `batch_isend_irecv` group."""

    op: str  # send | recv
    tensor: torch.Tensor
    peer: int  # global rank
    group: Group
    tag: int = 0


def _issue(op: str, t: torch.Tensor, peer: int, group: Group, tag: int):
    fn = dist.isend if op == "send" else dist.irecv
    return fn(t, peer, group=group.pg, tag=tag)


def _p2p(op: str, t: torch.Tensor, peer: int, group: Group, tag: int) -> Handle:
    rec, delay = _op_delayed(op, group, t, peer=peer, tag=tag)
    sp = tracing.open_span(op, "comm", **rec.meta())
    wired = op == "send" and (delay > 0 or (group.name, peer) in _wires)  # once late, a stream stays in order
    if _strict is None and not wired:
        return Handle(_issue(op, t, peer, group, tag), sp, keep=t, nccl=_backend(group) == "nccl", op=rec)
    h = Handle(None, sp, keep=t, driven=True, op=rec)
    h.desc = f"{op} {'to' if op == 'send' else 'from'} rank {peer} (group {group.name}, #{rec.seq})"
    if _strict is None:  # a slow wire: the message leaves late, in order, and the sender goes on
        _wire(group, peer).put(time.monotonic() + delay, lambda: [_issue(op, t, peer, group, tag)], h._finish)
        return h
    due = time.monotonic() + delay

    def issue() -> list:
        time.sleep(max(0.0, due - time.monotonic()))
        return [_issue(op, t, peer, group, 0)]  # NCCL ignores tags: match by order

    _strict.first_use(group.name, group.ranks, peer, h.desc)  # nccl-lazy: blocks the host, as NCCL does
    _strict.submit([(_stream(group), peer)], op, h.desc, issue, h._finish)
    return h


class _Wire:
    """Late delivery on one (group, peer) stream: messages leave in order, each no earlier than its due time."""

    def __init__(self) -> None:
        self.q: queue.SimpleQueue[tuple[float, Callable[[], list], Callable[..., None]]] = queue.SimpleQueue()
        threading.Thread(target=self._run, name="comm-wire", daemon=True).start()

    def put(self, due: float, issue: Callable[[], list], done: Callable[..., None]) -> None:
        self.q.put((due, issue, done))

    def _run(self) -> None:
        while True:
            due, issue, done = self.q.get()
            time.sleep(max(0.0, due - time.monotonic()))
            try:
                for work in issue():
                    work.wait()
            except BaseException as e:  # noqa: BLE001 - surfaced to the waiter
                done(e)
                continue
            done()


_wires: dict[tuple[str, int], _Wire] = {}


def _wire(group: Group, peer: int) -> _Wire:
    key = (group.name, peer)
    if key not in _wires:
        _wires[key] = _Wire()
    return _wires[key]


def isend(t: torch.Tensor, dst: int, group: Group, tag: int = 0) -> Handle:
    """Asynchronous send to global rank `dst`."""
    return _p2p("send", t.contiguous(), dst, group, tag)


def irecv(t: torch.Tensor, src: int, group: Group, tag: int = 0) -> Handle:
    """Asynchronous receive into `t` from global rank `src`."""
    return _p2p("recv", t, src, group, tag)


def batch_isend_irecv(ops: Sequence[P2P]) -> list[Handle]:
    """Issue P2P ops as one group (NCCL group call): ops in a group do not wait for each other."""
    recs = [_op(o.op, o.group, o.tensor, peer=o.peer, tag=o.tag) for o in ops]
    spans = [tracing.open_span(o.op, "comm", **r.meta()) for o, r in zip(ops, recs)]
    tensors = [o.tensor.contiguous() if o.op == "send" else o.tensor for o in ops]
    if _strict is None:
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend if o.op == "send" else dist.irecv, t, o.peer,
                                                   o.group.pg, o.tag) for o, t in zip(ops, tensors)])
        nccl = _backend(ops[0].group) == "nccl"
        return [Handle(w, sp, keep=t, nccl=nccl, op=r) for w, sp, t, r in zip(works, spans, tensors, recs)]
    handles = [Handle(None, sp, keep=t, driven=True, op=r) for sp, t, r in zip(spans, tensors, recs)]

    def done(err: BaseException | None) -> None:
        for h in handles:
            h._finish(err)

    what = f"group of {len(ops)} P2P ops with ranks {sorted({o.peer for o in ops})}"
    for g in {o.group.name: o.group for o in ops}.values():  # grouped calls use the group's communicator
        _strict.first_use(g.name, g.ranks, None, what)
    streams = sorted({(_stream(o.group), o.peer) for o in ops})
    _strict.submit(streams, "group", what,
                   lambda: [_issue(o.op, t, o.peer, o.group, 0) for o, t in zip(ops, tensors)], done)
    return handles


def warm_up_link(group: Group, src: int, dst: int) -> None:
    """One tiny message from `src` to `dst` on a pipeline link at start-up, outside the op records (traces and
    sequence numbers start with the first real message): on NCCL without device_id this creates the link's
    2-rank communicator now, in the order every rank follows, not when a schedule first uses it."""
    me = dist.get_rank()
    peer = dst if me == src else src
    if _strict is not None:
        _strict.first_use(group.name, group.ranks, peer, f"warm-up of link {group.name} {src}->{dst}")
    device = torch.device("cuda", torch.cuda.current_device()) if _backend(group) == "nccl" else None
    t = torch.zeros(1, device=device)
    (dist.send if me == src else dist.recv)(t, peer, group=group.pg)


def send(t: torch.Tensor, dst: int, group: Group, tag: int = 0) -> None:
    isend(t, dst, group, tag).wait()


def recv(t: torch.Tensor, src: int, group: Group, tag: int = 0) -> torch.Tensor:
    irecv(t, src, group, tag).wait()
    return t
