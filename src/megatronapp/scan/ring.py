"""A slow collective group narrowed to the slow link inside it, from the order in which its members leave.

A ring collective (NCCL's default for all-reduce, reduce-scatter and all-gather; the engine's gloo rings too)
passes chunks from each member to its successor in group order. A slow link (a -> b) delays every chunk b
receives, and everyone downstream of b receives (and forwards) later in turn, so b leaves last, each member after
it a little earlier, and a, the link's sender, first (see simulate.ring_shift for the model). Seen around the
ring, members' exit times form a sawtooth: a gentle downward slope with one big step UP, from a to b. Healthy
rings leave together (no step), and a slow member (compute) arrives late but leaves with the rest.

Per group: each member's exit, put on one clock through the groups that DO leave together (bridge_offsets: a
duration in the collective would mix in arrival skew, which at a DP all-reduce is as large as the step), minus
the instance median, then the median over every instance the group ran. The best-fitting
sawtooth names the step; the pair is reported only when that step
stands clear of every other neighbour-to-neighbour difference (robust z over the n candidate pairs, twice the
runner-up, and in most instances). Otherwise the finding stays on the group and says the pair could not be told.
Limits: the ring is assumed to follow group order (NCCL's rings follow rank order within a node but may reorder
across nodes, and tree algorithms have no ring); a ring of two is already a pair.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from megatronapp.scan.findings import Finding, Thresholds

if TYPE_CHECKING:
    from megatronapp.scan.detect import Table

MS = 1e6
_SWEEPS = 30  # relaxation sweeps over the bridge graph


def _coord(tb: Table, r: int) -> dict:
    dp, pp, tp = (int(v) for v in tb.coords[r])
    return {"rank": int(r), "dp": dp, "pp": pp, "tp": tp}


def probe_command(tb: Table, kind: str, rank: int) -> str:
    """The `megatronapp diagnose` call that measures every ring-neighbour pair of this group."""
    tp, pp, dp = (int(tb.coords[:, i].max()) + 1 for i in (2, 1, 0))
    return f"megatronapp diagnose --nproc {tb.world} --tp {tp} --pp {pp} --dp {dp} --group {kind}:{rank}"


def bridge_offsets(tb: Table, coll: np.ndarray, inst: np.ndarray, slow: set[int]) -> dict[int, float]:
    """Clock offsets (ns, relative within each connected part) from the exits of every HEALTHY collective group.

    Without a global clock, members of the slow group are compared through groups that leave together: a DP
    member's TP peers sit in other DP groups, whose members leave together, and whose TP peers are the slow
    group's other members (and the same with TP and DP swapped). Per (group, member) the median over instances of
    its exit minus the group's first member's exit is one edge; offsets follow the edges breadth-first. The slow
    groups (`slow`, group ids) are left out: their members do not leave together."""
    from collections import deque

    from megatronapp.scan.detect import group_median

    keep = ~np.isin(tb.gkey[coll], list(slow))
    rows, key = coll[keep], inst[keep]
    end = tb.end[rows].astype(float)
    ui, inv = np.unique(key, return_inverse=True)
    first = np.full(len(ui), -1, np.int64)
    lead = np.array([tb.groups[g][1][0] for g in range(len(tb.groups))], np.int64)
    is_lead = tb.rank[rows] == lead[tb.gkey[rows]]
    first[inv[is_lead]] = np.flatnonzero(is_lead)
    ok = first[inv] >= 0
    delta = end[ok] - end[first[inv[ok]]]
    edge = tb.gkey[rows][ok] * tb.world + tb.rank[rows][ok]
    ue, med, _ = group_median(edge, delta)
    src, dst = ue % tb.world, lead[ue // tb.world]
    real = src != dst
    src, dst, med = src[real], dst[real], med[real]  # edge: off[src] - off[dst] = med
    adj: dict[int, list[tuple[int, float]]] = {}
    for r, root, d in zip(src.tolist(), dst.tolist(), med.tolist()):
        adj.setdefault(root, []).append((r, d))
        adj.setdefault(r, []).append((root, -d))
    off: dict[int, float] = {}
    for start in adj:
        if start in off:
            continue
        off[start] = 0.0
        todo = deque([start])
        while todo:
            u = todo.popleft()
            for v, d in adj[u]:
                if v not in off:
                    off[v] = off[u] + d
                    todo.append(v)
    # One path's errors add up hop by hop; a few relaxation sweeps average over all the paths nearby.
    x = np.zeros(tb.world)
    x[list(off)] = list(off.values())
    deg = np.bincount(src, minlength=tb.world) + np.bincount(dst, minlength=tb.world)
    for _ in range(_SWEEPS):
        acc = np.bincount(src, x[dst] + med, tb.world) + np.bincount(dst, x[src] - med, tb.world)
        x = np.where(deg > 0, acc / np.maximum(deg, 1), x)
    return {r: float(x[r]) for r in off}


def exit_pattern(members: tuple[int, ...], rank: np.ndarray, inst: np.ndarray, value: np.ndarray
                 ) -> tuple[np.ndarray, np.ndarray]:
    """(per member: median of its exit minus the instance median, per instance x member: the same, unpooled)."""
    pos = np.full(int(max(members)) + 1, -1)
    pos[list(members)] = np.arange(len(members))
    ui, inv = np.unique(inst, return_inverse=True)
    m = np.full((len(ui), len(members)), np.nan)
    m[inv, pos[rank]] = value
    m = m[np.isfinite(m).all(axis=1)]
    res = m - np.median(m, axis=1, keepdims=True) if len(m) else m
    return (np.median(res, axis=0) if len(res) else np.full(len(members), np.nan)), res


def localise(tb: Table, th: Thresholds, f: Finding, kind: str, rank: np.ndarray, inst: np.ndarray,
             value: np.ndarray) -> Finding:
    """The group finding `f` turned into a finding on the pair whose link is slow, or `f` saying why not."""
    members = f.ranks
    n = len(members)
    if n < 3:
        return f
    probe = probe_command(tb, kind, members[0]) if kind in ("tp", "pp", "dp", "world") else None
    r, per_inst = exit_pattern(members, rank, inst, value)
    step = r - np.roll(r, 1)  # step[i]: member i's exit minus its ring predecessor's
    if len(per_inst) and np.isfinite(step).all():
        # Sawtooth fit: receiver q highest, each later member one notch lower; the best q by correlation.
        t = -((np.arange(n)[None, :] - np.arange(n)[:, None]) % n).astype(float)
        score = (t - t.mean(axis=1, keepdims=True)) @ (r - r.mean())
        q = int(np.argmax(score))
        others = np.delete(step, q)
        med = float(np.median(others))
        spread = 1.4826 * float(np.median(np.abs(others - med)))
        runner = float(np.max(others) - med)
        jump = float(step[q] - med)
        z = jump / max(spread, 10.0)  # ns: identical steps are not infinitely sure
        inst_step = per_inst[:, q] - per_inst[:, q - 1]
        frac = float(np.mean(inst_step >= jump / 2))
        zmin = th.z_for(th.link_z, n)
        if jump > 0 and z >= zmin and jump >= 2 * max(runner, 0.0) and frac >= th.persistent:
            a, b = int(members[q - 1]), int(members[q])
            ev = {**f.evidence, "method": "ring exit pattern", "group": list(members), "group_kind": kind,
                  "exit_step_ms": round(jump / MS, 4), "next_step_ms": round(runner / MS, 4),
                  "step_z": round(z, 1), "instances": int(len(per_inst)), "consistent": round(frac, 3),
                  "from": "exits bridged through healthy groups"}
            if probe:
                ev["probe"] = probe_command(tb, kind, a)
            conf = round(f.confidence * frac, 3)  # the group is slow (f); the pair holds in `frac` of instances
            return Finding("slow-link", (a, b), [_coord(tb, a), _coord(tb, b)],
                           f"{f.factor:.2f}x ring collective time in {kind} group of {n} ranks; members leave "
                           f"{jump / MS:.2f} ms later from rank {a} to rank {b}: link {a}->{b}", f.factor,
                           f.excess_ms, conf, ev)
        f.evidence.update(exit_step_ms=round(jump / MS, 4), next_step_ms=round(runner / MS, 4), step_z=round(z, 1))
    f.evidence["localised"] = False
    f.slowdown += ("; no single pair inside the group stands out (exit steps between ring neighbours are within "
                   "noise)" + (f": probe its pairs with `{probe}`" if probe else ""))
    if probe:
        f.evidence["probe"] = probe
    return f
