"""MegaScan for any PyTorch job: trace torch.distributed calls and chosen modules without our engine.

    from megatronapp import scan
    scan.instrument("trace/")            # after init_process_group, before the training loop
    for batch in data:
        with scan.step():                # one iteration
            ...
    scan.uninstrument()

The collectives and point-to-point calls of the `torch.distributed` namespace are replaced by wrappers that
record comm spans with per-group sequence numbers (so instances match across ranks) and then call the original.
Code that imported a function by name before `instrument()` keeps the unwrapped one.
"""
from __future__ import annotations

import contextlib
import inspect
import itertools
import threading
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megatronapp import tracing
from megatronapp.parallel.topology import Group
from megatronapp.scan.read.format import rank_file
from megatronapp.scan.record.tracer import Tracer, base_header, handshake

# Every c10d collective of the `torch.distributed` namespace that moves tensors (FSDP2 calls the `*_single` names).
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single", "reduce_scatter",
               "reduce_scatter_tensor", "reduce_scatter_single", "all_to_all", "all_to_all_single", "reduce",
               "gather", "scatter", "broadcast", "all_reduce_coalesced", "all_gather_coalesced", "barrier")
P2P = ("send", "recv", "isend", "irecv")


class _State:
    def __init__(self, tracer: Tracer):
        self.tracer = tracer
        self.originals: dict[str, Any] = {}
        self.hooks: list[Any] = []
        self.seq: dict[tuple, itertools.count] = {}
        self.lock = threading.Lock()
        self.groups: dict[int, tuple[str, tuple[int, ...]]] = {}
        self.iteration = 0
        self.funcol_originals: dict[str, Any] = {}
        self.funcol_pending: dict[int, tuple[Any, Any]] = {}
        self.in_funcol = threading.local()
        self.in_funcol.active = False

    def next_seq(self, key: tuple) -> int:
        with self.lock:
            return next(self.seq.setdefault(key, itertools.count()))

    def group(self, pg: Any) -> tuple[str, tuple[int, ...]]:
        """(name, global ranks) of a process group; the name is the same on every member."""
        pg = pg if pg is not None else dist.group.WORLD
        info = self.groups.get(id(pg))
        if info is None:
            ranks = tuple(sorted(dist.get_process_group_ranks(pg)))
            name = "world" if pg is dist.group.WORLD else f"pg{getattr(pg, 'group_name', '') or len(self.groups)}"
            info = self.groups[id(pg)] = (name, ranks)
        return info


_state: _State | None = None


def _nbytes(x: Any) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(y) for y in x)
    return 0


class _TracedWork:
    """An async work handle whose span ends when it is waited on; everything else is the real handle's."""

    def __init__(self, work: Any, spans: list[Any]):
        self._work, self._spans = work, spans

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        out = self._work.wait(*args, **kwargs)
        spans, self._spans = self._spans, []
        for sp in spans:
            tracing.close_span(sp)
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


def _closed_on_completion(work: Any, spans: list[Any]) -> Any:
    """The real Work, its spans closed by a completion callback; a wrapper only where the backend has no future.

    Callers that type-check the handle (FSDP2 waits on `dist.Work` instances and skips anything else) must get
    the backend's own object, or they may read a buffer before the collective finished."""
    try:
        fut = work.get_future()
    except (AttributeError, RuntimeError):  # gloo P2P works have no future
        return _TracedWork(work, spans)

    def done(_f: Any) -> None:
        for sp in spans:
            tracing.close_span(sp)
    fut.add_done_callback(done)
    return work


def _collective(name: str, orig: Any) -> Any:
    sig = inspect.signature(orig)
    tensor_arg = next(iter(sig.parameters))

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        st = _state
        if st is None or not tracing.enabled():
            return orig(*args, **kwargs)
        a = sig.bind(*args, **kwargs).arguments
        gname, ranks = st.group(a.get("group"))
        if dist.get_rank() not in ranks:
            return orig(*args, **kwargs)
        meta = {"group": gname, "group_ranks": list(ranks), "seq": st.next_seq((gname, ranks)),
                "bytes": _nbytes(a.get(tensor_arg)) if name != "barrier" else 0, "peer": None}
        if a.get("async_op"):
            sp = tracing.open_span(name, "comm", **meta)
            return _closed_on_completion(orig(*args, **kwargs), [sp])
        with tracing.span(name, "comm", **meta):
            return orig(*args, **kwargs)

    wrapper._megascan_original = orig  # type: ignore[attr-defined]
    return wrapper


def _peer(a: dict, direct: str, in_group: str) -> int | None:
    if a.get(direct) is not None:
        return int(a[direct])
    if a.get(in_group) is not None:
        return dist.get_global_rank(a.get("group") or dist.group.WORLD, a[in_group])
    return None


def _p2p(name: str, orig: Any) -> Any:
    sig = inspect.signature(orig)
    sending = "send" in name

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        st = _state
        if st is None or not tracing.enabled():
            return orig(*args, **kwargs)
        a = sig.bind(*args, **kwargs).arguments
        gname, ranks = st.group(a.get("group"))
        peer = _peer(a, "dst", "group_dst") if sending else _peer(a, "src", "group_src")
        me = dist.get_rank()
        meta = {"group": gname, "group_ranks": list(ranks), "bytes": _nbytes(a.get("tensor")), "peer": peer,
                "seq": -1, "tag": a.get("tag", 0)}
        if peer is not None:
            meta["seq"] = st.next_seq((gname, "p2p", me, peer) if sending else (gname, "p2p", peer, me))
        op = "send" if sending else "recv"
        if name in ("isend", "irecv"):
            sp = tracing.open_span(op, "comm", **meta)
            return _TracedWork(orig(*args, **kwargs), [sp])
        sp = tracing.open_span(op, "comm", **meta)
        try:
            out = orig(*args, **kwargs)
        finally:
            if sp is not None and peer is None and isinstance(out, int) and out >= 0:
                # recv from any source: the sender is known only now; sinks hold this span's meta dict.
                sp.meta.update(peer=out, seq=st.next_seq((gname, "p2p", out, me)))
            tracing.close_span(sp)
        return out

    wrapper._megascan_original = orig  # type: ignore[attr-defined]
    return wrapper


def _batch(orig: Any) -> Any:
    def wrapper(p2p_op_list: list) -> Any:
        st = _state
        if st is None or not tracing.enabled():
            return orig(p2p_op_list)
        me, spans = dist.get_rank(), []
        for p in p2p_op_list:
            sending = p.op is st.originals["isend"]
            gname, ranks = st.group(p.group)
            key = (gname, "p2p", me, p.peer) if sending else (gname, "p2p", p.peer, me)
            spans.append(tracing.open_span("send" if sending else "recv", "comm", group=gname,
                                           group_ranks=list(ranks), seq=st.next_seq(key), bytes=_nbytes(p.tensor),
                                           peer=p.peer, tag=p.tag))
        works = orig(p2p_op_list)
        if len(works) == len(spans):
            return [_TracedWork(w, [s]) for w, s in zip(works, spans)]
        # Coalesced backends return fewer handles: the first one waited on ends every span.
        return [_TracedWork(w, spans if i == 0 else []) for i, w in enumerate(works)]

    wrapper._megascan_original = orig  # type: ignore[attr-defined]
    return wrapper


# Functional collectives (torch.distributed._functional_collectives: DTensor, tensor parallel, compiled code in
# eager) return a tensor whose data is ready after `wait_tensor`; a span runs from issue to that wait.
FUNCTIONAL = ("all_reduce", "all_gather_single", "all_gather_tensor", "reduce_scatter_single",
              "reduce_scatter_tensor", "all_to_all_single", "broadcast", "all_gather_tensor_autograd",
              "reduce_scatter_tensor_autograd", "all_to_all_single_autograd", "all_gather_single_autograd",
              "reduce_scatter_single_autograd")
_FUNCOL_PENDING_LIMIT = 4096  # outputs issued and not waited on yet (a job may never wait on some)


def _functional(name: str, orig: Any, funcol: Any) -> Any:
    group_pos = list(inspect.signature(orig).parameters).index("group")

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        st = _state
        if st is None or not tracing.enabled() or getattr(st.in_funcol, "active", False) \
                or torch.compiler.is_compiling():  # deprecated names call the new ones: one span, not two;
            return orig(*args, **kwargs)  # and a graph being compiled must not trace our Python side effects
        group = kwargs.get("group", args[group_pos] if len(args) > group_pos else None)
        try:
            from torch.distributed import distributed_c10d as c10d

            with warnings.catch_warnings():  # torch warns about ranks-list groups itself, in the call below
                warnings.simplefilter("ignore", FutureWarning)
                pg = c10d._resolve_process_group(funcol._resolve_group_name(group, kwargs.get("tag", "")))
        except Exception:  # noqa: BLE001 (a group form we cannot name: run untraced rather than fail the job)
            return orig(*args, **kwargs)
        gname, ranks = st.group(pg)
        sp = tracing.open_span(name.removesuffix("_autograd"), "comm", group=gname, group_ranks=list(ranks),
                               seq=st.next_seq((gname, ranks)), bytes=_nbytes(args[0] if args else None),
                               peer=None)
        st.in_funcol.active = True
        try:
            out = orig(*args, **kwargs)
        finally:
            st.in_funcol.active = False
        elem = getattr(out, "elem", None)
        if sp is not None and isinstance(out, funcol.AsyncCollectiveTensor) and not out.completed \
                and elem is not None:
            with st.lock:  # keyed by storage: the wait may come through a view of the output (ag[0].item())
                st.funcol_pending[elem.untyped_storage().data_ptr()] = (elem, sp)
                while len(st.funcol_pending) > _FUNCOL_PENDING_LIMIT:
                    st.funcol_pending.pop(next(iter(st.funcol_pending)))
        else:
            tracing.close_span(sp)  # already waited on (a plain tensor came back)
        return out

    wrapper._megascan_original = orig  # type: ignore[attr-defined]
    return wrapper


def _wait_tensor(orig: Any) -> Any:
    def wrapper(tensor: Any) -> Any:
        out = orig(tensor)
        st = _state
        if st is not None and st.funcol_pending and isinstance(tensor, torch.Tensor) \
                and not torch.compiler.is_compiling():
            with st.lock:
                entry = st.funcol_pending.pop(tensor.untyped_storage().data_ptr(), None)
            if entry is not None:
                tracing.close_span(entry[1])
        return out

    wrapper._megascan_original = orig  # type: ignore[attr-defined]
    return wrapper


def _unwrap(fn: Any) -> Any:
    return getattr(fn, "_megascan_original", fn)


def _module_hooks(st: _State, modules: Any, granularity: str) -> None:
    if modules is None:
        return
    named = modules.items() if isinstance(modules, dict) else (
        [("forward", modules)] if isinstance(modules, torch.nn.Module) else
        [("forward" if len(modules) == 1 else f"forward.{i}", m) for i, m in enumerate(modules)])
    for name, mod in named:
        targets = [(name, "compute", mod)]
        if granularity == "full":  # per-layer spans: direct children, list members one by one
            for cname, child in mod.named_children():
                if isinstance(child, torch.nn.ModuleList):
                    targets += [(f"{cname}.{i}", "layer", sub) for i, sub in enumerate(child)]
                else:
                    targets.append((cname, "layer", child))
        for sname, cat, m in targets:
            stack: list[Any] = []

            def pre(_m: Any, _inp: Any, sname: str = sname, cat: str = cat, stack: list = stack) -> None:
                stack.append(tracing.open_span(sname, cat))

            def post(_m: Any, _inp: Any, _out: Any, stack: list = stack) -> None:
                if stack:
                    tracing.close_span(stack.pop())

            st.hooks += [m.register_forward_pre_hook(pre), m.register_forward_hook(post)]
        # The backward of each traced module as a compute span of its own ("backward", or "backward.NAME" for
        # "forward.NAME"): a second kind of op lets detection tell a slow rank (every kind slower) from a rank
        # the machine happened to delay (one kind). It opens when the module's output gradient is ready and
        # closes when autograd finishes the backward pass (a callback queued on the engine, as DDP and FSDP do):
        # a module-level "backward done" hook fires at once when the module's inputs need no gradient.
        bname = "backward" + name[len("forward"):] if name.startswith("forward") else f"{name}.backward"

        def bpre(_m: Any, _g: Any, bname: str = bname) -> None:
            sp = tracing.open_span(bname, "compute")
            if sp is not None:
                torch.autograd.Variable._execution_engine.queue_callback(lambda: tracing.close_span(sp))

        st.hooks.append(mod.register_full_backward_pre_hook(bpre))


_DIM_ALIASES = {"dp": ("dp", "data", "replicate", "shard", "fsdp", "dp_shard", "dp_replicate"),
                "pp": ("pp", "pipe", "pipeline"), "tp": ("tp", "tensor", "model")}


def coordinates(mesh: Any = None, dp: int | None = None, pp: int | None = None, tp: int | None = None,
                sizes: tuple[int, int, int] | None = None) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """This rank's ((dp, pp, tp) coordinate, (tp, pp, dp) sizes) from a DeviceMesh or explicit ranks.

    Peers are the ranks of the same pipeline stage, so a job with stages must say which stage each rank is;
    without anything every rank is a data-parallel replica of one stage (plain DDP / FSDP)."""
    world = dist.get_world_size()
    if mesh is not None:
        names = tuple(mesh.mesh_dim_names or ())
        found: dict[str, tuple[int, int]] = {}
        for i, n in enumerate(names):
            for axis, aliases in _DIM_ALIASES.items():
                if n.lower() in aliases:
                    lr, sz = mesh.get_local_rank(i), mesh.size(i)
                    prev = found.get(axis, (0, 1))  # several data dims (HSDP): one flattened dp coordinate
                    found[axis] = (prev[0] * sz + lr, prev[1] * sz)
        if len(found) == 0:
            raise ValueError(f"instrument(mesh=...): dimension names {names} name no dp/pp/tp axis; name them "
                             f"with one of {sum(_DIM_ALIASES.values(), ())}")
        c = {a: found.get(a, (0, 1)) for a in ("dp", "pp", "tp")}
        return (c["dp"][0], c["pp"][0], c["tp"][0]), (c["tp"][1], c["pp"][1], c["dp"][1])
    if dp is None and pp is None and tp is None:
        return (dist.get_rank(), 0, 0), (1, 1, world)
    tps, pps, dps = sizes if sizes is not None else (1, 1, world)
    return (dp or 0, pp or 0, tp or 0), (tps, pps, dps)


def instrument(trace_dir: str | Path, granularity: str = "coarse", modules: Any = None, *, interval: int = 1,
               iterations: int = 1, handshake_rounds: int = 5, mesh: Any = None, dp: int | None = None,
               pp: int | None = None, tp: int | None = None, sizes: tuple[int, int, int] | None = None) -> Tracer:
    """Start tracing this process's torch.distributed calls (and `modules`' forwards) into `trace_dir`.

    Coordinates: a DeviceMesh (`mesh`, dims named dp/pp/tp or data/pipe/tensor...) or this rank's `dp`, `pp`,
    `tp` with `sizes` = (tp, pp, dp); by default every rank is a DP replica of one stage."""
    global _state
    if _state is not None:
        raise RuntimeError("megatronapp.scan.instrument() is already active; call scan.uninstrument() first")
    if not dist.is_initialized():
        raise RuntimeError("megatronapp.scan.instrument() needs torch.distributed.init_process_group() first")
    rank, world = dist.get_rank(), dist.get_world_size()
    coord, topo = coordinates(mesh, dp, pp, tp, sizes)
    header = base_header(rank, world, coord, topo)
    header["instrumented"] = True
    if world > 1:
        header["handshake"] = handshake(Group("world", tuple(range(world)), dist.group.WORLD), handshake_rounds,
                                        cuda=dist.get_backend() == "nccl")
    tracer = Tracer(rank_file(trace_dir, rank), header, interval=interval, iterations=iterations,
                    granularity=granularity, cuda=dist.get_backend() == "nccl")
    st = _State(tracer)
    collectives = [n for n in COLLECTIVES if hasattr(dist, n)]  # names differ across torch versions
    for name in (*collectives, *P2P, "batch_isend_irecv", "P2POp"):
        st.originals[name] = getattr(dist, name)
    for name in collectives:
        setattr(dist, name, _collective(name, st.originals[name]))
    for name in P2P:
        setattr(dist, name, _p2p(name, st.originals[name]))
    dist.batch_isend_irecv = _batch(st.originals["batch_isend_irecv"])
    dist.P2POp = _traced_p2pop(st.originals["P2POp"])
    import torch.distributed._functional_collectives as funcol

    for name in (*(n for n in FUNCTIONAL if hasattr(funcol, n)), "wait_tensor"):
        st.funcol_originals[name] = getattr(funcol, name)
        setattr(funcol, name, _wait_tensor(funcol.wait_tensor) if name == "wait_tensor"
                else _functional(name, st.funcol_originals[name], funcol))
    _module_hooks(st, modules, granularity)
    _state = st
    tracing.install(tracer)
    return tracer


def trace_ddp(model: Any) -> None:
    """Trace a DDP model's gradient all-reduces: DDP issues them from C++, past the wrappers, unless a comm hook
    routes them through `dist.all_reduce` (PyTorch's own default all-reduce hook does, with the same result)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    model.register_comm_hook(None, default_hooks.allreduce_hook)


def _traced_p2pop(base: type) -> type:
    # torch checks `op in [isend, irecv]` against its own functions: hand it the originals behind our wrappers.
    class P2POp(base):  # type: ignore[misc, valid-type]
        def __new__(cls, op: Any, *args: Any, **kwargs: Any) -> Any:
            return base.__new__(cls, _unwrap(op), *args, **kwargs)

        def __init__(self, op: Any, *args: Any, **kwargs: Any) -> None:
            super().__init__(_unwrap(op), *args, **kwargs)

    return P2POp


@contextlib.contextmanager
def step() -> Iterator[int]:
    """Mark one iteration of the instrumented job; yields its number (0, 1, ...)."""
    st = _state
    if st is None:
        raise RuntimeError("megatronapp.scan.step() needs megatronapp.scan.instrument(...) first")
    it = st.iteration
    st.iteration += 1
    with tracing.step(it):
        yield it


def uninstrument() -> None:
    """Restore torch.distributed, remove module hooks, flush and close the trace file."""
    global _state
    st, _state = _state, None
    if st is None:
        return
    for name, fn in st.originals.items():
        setattr(dist, name, fn)
    import torch.distributed._functional_collectives as funcol

    for name, fn in st.funcol_originals.items():
        setattr(funcol, name, fn)
    for h in st.hooks:
        h.remove()
    st.tracer.close()

