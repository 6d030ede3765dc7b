"""Every collective and point-to-point operation of the engine goes through here.

Each op gets a `CommOp` record (name, group, per-group sequence number, bytes, peer). It is recorded as a span
(category "comm") when tracing is on, and handed to interceptors (fault injection: slow links, hangs) before it
is issued. Nothing else in the engine calls torch.distributed for communication.
"""
from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatronapp import tracing
from megatronapp.parallel.topology import Group


@dataclass(frozen=True)
class CommOp:
    name: str  # all_reduce | all_gather | reduce_scatter | broadcast | send | recv | barrier
    group: str  # group name: tp, pp, dp, embd, world
    group_ranks: tuple[int, ...]
    seq: int  # sequence number of this op within its group on this rank (matches across the group's members)
    nbytes: int
    peer: int | None = None  # global rank of the other side for P2P
    tag: int = 0

    def meta(self) -> dict:
        return {"group": self.group, "group_ranks": list(self.group_ranks), "seq": self.seq,
                "bytes": self.nbytes, "peer": self.peer, "tag": self.tag}


# An interceptor sees every op before it is issued; it may sleep (slow link) or block (hang drill).
Interceptor = Callable[[CommOp], None]
_interceptors: list[Interceptor] = []
_seq: dict[tuple, itertools.count] = {}
_seq_lock = threading.Lock()


def add_interceptor(fn: Interceptor) -> None:
    _interceptors.append(fn)


def remove_interceptor(fn: Interceptor) -> None:
    if fn in _interceptors:
        _interceptors.remove(fn)


def reset() -> None:
    """Forget sequence numbers and interceptors (between runs in one process)."""
    _seq.clear()
    _interceptors.clear()


def _next_seq(key: tuple) -> int:
    with _seq_lock:
        counter = _seq.setdefault(key, itertools.count())
        return next(counter)


def _op(name: str, group: Group, t: torch.Tensor | None, peer: int | None = None, tag: int = 0) -> CommOp:
    # P2P ops are numbered per (direction, peer) so sender and receiver agree on the number.
    if peer is not None:
        me = dist.get_rank()
        key = (group.name, "p2p", me, peer) if name == "send" else (group.name, "p2p", peer, me)
    else:
        key = (group.name, group.ranks)
    nbytes = 0 if t is None else t.numel() * t.element_size()
    op = CommOp(name, group.name, group.ranks, _next_seq(key), nbytes, peer, tag)
    for fn in _interceptors:
        fn(op)
    return op


_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def all_reduce(t: torch.Tensor, group: Group, op: str = "sum") -> torch.Tensor:
    """In-place all-reduce over `group`; a no-op for a group of one."""
    if group.size == 1:
        return t
    rec = _op("all_reduce", group, t)
    with tracing.span("all_reduce", "comm", **rec.meta()):
        dist.all_reduce(t, op=_REDUCE_OPS[op], group=group.pg)
    return t


def all_reduce_async(t: torch.Tensor, group: Group, op: str = "sum") -> Handle:
    """Start an in-place all-reduce; wait on the returned handle."""
    if group.size == 1:
        return Handle(None, None)
    rec = _op("all_reduce", group, t)
    sp = tracing.open_span("all_reduce", "comm", **rec.meta())
    return Handle(dist.all_reduce(t, op=_REDUCE_OPS[op], group=group.pg, async_op=True), sp)


def all_gather(t: torch.Tensor, group: Group, dim: int = 0) -> torch.Tensor:
    """Concatenate every member's `t` along `dim`, in group-rank order."""
    if group.size == 1:
        return t
    rec = _op("all_gather", group, t)
    parts = [torch.empty_like(t) for _ in range(group.size)]
    with tracing.span("all_gather", "comm", **rec.meta()):
        dist.all_gather(parts, t.contiguous(), group=group.pg)
    return torch.cat(parts, dim=dim)


def reduce_scatter(t: torch.Tensor, group: Group, dim: int = 0) -> torch.Tensor:
    """Sum over the group, then keep this member's slice of `dim`."""
    if group.size == 1:
        return t
    rec = _op("reduce_scatter", group, t)
    chunks = [c.contiguous() for c in t.chunk(group.size, dim=dim)]
    out = torch.empty_like(chunks[0])
    with tracing.span("reduce_scatter", "comm", **rec.meta()):
        # gloo has no reduce_scatter: emulate with all_reduce and a slice (same numbers, more bytes).
        if dist.get_backend(group.pg) == "gloo":
            full = t.contiguous().clone()
            dist.all_reduce(full, group=group.pg)
            out.copy_(full.chunk(group.size, dim=dim)[group.rank_in(dist.get_rank())])
        else:
            dist.reduce_scatter(out, chunks, group=group.pg)
    return out


def broadcast(t: torch.Tensor, src: int, group: Group) -> torch.Tensor:
    """In-place broadcast from global rank `src`."""
    if group.size == 1:
        return t
    rec = _op("broadcast", group, t, peer=None)
    with tracing.span("broadcast", "comm", src=src, **rec.meta()):
        dist.broadcast(t, src=src, group=group.pg)
    return t


def broadcast_object(obj: object, src: int, group: Group) -> object:
    """Broadcast a small picklable object (control decisions, not tensors)."""
    if group.size == 1:
        return obj
    rec = _op("broadcast", group, None)
    box = [obj]
    with tracing.span("broadcast_object", "comm", src=src, **rec.meta()):
        dist.broadcast_object_list(box, src=src, group=group.pg)
    return box[0]


def barrier(group: Group) -> None:
    if group.size == 1:
        return
    rec = _op("barrier", group, None)
    with tracing.span("barrier", "comm", **rec.meta()):
        dist.barrier(group=group.pg)


class Handle:
    """An outstanding async op; `wait()` completes it and closes its span. Safe to wait from another thread."""

    __slots__ = ("work", "span", "_done")

    def __init__(self, work: object, sp: object):
        self.work, self.span, self._done = work, sp, False

    def wait(self) -> None:
        if self._done:
            return
        if self.work is not None:
            self.work.wait()
        self._done = True
        tracing.close_span(self.span)

    @property
    def done(self) -> bool:
        return self._done


def isend(t: torch.Tensor, dst: int, group: Group, tag: int = 0) -> Handle:
    """Asynchronous send to global rank `dst`."""
    rec = _op("send", group, t, peer=dst, tag=tag)
    sp = tracing.open_span("send", "comm", **rec.meta())
    return Handle(dist.isend(t.contiguous(), dst=dst, group=group.pg, tag=tag), sp)


def irecv(t: torch.Tensor, src: int, group: Group, tag: int = 0) -> Handle:
    """Asynchronous receive into `t` from global rank `src`."""
    rec = _op("recv", group, t, peer=src, tag=tag)
    sp = tracing.open_span("recv", "comm", **rec.meta())
    return Handle(dist.irecv(t, src=src, group=group.pg, tag=tag), sp)


def send(t: torch.Tensor, dst: int, group: Group, tag: int = 0) -> None:
    isend(t, dst, group, tag).wait()


def recv(t: torch.Tensor, src: int, group: Group, tag: int = 0) -> torch.Tensor:
    irecv(t, src, group, tag).wait()
    return t
