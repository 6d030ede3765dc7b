"""Every collective and point-to-point operation of the engine goes through here.

Nothing else in the engine calls torch.distributed for communication. The layer, bottom up:

- `comm_wire.py`: the modelled wire (an op's bytes still on the wire hold its completion; late sends in order);
- `comm_context.py`: `CommOp` records and the one `CommContext` that issues and records every op: per-group
  sequence numbers, interceptors (fault drills, link models), the strict NCCL mode (`nccl_semantics`), the flight
  recorder feed; all of the layer's state, forgotten by `reset()`;
- `comm_handle.py`: `Handle` (readiness the same on every backend), the gloo watcher threads, `wait_until`;
- this file: the ops. Each takes one path: `CONTEXT.issue()` (record, interceptors, strict checks, flight
  recorder), a `comm` span with the record's metadata (MegaScan reads `group`, `seq`, `bytes`, `peer`), then
  torch.distributed: a blocking collective waits and is held until its wire's due time (`_blocking`), an async
  one returns a `Handle` (`_start`), a P2P op returns a `Handle` issued at once, through its stream's wire when
  late, or through the strict mode's streams (`_p2p`).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from megatronapp import tracing
from megatronapp.parallel.comm_context import CONTEXT, SEMANTICS, CommContext, CommOp, Interceptor
from megatronapp.parallel.comm_handle import NCCL_POLL_MAX_S, POLL_MAX_S, Handle, wait_until
from megatronapp.parallel.comm_wire import hold
from megatronapp.parallel.group import Group

__all__ = ["CONTEXT", "NCCL_POLL_MAX_S", "POLL_MAX_S", "SEMANTICS", "CommContext", "CommOp", "Handle", "Interceptor",
           "P2P", "add_interceptor", "all_gather", "all_gather_async", "all_gather_inplace_async", "all_reduce",
           "all_reduce_async", "barrier", "batch_isend_irecv", "broadcast", "broadcast_object", "irecv", "isend",
           "recv", "reduce_scatter", "reduce_scatter_async", "reduce_scatter_inplace_async", "remove_interceptor",
           "reset", "semantics", "send", "set_semantics", "wait_until", "warm_up_link"]


def add_interceptor(fn: Interceptor) -> None:
    """Hand every op to `fn` before it is issued (see `comm_context.Interceptor`)."""
    CONTEXT.add_interceptor(fn)


def remove_interceptor(fn: Interceptor) -> None:
    """Stop handing ops to `fn`."""
    CONTEXT.remove_interceptor(fn)


def reset() -> None:
    """Forget sequence numbers, interceptors and the strict mode (between runs in one process)."""
    CONTEXT.reset()


def set_semantics(mode: str, stall_timeout_s: float | None = None) -> None:
    """Choose NCCL's rules on any backend: "native", "nccl", "nccl-lazy" or "nccl-eager" (nccl_semantics);
    the stall timeout defaults to `CONTEXT.stall_timeout_s`."""
    CONTEXT.set_semantics(mode, stall_timeout_s)


def semantics() -> str:
    """The communication rules in force ("native" unless a strict mode is on)."""
    return CONTEXT.mode


# -- collectives -------------------------------------------------------------------------------------------
_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def _blocking(name: str, group: Group, t: torch.Tensor | None, start: Callable[[], Any], label: str = "",
              **extra: Any) -> None:
    """Issue a collective and wait for it, then for its wire. On NCCL `wait()` only orders streams, so the flight
    recorder is told of its completion when the work's CUDA event says so. `extra`: more span metadata."""
    rec, due = CONTEXT.issue(name, group, t, label=label, blocking=True)
    with tracing.span(name, "comm", **extra, **rec.meta()):
        work = start()
        work.wait()
        if CONTEXT.backend(group) == "nccl":
            CONTEXT.flight.done_when(rec, work.is_completed)
        else:
            CONTEXT.flight.done(rec)
        hold(due)


def _start(name: str, group: Group, t: torch.Tensor, label: str, start: Callable[[], Any],
           keep: torch.Tensor | None = None) -> Handle:
    """Issue an async collective; its handle is not complete before its wire's due time. Under nccl-eager it
    queues behind the group's P2P ops on the group's stream."""
    rec, due = CONTEXT.issue(name, group, t, label=label)
    sp = tracing.open_span(name, "comm", **rec.meta())
    strict = CONTEXT.strict
    if strict is None or not strict.eager:
        return Handle(start(), sp, keep=keep, nccl=CONTEXT.backend(group) == "nccl", op=rec, due=due)
    h = Handle(None, sp, keep=keep, driven=True, op=rec, due=due)
    h.desc = f"{rec.name} on group {group.name} (#{rec.seq})"
    strict.submit([(CONTEXT.stream(group), None)], "collective", h.desc, lambda: [start()], h.finish)
    return h


def _mine(t: torch.Tensor, group: Group, dim: int = 0) -> torch.Tensor:
    """This rank's slice of `t` (group.size equal slices along `dim`)."""
    return t.chunk(group.size, dim=dim)[group.rank_in(dist.get_rank())]


def all_reduce(t: torch.Tensor, group: Group, op: str = "sum", label: str = "") -> torch.Tensor:
    """In-place all-reduce over `group`; a no-op for a group of one. `label` names the op for order checks."""
    if group.size == 1:
        return t
    _blocking("all_reduce", group, t, lambda: dist.all_reduce(t, op=_REDUCE_OPS[op], group=group.pg, async_op=True),
              label)
    return t


def all_reduce_async(t: torch.Tensor, group: Group, op: str = "sum", label: str = "") -> Handle:
    """Start an in-place all-reduce; wait on the returned handle."""
    if group.size == 1:
        return Handle(None, None)
    return _start("all_reduce", group, t, label,
                  lambda: dist.all_reduce(t, op=_REDUCE_OPS[op], group=group.pg, async_op=True))


# NCCL takes one flat buffer per collective: the list forms (`all_gather(list, t)`, `reduce_scatter(t, list)`)
# make ProcessGroupNCCL flatten the list into a buffer and copy it out again. The single-tensor forms below hand
# it that buffer directly; a gather along dim 0 then needs no copy at all, along another dim one concatenation.
# Plain gloo keeps the forms it has always had (older torch's gloo lacks the single-tensor ones); under the strict
# modes gloo runs NCCL's, so the tests cover them.
_gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # renamed in torch 2.13
_scatter_from = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor  # renamed in 2.13


def _native_gloo(group: Group) -> bool:
    return CONTEXT.backend(group) == "gloo" and CONTEXT.strict is None


def _gather(out: torch.Tensor, src: torch.Tensor, group: Group) -> Callable[[], Any]:
    """Start filling `out` ([group.size * n, ...]) with every member's `src` ([n, ...]) as consecutive blocks."""
    if _native_gloo(group):
        return lambda: dist.all_gather(list(out.chunk(group.size)), src, group=group.pg, async_op=True)
    return lambda: _gather_into(out, src, group=group.pg, async_op=True)


def reduce_scatter_inplace_async(t: torch.Tensor, group: Group, label: str = "") -> Handle:
    """Start summing the flat `t` over the group in place: once waited on, member i's slice i (of group.size
    equal slices) holds the sum; the other slices are left undefined. A no-op for a group of one."""
    if group.size == 1:
        return Handle(None, None)
    if _native_gloo(group):
        # gloo's reduce-scatter costs about twice its all-reduce (measured: 16 MiB, 2 ranks, 14 vs 8 ms of CPU);
        # an in-place all-reduce leaves the same sums in every slice, ours included. Under --comm-semantics nccl
        # gloo runs the op NCCL would run, so the tests cover both.
        return _start("reduce_scatter", group, t, label, lambda: dist.all_reduce(t, group=group.pg, async_op=True),
                      keep=t)
    # in place (output = the input's own slice) as Megatron's distributed optimizer does
    mine = _mine(t, group)
    return _start("reduce_scatter", group, t, label, lambda: _scatter_from(mine, t, group=group.pg, async_op=True),
                  keep=t)


def all_gather_inplace_async(t: torch.Tensor, group: Group, label: str = "") -> Handle:
    """Start filling the flat `t` from every member's own slice (slice i from member i), in place."""
    if group.size == 1:
        return Handle(None, None)
    mine = _mine(t, group)
    return _start("all_gather", group, t, label, _gather(t, mine, group), keep=t)


def _stacked(t: torch.Tensor, group: Group, dim: int) -> torch.Tensor:
    """Member i's chunk of `dim` as block i along dim 0, contiguous: `t` itself when dim is 0."""
    if dim == 0 and t.is_contiguous():
        return t
    return torch.cat(t.chunk(group.size, dim=dim), dim=0)


def all_gather(t: torch.Tensor, group: Group, dim: int = 0) -> torch.Tensor:
    """Concatenate every member's `t` along `dim`, in group-rank order."""
    if group.size == 1:
        return t
    src = t.contiguous()
    out = src.new_empty((group.size * src.shape[0], *src.shape[1:]))  # blocks along dim 0, as gloo checks them
    _blocking("all_gather", group, t, _gather(out, src, group))
    if dim == 0:
        return out
    return torch.cat(out.chunk(group.size, dim=0), dim=dim)


def reduce_scatter(t: torch.Tensor, group: Group, dim: int = 0) -> torch.Tensor:
    """Sum over the group, then keep this member's slice of `dim`."""
    if group.size == 1:
        return t
    if _native_gloo(group):
        # all-reduce a copy and keep our slice (same numbers; cheaper on gloo, see reduce_scatter_inplace_async)
        full = t.contiguous().clone()
        _blocking("reduce_scatter", group, t, lambda: dist.all_reduce(full, group=group.pg, async_op=True))
        return _mine(full, group, dim).contiguous()
    stacked = _stacked(t, group, dim)
    out = stacked.new_empty((stacked.shape[0] // group.size, *stacked.shape[1:]))
    _blocking("reduce_scatter", group, t, lambda: _scatter_from(out, stacked, group=group.pg, async_op=True))
    return out


def all_gather_async(t: torch.Tensor, group: Group, label: str = "") -> tuple[torch.Tensor, Handle]:
    """Start gathering every member's `t`; once the handle is waited on, the tensor [group.size, *t.shape] holds
    them in group-rank order."""
    if group.size == 1:
        return t.unsqueeze(0), Handle(None, None)
    src = t.contiguous()
    out = src.new_empty((group.size * src.shape[0], *src.shape[1:]))
    return out.view(group.size, *src.shape), _start("all_gather", group, t, label, _gather(out, src, group), keep=src)


def reduce_scatter_async(t: torch.Tensor, group: Group, dim: int = 0,
                         label: str = "") -> tuple[torch.Tensor, Handle]:
    """Start summing `t` over the group; once the handle is waited on, the tensor holds this member's slice of
    `dim` of the sum."""
    if group.size == 1:
        return t, Handle(None, None)
    if _native_gloo(group):  # all-reduce a copy: the slice is a view of it
        full = t.contiguous().clone()
        h = _start("reduce_scatter", group, t, label, lambda: dist.all_reduce(full, group=group.pg, async_op=True),
                   keep=full)
        return _mine(full, group, dim), h
    stacked = _stacked(t, group, dim)
    out = stacked.new_empty((stacked.shape[0] // group.size, *stacked.shape[1:]))
    return out, _start("reduce_scatter", group, t, label,
                       lambda: _scatter_from(out, stacked, group=group.pg, async_op=True), keep=stacked)


def broadcast(t: torch.Tensor, src: int, group: Group) -> torch.Tensor:
    """In-place broadcast from global rank `src`."""
    if group.size == 1:
        return t
    _blocking("broadcast", group, t, lambda: dist.broadcast(t, src=src, group=group.pg, async_op=True),
              f"src {src}", src=src)
    return t


def broadcast_object(obj: object, src: int, group: Group) -> object:
    """Broadcast a small picklable object (control decisions, not tensors)."""
    if group.size == 1:
        return obj
    rec, due = CONTEXT.issue("broadcast", group, None, label=f"object from {src}", blocking=True)
    box = [obj]
    with tracing.span("broadcast_object", "comm", src=src, **rec.meta()):
        # NCCL moves the pickled bytes through a tensor on the current CUDA device; gloo through a CPU one.
        device = torch.device("cuda", torch.cuda.current_device()) if CONTEXT.backend(group) == "nccl" else None
        dist.broadcast_object_list(box, src=src, group=group.pg, device=device)  # returns when it has arrived
        CONTEXT.flight.done(rec)
        hold(due)
    return box[0]


def barrier(group: Group) -> None:
    """Wait until every member of `group` has reached this barrier."""
    if group.size == 1:
        return
    _blocking("barrier", group, None, lambda: dist.barrier(group=group.pg, async_op=True))


# -- point to point ----------------------------------------------------------------------------------------
@dataclass
class P2P:
    """One op of a `batch_isend_irecv` group."""

    op: str  # send | recv
    tensor: torch.Tensor
    peer: int  # global rank
    group: Group
    tag: int = 0


def _issue(op: str, t: torch.Tensor, peer: int, group: Group, tag: int) -> Any:
    fn = dist.isend if op == "send" else dist.irecv
    return fn(t, peer, group=group.pg, tag=tag)


def _p2p(op: str, t: torch.Tensor, peer: int, group: Group, tag: int) -> Handle:
    """Issue a send or receive: at once natively; a late send (an interceptor's wire) through its stream's wire,
    in order, while the sender goes on; under a strict mode through the strict mode's streams."""
    rec, due = CONTEXT.issue(op, group, t, peer=peer, tag=tag)
    sp = tracing.open_span(op, "comm", **rec.meta())
    strict = CONTEXT.strict
    wired = op == "send" and (due > 0 or CONTEXT.wired(group, peer))  # once late, a stream stays in order
    if strict is None and not wired:
        return Handle(_issue(op, t, peer, group, tag), sp, keep=t, nccl=CONTEXT.backend(group) == "nccl", op=rec)
    h = Handle(None, sp, keep=t, driven=True, op=rec)
    h.desc = f"{op} {'to' if op == 'send' else 'from'} rank {peer} (group {group.name}, #{rec.seq})"
    if strict is None:
        CONTEXT.wire(group, peer).put(due, lambda: [_issue(op, t, peer, group, tag)], h.finish)
        return h

    def issue() -> list:
        hold(due)
        return [_issue(op, t, peer, group, 0)]  # NCCL ignores tags: match by order

    strict.first_use(group.name, group.ranks, peer, h.desc)  # nccl-lazy: blocks the host, as NCCL does
    strict.submit([(CONTEXT.stream(group), peer)], op, h.desc, issue, h.finish)
    return h


def isend(t: torch.Tensor, dst: int, group: Group, tag: int = 0) -> Handle:
    """Asynchronous send to global rank `dst`."""
    return _p2p("send", t.contiguous(), dst, group, tag)


def irecv(t: torch.Tensor, src: int, group: Group, tag: int = 0) -> Handle:
    """Asynchronous receive into `t` from global rank `src`."""
    return _p2p("recv", t, src, group, tag)


def send(t: torch.Tensor, dst: int, group: Group, tag: int = 0) -> None:
    """Send to global rank `dst` and wait until it has left."""
    isend(t, dst, group, tag).wait()


def recv(t: torch.Tensor, src: int, group: Group, tag: int = 0) -> torch.Tensor:
    """Receive into `t` from global rank `src`."""
    irecv(t, src, group, tag).wait()
    return t


def batch_isend_irecv(ops: Sequence[P2P]) -> list[Handle]:
    """Issue P2P ops as one group (NCCL group call): ops in a group do not wait for each other. A grouped send
    is not put on a modelled wire (an interceptor's delay for it is not applied)."""
    recs = [CONTEXT.issue(o.op, o.group, o.tensor, peer=o.peer, tag=o.tag)[0] for o in ops]
    spans = [tracing.open_span(o.op, "comm", **r.meta()) for o, r in zip(ops, recs)]
    tensors = [o.tensor.contiguous() if o.op == "send" else o.tensor for o in ops]
    strict = CONTEXT.strict
    if strict is None:
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend if o.op == "send" else dist.irecv, t, o.peer,
                                                   o.group.pg, o.tag) for o, t in zip(ops, tensors)])
        nccl = CONTEXT.backend(ops[0].group) == "nccl"
        return [Handle(w, sp, keep=t, nccl=nccl, op=r) for w, sp, t, r in zip(works, spans, tensors, recs)]
    handles = [Handle(None, sp, keep=t, driven=True, op=r) for sp, t, r in zip(spans, tensors, recs)]

    def done(err: BaseException | None) -> None:
        for h in handles:
            h.finish(err)

    what = f"group of {len(ops)} P2P ops with ranks {sorted({o.peer for o in ops})}"
    for g in {o.group.name: o.group for o in ops}.values():  # grouped calls use the group's communicator
        strict.first_use(g.name, g.ranks, None, what)
    streams = sorted({(CONTEXT.stream(o.group), o.peer) for o in ops})
    strict.submit(streams, "group", what,
                  lambda: [_issue(o.op, t, o.peer, o.group, 0) for o, t in zip(ops, tensors)], done)
    return handles


def warm_up_link(group: Group, src: int, dst: int) -> None:
    """One tiny message from `src` to `dst` on a pipeline link at start-up, outside the op records (traces and
    sequence numbers start with the first real message): on NCCL without device_id this creates the link's
    2-rank communicator now, in the order every rank follows, not when a schedule first uses it."""
    me = dist.get_rank()
    peer = dst if me == src else src
    if CONTEXT.strict is not None:
        CONTEXT.strict.first_use(group.name, group.ranks, peer, f"warm-up of link {group.name} {src}->{dst}")
    device = torch.device("cuda", torch.cuda.current_device()) if CONTEXT.backend(group) == "nccl" else None
    t = torch.zeros(1, device=device)
    (dist.send if me == src else dist.recv)(t, peer, group=group.pg)
