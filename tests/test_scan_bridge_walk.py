"""The bridge's breadth-first walk over arrays (ring._breadth_first) gives exactly the offsets and parts of the
plain FIFO walk over per-node edge lists it replaced: the least-squares solve starts from them, so reports stay
byte-identical only if they match bit for bit."""
from __future__ import annotations

from collections import deque

import numpy as np
import pytest

from megatronapp.scan.detect.ring import _breadth_first


def _queue_walk(src: np.ndarray, dst: np.ndarray, med: np.ndarray, world: int) -> tuple[np.ndarray, np.ndarray]:
    adj: dict[int, list[tuple[int, float]]] = {}
    for r, root, d in zip(src.tolist(), dst.tolist(), med.tolist()):
        adj.setdefault(root, []).append((r, d))
        adj.setdefault(r, []).append((root, -d))
    off: dict[int, float] = {}
    part = np.full(world, -1)
    for start in adj:
        if start in off:
            continue
        off[start] = 0.0
        part[start] = start
        todo = deque([start])
        while todo:
            u = todo.popleft()
            for v, d in adj[u]:
                if v not in off:
                    off[v] = off[u] + d
                    part[v] = start
                    todo.append(v)
    x = np.zeros(world)
    x[list(off)] = list(off.values())
    return x, part


@pytest.mark.parametrize("seed", range(6))
def test_array_walk_matches_queue_walk(seed: int) -> None:
    rng = np.random.default_rng(seed)
    world = int(rng.integers(5, 400))
    m = int(rng.integers(1, 3 * world))
    # Random edges (repeats and both orientations included, no self-loops), offsets on clocks ~1e14 ns apart.
    src = rng.integers(0, world, m)
    dst = rng.integers(0, world, m)
    keep = src != dst
    src, dst = src[keep], dst[keep]
    med = rng.normal(0, 1e5, len(src)) + rng.choice([0.0, 1e14], len(src))
    got_x, got_part = _breadth_first(src, dst, med, world)
    want_x, want_part = _queue_walk(src, dst, med, world)
    assert np.array_equal(got_part, want_part)
    assert np.array_equal(got_x, want_x)  # bit for bit


def test_array_walk_on_mesh_groups_with_parts() -> None:
    # Group-shaped edges as the bridge makes them (member -> group lead), two disconnected meshes, one idle rank.
    world, edges = 33, []
    for base in (0, 16):
        for g in range(4):
            lead = base + 4 * g
            edges += [(lead + k, lead) for k in range(1, 4)]  # "tp" groups
            edges += [(base + g + 4 * k, base + g) for k in range(1, 4)]  # "dp" groups
    src = np.array([e[0] for e in edges])
    dst = np.array([e[1] for e in edges])
    med = np.linspace(-3.0, 5.0, len(src))
    got_x, got_part = _breadth_first(src, dst, med, world)
    want_x, want_part = _queue_walk(src, dst, med, world)
    assert np.array_equal(got_part, want_part) and got_part[32] == -1
    assert set(got_part[:16]) == {0} and set(got_part[16:32]) == {16}
    assert np.array_equal(got_x, want_x)
