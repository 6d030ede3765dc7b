"""Evidence that holds on a busy machine and with few peers: op floors, send stalls, the run's own noise.

Real runs on shared CPUs (or GPUs sharing hosts with noisy neighbours) are dominated by one-sided noise: a
process that is descheduled only ever takes LONGER. Per-iteration totals then vary several-fold between healthy
replicas, and with only two ranks per pipeline stage a median/MAD comparison is symmetric (each is "the outlier"
of the other). Three views do not depend on that:

1. Op floors. The fastest repeats of an op (a low quantile over microbatches and iterations) are what the op
   costs when nobody interferes; contention inflates the slow tail far more than the floor. A slow rank's floors
   are above its peers' for every kind of op (forward AND backward), which is asymmetric even with one peer:
   the higher floors are the slower rank. Noise and victims' scheduling delays lift one kind at a time.
2. Send stalls. The time between a rank's last own activity and the posting of a send (or collective) is ~0 in
   healthy code; a link that delays each transfer at its ends shows up as a stall before exactly the sends
   towards the other end, on BOTH ends. Compared with the same send (same stages, same sequence number) of the
   other pipeline columns.
3. Run noise. How far a rank's per-iteration value strays above its own median in a healthy-looking rank (the
   median over ranks), used as an extra floor under any per-iteration finding: nothing smaller is called a fault.
"""
from __future__ import annotations

import math
import warnings

import numpy as np

from megatronapp.scan.detect.findings import Finding, Thresholds
from megatronapp.scan.detect.stats import by_key_then_value
from megatronapp.scan.detect.table import Table, coord
from megatronapp.scan.read.format import CAT_INDEX

MS = 1e6
_COMPUTE, _COMM, _OPT, _DATA = (CAT_INDEX[c] for c in ("compute", "comm", "optimizer", "data"))


# Expected (max - median) of n standard normal samples (Monte Carlo, 200,000 draws per n): how far the largest
# of n iterations reaches above the middle by chance alone. It grows with n, so a short window shows less of
# the run's jitter than a long one.
_EXPECTED_REACH = {3: 0.849, 4: 1.027, 5: 1.162, 6: 1.268, 7: 1.353, 8: 1.423, 9: 1.483, 10: 1.538}


def excursion_noise(x: np.ndarray, present: np.ndarray) -> float:
    """Median over ranks of (max - median) of each rank's per-iteration values: the run's typical upward jitter.

    Windows under 10 iterations are scaled up to what 10 would show (a job judged on the 4 iterations it
    finished before a hang showed 1.7 ms of jitter and a 7 ms one-off passed as a pause)."""
    rows = x[present]
    n = int(np.isfinite(rows).sum(axis=1).max(initial=0)) if rows.size else 0
    if n < 3 or not np.isfinite(rows).any():
        return 0.0
    with np.errstate(all="ignore"):
        up = np.nanmax(rows, axis=1) - np.nanmedian(rows, axis=1)
    typical = float(np.nanmedian(up)) if np.isfinite(up).any() else 0.0
    return typical * _EXPECTED_REACH[10] / _EXPECTED_REACH[min(n, 10)]


# ----------------------------------------------------------------------------- helpers
def group_quantile(keys: np.ndarray, vals: np.ndarray, q: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(unique keys, lower q-quantile of vals per key, count per key), by one sort."""
    o = by_key_then_value(keys, vals)
    k, v = keys[o], vals[o]
    uk, start, cnt = np.unique(k, return_index=True, return_counts=True)
    return uk, v[start + np.floor(q * (cnt - 1)).astype(np.int64)], cnt


def loo_median(keys: np.ndarray, vals: np.ndarray) -> np.ndarray:
    """Per element: the median of the OTHER elements with the same key (NaN when it is alone)."""
    out = np.full(len(vals), np.nan)
    if not len(vals):
        return out
    o = by_key_then_value(keys, vals)
    k, v = keys[o], vals[o].astype(float)
    uk, start, cnt = np.unique(k, return_index=True, return_counts=True)
    g = np.searchsorted(uk, k)
    n, s0 = cnt[g], start[g]
    p = np.arange(len(k)) - s0  # position in its sorted group

    def rest(j: np.ndarray) -> np.ndarray:  # the j-th of the others, in sorted order
        return v[np.minimum(s0 + j + (j >= p), len(v) - 1)]

    m = n - 1  # how many others
    lo, hi = rest(np.maximum((m - 1) // 2, 0)), rest(np.maximum(m // 2, 0))
    res = np.where(m >= 1, (lo + hi) / 2, np.nan)
    out[o] = res
    return out


# ----------------------------------------------------------------------------- 1. op floors
_NO_LONE = object()  # floor_findings called without stage information: lone stages are left to structure.py


def op_floors(tb: Table, excl: np.ndarray, iters: np.ndarray, q: float) -> tuple | None:
    """The compute ops of the judged iterations, by kind: (rank, exclusive ms, iteration index and kind id per op;
    kind keys; per rank x kind, the q-floor in ms and the repeats per iteration). A kind is an op name and chunk
    (microbatches and iterations are its repeats); one with fewer than 3 repeats on a rank has no floor there.
    None when there is no compute op."""
    m = (tb.cat == _COMPUTE) & np.isin(tb.it, iters)
    if not m.any() or len(iters) == 0:
        return None
    W, n_it = tb.world, len(iters)
    rank, x = tb.rank[m], excl[m].astype(float) / MS
    iti = np.searchsorted(iters, tb.it[m])
    ukind, kind = np.unique(tb.name[m] * 1_000 + np.maximum(tb.chunk[m], 0), return_inverse=True)
    K = len(ukind)
    keys, fl, cnt = group_quantile(rank * K + kind, x, q)
    floor = np.full((W, K), np.nan)
    count = np.zeros((W, K))
    enough = cnt >= 3
    floor.ravel()[keys[enough]] = fl[enough]
    count.ravel()[keys[enough]] = cnt[enough] / n_it
    return rank, x, iti, kind, ukind, floor, count


def floor_findings(tb: Table, excl: np.ndarray, iters: np.ndarray, th: Thresholds,
                   stage_work: dict[int, float] | None | object = _NO_LONE) -> list[Finding]:
    """Slow-compute ranks: compute-op floors above those of the ranks doing the same work (>= 1 peer).

    A rank alone in its stage (a pure pipeline) has no such peer: its floors are compared with the other
    stages' floors of the same kind of op (a layer's forward is a layer's forward), each scaled by the stage's
    expected work (`stage_work`, from a cost model) when the headers carry it (None: equal stages; not passed:
    lone stages are not judged here). Floors are what an op costs undisturbed, so unlike per-iteration totals
    they are not swamped by the host noise of a busy machine. A rank with stage peers whose floors are only
    moderately above theirs is also named when its compute is above theirs in nearly every iteration by a wide
    median margin (`_peer_ratio`), unless a rank of its own TP group is named and slower (it is that rank's
    victim)."""
    lone_ok = stage_work is not _NO_LONE
    work_of = stage_work if isinstance(stage_work, dict) else {}
    ops = op_floors(tb, excl, iters, th.floor_q)
    if ops is None:
        return []
    rank, x, iti, kind, ukind, floor, count = ops
    W, n_it, K = tb.world, len(iters), len(ukind)
    stage = tb.coords[:, 1]
    per_it = np.full(W * K * n_it, np.inf)
    np.minimum.at(per_it, (rank * K + kind) * n_it + iti, x)
    per_it = np.where(np.isinf(per_it), np.nan, per_it).reshape(W, K, n_it)
    # Peers' floors: leave-one-out median within the stage (a plain median from 5 ranks on, as elsewhere).
    ref = np.full((W, K), np.nan)
    ref_it = np.full((W, K, n_it), np.nan)
    present = np.isin(np.arange(W), rank)
    # An op kind no peer ran gives an all-NaN median: NaN, dropped by `ok` below. numpy says so by a warning, not
    # through errstate; the suite printed it for every 2-rank and per-layer job.
    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        work = np.array([work_of.get(int(x), 1.0) for x in stage], float)[:, None]
        for s in np.unique(stage[present]):
            members = np.flatnonzero((stage == s) & present)
            if len(members) < 2:
                others = np.flatnonzero(present & (stage != s))
                if lone_ok and len(others) >= 2:  # a lone stage: the other stages' floors, per unit of work
                    r = members[0]
                    ref[r] = np.nanmedian(floor[others] / work[others], axis=0) * work[r]
                    ref_it[r] = np.nanmedian(per_it[others] / work[others, :, None], axis=0) * work[r]
                continue
            if len(members) >= 5:
                ref[members] = np.nanmedian(floor[members], axis=0)
                ref_it[members] = np.nanmedian(per_it[members], axis=0)
                continue
            for i, r in enumerate(members):
                others = np.delete(members, i)
                ref[r] = np.nanmedian(floor[others], axis=0)
                ref_it[r] = np.nanmedian(per_it[others], axis=0)
        # An op whose peers' floor is 0 (a marker span, a zero-length kernel) gives no ratio to judge by: a finite
        # cost over nothing was written as `Infinity` into the JSON report.
        ok = np.isfinite(floor) & np.isfinite(ref) & (ref > 0)
        mine = np.where(ok, floor * count, 0).sum(axis=1)
        theirs = np.where(ok, ref * count, 0).sum(axis=1)
        ratio = mine / np.maximum(theirs, 1e-9)
        excess = mine - theirs  # ms per iteration, at floor speed
        # Consistency: the rank's fastest op of each iteration, against its peers' in that iteration.
        okc = ok[:, :, None] & np.isfinite(per_it) & np.isfinite(ref_it)
        it_ratio = (np.where(okc, per_it * count[:, :, None], 0).sum(axis=1)
                    / np.maximum(np.where(okc, ref_it * count[:, :, None], 0).sum(axis=1), 1e-9))
        # A slow rank (slower clock, throttling, a slow device) is slow at EVERY kind of op that is a real share
        # of its work; contention and the scheduling a victim suffers when its inputs arrive mid-op inflate one
        # kind at a time. The smallest op kinds that together make under MINOR_OP of the work are left out: they
        # may run where the slowness is not (a 13x-slow real DDP rank's input `aten::randn`, 5% of its work on the
        # host, at 1.00x beside 9.7x and 8.0x forward and backward, kept this path from a rank its per-iteration
        # view lost to a noisy window). A tail, not every small kind: with many even kinds (a GPU trace's kernels)
        # each is small, and all of them together are the work.
        weakest = np.nanmin(np.where(ok & ~_minor_tail(np.where(ok, ref * count, 0)), floor / ref, np.inf), axis=1)
    rel = th.floor_rel
    high = it_ratio > 1 + rel / 4
    frac = high.mean(axis=1)
    hit = (ok.any(axis=1) & (ratio >= 1 + rel) & (weakest >= 1 + rel / 2) & (excess >= th.abs_ms)
           & (frac >= th.persistent))
    q = _peer_ratio(rank, iti, x, stage, present, W, n_it)
    judged = np.isfinite(q).sum(axis=1)
    # Where the trace records no CPU waits (PyTorch profiler traces, older recordings), contention is inside the
    # compute judged, so an iteration counts only where the rank is 10%+ above (the per-iteration floor bar), not
    # by a hair: real DDP ranks on 2 cores beside 4 busy processes read 1.3-2.4x in most iterations and 1.02-1.05x
    # in 1-2 of 8, and were named at confidence 0.69 (a healthy job) and 1.00. Where waits are recorded, compute
    # is judged without them and any margin is the rank's own (a 1.4x rank of a quiet recording: 1.01-1.09x in 2 of
    # 10 iterations).
    margin = rel / 4 if tb.cpu_wait is None else 0.0
    above = (q > 1 + margin).sum(axis=1)
    cons_factor = np.ones(W)
    enough = judged >= _CONSISTENT_MIN_IT
    if enough.any():
        cons_factor[enough] = np.nanmedian(q[enough], axis=1)
    # A second path, for a slow rank of a noisy run whose floors stay under the bar: its floors above its peers'
    # all the same (1 + rel/4: a victim waiting on async ops inside its compute spans has normal floors), and its
    # compute per iteration above theirs in nearly every iteration by a wide median margin.
    candidate = ~hit & ok.any(axis=1) & (ratio >= 1 + rel / 4) & (excess >= th.abs_ms) & \
        (cons_factor >= 1 + rel / 2) & np.array([n >= _CONSISTENT_MIN_IT and sign_p(int(a), int(n)) <= _CONSISTENT_P
                                                 for a, n in zip(above, judged)])
    # ...unless a rank of its own TP group (same dp and pp) is named and slower: a TP peer of a slow rank waits for
    # it in every layer, partly inside its compute spans (a real 8-rank run: a 5x rank's TP peer read 1.23x in 8 of
    # 8 iterations, floors 1.3x).
    tp_group = tb.coords[:, 0] * (int(stage.max()) + 1) + stage
    consistent = candidate.copy()
    for r in np.flatnonzero(candidate):
        mates = np.flatnonzero(present & (tp_group == tp_group[r]) & (np.arange(W) != r))
        if np.any(hit[mates] | (candidate[mates] & (cons_factor[mates] > cons_factor[r]))):
            consistent[r] = False
    out = []
    for r in np.flatnonzero(hit | consistent):
        peers = int(((stage == stage[r]) & present).sum()) - 1
        lone = peers == 0
        by_op = {tb.names[int(ukind[j]) // 1_000]: round(float(floor[r, j] / ref[r, j]), 3)
                 for j in range(K) if ok[r, j]}
        ev = {"method": "op floors" + (" against the other stages" if lone else ""), "floor_ratio_by_op": by_op,
              "peers": peers, "iterations": [int(t) for t, h in zip(iters, high[r]) if h],
              "floor_ms_per_iteration": round(float(mine[r]), 3),
              "peer_floor_ms_per_iteration": round(float(theirs[r]), 3)}
        # Honest confidence: 0.5 at the threshold, 1.0 at twice it, scaled by consistency; one peer is weaker
        # evidence than several (a peer that is itself unusually fast cannot be told apart from a slow rank).
        if hit[r]:
            conf = min(1.0, 0.5 + (ratio[r] - 1 - rel) / (2 * rel)) * frac[r]
            factor, what = ratio[r], f"{ratio[r]:.2f}x compute at its fastest"
        else:
            conf = min(1.0, 0.5 + (cons_factor[r] - 1 - rel / 2) / rel) * above[r] / judged[r]
            factor = cons_factor[r]
            what = (f"{factor:.2f}x compute, {f'{margin:.0%}+ ' if margin else ''}above its peers in {above[r]} of "
                    f"{judged[r]} iterations (floors {ratio[r]:.2f}x)")
            ev.update(method="compute above its peers in nearly every iteration, floors above too",
                      iterations=[int(t) for t, v in zip(iters, q[r]) if v > 1 + margin], sign_p=round(sign_p(
                          int(above[r]), int(judged[r])), 5), compute_ratio_by_iteration=[
                          None if not np.isfinite(v) else round(float(v), 3) for v in q[r]])
        conf *= 0.85 if peers <= 1 else 1.0  # one peer, or only other stages' work (a lone stage)
        out.append(Finding("slow-compute", (int(r),), [coord(tb, r)],
                           f"{what} (+{excess[r]:.1f} ms per iteration at floor speed)",
                           round(float(factor), 3), round(float(excess[r]), 3), round(float(conf), 3), ev))
    return out


MINOR_OP = 0.1  # the smallest op kinds under this share of a rank's floor time together: not judged for "all ops"


def _minor_tail(weight: np.ndarray) -> np.ndarray:
    """Per row: the op kinds, smallest weight first, whose running total stays under MINOR_OP of the row's."""
    order = np.argsort(weight, axis=1, kind="stable")
    w = np.take_along_axis(weight, order, axis=1)
    cum = np.cumsum(w, axis=1) / np.maximum(w.sum(axis=1, keepdims=True), 1e-12)
    tail = np.zeros(weight.shape, bool)
    np.put_along_axis(tail, order, cum < MINOR_OP, axis=1)
    return tail
_CONSISTENT_P = 0.02  # one-sided sign test over iterations: 9 of 10 above the peers (p 0.011), 8 of 8 (0.004)
_CONSISTENT_MIN_IT = 7  # fewer iterations: even all of them above the peers is weak evidence


def _peer_ratio(rank: np.ndarray, iti: np.ndarray, x: np.ndarray, stage: np.ndarray, present: np.ndarray,
                W: int, n_it: int) -> np.ndarray:
    """Per rank and iteration: its exclusive compute over its stage peers' median (NaN without peers). On a busy
    host a 1.5x rank of ~30 ms iterations clears the run's jitter in ms in some iterations only, but its sign
    does not waver: above its peers in every iteration (1.15-1.78x) where healthy ranks sit above in about half
    (0.78-1.24x)."""
    comp = np.bincount(rank * n_it + iti, x, W * n_it).reshape(W, n_it)
    comp[~present] = np.nan
    q = np.full((W, n_it), np.nan)
    with np.errstate(all="ignore"):
        for s in np.unique(stage[present]):
            members = np.flatnonzero(present & (stage == s))
            if len(members) >= 5:  # the plain stage median, as elsewhere (one rank barely moves it)
                q[members] = comp[members] / np.nanmedian(comp[members], axis=0)
                continue
            for i, r in enumerate(members if len(members) > 1 else []):
                q[r] = comp[r] / np.nanmedian(comp[np.delete(members, i)], axis=0)
    return np.where(np.isfinite(q), q, np.nan)


def sign_p(k: int, n: int) -> float:
    """One-sided sign test: P(at least k of n fair coin flips come up heads)."""
    return sum(math.comb(n, j) for j in range(k, n + 1)) / 2.0 ** n if n else 1.0


# ----------------------------------------------------------------------------- 2. send stalls
def posting_stall(tb: Table, comm_ends: bool = False) -> np.ndarray:
    """Per row: time (ns) from the rank's last own activity before it to its start (0 for the first row).

    Own activity: every span start, and the end of work spans (compute, optimizer, data). Comm ends are not: an
    asynchronous op (a receive posted ahead, a gradient bucket) completes while the rank does something else, or
    stalls; the iteration's step span ends after everything. With `comm_ends` they are (for collectives,
    which are often posted right after waiting on earlier asynchronous ones: that wait is not a stall)."""
    n = len(tb.ts)
    if not n:
        return np.zeros(0, np.int64)
    own = (_COMPUTE, _OPT, _DATA, _COMM) if comm_ends else (_COMPUTE, _OPT, _DATA)
    event = np.where(np.isin(tb.cat, own), tb.end, tb.ts)
    new_rank = np.r_[True, tb.rank[1:] != tb.rank[:-1]]
    run = np.empty(n, np.int64)
    start = np.flatnonzero(new_rank)
    for a, b in zip(start, np.r_[start[1:], n]):  # rows are sorted by (rank, ts): one running max per rank
        run[a:b] = np.maximum.accumulate(event[a:b])
    prev = np.where(new_rank, tb.ts, np.r_[tb.ts[:1], run[:-1]])
    return np.maximum(tb.ts - np.minimum(prev, tb.ts), 0)


def stall_link_findings(tb: Table, stall: np.ndarray, iters: np.ndarray, th: Thresholds) -> list[Finding]:
    """Slow links seen as stalls before posting the sends between two ranks, in both directions."""
    nid = {n: i for i, n in enumerate(tb.names)}
    send = np.flatnonzero((tb.cat == _COMM) & (tb.peer >= 0) & (tb.name == nid.get("send", -2)) & (tb.seq >= 0)
                          & np.isin(tb.it, iters))
    if not len(send):
        return []
    W = tb.world
    stage = tb.coords[:, 1]
    src, dst = tb.rank[send], tb.peer[send]
    pair = src * W + dst
    # The same send on other columns: same stages, size and sequence number.
    names: dict[str, int] = {}
    chan = np.array([names.setdefault(g, len(names)) for g, _ in tb.groups] + [-1], np.int64)[tb.gkey[send]]
    size_id = np.unique(tb.nbytes[send], return_inverse=True)[1].ravel()
    P = int(stage.max()) + 1
    # Same stages, channel (group name: act/grad, up/down) and size.
    cls = ((stage[src] * P + stage[dst]) * (len(names) + 1) + chan + 1) * (int(size_id.max()) + 1) + size_id
    inst = cls * (int(tb.seq[send].max()) + 1) + tb.seq[send]
    v = stall[send].astype(float) / MS
    excess = v - loo_median(inst, v)
    fin = np.isfinite(excess)
    if not fin.any():
        return []
    up, n_s = np.unique(pair[fin], return_counts=True)
    pi = np.searchsorted(up, pair[fin])
    _, med, _ = group_quantile(pair[fin], excess[fin], 0.5)
    frac = np.bincount(pi, excess[fin] >= th.stall_abs_ms, len(up)) / n_s
    # What the stalls cost the sender per iteration: the part of the host time a link end loses to its link.
    lost = np.bincount(pi, np.maximum(excess[fin], 0), len(up)) / max(len(iters), 1)
    _, stall_med, _ = group_quantile(pair[fin], v[fin], 0.5)
    _, peer_med, _ = group_quantile(pair[fin], (v - excess)[fin], 0.5)
    flagged: dict[tuple[int, int], dict] = {}
    for j in np.flatnonzero((n_s >= 2) & (med >= th.stall_abs_ms) & (frac >= th.persistent)):
        a, b = int(up[j] // W), int(up[j] % W)
        flagged[(a, b)] = {"sends": int(n_s[j]), "stall_ms": round(float(stall_med[j]), 3),
                           "peer_stall_ms": round(float(peer_med[j]), 3), "excess_ms": float(med[j]),
                           "frac": float(frac[j]), "lost_ms": float(lost[j])}
    out = []
    for (a, b), fa in flagged.items():
        fb = flagged.get((b, a))
        if fb is None or a > b:
            continue  # one end only: the sender's own problem, left to the self-time views
        excess_ms = (fa["excess_ms"] + fb["excess_ms"]) / 2
        base = max((fa["peer_stall_ms"] + fb["peer_stall_ms"]) / 2, th.stall_floor_ms)
        factor = (base + excess_ms) / base
        conf = min(1.0, 0.5 + (excess_ms - th.stall_abs_ms) / (8 * th.stall_abs_ms)) * min(fa["frac"], fb["frac"])
        ev = {"what": "P2P", "method": "send stalls", "transfers": fa["sends"] + fb["sends"],
              "directions": [[a, b], [b, a]], "stall_ms": [fa["stall_ms"], fb["stall_ms"]],
              "peer_stall_ms": [fa["peer_stall_ms"], fb["peer_stall_ms"]],
              "median_ms": round(base + excess_ms, 4), "peer_median_ms": round(base, 4),
              "stall_ms_per_iteration": {a: round(fa["lost_ms"], 3), b: round(fb["lost_ms"], 3)}}
        out.append(Finding("slow-link", (a, b), [coord(tb, a), coord(tb, b)],
                           f"+{excess_ms:.1f} ms stalled before each send on link {a}-{b} (both directions)",
                           round(float(factor), 3), round(float(excess_ms), 3), round(float(conf), 3), ev))
    return out

