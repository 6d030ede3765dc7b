"""Views 2 and 3: slow P2P links and collective groups, and who made whom wait (victims passed over)."""
from __future__ import annotations

import math

import numpy as np

from megatronapp.scan.detect import ring
from megatronapp.scan.detect.align import row_offsets
from megatronapp.scan.detect.evidence import sign_p
from megatronapp.scan.detect.findings import Finding, Thresholds, link_label
from megatronapp.scan.detect.stats import confidence, group_median, lookup, robust_excess
from megatronapp.scan.detect.table import COMM, MS, Phases, Table, Waits, coord, group_name_ids, match_p2p, rank_chunks

_FLOOR_NOISE = 2.0  # a link's floor must stand twice its own low-end spread above its peers' (_cross_stage_links)


def _seg_cumwait(tb: Table, w: np.ndarray) -> np.ndarray:
    """Wait a rank had accumulated in the current iteration before each row (a range of ranks at a time: the
    temporaries stay small at scale, and a running sum over millions of rows would lose precision)."""
    out = np.empty(len(w))
    for a, b in rank_chunks(tb):
        wc = w[a:b]
        cs = np.cumsum(wc)
        new = np.ones(b - a, bool)
        new[1:] = (tb.rank[a + 1:b] != tb.rank[a:b - 1]) | (tb.it[a + 1:b] != tb.it[a:b - 1])
        seg_start = np.maximum.accumulate(np.where(new, np.arange(b - a), 0))
        out[a:b] = cs - wc - (cs[seg_start] - wc[seg_start])
    return out


def links_and_waits(tb: Table, ph: Phases, th: Thresholds, offsets: dict[int, int] | None,
                    clock: dict | None = None) -> tuple[list[Finding], Waits]:
    """Slow P2P links and slow collective groups, and who made whom wait (clock: estimate_offsets' drift report)."""
    W, n_it = tb.world, len(ph.iters)
    # Per-row clock offsets only where offsets are given (without them every time is read on its own clock).
    off_row = None if offsets is None else \
        row_offsets(tb.rank, tb.ts, {int(r): o for r, o in offsets.items() if 0 <= int(r) < W}, clock)
    wait = np.zeros(len(tb.ts))
    findings: list[Finding] = []
    deferred = []  # blame needs every wait first (a rank's earlier waits decide if it is a victim)
    comm = tb.cat == COMM
    nid = {n: i for i, n in enumerate(tb.names)}
    pp = tb.coords[:, 1]

    # --- P2P: match send (a -> b, seq k) with recv on b from a, seq k.
    send = np.flatnonzero(comm & (tb.peer >= 0) & (tb.name == nid.get("send", -2)) & (tb.seq >= 0))
    recv = np.flatnonzero(comm & (tb.peer >= 0) & (tb.name == nid.get("recv", -2)) & (tb.seq >= 0))
    if len(send) and len(recv):
        S = int(max(tb.seq[send].max(), tb.seq[recv].max())) + 1
        si, ri = match_p2p(tb, send, recv)
        pair = tb.rank[si] * W + tb.rank[ri]
        dom = tb.clock if tb.clock is not None else np.full(W, -1, np.int64)
        # Two ranks on one host read one clock: the transfer is timed as it is, wire delay included.
        shared = (dom[tb.rank[si]] >= 0) & (dom[tb.rank[si]] == dom[tb.rank[ri]])
        if offsets is None:
            # No global clock: the two ends of a transfer finish together, which fixes each pair's offset
            # (and absorbs a constant wire delay: only pairs on one clock show it).
            up, dmed, _ = group_median(pair, (tb.end[ri] - tb.end[si]).astype(float))
            s_at = tb.ts[si] + np.where(shared, 0, lookup(up, dmed, pair)).astype(np.int64)
            r_at = tb.ts[ri]
        else:
            s_at = tb.ts[si] - np.where(shared, 0, off_row[si] - off_row[ri]) - off_row[ri]
            r_at = tb.ts[ri] - off_row[ri]
        r_end = r_at + tb.dur[ri]
        w = np.maximum(s_at - r_at, 0).astype(float)
        xfer = (r_end - np.maximum(s_at, r_at)).astype(float)
        wait[ri] = w
        # Same transfer on other columns: same stages, same channel (group name) and size.
        cls = (pp[tb.rank[si]] * (tb.coords[:, 1].max() + 1) + pp[tb.rank[ri]]) * (1 << 20) + \
            np.unique(group_name_ids(tb)[tb.gkey[si]] * (1 << 40) + tb.nbytes[si], return_inverse=True)[1]
        inst = cls * S + tb.seq[si]
        ui, imed, _ = group_median(inst, xfer)
        ratio = xfer / np.maximum(lookup(ui, imed, inst), 1.0)
        findings += _link_findings(tb, th, pair, cls, ratio, xfer, lambda p: (int(p // W), int(p % W)), "P2P")
        seen = {f.ranks for f in findings}
        findings += [f for f in _cross_stage_links(tb, th, si, pair, shared, xfer, n_it, ph.step_ms)
                     if f.ranks not in seen]
        # Blame: the sender, for wait beyond what this transfer usually costs, unless it was itself held up.
        def p2p_blame(cw_all, si=si, inst=inst, w=w):
            uw, wmed, _ = group_median(inst, w)
            excess = w - lookup(uw, wmed, inst)
            cw = cw_all[si]
            uc, cmed, _ = group_median(inst, cw)
            m = (excess > 0) & ~(cw - lookup(uc, cmed, inst) >= 0.5 * excess)
            return si[m], excess[m]
        deferred.append(p2p_blame)

    # --- collectives: same (group, seq) on every member.
    coll = np.flatnonzero(comm & (tb.peer < 0) & (tb.gkey >= 0) & (tb.seq >= 0))
    if len(coll):
        S = int(tb.seq[coll].max()) + 1
        inst = tb.gkey[coll] * S + tb.seq[coll]
        ui, cnt = np.unique(inst, return_counts=True)
        size = np.array([len(tb.groups[g][1]) for g in range(len(tb.groups))])
        full = lookup(ui, cnt, inst) == size[tb.gkey[coll]]
        coll, inst = coll[full], inst[full]
    if len(coll):
        # Arrival: aligned start, or (no clock) minus the duration, as members leave a collective together.
        arr = (tb.ts[coll] - off_row[coll]) if offsets is not None else -tb.dur[coll]
        arr = arr.astype(float)
        ui, inv = np.unique(inst, return_inverse=True)
        amax = np.full(len(ui), -np.inf)
        np.maximum.at(amax, inv, arr)
        w = amax[inv] - arr
        wait[coll] = w
        _, amed, _ = group_median(inst, arr)
        n_inst = len(ui)

        def coll_blame(cw_all, coll=coll, inst=inst, inv=inv, w=w, amax=amax, amed=amed, n=n_inst):
            cw = cw_all[coll]
            _, cmed, _ = group_median(inst, cw)
            late = amax[inv] - amed[inv]
            wsum = np.bincount(inv, w, n)
            root = (w == 0) & (late > 0) & ~(cw - cmed[inv] >= 0.5 * late)
            rows = np.flatnonzero(root)
            keep = rows[np.unique(inv[rows], return_index=True)[1]]  # one culprit per instance (ties: first)
            return coll[keep], wsum[inv[keep]]
        deferred.append(coll_blame)
        # Pure collective time: the last arriver's duration (it waited for nobody).
        ctime = np.full(len(ui), np.inf)
        np.minimum.at(ctime, inv, tb.dur[coll].astype(float))
        first = np.unique(inv, return_index=True)[1]
        g_of = tb.gkey[coll][first]
        # Kind of group (name and size) per instance, numbered by first appearance among the instances: one
        # lookup per group of the table, not one per instance (246,400 at 12,288 ranks).
        kinds: dict[tuple[str, int], int] = {}
        kind_of = np.array([kinds.setdefault((g, len(r)), len(kinds)) for g, r in tb.groups] + [-1], np.int64)
        _, first_seen, gname = np.unique(kind_of[g_of], return_index=True, return_inverse=True)
        gname = np.argsort(np.argsort(first_seen))[gname.ravel()]
        cls = gname * (1 << 20) + size_classes(tb.name[coll][first], tb.nbytes[coll][first])
        ci = cls * S + tb.seq[coll][first]
        uc, cm, _ = group_median(ci, ctime)
        ratio = ctime / np.maximum(lookup(uc, cm, ci), 1.0)
        # A slow group is narrowed to the slow link inside it where the members' exit order singles one out.
        # Exits are put on one clock through the groups that leave together (ring.bridge_offsets), also when
        # offsets are given: their alignment anchored on the slow group's exits too, which do not coincide.
        slow = _link_findings(tb, th, g_of, cls, ratio, ctime, lambda g: tb.groups[int(g)][1], "collective", ci)
        gids = [[g for g, (_, r) in enumerate(tb.groups) if r == f.ranks] for f in slow]
        flagged = {g for x in gids for g in x}
        bridge, part = ring.bridge_offsets(tb, coll, inst, flagged) if any(len(f.ranks) > 2 for f in slow) \
            else (None, None)
        for f, mine_g in zip(slow, gids):
            mine = np.isin(tb.gkey[coll], mine_g)
            rk = tb.rank[coll][mine]
            one_clock = bridge is not None and len(set(part[list(f.ranks)])) == 1
            value = tb.end[coll][mine] - (bridge[rk] if one_clock else np.nan)
            findings.append(ring.localise(tb, th, f, tb.groups[mine_g[0]][0], rk, inst[mine], value))
        findings += ring.scan_groups(tb, th, coll, inst, flagged)  # weak ring links the group test cannot see

    cw_all = _seg_cumwait(tb, wait)
    blame_rows = [f(cw_all) for f in deferred]  # (culprit row index, ns)
    cells = W * max(n_it, 1)
    # bincount, not np.add.at: the same sums in the same order, without add.at's per-element cost.
    waited = np.zeros(cells)
    for a, b in rank_chunks(tb):  # a cell is one rank's: each cell's sum is made within one range, in row order
        it = tb.it[a:b]
        m = np.isin(it, ph.iters)
        iti = np.searchsorted(ph.iters, it[m]).clip(0, max(n_it - 1, 0))
        waited += np.bincount(tb.rank[a:b][m] * max(n_it, 1) + iti, wait[a:b][m] / MS, cells)
    waited = waited.reshape(W, -1)
    rows = np.concatenate([r for r, _ in blame_rows] + [np.zeros(0, np.int64)])
    ns = np.concatenate([x for _, x in blame_rows] + [np.zeros(0)])
    ok = np.isin(tb.it[rows], ph.iters)
    rows, ns = rows[ok], ns[ok]
    iti = np.searchsorted(ph.iters, tb.it[rows]).clip(0, max(n_it - 1, 0))
    caused = np.bincount(tb.rank[rows] * max(n_it, 1) + iti, ns / MS, cells).reshape(W, -1)
    count = np.bincount(tb.rank[rows], minlength=W).astype(np.int64)
    return findings, Waits(waited, caused, count)


def size_classes(name: np.ndarray, nbytes: np.ndarray, within: float = 0.05) -> np.ndarray:
    """Class id per op: the same op on payloads within `within` of each other is one class. The DP groups of two
    pipeline stages all-reduce gradients of slightly different sizes (3% apart in the tiny GPT-2: embedding vs
    LM head); split by exact size, each stage's groups were judged alone (a pair, or one group: never)."""
    keys, inv = np.unique(name.astype(np.int64) * (1 << 40) + nbytes, return_inverse=True)  # few distinct sizes
    ids = np.empty(len(keys), np.int64)
    cid, start = -1, None
    for i, k in enumerate(keys.tolist()):  # sorted by name, then size
        n, b = divmod(k, 1 << 40)
        if start is None or n != start[0] or b > (1 + within) * start[1]:
            cid, start = cid + 1, (n, b)
        ids[i] = cid
    return ids[inv.ravel()]


def _link_findings(tb: Table, th: Thresholds, unit: np.ndarray, cls: np.ndarray, ratio: np.ndarray,
                   t: np.ndarray, ranks_of, what: str, inst: np.ndarray | None = None) -> list[Finding]:
    """Links (or groups) whose median transfer time stands out among units of the same class. With `inst` (the
    same op instance on every unit, e.g. size class and sequence number: one id per row), a class of exactly two
    units is judged pairwise on the instances both ran."""
    uu, rmed, n = group_median(unit, ratio)
    _, tmed, _ = group_median(unit, t)
    # Consistency: a link slow on the wire is slow in most of its transfers; a few transfers a busy host delayed
    # move a median of few transfers (a job judged on the iterations before a hang) but not this count.
    above = np.bincount(np.searchsorted(uu, unit), ratio > 1.0, len(uu))
    # Jitter of one transfer (median over units of each unit's MAD): a slow link must stand above it.
    _, dev, _ = group_median(unit, np.abs(t - lookup(uu, tmed, unit)))
    jitter = 1.4826 * float(np.median(dev)) if len(dev) else 0.0
    ucls = cls[np.unique(unit, return_index=True)[1]]
    zmin = th.z_for(th.link_z, len(uu))
    out = []
    for c in np.unique(ucls):
        rows = np.flatnonzero(ucls == c)
        if len(rows) < 2:
            continue  # a link with no peer doing the same transfer cannot be judged
        if len(rows) == 2 and inst is not None:
            f = slower_of_two(tb, th, uu[rows], unit, t, inst, zmin, ranks_of, what)
            out += [f] if f else []
            continue
        ref, exc, z = robust_excess(rmed[rows, None], np.zeros(len(rows), np.int64), th.scale_floor)
        for i, k in enumerate(rows):
            peer_t = tmed[k] / rmed[k] * ref[i, 0]
            if not (exc[i, 0] >= th.link_rel and z[i, 0] >= zmin
                    and tmed[k] - peer_t >= max(th.link_abs_ms * MS, th.link_noise * jitter)
                    and sign_p(int(above[k]), int(n[k])) <= th.link_sign_p):
                continue
            rks = tuple(int(x) for x in ranks_of(uu[k]))
            factor = float(rmed[k] / ref[i, 0])
            ev = {"what": what, "transfers": int(n[k]), "median_ms": round(tmed[k] / MS, 4),
                  "peer_median_ms": round(peer_t / MS, 4), "z": round(float(z[i, 0]), 1)}
            label = link_label(rks)
            out.append(Finding("slow-link", rks, [coord(tb, r) for r in rks],
                               f"{factor:.2f}x transfer time on {what} {label}", round(factor, 3),
                               round((tmed[k] - peer_t) / MS, 4), confidence(float(z[i, 0]), 1.0, zmin), ev))
    return out


def _activation_links(tb: Table, si: np.ndarray, uu: np.ndarray, ui: np.ndarray) -> np.ndarray:
    """Per link (sender * world + receiver, sorted in uu; ui: each transfer's link): True where it carries
    activations (forward), by its channel's name (`act` / `grad` among its dot-separated parts) where most of
    its transfers name one, else by stage order (towards a later stage)."""
    stage = tb.coords[:, 1]
    fwd = stage[uu // tb.world] < stage[uu % tb.world]
    parts = [set(g.split(".")) for g, _ in tb.groups] + [set()]
    act = np.array([("act" in p) - ("grad" in p) for p in parts], np.int64)[tb.gkey[si]]  # +1 act, -1 grad, 0
    vote = np.bincount(ui, act, len(uu))
    return np.where(vote > 0, True, np.where(vote < 0, False, fwd))


_PAIR_NOISE = 2.0  # a pair's median difference must reach twice the spread of one instance's difference


def slower_of_two(tb: Table, th: Thresholds, units: np.ndarray, unit: np.ndarray, t: np.ndarray, inst: np.ndarray,
                   zmin: float, ranks_of, what: str) -> Finding | None:
    """The slower of two units doing the same ops (the DP groups of two stages), judged on paired instances.

    Two units have no spread to measure an outlier in (each is the other's), but they repeat the same op: the
    difference of each instance (same op, same sequence number) is a sample of how much slower one is. A slow
    link pays its delay in nearly every instance; a healthy pair differs by chance either way. Both must hold:
    the median difference stands out of its standard error (z), and most instances are slower (sign test); the
    difference must also reach twice the spread of one instance's difference and floor_rel of the faster one,
    the bar of a comparison with one peer: the two groups sit in different stages and meet different load (a
    healthy embedding all-reduce pair differed by 1.12x in 5 of 5 instances before a hang)."""
    ta_of, tb_of = (dict(zip(inst[unit == u].tolist(), t[unit == u].tolist())) for u in units)
    common = sorted(ta_of.keys() & tb_of.keys())
    if len(common) < 5:
        return None
    ta, tb_ = np.array([ta_of[k] for k in common]), np.array([tb_of[k] for k in common])
    d = tb_ - ta
    if np.median(d) < 0:
        d, ta, tb_, units = -d, tb_, ta, units[::-1]
    med, n = float(np.median(d)), len(d)
    spread = max(1.4826 * float(np.median(np.abs(d - med))), th.scale_floor * float(np.median(ta)), 1.0)
    z = med / (1.2533 * spread / math.sqrt(n))  # the sample median's standard error
    slower = int((d > 0).sum())
    ref = float(np.median(ta))
    factor = float(np.median(tb_)) / max(ref, 1.0)
    if not (z >= zmin and factor >= 1 + th.floor_rel and med >= max(th.link_abs_ms * MS, _PAIR_NOISE * spread)
            and sign_p(slower, n) <= th.link_sign_p):
        return None
    rks = tuple(int(x) for x in ranks_of(units[1]))
    ev = {"what": what, "method": "paired instances", "transfers": n, "slower_in": slower,
          "median_ms": round(float(np.median(tb_)) / MS, 4), "peer_median_ms": round(ref / MS, 4),
          "peer": [int(x) for x in ranks_of(units[0])], "median_difference_ms": round(med / MS, 4),
          "difference_spread_ms": round(spread / MS, 4), "z": round(z, 1)}
    label = link_label(rks)
    return Finding("slow-link", rks, [coord(tb, r) for r in rks],
                   f"{factor:.2f}x transfer time on {what} {label} (+{med / MS:.1f} ms in {slower} of {n} "
                   f"instances against its only peer)", round(factor, 3), round(med / MS, 4),
                   confidence(z, slower / n, zmin), ev)


def _cross_stage_links(tb: Table, th: Thresholds, si: np.ndarray, pair: np.ndarray, shared: np.ndarray,
                       xfer: np.ndarray, n_it: int = 0, step_ms: float = 0.0) -> list[Finding]:
    """Slow P2P links by their FLOORS, judged against transfers of the same byte size on the other columns,
    between OTHER stage pairs and in the other direction: a homogeneous pipeline moves the same hidden-state
    tensor (activations up, gradients down) between every pair of adjacent stages. Used for every column count:
    with one or two columns the column view has no peer, and with more its medians carry each receiver's
    scheduling (a +10 ms wire delay on one of four columns: median z 2.6, floor named). Only
    transfers timed on one clock take part (elsewhere the pair-offset assumption has absorbed a constant wire
    delay); a stage pair that legitimately moves more bytes falls in another class.
    The statistic is each link's FLOOR (its fastest transfer): a delay on the wire is paid by every transfer,
    while a healthy link now and then finds its receiver waiting and shows its true cost. Medians do not work
    here: on a busy host they carry each receiver's own scheduling (ms to tens of ms, different per stage pair).
    Few links: reference and spread leave the judged link out; the excess must also clear one transfer's
    own low-end spread (twice, see _FLOOR_NOISE). A delay on only some transfers does not move the floor and
    is not seen here.
    A floor excess must also matter to the job: summed over the link's transfers of one iteration it reaches
    th.link_share of the median iteration (n_it, step_ms). Floors are least-of-sample times of few links, and on
    a shared host healthy ones differ by tenths of a millisecond: 1.45x, 1.54x and 1.78x (+0.05-0.1 ms a
    transfer, 0.2-0.4% of the iteration) on healthy pp 4 and pp 2 dp 2 runs, the 1.54x at confidence 1.00
    (z 21 against three floors within 0.01 ms: their MAD cannot show the spread of a minimum). The wire delays
    this view is for cost 7% and more of the iteration on the same machine."""
    W = tb.world
    if shared.sum() < 3:
        return []
    # Same bytes on the same kind of wire, whichever way (activations up, gradients down: one tensor shape). A
    # wrap-around link (last stage to first and back, an interleaved schedule's chunk boundaries) is another kind
    # of transfer: its receiver is mid-way through another chunk, not waiting at the pipeline's edge, and its
    # fastest transfer sat 1.45x above the adjacent links' on a healthy pp 4 dpp-zb run (issue 25: named at
    # confidence 0.51 on a held-out one). Its peers are the wrap-around links of the other columns; with one
    # column it has none and is judged by the stall views only, as any link without a peer.
    stage = tb.coords[:, 1]
    wrap = np.abs(stage[tb.rank[si[shared]]] - stage[tb.peer[si[shared]]]) > 1
    kind = np.unique(tb.nbytes[si[shared]] * 2 + wrap, return_inverse=True)[1]
    unit, t = pair[shared], xfer[shared]
    uu, tmed, n = group_median(unit, t)
    ui = np.searchsorted(uu, unit)
    floor = np.full(len(uu), np.inf)
    np.minimum.at(floor, ui, t)
    # How sharply each link's times rise from its floor (10th percentile minus floor): a link that seldom finds
    # its receiver waiting has a floor that much above its true cost. The run's typical value floors it.
    low = np.array([np.quantile(t[ui == k], 0.1) for k in range(len(uu))]) - floor
    # The run's typical value is taken per DIRECTION (down or up the pipeline): how often a transfer finds its
    # receiver ready is the receiver's place in the schedule. On real 8-rank runs (1F1B) activations went into a
    # stage mid-work (median 10-20 ms, 10th percentile 0.7-2.2 ms above the floor) while gradients came back to
    # a waiting stage (median ~1 ms, 0.03-0.3 ms); mixed, the tight gradient links set the bar for the loose
    # activation ones, and an activation link that never once found its receiver ready (fastest 1.0 ms, others
    # 0.25 ms, its reverse direction 0.22 ms) was named at confidence 1.00 in 2 of bench_scan_real's 20 8-rank
    # runs. Where the channel names say which way a transfer goes (the engine's pp.act.* and pp.grad.*), they
    # decide: an interleaved schedule's wrap-around link, last stage to first, carries ACTIVATIONS (chunk
    # boundaries) against the stage order; counted as 'up' with the tight gradient links, a healthy
    # interleaved dpp-zb run named it at confidence 0.51 (issue 25).
    down = _activation_links(tb, si[shared], uu, ui)
    typical = np.zeros(len(uu))
    for way in (down, ~down):
        if way.any():
            typical[way] = np.median(low[way])
    noise = np.maximum(low, typical) * _FLOOR_NOISE
    ukind = kind[np.unique(unit, return_index=True)[1]]
    zmin = th.z_for(th.link_z, len(uu))
    out = []
    for c in np.unique(ukind):
        rows = np.flatnonzero(ukind == c)
        if len(rows) < 3:
            continue  # two links: either could be the slow one
        for k in rows:
            others = floor[rows[rows != k]]
            ref = float(np.median(others))
            scale = max(1.4826 * float(np.median(np.abs(others - ref))), th.scale_floor * ref, 1.0)
            exc = floor[k] - ref
            z = exc / scale
            if not (exc >= th.link_rel * ref and z >= zmin
                    and exc >= max(th.link_abs_ms * MS, th.link_noise * noise[k])):
                continue
            share = exc * n[k] / max(n_it, 1) / (step_ms * MS) if step_ms > 0 else None
            if share is not None and share < th.link_share:
                continue  # (no step spans, no iteration time: the bar cannot be applied and is not)
            rks = (int(uu[k] // W), int(uu[k] % W))
            factor = floor[k] / max(ref, 1.0)
            ev = {"what": "P2P", "peers": "other stage pairs and directions, same size, one clock",
                  "transfers": int(n[k]), "floor_ms": round(floor[k] / MS, 4), "peer_floor_ms": round(ref / MS, 4),
                  "median_ms": round(tmed[k] / MS, 4), "noise_ms": round(noise[k] / MS, 4), "z": round(float(z), 1),
                  "share_of_iteration": None if share is None else round(share, 4)}
            out.append(Finding("slow-link", rks, [coord(tb, r) for r in rks],
                               f"{factor:.2f}x fastest transfer on P2P {rks[0]}-{rks[1]} (other stage pairs)",
                               round(factor, 3), round(exc / MS, 4), confidence(float(z), 1.0, zmin), ev))
    return out


