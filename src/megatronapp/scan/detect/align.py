"""Clock alignment: each rank's clock offset (and linear drift) relative to rank 0, from the trace itself.

Anchors: the members of a blocking collective leave it at nearly the same instant (nobody leaves before the
last one arrived), so the END of a matched collective instance is one true instant seen on several clocks. The
start-up handshake (a few world all-reduces) adds anchors joining every rank to rank 0. Send/recv pairs in both
directions add NTP-style bounds (a message never arrives before it was sent) for ranks linked only by P2P.
Per pair of ranks the anchor differences are fitted with a resistant line (medians of thirds: outliers from a
descheduled process do not move it), then held inside the causal bounds every collective gives (nobody leaves
before everyone arrived, and clock reads are only ever late). The pairs form a graph solved from rank 0 along
the most certain paths and then smoothed over loops, so ranks sharing no group with rank 0 are still aligned
transitively.
Model: offset_r(t) = a_r + b_r * (t - o_r), with t on rank r's own clock and o_r the reading of rank r's clock at
one common instant (rank 0's first timestamp): clocks may differ by days, so drift is only ever multiplied by
time measured from that shared instant, never from one start time read on different clocks. A first pass
without drift finds each o_r; the second fits drift around it. Aligned time = t - offset_r(t).
"""
from __future__ import annotations

import heapq
from typing import Any

import numpy as np

from megatronapp.scan.detect.stats import group_median
from megatronapp.scan.read.format import CAT_INDEX, RankTrace

# Collectives whose members all block until every member arrived (broadcast's root may leave early).
ANCHOR_OPS = frozenset({"all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter",
                        "reduce_scatter_tensor", "barrier", "all_to_all"})
_MIN_DRIFT_SPAN_NS = 50_000_000  # below this time span a pair's samples cannot tell drift from noise
_NOISE_FLOOR_NS = 5_000.0
_MAX_DRIFT = 0.01  # 1%: far beyond any real oscillator; bounds the slope search


def _collective_rows(traces: list[RankTrace]) -> tuple[np.ndarray, ...]:
    """(rank, instance key, start, end) of every anchoring collective span and handshake round."""
    gkeys: dict[tuple, int] = {}
    ranks, gks, seqs, starts, ends, hss = [], [], [], [], [], []
    comm = CAT_INDEX["comm"]
    for t in traces:
        hs = t.header.get("handshake")
        if hs and hs.get("exit"):
            gk = gkeys.setdefault(("__handshake__", tuple(hs["group_ranks"])), len(gkeys))
            n = len(hs["exit"])
            ranks.append(np.full(n, t.rank)), gks.append(np.full(n, gk)), seqs.append(np.arange(n))
            ends.append(np.asarray(hs["exit"], dtype=np.int64))
            starts.append(np.asarray(hs.get("send", hs["exit"]), dtype=np.int64))
            hss.append(np.ones(n, bool))
        if not len(t):
            continue
        anchor_name = np.array([n in ANCHOR_OPS for n in t.names] + [False], dtype=bool)
        # Two groups may hold the same ranks (pp and embd at pp=2) with separate counters: key on the name too.
        gmap = np.array([gkeys.setdefault(g, len(gkeys)) for g in t.groups] + [-1], dtype=np.int64)
        m = (t.cat == comm) & (t.gid >= 0) & (t.seq >= 0) & (t.peer < 0) & anchor_name[t.name]
        if not m.any():
            continue
        ranks.append(np.full(int(m.sum()), t.rank)), gks.append(gmap[t.gid[m]]), seqs.append(t.seq[m])
        ends.append(t.ts[m] + t.dur[m])
        starts.append(t.ts[m])
        hss.append(np.zeros(int(m.sum()), bool))
    if not ranks:
        return (*(np.zeros(0, np.int64) for _ in range(4)), np.zeros(0, bool))
    seq = np.concatenate(seqs).astype(np.int64)
    key = np.concatenate(gks).astype(np.int64) * (int(seq.max()) + 1) + seq
    return (np.concatenate(ranks).astype(np.int64), key, np.concatenate(starts), np.concatenate(ends),
            np.concatenate(hss))


def _collective_samples(traces: list[RankTrace]) -> tuple[np.ndarray, ...]:
    """Pair samples (i, j, t_i, end_j - end_i, lower, upper, from handshake) with i the lowest rank of each
    collective instance.

    Nobody leaves before everyone arrived, so off_j - off_i lies in [start_j - end_i, end_j - start_i]."""
    rank, key, start, end, hs = _collective_rows(traces)
    order = np.lexsort((rank, key))
    rank, key, start, end, hs = rank[order], key[order], start[order], end[order], hs[order]
    first = np.r_[True, key[1:] != key[:-1]] if len(key) else np.zeros(0, bool)
    inst = np.cumsum(first) - 1
    head = np.flatnonzero(first)
    ref_rank, ref_end, ref_start = rank[head][inst], end[head][inst], start[head][inst]
    keep = ~first & (rank != ref_rank)  # a rank listed twice in one instance is a corrupt row: ignored
    return (ref_rank[keep], rank[keep], ref_end[keep], (end - ref_end)[keep], (start - ref_end)[keep],
            (end - ref_start)[keep], hs[keep])


def _p2p_samples(traces: list[RankTrace]) -> tuple[np.ndarray, ...]:
    """NTP-style pair samples from send/recv pairs seen in both directions, one per pair and iteration."""
    sends, recvs = [], []
    channels: dict[str, int] = {}  # sequence numbers count per channel (group name): part of the match key
    for t in traces:
        if not len(t):
            continue
        ids = {n: i for i, n in enumerate(t.names)}
        chan = np.array([channels.setdefault(g, len(channels)) for g, _ in t.groups] + [-1], np.int64)
        for name, out in (("send", sends), ("recv", recvs)):
            m = (t.name == ids.get(name, -2)) & (t.peer >= 0) & (t.seq >= 0)
            if m.any():
                # (sender, receiver, seq, iteration, time): start of a send, end of a recv.
                me = np.full(int(m.sum()), t.rank)
                pair = (me, t.peer[m]) if name == "send" else (t.peer[m], me)
                tt = t.ts[m] if name == "send" else t.ts[m] + t.dur[m]
                out.append(np.stack([*pair, (t.seq[m] << 10) + chan[t.gid[m]] + 1,  # < 1023 channel names
                                     t.it[m], tt]).astype(np.int64))
    empty = tuple(np.zeros(0, np.int64) for _ in range(4))
    if not sends or not recvs:
        return empty
    s, r = np.concatenate(sends, axis=1), np.concatenate(recvs, axis=1)
    big = int(max(s[2].max(), r[2].max())) + 1
    w = int(max(s[:2].max(), r[:2].max())) + 1
    ks, kr = (s[0] * w + s[1]) * big + s[2], (r[0] * w + r[1]) * big + r[2]
    common, si, ri = np.intersect1d(ks, kr, assume_unique=False, return_indices=True)
    if not len(common):
        return empty
    src, dst, it = s[0][si], s[1][si], s[3][si]
    d = r[4][ri] - s[4][si]  # = off_dst - off_src + latency
    tsend = s[4][si]
    lo, hi = np.minimum(src, dst), np.maximum(src, dst)
    pkey = (lo * w + hi) * (int(it.max()) + 2) + it
    per_dir = []
    for m in (src == lo, src != lo):  # lower -> higher rank, then the way back
        k, dd, ts = pkey[m], d[m], tsend[m]
        o = np.argsort(k, kind="stable")
        k, dd, ts = k[o], dd[o], ts[o]
        first = np.flatnonzero(np.r_[True, k[1:] != k[:-1]]) if len(k) else np.zeros(0, np.int64)
        per_dir.append((k[first], np.minimum.reduceat(dd, first) if len(k) else dd,
                        np.minimum.reduceat(ts, first) if len(k) else ts))
    (kf, df, tf), (kb, db, _) = per_dir
    both, fi, bi = np.intersect1d(kf, kb, assume_unique=True, return_indices=True)
    pair = both // (int(it.max()) + 2)
    return pair // w, pair % w, tf[fi], (df[fi] - db[bi]) // 2


def _fit_edge(t: np.ndarray, d: np.ndarray, t0: int, lower: np.ndarray | None = None,
              upper: np.ndarray | None = None, startup: np.ndarray | None = None,
              drift: bool = True) -> tuple[float, float, float, bool]:
    """Resistant line d = a + b (t - t0), then kept inside the causal bounds; (a, b, mad, has_slope).

    Slope from the medians of the outer thirds of the run's anchors (start-up handshake rounds, bunched at one
    instant of heavy start-up load, would only tilt it); then, since clock reads are only ever late,
    `lower <= a + b x <= upper` holds for the true line: the slope is moved into the range the bounds allow
    and the level is the middle of the band they leave (the median when there are no bounds)."""
    x = (t - t0).astype(np.float64)
    y = d.astype(np.float64)
    b, has_slope = 0.0, False
    run = ~startup if startup is not None and (~startup).sum() >= 6 else np.ones(len(x), bool)
    xr_, yr_ = x[run], y[run]
    if drift and len(xr_) >= 6 and xr_.max() - xr_.min() >= _MIN_DRIFT_SPAN_NS:
        o = np.argsort(xr_)
        k = len(o) // 3
        xl, xr = np.median(xr_[o[:k]]), np.median(xr_[o[-k:]])
        if xr - xl >= _MIN_DRIFT_SPAN_NS / 2:
            b = (np.median(yr_[o[-k:]]) - np.median(yr_[o[:k]])) / (xr - xl)
            has_slope = True
    if has_slope and lower is not None and upper is not None:
        b = _clip_slope(x, lower.astype(np.float64), upper.astype(np.float64), b)
    a = float(np.median(y - b * x))
    if lower is not None and upper is not None and len(x):
        lo, hi = float(np.max(lower - b * x)), float(np.min(upper - b * x))
        a = 0.5 * (lo + hi)
    mad = float(np.median(np.abs(y - a - b * x)))
    return a, b, mad, has_slope


def _clip_slope(x: np.ndarray, lower: np.ndarray, upper: np.ndarray, b: float) -> float:
    """Move slope `b` into the range of slopes for which some line passes every bound (if that range exists)."""
    def width(bb: float) -> float:  # concave in bb: a min of lines minus a max of lines
        return float(np.min(upper - bb * x) - np.max(lower - bb * x))

    if width(b) >= 0:
        return b
    lo, hi = b - _MAX_DRIFT, b + _MAX_DRIFT
    for _ in range(80):  # ternary search for the widest band
        m1, m2 = lo + (hi - lo) / 3, hi - (hi - lo) / 3
        lo, hi = (m1, hi) if width(m1) < width(m2) else (lo, m2)
    best = 0.5 * (lo + hi)
    if width(best) < 0:
        return b  # the bounds contradict each other: keep the median slope
    inside, outside = best, b  # bisect to the feasible slope nearest the median one
    for _ in range(60):
        mid = 0.5 * (inside + outside)
        inside, outside = (mid, outside) if width(mid) >= 0 else (inside, mid)
    return inside


def estimate_offsets(traces: list[RankTrace], p2p_weight: float = 0.1) -> tuple[dict[int, int], float, dict]:
    """Offsets (ns at time t0) of each rank's clock relative to rank 0, the median anchor residual, and a report.

    The report holds `slope` (ns of offset per ns, per rank), `t0`, `unaligned` ranks (no path to rank 0),
    anchor and edge counts; pass it to `to_reference` to align timestamps including drift."""
    ranks = sorted(t.rank for t in traces)
    report: dict[str, Any] = {"slope": {r: 0.0 for r in ranks}, "t0": 0, "unaligned": [], "anchors": 0,
                              "edges": 0, "p2p_edges": 0}
    if not ranks:
        return {}, 0.0, report
    first = {t.rank: int(t.ts.min()) for t in traces if len(t)}
    t0 = first.get(ranks[0], min(first.values(), default=0))  # one instant, on rank 0's clock
    report["t0"] = t0
    ci, cj, ct, cd, cl, cu, chs = _collective_samples(traces)
    pi, pj, pt, pd = _p2p_samples(traces)
    report["anchors"] = len(ci)
    samples = (((ci, cj, ct, cd, cl, cu, chs), 1.0), ((pi, pj, pt, pd, None, None, None), p2p_weight))
    # Pass 1 (no drift) places t0 on every clock; pass 2 fits drift against time since that shared instant.
    a0, _ = _solve(ranks, _edges(samples, ranks, {}, t0, drift=False, report=report))
    origin = {r: int(round(t0 + a0[r])) if r in a0 else first.get(r, t0) for r in ranks}
    edges = _edges(samples, ranks, origin, t0, drift=True, report=report)
    report["edges"] = len(edges)
    a_of, b_of = _solve(ranks, edges)
    report["unaligned"] = [r for r in ranks if r not in a_of]
    report["origin"] = origin
    offsets = {r: round(a_of.get(r, 0.0)) for r in ranks}
    report["slope"] = {r: float(b_of.get(r, 0.0)) for r in ranks}
    residual = 0.0
    report["residual_by_rank"] = {}
    if len(ci):
        n = max(ranks) + 1
        model = np.array([[a_of.get(r, 0.0), b_of.get(r, 0.0)] for r in range(n)])
        org = np.array([origin.get(r, t0) for r in range(n)], np.int64)
        x = (ct - org[ci]).astype(np.float64)  # time since the shared instant (ppm-close on every clock)
        err = np.abs(cd - (model[cj, 0] + model[cj, 1] * x - model[ci, 0] - model[ci, 1] * x))
        residual = float(np.median(err))
        # Each rank's own residual (where one clock fits badly, its timeline is suspect): the median over the
        # anchors it is either end of, all ranks by one grouped sort (a mask per rank took minutes at 12,288).
        two = ci != cj
        ur, rmed, _ = group_median(np.concatenate([ci, cj[two]]), np.concatenate([err, err[two]]))
        by_rank = dict(zip(ur.tolist(), rmed.tolist()))
        report["residual_by_rank"] = {r: by_rank[r] for r in ranks if r in by_rank}
    return offsets, residual, report


def _edges(samples: tuple, ranks: list[int], origin: dict[int, int], t0: int, drift: bool,
           report: dict) -> list[tuple[int, int, float, float, float, bool]]:
    """One fitted (i, j, a, b, weight, has_slope) per pair of ranks that share anchors, all pairs at once."""
    edges = []
    n = max(ranks) + 1
    org = np.array([origin.get(r, t0) for r in range(n)], np.int64)
    for (si, sj, st, sd, sl, su, sh), scale in samples:
        if not len(si):
            continue
        ekey = si * n + sj
        order = np.argsort(ekey, kind="stable")
        ekey, st, sd = ekey[order], st[order], sd[order]
        if sl is not None:
            sl, su, sh = sl[order], su[order], sh[order]
        uk, gid = np.unique(ekey, return_inverse=True)
        x = (st - org[ekey // n]).astype(np.float64)
        a, b, mad, has_slope = _fit_edges(gid, len(uk), x, sd.astype(np.float64), sl, su, sh, drift)
        cnt = np.bincount(gid, minlength=len(uk))
        w = scale * cnt / (mad + _NOISE_FLOOR_NS) ** 2
        edges += [(int(k // n), int(k % n), float(a[e]), float(b[e]), float(w[e]), bool(has_slope[e]))
                  for e, k in enumerate(uk.tolist())]
        if scale != 1.0:
            report["p2p_edges"] = len(uk)
    return edges


def _gmedian(g: np.ndarray, v: np.ndarray, n: int) -> np.ndarray:
    """Median of v per group id in [0, n), NaN for a group with no sample (stats.group_median, dense)."""
    med = np.full(n, np.nan)
    uk, m, _ = group_median(g, v)
    med[uk] = m
    return med


def _fit_edges(g: np.ndarray, n: int, x: np.ndarray, y: np.ndarray, lower: np.ndarray | None,
               upper: np.ndarray | None, startup: np.ndarray | None, drift: bool
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """`_fit_edge` for every pair at once: samples grouped by g (contiguous, sorted), x the time since the pair's
    origin. Per pair (a, b, mad, has_slope), equal to fitting each pair on its own (tests compare the two); the
    rare pair whose bounds reject the median slope is moved by `_clip_slope`, one pair at a time."""
    cnt = np.bincount(g, minlength=n)
    first = np.concatenate([[0], np.cumsum(cnt)[:-1]])
    run = np.ones(len(x), bool)
    if startup is not None:
        calm = np.bincount(g, ~startup, minlength=n)
        run = ~startup | (calm[g] < 6)
    b = np.zeros(n)
    has_slope = np.zeros(n, bool)
    if drift:
        gr, xr, yr = g[run], x[run], y[run]
        o = np.lexsort((xr, gr))
        gs, xs, ys = gr[o], xr[o], yr[o]
        nr = np.bincount(gs, minlength=n)
        start = np.concatenate([[0], np.cumsum(nr)[:-1]])
        pos = np.arange(len(gs)) - start[gs]
        k = nr // 3
        lo_third, hi_third = pos < k[gs], pos >= (nr - k)[gs]
        xl, xh = _gmedian(gs[lo_third], xs[lo_third], n), _gmedian(gs[hi_third], xs[hi_third], n)
        yl, yh = _gmedian(gs[lo_third], ys[lo_third], n), _gmedian(gs[hi_third], ys[hi_third], n)
        span = np.zeros(n)
        some = nr > 0
        span[some] = xs[start[some] + nr[some] - 1] - xs[start[some]]
        with np.errstate(invalid="ignore"):
            has_slope = (nr >= 6) & (span >= _MIN_DRIFT_SPAN_NS) & (xh - xl >= _MIN_DRIFT_SPAN_NS / 2)
        b[has_slope] = (yh - yl)[has_slope] / (xh - xl)[has_slope]
    bounded = lower is not None and upper is not None
    if bounded:
        lower, upper = lower.astype(np.float64), upper.astype(np.float64)
        width = np.minimum.reduceat(upper - b[g] * x, first) - np.maximum.reduceat(lower - b[g] * x, first)
        for e in np.flatnonzero(has_slope & (width < 0)):
            sl = slice(first[e], first[e] + cnt[e])
            b[e] = _clip_slope(x[sl], lower[sl], upper[sl], float(b[e]))
    a = _gmedian(g, y - b[g] * x, n)
    if bounded:
        a = 0.5 * (np.maximum.reduceat(lower - b[g] * x, first) + np.minimum.reduceat(upper - b[g] * x, first))
    mad = _gmedian(g, np.abs(y - a[g] - b[g] * x), n)
    return a, b, mad, has_slope


def _solve(ranks: list[int], edges: list[tuple]) -> tuple[dict[int, float], dict[int, float]]:
    """Offsets from pair measurements: most-certain-path tree from rank 0, then weighted smoothing over loops."""
    adj: dict[int, list[tuple[int, float, float, float, bool]]] = {r: [] for r in ranks}
    for i, j, a, b, w, s in edges:
        adj.setdefault(i, []).append((j, a, b, w, s))
        adj.setdefault(j, []).append((i, -a, -b, w, s))
    root = ranks[0]
    a_of, b_of = {root: 0.0}, {root: 0.0}
    # Dijkstra on uncertainty; a pair that cannot see drift costs more so drift-aware paths win when present.
    dist, heap = {root: 0.0}, [(0.0, root)]
    while heap:
        c, u = heapq.heappop(heap)
        if c > dist.get(u, np.inf):
            continue
        for v, a, b, w, s in adj.get(u, ()):
            cost = c + (1.0 / w) * (1.0 if s else 100.0)
            if cost < dist.get(v, np.inf):
                dist[v] = cost
                a_of[v], b_of[v] = a_of[u] + a, b_of[u] + b
                heapq.heappush(heap, (cost, v))
    if len(edges) > len(a_of) - 1:  # loops: average their disagreement (Jacobi on the weighted graph)
        e = np.array([(i, j, a, b, w, s) for i, j, a, b, w, s in edges if i in a_of and j in a_of], float)
        if len(e):
            n = int(max(max(a_of), e[:, :2].max())) + 1
            i, j = e[:, 0].astype(int), e[:, 1].astype(int)
            av = np.zeros(n)
            bv = np.zeros(n)
            for r, a in a_of.items():
                av[r], bv[r] = a, b_of[r]
            for vals, col, wts in ((av, 2, e[:, 4]), (bv, 3, e[:, 4] * e[:, 5])):
                wsum = np.bincount(i, wts, n) + np.bincount(j, wts, n)
                free = wsum > 0
                free[root] = False
                for _ in range(100):
                    num = (np.bincount(j, wts * (vals[i] + e[:, col]), n)
                           + np.bincount(i, wts * (vals[j] - e[:, col]), n))
                    vals[free] = 0.5 * vals[free] + 0.5 * num[free] / wsum[free]
            a_of = {r: float(av[r]) for r in a_of}
            b_of = {r: float(bv[r]) for r in b_of}
    return a_of, b_of


def to_reference(rank: int, ts: np.ndarray, offsets_ns: dict[int, int], report: dict | None = None) -> np.ndarray:
    """Convert timestamps on `rank`'s clock to rank 0's clock (ns), using drift from `report` when given."""
    a = offsets_ns.get(rank, 0)
    if report is None or not report.get("slope", {}).get(rank):
        return ts - a
    b = report["slope"][rank]
    o = report.get("origin", {}).get(rank, report["t0"])
    return ts - a - np.round(b * (ts - o).astype(np.float64)).astype(np.int64)


def row_offsets(rank: np.ndarray, ts: np.ndarray, offsets_ns: dict[int, int], report: dict | None = None
                ) -> np.ndarray:
    """Per timestamp (`ts` read on clock `rank[i]`), the ns to subtract to put it on rank 0's clock: the rank's
    offset, plus its drift times the time since the shared instant when `report` (from estimate_offsets) holds it."""
    n = int(rank.max()) + 1 if len(rank) else 0
    a = np.zeros(n, np.int64)
    b = np.zeros(n)
    o = np.zeros(n, np.int64)
    slope, origin = (report or {}).get("slope", {}), (report or {}).get("origin", {})
    t0 = int((report or {}).get("t0", 0))
    for r in range(n):
        a[r] = int(offsets_ns.get(r, 0))
        b[r] = float(slope.get(r, 0.0))
        o[r] = int(origin.get(r, t0))
    # Drift only ever multiplies time since the shared instant (ms to hours), never a raw clock reading (days).
    return a[rank] + np.round(b[rank] * (ts - o[rank]).astype(np.float64)).astype(np.int64)


def clock_domains(traces: list[RankTrace], world: int) -> np.ndarray:
    """Per rank, the id of the clock it read (-1: unknown). Processes on one booted Linux host read one
    CLOCK_MONOTONIC (CUDA-event times are re-anchored to it), so two ranks whose headers name the same host and
    clock kind share a clock exactly: their offset is 0, no estimate needed. Boot ids, where both headers carry
    one, must agree (a host name reused after a reboot, or by a container on another machine); a rank without
    one on a host whose ranks report several boot ids is left unknown rather than guessed."""
    dom = np.full(world, -1, np.int64)
    by_host: dict[tuple[str, str], list[tuple[int, str | None]]] = {}
    for t in traces:
        host, clock = t.header.get("host"), t.header.get("clock")
        if isinstance(host, str) and host and clock in ("monotonic_ns", "cuda_event") and 0 <= t.rank < world:
            by_host.setdefault((host, "monotonic"), []).append((t.rank, t.header.get("boot_id") or None))
    ids: dict[tuple, int] = {}
    for key, members in by_host.items():
        boots = {b for _, b in members if b}
        for r, b in members:
            if b is None and len(boots) > 1:
                continue
            dom[r] = ids.setdefault((*key, b or next(iter(boots), None)), len(ids))
    return dom
