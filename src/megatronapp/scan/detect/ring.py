"""A slow collective group narrowed to the slow link inside it, from the order in which its members leave.

A ring collective (NCCL's default for all-reduce, reduce-scatter and all-gather; gloo's ring algorithm likewise)
passes chunks from each member to its successor in group order. A slow link (a -> b) delays every chunk b
receives, and everyone downstream of b receives (and forwards) later in turn, so b leaves last, each member after
it a little earlier, and a, the link's sender, first (see simulate.ring_shift for the model). Seen around the
ring, members' exit times form a sawtooth: a gentle downward slope with one big step UP, from a to b. Healthy
rings leave together (no step), and a slow member (compute) arrives late but leaves with the rest.

Per group: each member's exit, put on one clock through the groups that DO leave together (bridge_offsets: a
duration in the collective would mix in arrival skew, which at a DP all-reduce is as large as the step), minus
the instance median, then the median over every instance the group ran. The best-fitting sawtooth names the
step; the pair is reported only when that step stands clear of every other neighbour-to-neighbour difference
(robust z over the n candidate pairs, twice the runner-up, and in most instances). Otherwise the finding stays
on the group and says the pair could not be told.
A weak link hardly slows its group as a whole (the last arriver's duration rises only (1+f)/2-fold), so every
group of three or more is also screened for a step (scan_groups), and the candidates are judged on offsets
bridged without them, against healthy groups of the same kind left out the same way (their steps are the noise).
Limits: the ring is assumed to follow group order (NCCL's rings follow rank order within a node but may reorder
across nodes, and tree algorithms have no ring); a ring of two is already a pair.
"""
from __future__ import annotations

import functools

import numpy as np

from megatronapp.scan.detect.findings import Finding, Thresholds
from megatronapp.scan.detect.stats import group_median
from megatronapp.scan.detect.table import Table, coord

MS = 1e6
_CG_STEPS = 300  # conjugate-gradient steps for the bridge's least squares (converges in far fewer)
_MAX_SCREENED = 8  # groups judged again after the screen (each costs one bridge)


def probe_command(tb: Table, kind: str, rank: int) -> str:
    """The `megatronapp diagnose` call that measures every ring-neighbour pair of this group."""
    tp, pp, dp = (int(tb.coords[:, i].max()) + 1 for i in (2, 1, 0))
    return f"megatronapp diagnose --nproc {tb.world} --tp {tp} --pp {pp} --dp {dp} --group {kind}:{rank}"


def bridge_offsets(tb: Table, coll: np.ndarray, inst: np.ndarray, slow: set[int]) -> tuple[np.ndarray, np.ndarray]:
    """Per rank: clock offset (ns; NaN if unreached) from the exits of every HEALTHY collective group, and the
    connected part it was reached in (offsets of different parts are unrelated: compare within one part only).

    Without a global clock, members of the slow group are compared through groups that leave together: a DP
    member's TP peers sit in other DP groups, whose members leave together, and whose TP peers are the slow
    group's other members (and the same with TP and DP swapped). Per (group, member) the median over instances of
    its exit minus the group's first member's exit is one edge; offsets follow the edges breadth-first. The slow
    groups (`slow`, group ids) are left out: their members do not leave together."""
    keep = ~np.isin(tb.gkey[coll], list(slow))
    rows, key = coll[keep], inst[keep]
    end = tb.end[rows].astype(float)
    if len(key) and int(key.max()) - int(key.min()) < 4 * len(key):  # instance ids are dense: index by them
        inv, n_inst = key - key.min(), int(key.max()) - int(key.min()) + 1
    else:  # (np.unique's sort of 2 million ids cost more than the rest of the bridge)
        ui, inv = np.unique(key, return_inverse=True)
        n_inst = len(ui)
    first = np.full(n_inst, -1, np.int64)
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
    x, part = _breadth_first(src, dst, med, tb.world)
    # One path's errors add up hop by hop: least squares over every edge instead (conjugate gradients on the
    # graph Laplacian, from the breadth-first offsets), so each offset averages all the paths to it.
    W = tb.world
    deg = np.bincount(src, minlength=W) + np.bincount(dst, minlength=W)

    def lap(v: np.ndarray) -> np.ndarray:
        return deg * v - np.bincount(src, v[dst], W) - np.bincount(dst, v[src], W)

    # Solved for the correction to the breadth-first offsets: clocks days apart make offsets ~1e14 ns, and the
    # iteration must not work with those (rounding); the correction is microseconds.
    rhs = np.bincount(src, med, W) - np.bincount(dst, med, W)
    res = rhs - lap(x)
    y = np.zeros(W)
    d = res.copy()
    rr = float(res @ res)
    for _ in range(_CG_STEPS):
        if rr <= W * 1.0:  # 1 ns RMS per rank: far below any step that matters (they are >= 10 us)
            break
        ld = lap(d)
        curv = float(d @ ld)
        if curv <= 0:
            break
        alpha = rr / curv
        y += alpha * d
        res -= alpha * ld
        rr, rr_old = float(res @ res), rr
        d = res + (rr / rr_old) * d
    x = x + y
    return np.where(part >= 0, x, np.nan), part


def _breadth_first(src: np.ndarray, dst: np.ndarray, med: np.ndarray, world: int) -> tuple[np.ndarray, np.ndarray]:
    """Offsets along the breadth-first trees of the edge graph (off[src] - off[dst] = med), and per rank the part
    (its tree's root; -1 unreached); offsets of unreached ranks are 0.

    The same walk as a FIFO queue over per-node edge lists in edge order, with parts started in the order nodes
    first appear (dst before src, edge by edge), but one level at a time over arrays: the queue holds a level's
    nodes in the order they were found, and a node is set by its first finder. The least-squares solve starts
    from these offsets, so they must match that walk exactly (a Python queue over the ~100,000 edges at 12,288
    ranks cost about a second per bridge)."""
    m = len(src)
    # Both directions of every edge, grouped by node and in edge order within a node (the queue's visit order).
    node = np.concatenate([dst, src])
    nbr = np.concatenate([src, dst])
    step = np.concatenate([med, -med])
    order = np.lexsort((np.concatenate([np.arange(m), np.arange(m)]), node))
    node, nbr, step = node[order], nbr[order], step[order]
    start_at = np.searchsorted(node, np.arange(world + 1))
    count = np.diff(start_at)
    x = np.zeros(world)
    part = np.full(world, -1)
    seen = np.zeros(world, bool)
    # Nodes in the order they first appear as dict keys: per edge, dst then src.
    appear = np.empty(2 * m, np.int64)
    appear[0::2], appear[1::2] = dst, src
    first = np.unique(appear, return_index=True)[1]
    roots_in_order = appear[np.sort(first)]
    p = 0
    while p < len(roots_in_order):
        root = int(roots_in_order[p])
        p += 1
        if seen[root]:
            continue
        seen[root] = True
        part[root] = root
        level = np.array([root], np.int64)
        while len(level):
            n_each = count[level]
            total = int(n_each.sum())
            if not total:
                break
            # Entries of every node of the level, node after node (queue order), each node's in edge order.
            begin = np.repeat(start_at[level] - np.cumsum(n_each) + n_each, n_each)
            at = begin + np.arange(total)
            v = nbr[at]
            new = ~seen[v]
            at, v = at[new], v[new]
            idx = np.unique(v, return_index=True)[1]
            idx.sort()  # first finder of each node, in the order found
            at, v = at[idx], v[idx]
            x[v] = x[node[at]] + step[at]
            seen[v] = True
            part[v] = root
            level = v
    return x, part


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


@functools.lru_cache(maxsize=64)
def _sawtooth_templates(n: int) -> np.ndarray:
    """Row q: the sawtooth with receiver q, centred (the same for every group of n: built once per size; a scan
    visits thousands of groups of a few sizes)."""
    t = -((np.arange(n)[None, :] - np.arange(n)[:, None]) % n).astype(float)
    out = t - t.mean(axis=1, keepdims=True)
    out.flags.writeable = False
    return out


def sawtooth(r: np.ndarray, noise: float = 0.0) -> tuple[int, float, float, float]:
    """(receiver position q, its step above the typical one, the next largest step, robust z) of the best-fitting
    sawtooth: receiver q highest, each later member one notch lower (by correlation over all q)."""
    n = len(r)
    step = r - np.roll(r, 1)  # step[i]: member i's exit minus its ring predecessor's
    q = int(np.argmax(_sawtooth_templates(n) @ (r - r.mean())))
    others = np.delete(step, q)
    med = float(np.median(others))
    spread = 1.4826 * float(np.median(np.abs(others - med)))
    return q, float(step[q] - med), float(np.max(others) - med), float(step[q] - med) / max(spread, noise, 10.0)


def localise(tb: Table, th: Thresholds, f: Finding, kind: str, rank: np.ndarray, inst: np.ndarray,
             value: np.ndarray, comparisons: int = 1, noise: float = 0.0) -> Finding:
    """The group finding `f` turned into a finding on the pair whose link is slow, or `f` saying why not."""
    members = f.ranks
    n = len(members)
    if n < 3:
        return f
    probe = probe_command(tb, kind, members[0]) if kind in ("tp", "pp", "dp", "world") else None
    r, per_inst = exit_pattern(members, rank, inst, value)
    if len(per_inst) and np.isfinite(r).all():
        q, jump, runner, z = sawtooth(r, noise)
        inst_step = per_inst[:, q] - per_inst[:, q - 1]
        frac = float(np.mean(inst_step >= jump / 2))
        zmin = th.z_for(th.link_z, n * comparisons)
        if jump > 0 and z >= zmin and jump >= 2 * max(runner, 0.0) and frac >= th.persistent:
            a, b = int(members[q - 1]), int(members[q])
            ev = {**f.evidence, "method": "ring exit pattern", "group": list(members), "group_kind": kind,
                  "exit_step_ms": round(jump / MS, 4), "next_step_ms": round(runner / MS, 4),
                  "step_z": round(z, 1), "instances": int(len(per_inst)), "consistent": round(frac, 3),
                  "from": "exits bridged through healthy groups"}
            if probe:
                ev["probe"] = probe_command(tb, kind, a)
            conf = round(f.confidence * frac, 3)  # the group is slow (f); the pair holds in `frac` of instances
            return Finding("slow-link", (a, b), [coord(tb, a), coord(tb, b)],
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


def scan_groups(tb: Table, th: Thresholds, coll: np.ndarray, inst: np.ndarray, flagged: set[int]) -> list[Finding]:
    """Slow ring links in groups the group test left alone: a weak link in a small group raises the group's
    shortest duration (the last arriver's) only (1+f)/2-fold, but still puts a step in the exits.

    Two passes: every group of three or more is screened on offsets bridged through all unflagged groups (its own
    step is then partly absorbed, so the screen is lenient), and the groups that pass are judged again on offsets
    bridged without them, by `localise` with the candidate count of the whole screen in the z."""
    W = tb.world
    sizes = np.array([len(r) for _, r in tb.groups])
    pool = [g for g in np.unique(tb.gkey[coll]).tolist() if sizes[g] >= 3 and g not in flagged]
    if not pool:
        return []
    off, part = bridge_offsets(tb, coll, inst, flagged)
    v = tb.end[coll] - off[tb.rank[coll]]
    ok = np.isfinite(v)
    ui, imed, _ = group_median(inst[ok], v[ok])
    res = v[ok] - imed[np.searchsorted(ui, inst[ok])]
    uk, rmed, _ = group_median(tb.gkey[coll][ok] * W + tb.rank[coll][ok], res)
    zmin = th.z_for(th.link_z, int(sizes[pool].sum()))
    pattern: dict[int, np.ndarray] = {}
    for g in pool:
        keys = g * W + np.asarray(tb.groups[g][1])
        at = np.searchsorted(uk, keys).clip(0, max(len(uk) - 1, 0))
        if len(uk) and np.array_equal(uk[at], keys) and len(set(part[list(tb.groups[g][1])])) == 1:
            pattern[g] = rmed[at]
    # The noise of one step is that of every group of the kind (mostly healthy): the bridge's error is in it,
    # which a group's own few steps cannot show.
    kind_of = {g: (tb.groups[g][0], int(sizes[g])) for g in pattern}
    dev: dict[tuple, list] = {}
    for g, r in pattern.items():
        st = r - np.roll(r, 1)
        dev.setdefault(kind_of[g], []).append(st - np.median(st))
    noise = {k: 1.4826 * float(np.median(np.abs(np.concatenate(v)))) for k, v in dev.items()}
    cand = []
    for g, r in pattern.items():
        q, jump, runner, z = sawtooth(r, noise[kind_of[g]])
        if jump > 0 and z >= zmin / 2:
            cand.append((z, g))
    out = []
    # Rows of each group in `coll` by one stable sort (ascending, as a boolean mask would give them): the judging
    # below visits hundreds of groups, and a mask over every collective row per group dominated at 12,288 ranks.
    by_group = np.argsort(tb.gkey[coll], kind="stable")
    group_at = np.searchsorted(tb.gkey[coll][by_group], np.arange(len(tb.groups) + 1))
    end_coll = tb.end[coll]
    for kind in sorted({kind_of[g] for _, g in cand}):
        mine_c = [g for _, g in sorted(cand, reverse=True) if kind_of[g] == kind][:_MAX_SCREENED]
        # Judged on offsets bridged WITHOUT the candidates (their exits are not together), and so are a set of
        # healthy groups of the same kind left out the same way: their steps are the noise of that judgement (a
        # group left out hangs on one edge per member, and those errors line up into steps). Groups of one kind
        # are disjoint; at most half of them per connected part are left out, so the bridge stays connected.
        per_part: dict[int, list[int]] = {}
        for g in pattern:
            if kind_of[g] == kind:
                per_part.setdefault(int(part[tb.groups[g][1][0]]), []).append(g)
        out_set, calib = set(), []
        for gs in per_part.values():
            room = len(gs) // 2
            for g in [g for g in gs if g in mine_c][:room]:
                out_set.add(g)
            for g in [g for g in gs if g not in mine_c][:room - len(out_set & set(gs))]:
                calib.append(g)
        if not calib or not out_set:
            continue
        off2, part2 = bridge_offsets(tb, coll, inst, set(flagged) | out_set | set(calib))

        def steps_of(g: int, off2=off2, part2=part2) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
            members = tb.groups[g][1]
            mine = by_group[group_at[g]:group_at[g + 1]]
            value = end_coll[mine] - off2[tb.rank[coll[mine]]]
            if len(set(part2[list(members)])) > 1:
                value = value * np.nan  # the group's members are not on one bridged clock
            r, per = exit_pattern(members, tb.rank[coll[mine]], inst[mine], value)
            return r, per, mine, value

        dev = []
        for g in calib:
            r, per, _, _ = steps_of(g)
            if len(per):
                st = r - np.roll(r, 1)
                dev.append(st - np.median(st))
        if not dev:
            continue
        kind_noise = 1.4826 * float(np.median(np.abs(np.concatenate(dev))))
        # Each group's cost (median over instances of the last arriver's duration) and payload, candidates and
        # healthy groups alike, in one grouped pass: there are hundreds of them at thousands of ranks.
        sel = np.concatenate([by_group[group_at[g]:group_at[g + 1]] for g in sorted(set(calib) | out_set)])
        span = int(inst.max()) + 1
        key = tb.gkey[coll[sel]].astype(np.int64) * span + inst[sel]
        order = np.argsort(key, kind="stable")
        ks = key[order]
        first = np.flatnonzero(np.r_[True, ks[1:] != ks[:-1]])
        gs, costs, _ = group_median(ks[first] // span, np.minimum.reduceat(tb.dur[coll[sel]][order], first))
        _, payload, _ = group_median(tb.gkey[coll[sel]], tb.nbytes[coll[sel]].astype(float))
        healthy = np.isin(gs, calib)
        calib_cost, calib_bytes = costs[healthy], payload[healthy]
        for g in out_set:
            name, members = tb.groups[g]
            r, per, mine, value = steps_of(g)
            if not len(per):
                continue
            q, jump, _, z = sawtooth(r, kind_noise)
            rows = coll[mine]
            # The group's nominal cost: the last arriver's duration ((1+f)/2 of the ring's); f from the step model.
            at = int(np.searchsorted(gs, g))
            cost = float(costs[at])
            n = len(members)
            factor = 1.0 + max(jump, 0.0) * 2 * (n - 1) / (n * max(cost, 1.0))
            if factor < 1 + th.link_rel or jump < th.link_abs_ms * MS:
                continue  # a step, but one that costs the link less than a slow link must (as for groups)
            # A slow ring link makes its group slower too: the last arriver's duration rises (f-1)/2 of the cost
            # (the model `factor` comes from). A step in the exits of a group that costs no more than healthy
            # groups of its kind is an error of the bridged clocks, not a link: at 8,192 simulated ranks a 0.066
            # ms step in a TP group whose collective time equalled its peers' (-0.0004 ms against +0.058 ms
            # expected, spread 0.002) was named at confidence 0.51. True weak DP links (1.1x) read 0.7-1.5x of
            # the expected rise. Half of it must show, less what the healthy groups' spread can hide. Only healthy
            # groups moving the same payload (within 5%) are its peers (stages all-reduce gradients of different
            # sizes); with fewer than three of them the step is not checked against cost.
            mine_bytes = float(payload[at])
            alike = np.abs(calib_bytes - mine_bytes) <= 0.05 * max(mine_bytes, 1.0)
            expected = peer_cost = None
            if alike.sum() >= 3:
                peer_cost = float(np.median(calib_cost[alike]))
                spread = 1.4826 * float(np.median(np.abs(calib_cost[alike] - peer_cost)))
                expected = (factor - 1) / 2 * peer_cost
                if cost - peer_cost < expected / 2 - 2 * spread:
                    continue
            conf = round(min(1.0, 0.5 + (z - zmin) / (4 * zmin)), 3)
            f = Finding("slow-link", tuple(int(x) for x in members), [coord(tb, x) for x in members],
                        f"{factor:.2f}x on one ring link (est.)", round(factor, 3),
                        round((factor - 1) * cost / MS, 4), max(conf, 0.5),
                        {"what": "collective", "transfers": int(len(per)), "median_ms": round(cost / MS, 4),
                         "peer_median_ms": round(cost / MS, 4), "screened": "group within its peers' range",
                         "step_noise_ms": round(kind_noise / MS, 4),
                         "cost_excess_ms": None if peer_cost is None else round((cost - peer_cost) / MS, 4),
                         "cost_excess_expected_ms": None if expected is None else round(expected / MS, 4)})
            got = localise(tb, th, f, name, tb.rank[rows], inst[mine], value, len(pool), kind_noise)
            if len(got.ranks) == 2:
                out.append(got)  # a group that passed only the lenient screen is not reported
    return out
