"""A profiler-traced job's pipeline layout, read from its point-to-point transfers.

Kineto records no TP/PP layout, and ranks of different pipeline stages do different work: compared as peers,
the heaviest stage would be "slow". Where the traces name the peers of their sends and receives (a GPU job's NCCL
kernels: `Src Rank` / `Dst Rank`), the ranks that exchange activations form chains, one per pipeline: a chain's
first stage receives nothing from a neighbour before its first send of an iteration, and a stage's number is its
distance along the chain from there. Transfers are ordered by their END: a receive posted ahead starts early, but
the first transfer to finish between two stages in an iteration is an activation (no gradient comes back before
one went forward). Each chain is one column (a data-parallel replica, or a TP rank of one); ranks that take part
in no transfer stay as they were (one stage, every rank a replica). Chains that disagree (branching, a cycle,
chains of different lengths) leave the layout as it was, with a problem line saying so.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from megatronapp.scan.read.format import RankTrace


def _first_moves(t: RankTrace) -> dict[int, str]:
    """Per neighbour of rank t: whether its first transfer with it to finish in an iteration is mostly a send or a
    receive."""
    names = np.array(t.names, object)
    comm = (t.peer >= 0) & (t.it >= 0)
    if not comm.any():
        return {}
    op = names[t.name[comm]]
    peer, it, ts = t.peer[comm], t.it[comm], t.ts[comm] + t.dur[comm]
    votes: dict[int, int] = {}
    order = np.lexsort((ts, it))
    seen: set[tuple[int, int]] = set()
    for i in order.tolist():
        key = (int(peer[i]), int(it[i]))
        if key in seen:
            continue
        seen.add(key)
        votes[key[0]] = votes.get(key[0], 0) + (1 if op[i] == "send" else -1)
    return {p: ("send" if v > 0 else "recv") for p, v in votes.items()}


def pipeline_layout(traces: list[RankTrace]) -> tuple[list[RankTrace], list[str]]:
    """The traces with coord/topo set from their pipelines (see the module docstring), and problems."""
    moves = {t.rank: _first_moves(t) for t in traces}
    edges = {r: set(m) for r, m in moves.items() if m}
    if not edges:
        return traces, []
    # Downstream of each rank: the neighbour it first sends to (activations go forward).
    down: dict[int, set[int]] = {r: {p for p, mv in moves[r].items() if mv == "send"} for r in edges}
    up: dict[int, set[int]] = {r: {p for p, mv in moves[r].items() if mv == "recv"} for r in edges}
    present = set(edges)
    heads = sorted(r for r in present if not up[r])
    stage: dict[int, int] = {}
    column: dict[int, int] = {}
    for c, h in enumerate(heads):
        r, s = h, 0
        while True:
            if r in stage:
                return traces, [f"pipeline layout: rank {r} is in two pipelines; every rank judged as one stage"]
            stage[r], column[r] = s, c
            nxt = [p for p in down.get(r, ()) if p in present]
            if len(nxt) > 1:
                return traces, [f"pipeline layout: rank {r} sends activations to {sorted(nxt)}; every rank judged as "
                                "one stage"]
            if not nxt:
                break
            r, s = nxt[0], s + 1
    missed = present - set(stage)
    if missed or not heads:
        return traces, [f"pipeline layout: ranks {sorted(missed)[:8]} are on no chain from a first stage (a cycle, or "
                        "a stage missing); every rank judged as one stage"]
    pp = max(stage.values()) + 1
    lengths = {column[r] for r in stage if stage[r] == pp - 1}
    if len(lengths) != len(heads):
        return traces, [f"pipeline layout: pipelines of different lengths among {len(heads)} chains; every rank "
                        "judged as one stage"]
    dp = len(heads)
    out = []
    for t in traces:
        if t.rank in stage:
            coord = (column[t.rank], stage[t.rank], 0)
            header = {**t.header, "coord": list(coord), "topo": [1, pp, dp]}
            out.append(dataclasses.replace(t, coord=coord, topo=(1, pp, dp), header=header))
        else:
            out.append(t)
    return out, []
