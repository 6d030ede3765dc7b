"""Start-up model: key-value store operations, round trips and wall time of creating a job's process groups.

MegaScale (NSDI'24, section 3.5) cut a 2,048-GPU job's start-up from 1047 s to under 5 s: a faster store, and
process groups created in a fixed order without a barrier over the whole world after each one. This file counts
what each rank asks of the store (the c10d TCPStore that `init_process_group` gets) under two schemes:

- **naive**: every rank calls `new_group` for every group of the job in one global order, and each call ends in
  torch's store-based barrier over the *world* (the default of torch < 2.1, `TORCH_DIST_INIT_BARRIER=1` today,
  what Megatron-LM's initialisation did at MegaScale's time). G groups x a W-rank barrier: O(W^2) store work.
- **ordered**: the engine's `topology.build`: a rank creates only its own groups
  (`use_local_synchronization=True`), in a fixed order, and only the members rendezvous: O(W) store work.

Per communicator the backend's own rendezvous goes through the store as well:
- gloo (what runs here, validated against counts measured by `benchmarks/bench_startup.py`): every member sets
  its address and waits for and reads every member's, itself included: 1 set + n wait + n get.
- nccl (MegaScale's case; from torch's ProcessGroupNCCL, not measured here): group rank 0 sets the unique id,
  every other member gets it: 1 op each. Its socket bootstrap afterwards is not store traffic and is left out.

Requests and round trips per operation follow TCPStore's client: a get is two requests (it waits for the key,
then reads it); a set is one request the client does not wait for (no reply: 0 round trips, 1.7 us measured
against 14 us for an add); add, wait, check: one each. Time: a phase whose ranks make at most R round trips and
send the server S requests in all takes max(R x latency, S x service time): the clients' own latency, or the
single server's queue, whichever binds.
Left out: the store's own connection handshake, CUDA context creation, NCCL's communicator set-up (its bootstrap
all-gather over sockets, and the first collective), gloo's TCP connections between peers, imports, model build.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

REQUESTS = {"set": 1, "add": 1, "wait": 1, "check": 1, "compare_set": 1, "get": 2}
ROUND_TRIPS = {**REQUESTS, "set": 0}  # a set is sent without waiting for a reply
SCHEMES = ("naive", "ordered")
BACKENDS = ("gloo", "nccl")


@dataclass(frozen=True)
class GroupKind:
    """`count` disjoint groups of `size` ranks each (covering the world, but for the tied-embedding groups)."""

    name: str
    count: int
    size: int
    per_rank: int = 1  # groups of the kind each covered rank is in (the pipeline links: 4)


def group_kinds(tp: int, pp: int, dp: int) -> list[GroupKind]:
    """The groups of a (tp, pp, dp) layout with more than one member, in the engine's creation order."""
    w = tp * pp * dp
    kinds = [GroupKind(name, w // n, n) for name, n in (("tp", tp), ("pp", pp), ("dp", dp)) if n > 1]
    if pp > 1:
        kinds.append(GroupKind("embd", w // pp, 2))  # first and last stage of each (dp, tp) column
        # pipeline links: per column, per ring edge, one 2-rank group each way (activations, gradients)
        kinds.append(GroupKind("pp.link", 2 * w, 2, per_rank=4))
    return kinds


def communicators_per_rank(tp: int, pp: int, dp: int) -> dict[str, int]:
    """NCCL communicators one (end-stage) rank holds, by group kind: one per multi-member group it is in. The
    pipeline's 4 links are 2-rank groups with one sender and one receiver each: 4 communicators under eager init
    (the group's own) and under lazy init (its one pair), made at start-up. Before them (issue 22) the four
    channel groups spanned the column: 4 pp-rank communicators under eager init, and under lazy init up to 8
    2-rank pair communicators (each channel with both neighbours), made at first use."""
    out = {name: 1 for name, n in (("tp", tp), ("pp", pp), ("dp", dp)) if n > 1}
    if pp > 1:
        out["embd"] = 1
        out["pp.link"] = 4
    return out


def layout_groups(tp: int, pp: int, dp: int) -> list[tuple[str, tuple[int, ...]]]:
    """Every multi-member group of the layout with its ranks, in one global order (the naive scheme's)."""
    from megatronapp.parallel.topology import Topology

    shape = Topology(tp, pp, dp, 0)
    of = {"tp": shape.tp_ranks, "pp": shape.pp_ranks, "dp": shape.dp_ranks, "embd": shape.embedding_ranks}
    out = []
    for kind in group_kinds(tp, pp, dp):
        if kind.name == "pp.link":  # created in the links' round order (topology.make_links)
            out += [(kind.name, tuple(sorted((a, b)))) for rnd in shape.link_rounds() for _, a, b in rnd]
            continue
        groups = sorted({of[kind.name](r) for r in range(shape.world_size)})
        out += [(kind.name, g) for g in groups if len(g) > 1]
    return out


@dataclass
class StoreOps:
    """Operations one rank (or a server, summed) sees; `barriers` of them may add one `set` (see below)."""

    ops: Counter = field(default_factory=Counter)
    barriers: int = 0  # store-based barriers: the rank that finds the count full also sets a key (1 to W ranks)

    def __iadd__(self, other: StoreOps) -> StoreOps:
        self.ops.update(other.ops)
        self.barriers += other.barriers
        return self

    @property
    def total(self) -> int:
        return sum(self.ops.values())

    @property
    def requests(self) -> int:
        return sum(REQUESTS[k] * v for k, v in self.ops.items())

    @property
    def round_trips(self) -> int:
        return sum(ROUND_TRIPS[k] * v for k, v in self.ops.items())


def rendezvous_ops(backend: str, size: int, group_rank: int) -> StoreOps:
    """One member's store operations while a communicator of `size` ranks is created."""
    if backend == "gloo":
        return StoreOps(Counter(set=1, wait=size, get=size))
    if backend == "nccl":
        return StoreOps(Counter(set=1) if group_rank == 0 else Counter(get=1))
    raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")


def barrier_ops() -> StoreOps:
    """torch's `_store_based_barrier`: add 1, read the count (add 0), wait for the last-worker key.

    The rank(s) that read a full count also set that key; which do is a race, so it is kept apart (`barriers`)."""
    return StoreOps(Counter(add=2, wait=1), barriers=1)


def _check(scheme: str, backend: str) -> None:
    if scheme not in SCHEMES:
        raise ValueError(f"scheme must be one of {SCHEMES}, got {scheme!r}")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")


def engine_groups(rank: int, tp: int, pp: int, dp: int) -> list[tuple[int, ...]]:
    """The groups `topology.build` creates on `rank` (their ranks), in its order."""
    from megatronapp.parallel.topology import Topology

    topo = Topology(tp, pp, dp, rank)
    out = [m for m in (topo.tp_ranks(rank), topo.pp_ranks(rank), topo.dp_ranks(rank)) if len(m) > 1]
    embd = topo.embedding_ranks(rank)
    if len(embd) > 1 or pp > 2:  # a middle stage makes a one-member group so every rank makes as many groups
        out.append(embd)
    for links in topo.link_rounds():  # the pipeline links; a round off every edge: two one-member groups
        mine = [tuple(sorted((a, b))) for _, a, b in links if rank in (a, b)]
        out += mine + [(rank,)] * (2 - len(mine))
    return out


def rank_ops(scheme: str, backend: str, rank: int, tp: int, pp: int, dp: int, init_barrier: bool = False
             ) -> dict[str, StoreOps]:
    """One rank's store operations: `init` (the default group) and `groups` (creating the layout's groups)."""
    _check(scheme, backend)
    w = tp * pp * dp
    init = rendezvous_ops(backend, w, rank)
    if init_barrier or scheme == "naive":
        init += barrier_ops()
    groups = StoreOps()
    if scheme == "ordered":
        for m in engine_groups(rank, tp, pp, dp):
            groups += rendezvous_ops(backend, len(m), m.index(rank))
    else:
        for _, m in layout_groups(tp, pp, dp):
            if rank in m:
                groups += rendezvous_ops(backend, len(m), m.index(rank))
            groups += barrier_ops()
    return {"init": init, "groups": groups}


def _kind_server(backend: str, kind: GroupKind) -> tuple[int, int]:
    """(server requests, most round trips of one member) for creating all groups of one kind."""
    if backend == "gloo":  # per member: a set (1 request, no reply), n waits, n gets (2 requests each)
        return kind.count * kind.size * (1 + 3 * kind.size), 3 * kind.size
    return kind.count * (1 + 2 * (kind.size - 1)), 2  # group rank 0 sets the unique id, the others get it


def startup_time(scheme: str, backend: str, tp: int, pp: int, dp: int, latency_s: float, service_s: float
                 ) -> dict[str, float]:
    """Modelled seconds and server requests of creating the default group and the layout's groups.

    Uses counts per group kind (all groups of a kind have one size), so it is cheap at 12,288 ranks."""
    _check(scheme, backend)
    w = tp * pp * dp
    world = GroupKind("world", 1, w)
    s_init, r_init = _kind_server(backend, world)
    t_init = max(r_init * latency_s, s_init * service_s)
    kinds = group_kinds(tp, pp, dp)
    barrier_requests = 3 * w + 1  # W adds, W reads, W waits answered, one last-worker set
    if scheme == "naive":
        # The world barrier after each group serialises the groups: one phase per group, every rank in it.
        t_init += max(3 * latency_s, barrier_requests * service_s)
        t_groups, s_groups = 0.0, 0
        for k in kinds:
            s_k, r_k = _kind_server(backend, k)
            per_group = s_k / k.count + barrier_requests
            t_groups += k.count * max((r_k + 3) * latency_s, per_group * service_s)
            s_groups += k.count * per_group
        s_init += barrier_requests
    else:
        # Groups are independent: each rank walks its own few in order while the server serves everyone.
        s_groups, r_rank = 0, 0
        for k in kinds:
            s_k, r_k = _kind_server(backend, k)
            s_groups += s_k
            r_rank += r_k * k.per_rank
        # one-member groups: middle stages' tied-embedding ones; with an odd pp, those that keep link rounds
        # in step (2 per column in each of the two even rounds, 2 per middle stage in the wrap-around round)
        ones = w // pp * ((pp - 2 if pp > 2 else 0) + (2 * pp if pp % 2 and pp > 1 else 0))
        if ones:
            s_one, r_one = _kind_server(backend, GroupKind("one", ones, 1))
            s_groups += s_one
            r_rank += r_one * (1 + (2 if pp % 2 else 0))  # at most one embedding and two link fillers a rank
        t_groups = max(r_rank * latency_s, s_groups * service_s)
    return {"world": w, "groups": sum(k.count for k in kinds), "init_s": t_init, "groups_s": t_groups,
            "total_s": t_init + t_groups, "server_requests": int(s_init + s_groups)}
