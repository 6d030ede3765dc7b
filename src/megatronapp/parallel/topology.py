"""Rank <-> (dp, pp, tp) grid and the process groups of each parallel dimension.

Layout follows Megatron: tp varies fastest, then dp, then pp, so TP peers share a node and PP crosses nodes.
Groups are created TP first, then PP, then DP, each with local synchronization: only the member ranks
rendezvous, with no global barrier per group (MegaScale's fast initialisation).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import torch.distributed as dist

CHANNELS = ("pp.act.up", "pp.act.down", "pp.grad.up", "pp.grad.down")


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
class Group:
    """A process group with a readable name and its global ranks (sorted)."""

    name: str
    ranks: tuple[int, ...]
    pg: Any = None  # torch ProcessGroup; None for a single-member group (no communication needed)

    @property
    def size(self) -> int:
        return len(self.ranks)

    def rank_in(self, global_rank: int) -> int:
        return self.ranks.index(global_rank)


@dataclass
class Topology:
    tp: int
    pp: int
    dp: int
    rank: int = 0
    groups: dict[str, Group] = field(default_factory=dict)

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
        return self.groups[f"pp.{kind}.{'up' if src < dst else 'down'}"]

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


def build(tp: int, pp: int, dp: int, rank: int | None = None) -> Topology:
    """Create the topology and, when torch.distributed is initialised, this rank's process groups."""
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
            pg = dist.new_group(list(ranks), use_local_synchronization=True)
        topo.groups[name] = Group(name, ranks, pg)
    if pp > 1:
        # Pipeline P2P channels: a group per (payload kind, direction), so that on every (group, pair) NCCL
        # stream traffic flows one way only: a receive posted early never blocks a send (see pipeline/p2p.py).
        ranks = topo.pp_ranks(rank)
        for name in CHANNELS:
            pg = dist.new_group(list(ranks), use_local_synchronization=True) if initialized else None
            topo.groups[name] = Group(name, ranks, pg)
    topo.groups["world"] = Group("world", tuple(range(topo.world_size)), dist.group.WORLD if initialized else None)
    return topo
