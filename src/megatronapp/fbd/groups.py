"""Process groups of a MegaFBD job, created by every rank in one order.

The engine's `topology.build` creates groups with local synchronisation, whose names depend on how many groups
each member made before; backward and forward ranks make different groups, so here every group is made with
`new_group` over the whole world (a collective of all ranks, in the same order everywhere), which names groups
by a counter that is then equal on all ranks. A rank outside a group gets a `Group` without a process group.

Groups, in creation order: the backward layout's (TP, PP, DP, tied embedding, its pipeline links: a 2-rank
group per (kind, neighbour pair, direction) as the engine makes them, warmed up at start-up; "world" = all
backward ranks), then per forward instance its TP groups and its forward-chain channel, then
`fbd.act` (forward -> backward stage inputs), `fbd.weights` (backward -> forward weights) and `fbd.job` (every
rank, collectives only: plug-ins' view of the whole job). Each P2P group carries traffic one way only, so
under NCCL's rules a posted receive never blocks a send (docs/megafbd.md).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from megatronapp.fbd.layout import FbdLayout
from megatronapp.parallel import comm
from megatronapp.parallel.topology import Group, Topology, make_links


@dataclass
class FbdGroups:
    topo: Topology | None  # backward ranks: the engine topology of the backward layout
    forward_tp: Group | None  # forward ranks: TP group of this forward stage
    forward_chain: Group | None  # forward ranks: previous forward stage -> this one, this TP column (a 2-rank link)
    act: Group  # forward -> backward stage inputs (all ranks of the job)
    weights: Group  # backward -> forward weights (all ranks of the job)
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


def build(layout: FbdLayout, rank: int) -> FbdGroups:
    """Create every group of the job (collective over the world: all ranks call this, extra ranks included)."""
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
                    comm.warm_up_link(g, a, b)
    everyone = range(layout.total)
    act = mk.make("fbd.act", everyone) or Group("fbd.act", tuple(everyone))
    weights = mk.make("fbd.weights", everyone) or Group("fbd.weights", tuple(everyone))
    job = mk.make("fbd.job", everyone) or Group("fbd.job", tuple(everyone))
    return FbdGroups(topo, forward_tp, forward_chain, act, weights, job, forward_next)
