"""Rank <-> (dp, pp, tp) grid and the process groups of each parallel dimension.

Layout follows Megatron: tp varies fastest, then dp, then pp, so TP peers share a node and PP crosses nodes.
Groups are created TP first, then PP, then DP, each with local synchronization: only the member ranks
rendezvous, with no global barrier per group (MegaScale's fast initialisation).

Pipeline links: one 2-rank group per (payload kind, neighbour pair, direction), so every communicator has one
sender and one receiver. That is what makes the pipeline correct in both NCCL regimes (docs/architecture.md):
with eager init (device_id) a group's ops share one stream, so a rank must never receive and send on one group;
with lazy init the first op of each (group, pair) creates a communicator and blocks until the peer's first op
there, so the links are created and warmed up at start-up in one global order on every rank, before any
schedule decides an order of first uses (group building sits above `comm`, which it warms links up through;
the `Group` type lives below it, in `group.py`). Each link keeps its channel's name (`pp.act.up`, ...: the direction
in rank order), so traces and sequence numbers read as before.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import torch.distributed as dist

from megatronapp.parallel import comm
from megatronapp.parallel.group import Group

CHANNELS = ("pp.act.up", "pp.act.down", "pp.grad.up", "pp.grad.down")
# "pairs": a 2-rank group per pipeline link (the design); "column": the four CHANNELS groups over the whole
# pipeline column, the layout before issue 22, kept so tests can show the strict modes catch its hangs.
LINKS = "pairs"


def channel_name(kind: str, src: int, dst: int) -> str:
    """The channel a message of `kind` from `src` to `dst` travels on: its direction in rank order."""
    return f"pp.{kind}.{'up' if src < dst else 'down'}"


@dataclass(frozen=True)
class Coord:
    dp: int
    pp: int
    tp: int

    def label(self) -> str:
        return f"DP{self.dp}-PP{self.pp}-TP{self.tp}"


def rank_of(c: Coord, tp: int, dp: int) -> int:
    """Global rank of a grid coordinate."""
    return c.tp + tp * (c.dp + dp * c.pp)


def coord_of(rank: int, tp: int, pp: int, dp: int) -> Coord:
    """Grid coordinate of a global rank."""
    if not 0 <= rank < tp * pp * dp:
        raise ValueError(f"rank {rank} outside a world of {tp * pp * dp}")
    return Coord(dp=(rank // tp) % dp, pp=rank // (tp * dp), tp=rank % tp)


@dataclass
class Topology:
    tp: int
    pp: int
    dp: int
    rank: int = 0
    groups: dict[str, Group] = field(default_factory=dict)
    links: dict[tuple[str, int, int], Group] = field(default_factory=dict)  # (kind, src, dst) -> 2-rank group

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    @cached_property
    def coord(self) -> Coord:
        return coord_of(self.rank, self.tp, self.pp, self.dp)

    def rank_at(self, dp: int, pp: int, tp: int) -> int:
        return rank_of(Coord(dp, pp, tp), self.tp, self.dp)

    def tp_ranks(self, rank: int) -> tuple[int, ...]:
        c = coord_of(rank, self.tp, self.pp, self.dp)
        return tuple(self.rank_at(c.dp, c.pp, t) for t in range(self.tp))

    def pp_ranks(self, rank: int) -> tuple[int, ...]:
        c = coord_of(rank, self.tp, self.pp, self.dp)
        return tuple(self.rank_at(c.dp, p, c.tp) for p in range(self.pp))

    def dp_ranks(self, rank: int) -> tuple[int, ...]:
        c = coord_of(rank, self.tp, self.pp, self.dp)
        return tuple(self.rank_at(d, c.pp, c.tp) for d in range(self.dp))

    def embedding_ranks(self, rank: int) -> tuple[int, ...]:
        """First and last pipeline stage of this rank's (dp, tp) column: they share tied embeddings.

        A middle stage is alone in its embedding group."""
        pr = self.pp_ranks(rank)
        if rank not in (pr[0], pr[-1]):
            return (rank,)
        return tuple(sorted({pr[0], pr[-1]}))

    # Named accessors for the groups of this rank.
    @property
    def tp_group(self) -> Group:
        return self.groups["tp"]

    @property
    def tp_control_group(self) -> Group:
        """Where TP peers agree on host-side decisions: the gloo `tp.ctl` group when made, else the TP group."""
        return self.groups.get("tp.ctl") or self.groups["tp"]

    @property
    def pp_group(self) -> Group:
        return self.groups["pp"]

    @property
    def dp_group(self) -> Group:
        return self.groups["dp"]

    @property
    def embedding_group(self) -> Group:
        return self.groups["embd"]

    def channel(self, kind: str, src: int, dst: int) -> Group:
        """The P2P group that carries `kind` ("act" or "grad") from global rank `src` to `dst`."""
        link = self.links.get((kind, src, dst))
        if link is not None:
            return link
        return self.groups[channel_name(kind, src, dst)]  # the whole-column layout (LINKS = "column")

    def link_rounds(self) -> list[list[tuple[str, int, int]]]:
        """Every pipeline link of the job, (kind, src, dst), in the order all ranks create them in: rounds in
        which each rank is on at most one neighbour edge (a ring edge colouring: even edges, odd edges, and for
        an odd pp the wrap-around edge alone). On an edge s -> s+1: activations s -> s+1, then gradients back."""
        pp = self.pp
        if pp == 1:
            return []
        colour = [(s % 2 if s < pp - 1 or pp % 2 == 0 else 2) for s in range(pp)]
        rounds: list[list[tuple[str, int, int]]] = [[] for _ in range(max(colour) + 1)]
        for dp in range(self.dp):
            for tp in range(self.tp):
                for s in range(pp):
                    a, b = self.rank_at(dp, s, tp), self.rank_at(dp, (s + 1) % pp, tp)
                    rounds[colour[s]] += [("act", a, b), ("grad", b, a)]
        return rounds

    def prev_rank(self) -> int | None:
        """Global rank of the previous pipeline stage (wrapping, for interleaved chunks)."""
        if self.pp == 1:
            return None
        c = self.coord
        return self.rank_at(c.dp, (c.pp - 1) % self.pp, c.tp)

    def next_rank(self) -> int | None:
        if self.pp == 1:
            return None
        c = self.coord
        return self.rank_at(c.dp, (c.pp + 1) % self.pp, c.tp)

    def describe(self) -> str:
        """A table of who is where, one line per rank."""
        lines = [f"world={self.world_size}  tp={self.tp} pp={self.pp} dp={self.dp}  (tp fastest, then dp, then pp)"]
        for r in range(self.world_size):
            c = coord_of(r, self.tp, self.pp, self.dp)
            lines.append(f"  rank {r:>4}  {c.label():<16} tp-group {list(self.tp_ranks(r))}  "
                         f"pp-group {list(self.pp_ranks(r))}  dp-group {list(self.dp_ranks(r))}")
        return "\n".join(lines)


def build(tp: int, pp: int, dp: int, rank: int | None = None, tp_control: bool = False,
          timeout: Any = None) -> Topology:
    """Create the topology and, when torch.distributed is initialised, this rank's process groups. `tp_control`:
    also a host-side (gloo) group of the TP peers, `tp.ctl`, for per-task decisions (MegaDPP with TP), when the TP
    group is NCCL's: an object broadcast over NCCL costs host-device synchronisations per task. `timeout` (a
    timedelta): the groups' timeout, their forming included (None: torch's default)."""
    initialized = dist.is_available() and dist.is_initialized()
    if rank is None:
        rank = dist.get_rank() if initialized else 0
    topo = Topology(tp=tp, pp=pp, dp=dp, rank=rank)
    if initialized and dist.get_world_size() != topo.world_size:
        raise ValueError(f"world size {dist.get_world_size()} != tp*pp*dp = {topo.world_size}")
    # Order matters for the rendezvous: TP, then PP, then DP, then the tied-embedding group.
    for name, ranks_of in (("tp", topo.tp_ranks), ("pp", topo.pp_ranks), ("dp", topo.dp_ranks),
                           ("embd", topo.embedding_ranks)):
        ranks = ranks_of(rank)
        pg = None
        # torch names a locally synchronised group by its ranks *and* the number of groups this process made
        # before, so every rank must make the same number of groups: a middle stage makes a one-member
        # tied-embedding group where the end stages make a two-member one.
        if initialized and (len(ranks) > 1 or (name == "embd" and topo.pp > 2)):
            pg = dist.new_group(list(ranks), use_local_synchronization=True, timeout=timeout)
        topo.groups[name] = Group(name, ranks, pg)
    tp_group = topo.groups["tp"]
    if tp_control and tp_group.pg is not None and dist.get_backend(tp_group.pg) == "nccl":
        # every rank makes it (each has TP peers), so the local-synchronisation group count stays equal
        topo.groups["tp.ctl"] = Group("tp.ctl", tp_group.ranks, dist.new_group(
            list(tp_group.ranks), backend="gloo", use_local_synchronization=True, timeout=timeout))
    if pp > 1 and LINKS == "column":
        ranks = topo.pp_ranks(rank)
        for name in CHANNELS:
            pg = dist.new_group(list(ranks), use_local_synchronization=True, timeout=timeout) if initialized else None
            topo.groups[name] = Group(name, ranks, pg)
    elif pp > 1:
        make_links(topo, lambda ranks: dist.new_group(list(ranks), use_local_synchronization=True, timeout=timeout)
                   if initialized else None, warm=initialized)
    topo.groups["world"] = Group("world", tuple(range(topo.world_size)), dist.group.WORLD if initialized else None)
    return topo


def adopt(topo: Topology, fresh: Topology) -> None:
    """Give `topo`'s groups the process groups of `fresh`, a topology of the same layout and rank built in a new
    generation (resilience's in-place recovery): every object holding one of `topo`'s `Group`s (layers, reducer,
    optimizer, pipeline links) then talks over the new generation's groups."""
    if (fresh.tp, fresh.pp, fresh.dp, fresh.rank) != (topo.tp, topo.pp, topo.dp, topo.rank) \
            or fresh.groups.keys() != topo.groups.keys() or fresh.links.keys() != topo.links.keys():
        raise ValueError("a new generation's topology must have this rank's layout and groups")
    for mine, new in [*((topo.groups[k], g) for k, g in fresh.groups.items()),
                      *((topo.links[k], g) for k, g in fresh.links.items())]:
        if mine.ranks != new.ranks:
            raise ValueError(f"group {mine.name}: members {new.ranks} in the new generation, {mine.ranks} before")
        mine.pg = new.pg


def make_links(topo: Topology, new_group: Callable[[tuple[int, ...]], Any], warm: bool,
               every_rank: bool = False) -> None:
    """Create this rank's pipeline links round by round, then warm each up (one tiny message) in the same order,
    so lazily created NCCL communicators are made before any schedule runs. torch names a locally synchronised
    group after its ranks and the number of groups its maker made before, so in a round where this rank is on
    no edge it makes two one-member groups, as its peers make their edge's two. `every_rank`: `new_group` is a
    collective of the whole world (MegaFBD makes every group on every rank)."""
    mine = []
    for links in topo.link_rounds():
        made = 0
        for kind, src, dst in links:
            ranks = tuple(sorted((src, dst)))
            member = topo.rank in ranks
            if not (member or every_rank):
                continue
            pg = new_group(ranks)
            if member:
                g = topo.links[(kind, src, dst)] = Group(channel_name(kind, src, dst), ranks, pg)
                mine.append((g, src, dst))
                made += 1
        for _ in range(0 if every_rank else 2 - made):
            new_group((topo.rank,))
    if warm:
        for g, src, dst in mine:
            comm.warm_up_link(g, src, dst)
