"""A process group with a readable name: the type every op of `comm` takes.

It sits below `comm` so that group building (`topology.build`, `topology.make_links`, which warm links up through
`comm`) can sit above it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


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
