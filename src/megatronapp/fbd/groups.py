"""Process groups of a MegaFBD job, created by every rank in one order.

The engine's `topology.build` creates groups with local synchronisation, whose names depend on how many groups
each member made before; backward and forward ranks make different groups, so here every group is made with
`new_group` over the whole world (a collective of all ranks, in the same order everywhere), which names groups
by a counter that is then equal on all ranks. A rank outside a group gets a `Group` without a process group.

Groups, in creation order: the backward layout's (TP, PP, DP, tied embedding, its pipeline links: a 2-rank
group per (kind, neighbour pair, direction) as the engine makes them, warmed up at start-up; "world" = all
backward ranks), then per forward instance its TP groups and its forward-chain channel, then the `fbd.act` links
(forward -> backward stage inputs) and the `fbd.weights` links (backward -> forward weights), then `fbd.job`
(every rank, collectives only: plug-ins' view of the whole job).

Every P2P group is a 2-rank link with one sender and one receiver, warmed up at start-up in creation order. Under
eager NCCL init (one communicator and one stream per group) a rank's ops on a group complete in issue order: on
one `fbd.act` group shared by all ranks, a backward rank's receive posted for forward rank A would hold up its
receive from B, while A's send to another backward rank held up A's next one; two such orders can wait on each
other. A link per (sender, receiver) pair leaves each stream one sender and one receiver that issue its messages
in the same order (docs/megafbd.md). Lazily made pair communicators are all created by the warm-up, in one
global order, before any step.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from megatronapp.fbd.layout import FbdLayout
from megatronapp.parallel import comm
from megatronapp.parallel.topology import Group, Topology, make_links


class PairLinks:
    """This rank's links of one kind of one-way traffic: a 2-rank group per peer it sends to or receives from."""

    def __init__(self, name: str, by_peer: dict[int, Group] | None = None):
        self.name, self.by_peer = name, dict(by_peer or {})

    @classmethod
    def single(cls, group: Group, peer: int) -> PairLinks:
        return cls(group.name, {peer: group})

    def __call__(self, peer: int) -> Group:
        g = self.by_peer.get(peer)
        if g is None:
            raise RuntimeError(f"{self.name}: this rank has no link to rank {peer}; the layout plans its traffic "
                               f"with {sorted(self.by_peer)} only")
        return g


@dataclass
class FbdGroups:
    topo: Topology | None  # backward ranks: the engine topology of the backward layout
    forward_tp: Group | None  # forward ranks: TP group of this forward stage
    forward_chain: Group | None  # forward ranks: previous forward stage -> this one, this TP column (a 2-rank link)
    act: PairLinks  # forward -> backward stage inputs, a link per (forward rank, backward rank) of the plan
    weights: PairLinks  # backward -> forward weights, a link per (backward rank, forward rank) of the plan
    job: Group  # every rank of the job, collectives only: the tracer's clock handshake (plug-ins' "world")
    forward_next: Group | None = None  # forward ranks: this forward stage -> the next one (a 2-rank link)


class _Maker:
    """Make groups in a fixed order on every rank; keep the ones this rank belongs to."""

    def __init__(self, rank: int):
        self.rank, self.on = rank, dist.is_available() and dist.is_initialized()

    def make(self, name: str, ranks: list[int] | tuple[int, ...]) -> Group | None:
        ranks = tuple(sorted(ranks))
        pg = dist.new_group(list(ranks)) if self.on and len(ranks) > 1 else None
        if self.rank not in ranks:
            return None
        return Group(name, ranks, pg)


def _pair_links(mk: _Maker, name: str, pairs: set[tuple[int, int]], rank: int) -> PairLinks:
    """One 2-rank group per (sender, receiver) pair, made in sorted order by every rank, then warmed up in that
    order by their members (each member meets its peer at their common pair; the first pair not yet warmed in the
    global order has both members at it, so the warm-up cannot wait in a circle)."""
    links, mine = PairLinks(name), []
    for src, dst in sorted(pairs):
        g = mk.make(name, (src, dst))
        if g is not None:
            links.by_peer[dst if rank == src else src] = g
            mine.append((g, src, dst))
    if mk.on:
        for g, src, dst in mine:
            comm.warm_up_link(g, src, dst)
    return links


def build(layout: FbdLayout, rank: int, weight_pairs: set[tuple[int, int]]) -> FbdGroups:
    """Create every group of the job (collective over the world: all ranks call this, extra ranks included).
    `weight_pairs`: the (backward rank, forward rank) pairs of the weight plan (`layout.weight_plan`)."""
    mk = _Maker(rank)
    topo = Topology(layout.tp, layout.pp, layout.dp, rank) if rank < layout.backward_world else None
    shape = Topology(layout.tp, layout.pp, layout.dp, 0)  # only for the rank lists of each group
    wb = layout.backward_world
    kinds = [("tp", shape.tp_ranks), ("pp", shape.pp_ranks), ("dp", shape.dp_ranks), ("embd", shape.embedding_ranks)]
    for name, ranks_of in kinds:
        for ranks in sorted({ranks_of(r) for r in range(wb)}):
            g = mk.make(name, ranks)
            if g is not None and topo is not None:
                topo.groups[name] = g
    # every rank makes every link (whole-world new_group); forward ranks are on none of them
    links = topo or Topology(layout.tp, layout.pp, layout.dp, rank)
    make_links(links, lambda ranks: dist.new_group(list(ranks)) if mk.on else None, warm=mk.on, every_rank=True)
    g = mk.make("world", range(wb))
    if topo is not None:
        topo.groups["world"] = g
    forward_tp = forward_chain = forward_next = None
    for k in range(layout.n_f):
        for s in range(layout.pp_f):
            g = mk.make("fbd.fwd.tp", [layout.forward_rank(k, s, t) for t in range(layout.tp_f)])
            forward_tp = g or forward_tp
        for t in range(layout.tp_f):
            # one 2-rank group per chain link: under eager NCCL init a stage receiving and sending on one group
            # would queue its send behind its receive (see topology.make_links); lazily made, they are warmed
            # up below in this same order
            for s in range(layout.pp_f - 1):
                a, b = layout.forward_rank(k, s, t), layout.forward_rank(k, s + 1, t)
                g = mk.make("fbd.fwd.chain", [a, b])
                if g is not None:
                    if rank == b:
                        forward_chain = g
                    else:
                        forward_next = g
                    if mk.on:
                        comm.warm_up_link(g, a, b)
    act_pairs = {(f, dst) for f in range(layout.backward_world, layout.total) for dst, _ in layout.forward_sends(f)}
    act = _pair_links(mk, "fbd.act", act_pairs, rank)
    weights = _pair_links(mk, "fbd.weights", weight_pairs, rank)
    everyone = range(layout.total)
    job = mk.make("fbd.job", everyone) or Group("fbd.job", tuple(everyone))
    return FbdGroups(topo, forward_tp, forward_chain, act, weights, job, forward_next)
