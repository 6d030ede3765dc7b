"""Root-cause detection: which rank or link slows the job down, told apart from the ranks that only wait for it.

Three views of the same trace, each robust to noise (median/MAD statistics, with a relative AND an absolute
minimum effect before anything is called a fault):

1. Self time. Per rank and iteration, the time the rank spent on its own: exclusive compute (compute spans minus
   the comm spans nested in them), data loading and untraced gaps; everything else is waiting. Peers doing the
   same work (all ranks of one pipeline stage: DP replicas and TP peers) should have the same self time. A rank
   above its peers in most iterations is a slow-compute rank (excess in compute) or a late arriver (excess in
   data / untraced time); in a few iterations only, a transient pause. A victim's extra time is waiting, never
   self time, so victims are not blamed. Durations on one clock need no clock alignment.
2. Links. P2P transfer time per (src, dst) pair and the pure collective time of each group (the time from the
   last arrival to the end, i.e. the shortest member duration) against peers doing the same transfer.
3. Waits. At each matched collective the last arrival makes the others wait; at each recv the sender does. A
   wait is charged to the late rank only when its lateness is not explained by waits it suffered itself earlier
   in the iteration (then it is a victim passing a delay on). The result, "others waited X ms for this rank",
   is the evidence attached to findings and the ranking of who everyone waits for.

Real runs on busy machines and stages with few ranks add evidence.py: op floors (a slow rank's fastest repeats
are slower, which holds even with one peer), stalls before posting sends (a link that delays transfers at its
ends), and the run's own jitter as a floor under every per-iteration finding, so a healthy noisy run is quiet.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from megatronapp.scan import ring
from megatronapp.scan.align import clock_domains, row_offsets
from megatronapp.scan.contention import cpu_wait_share, starved_note
from megatronapp.scan.evidence import excursion_noise, floor_findings, posting_stall, sign_p, stall_link_findings
from megatronapp.scan.findings import KINDS, Finding, Report, Thresholds
from megatronapp.scan.format import CAT_INDEX, COLUMNS, RankTrace
from megatronapp.scan.hang import hang_findings
from megatronapp.scan.layercost import layer_findings, measured_stage_work
from megatronapp.scan.structure import collective_stall_findings, lone_stage_findings, lone_stage_pauses

__all__ = ["KINDS", "Analysis", "Finding", "Report", "Thresholds", "analyse", "detect"]

MS = 1e6
_FLOOR_NOISE = 2.0  # a link's floor must stand twice its own low-end spread above its peers' (_cross_stage_links)
_NEST_SLACK_NS = 2_000  # a child may end a hair after its parent (clock reads in a different order)
_COMPUTE, _COMM, _DATA, _OPT, _STEP = (CAT_INDEX[c] for c in ("compute", "comm", "data", "optimizer", "step"))
_LAYER = CAT_INDEX["layer"]


# ----------------------------------------------------------------------------- the joined span table
@dataclass
class Table:
    """All ranks' spans in one set of columns, sorted by (rank, ts), with global name and group ids."""

    world: int
    coords: np.ndarray  # [rank] -> (dp, pp, tp)
    names: list[str]
    groups: list[tuple[str, tuple[int, ...]]]
    rank: np.ndarray
    name: np.ndarray
    cat: np.ndarray
    ts: np.ndarray
    dur: np.ndarray
    it: np.ndarray
    gkey: np.ndarray
    seq: np.ndarray
    peer: np.ndarray
    nbytes: np.ndarray
    mb: np.ndarray
    chunk: np.ndarray
    clock: np.ndarray | None = None  # [rank] -> shared-clock id (align.clock_domains; -1: own clock, unknown)
    cpu_wait: np.ndarray | None = None  # per span: ns runnable but waiting for a CPU (-1 unknown); None: no span has it

    @property
    def end(self) -> np.ndarray:
        return self.ts + self.dur


def join(traces: list[RankTrace]) -> Table:
    """Concatenate rank traces into one table with global string and group ids."""
    world = max([t.world for t in traces] + [t.rank + 1 for t in traces] + [0])
    coords = np.full((world, 3), -1, np.int64)
    names: dict[str, int] = {}
    groups: dict[tuple, int] = {}
    nmap: list[int] = []  # every trace's local -> global ids, one after another
    gmap: list[int] = []
    noff, goff = [], []  # where each trace's part of nmap / gmap starts
    for t in traces:
        coords[t.rank] = t.coord
        noff.append(len(nmap))
        nmap += [names.setdefault(n, len(names)) for n in t.names]
        goff.append(len(gmap))
        gmap += [groups.setdefault((g, tuple(r)), len(groups)) for g, r in t.groups]
    # One concatenation per column (not one conversion per rank and column): thousands of ranks read as one table.
    lens = np.array([len(t) for t in traces], np.int64)
    c = {"rank": np.repeat(np.array([t.rank for t in traces], np.int64), lens)}
    for k in ("name", "gid", "cat", "ts", "dur", "it", "seq", "peer", "nbytes", "mb", "chunk"):
        c[k] = np.concatenate([np.asarray(getattr(t, k)) for t in traces]).astype(np.int64) if traces \
            else np.zeros(0, np.int64)
    names_at = np.array(nmap + [-1], np.int64)
    groups_at = np.array(gmap + [-1], np.int64)
    c["name"] = names_at[c["name"] + np.repeat(np.array(noff, np.int64), lens)]
    gid = c.pop("gid")
    c["gkey"] = np.where(gid >= 0, groups_at[np.maximum(gid + np.repeat(np.array(goff, np.int64), lens), 0)], -1)
    c["clock"] = clock_domains(traces, world)
    # Only traces that measured it (format 2, host-timed work spans) carry a column worth its memory at scale.
    if any(len(t.cpu_wait) and t.cpu_wait.max() >= 0 for t in traces):
        c["cpu_wait"] = np.concatenate([np.asarray(t.cpu_wait) for t in traces]).astype(np.int64)
    r, ts = c["rank"], c["ts"]
    # Sorted by (rank, ts) already (the simulator's files, most real ones): skip the sort; lexsort is stable, so
    # the order is the same either way.
    if np.all((r[1:] > r[:-1]) | ((r[1:] == r[:-1]) & (ts[1:] >= ts[:-1]))):
        return Table(world, coords, list(names), list(groups), **c)
    order = np.lexsort((ts, r))
    return Table(world, coords, list(names), list(groups), **{k: (v if k == "clock" else v[order])
                                                              for k, v in c.items()})


# ----------------------------------------------------------------------------- 1. self time
@dataclass
class Phases:
    """Per (rank, iteration) time in ms: compute (exclusive), data, gap (untraced), comm, self, window."""

    iters: np.ndarray
    compute: np.ndarray
    data: np.ndarray
    gap: np.ndarray
    comm: np.ndarray
    window: np.ndarray
    excl: np.ndarray  # per table row: duration minus nested comm (ns)

    @property
    def self_time(self) -> np.ndarray:
        return self.compute + self.data + self.gap


def phases(tb: Table) -> Phases:
    """Split each rank's iterations into own work, untraced gaps and communication."""
    step = tb.cat == _STEP
    iters = np.unique(tb.it[step] if step.any() else tb.it[tb.it >= 0])
    n_it, W = len(iters), tb.world
    shape = (W, max(n_it, 1))
    ok = np.isin(tb.it, iters)
    iti = np.searchsorted(iters, tb.it).clip(0, max(n_it - 1, 0))
    flat = tb.rank * shape[1] + iti

    def per_cell(mask: np.ndarray, values: np.ndarray) -> np.ndarray:
        m = mask & ok
        return np.bincount(flat[m], values[m], W * shape[1]).reshape(shape)

    work = np.isin(tb.cat, (_COMPUTE, _OPT, _DATA))
    excl = exclusive_time(tb, work)
    end, comm = tb.end, tb.cat == _COMM
    compute = per_cell(work & (tb.cat != _DATA), excl)
    data = per_cell(tb.cat == _DATA, excl)
    # Comm time as the union of comm intervals (async spans overlap), rest of the window is untraced gap.
    win_end = np.full(shape, np.nan)
    win_end_flat = win_end.ravel()
    sm = step & ok
    win_end_flat[flat[sm]] = end[sm]
    win_start = np.full(shape, np.nan)
    win_start.ravel()[flat[sm]] = tb.ts[sm]
    # An iteration's window starts where the previous one ended: stalls between iterations count too.
    prev_end = np.concatenate([win_start[:, :1], win_end[:, :-1]], axis=1)
    start = np.where(np.isnan(prev_end), win_start, prev_end)
    window = win_end - start
    cover = _union_per_cell(tb, ~step & ok, flat, W * shape[1]).reshape(shape)
    commu = _union_per_cell(tb, comm & ok, flat, W * shape[1]).reshape(shape)
    gap = np.maximum(window - cover, 0)
    return Phases(iters, compute / MS, data / MS, gap / MS, commu / MS, window / MS, excl)


def exclusive_time(tb: Table, parent: np.ndarray) -> np.ndarray:
    """Per row: the span's time less the comm nested in it and less its CPU wait (meaningful where `parent`).

    A comm span is nested in the latest `parent` span that started before it, on its rank, if it ends inside.
    The UNION of the nested comm is subtracted: async ops posted together (a batch of sends and receives) overlap,
    and their summed durations would take the parent's time twice."""
    comm = tb.cat == _COMM
    idx = np.where(parent, np.arange(len(tb.ts)), -1)
    last = np.maximum.accumulate(idx) if len(idx) else idx
    end = tb.end
    inside = comm & (last >= 0)
    lw = last[inside]
    nested = (tb.rank[lw] == tb.rank[inside]) & (end[inside] <= end[lw] + _NEST_SLACK_NS)
    parents, busy = _union_by_key(lw[nested], tb.ts[inside][nested], end[inside][nested])
    sub = np.zeros(len(tb.ts))
    sub[parents] = busy
    excl = np.maximum(tb.dur - sub, 0)
    if tb.cpu_wait is not None:
        # Time runnable but without a CPU is the host's, not the op's: on an oversubscribed host it is most of
        # a span's noise, and chance decides which rank waits. The span's wait is spread evenly over its time
        # (its nested comm ops took their share): the exclusive part keeps excl/dur of it.
        known = parent & (tb.cpu_wait > 0) & (tb.dur > 0)
        share = np.where(known, tb.cpu_wait * excl / np.maximum(tb.dur, 1), 0.0)
        excl = np.maximum(excl - share, 0)
    return excl


def _union_by_key(key: np.ndarray, s: np.ndarray, e: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(keys, union length of the intervals [s, e) of each key); rows sorted by key, then by s within a key."""
    if not len(key):
        return key, np.zeros(0)
    uk, first, inv = np.unique(key, return_index=True, return_inverse=True)
    # Each key on its own stretch of one line (times from its first start), so one running max never crosses keys.
    sn, en = s - s[first][inv], e - s[first][inv]
    off = inv.astype(np.int64) * (int(en.max()) + 1)
    sv, ev = sn + off, en + off
    run = np.maximum.accumulate(ev)
    prev = np.concatenate([[np.iinfo(np.int64).min], run[:-1]])
    return uk, np.bincount(inv, np.maximum(ev - np.maximum(sv, prev), 0).astype(np.float64), len(uk))


def _union_per_cell(tb: Table, mask: np.ndarray, flat: np.ndarray, n: int) -> np.ndarray:
    """Length of the union of the masked spans, summed per (rank, iteration) cell."""
    if not mask.any():
        return np.zeros(n)
    rank, ts, end, cell = tb.rank[mask], tb.ts[mask], tb.end[mask], flat[mask]
    # Put each rank on its own stretch of one line so a single running max never crosses ranks.
    base = np.zeros(tb.world, np.int64)
    lo = np.full(tb.world, np.iinfo(np.int64).max)
    np.minimum.at(lo, rank, ts)
    hi = np.zeros(tb.world, np.int64)
    np.maximum.at(hi, rank, end)
    span = int(np.max(np.where(hi > 0, hi - np.where(lo == np.iinfo(np.int64).max, 0, lo), 0))) + 1
    base = rank * span - lo[rank]
    s, e = ts + base, end + base
    o = np.argsort(s, kind="stable")
    s, e, cell = s[o], e[o], cell[o]
    run = np.maximum.accumulate(e)
    prev = np.concatenate([[np.iinfo(np.int64).min], run[:-1]])
    contrib = np.maximum(e - np.maximum(s, prev), 0)
    return np.bincount(cell, contrib.astype(np.float64), n)


def robust_excess(x: np.ndarray, groups: np.ndarray, floor: float, noise: float | None = None
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per row of x (ranks x iterations): (reference, excess, robust z) against rows of the same group.

    Reference is the group median (leave-one-out for groups under 5 members, so one slow rank of two or three
    cannot hide itself); scale is 1.4826 MAD floored at `floor` of the reference. With `noise` (the run's own
    jitter) the scale is also floored at it, and a group of two, which has no MAD worth the name (each member is
    the other's outlier), is judged on the floors alone; without it a pair is never told apart."""
    ref = np.full_like(x, np.nan)
    scale = np.full_like(x, np.nan)
    for g in np.unique(groups[groups >= 0]):
        rows = np.flatnonzero(groups == g)
        if len(rows) < 2:
            continue
        v = x[rows]
        mad = np.nanmedian(np.abs(v - np.nanmedian(v, axis=0)), axis=0) * 1.4826
        if len(rows) < 5:
            med = np.stack([np.nanmedian(np.delete(v, i, axis=0), axis=0) for i in range(len(rows))])
            if noise is not None:
                # The spread of the OTHERS too: with 3-4 ranks the judged one's own excess would widen the MAD it
                # is measured in (a 20 ms late arrival on 4 ranks sat at z 2-5 against its own deviation). Only
                # with the run's jitter as a floor under it: three values alone may agree by chance.
                mad = np.stack([np.nanmedian(np.abs(np.delete(v, i, axis=0) - med[i]), axis=0)
                                for i in range(len(rows))]) * 1.4826
        else:
            med = np.broadcast_to(np.nanmedian(v, axis=0), v.shape)
        if noise is not None and len(rows) == 2:
            mad = 0.0
        ref[rows] = med
        scale[rows] = np.maximum(np.maximum(np.broadcast_to(mad, v.shape), floor * np.abs(med)), noise or 0.0)
    exc = x - ref
    with np.errstate(invalid="ignore", divide="ignore"):
        z = exc / scale
    return ref, exc, z


def _coord(tb: Table, r: int) -> dict:
    dp, pp, tp = (int(v) for v in tb.coords[r])
    return {"rank": int(r), "dp": dp, "pp": pp, "tp": tp}


def _confidence(z: float, frac: float, zmin: float) -> float:
    """Grows with how far past the z threshold and how consistently; 0.5 at the threshold."""
    return round(float(min(1.0, frac) * min(1.0, 0.5 + (z - zmin) / (4 * zmin))), 3)


def rank_findings(tb: Table, ph: Phases, th: Thresholds) -> list[Finding]:
    """Slow-compute, transient-pause and late-arrival findings from self time against stage peers.

    Two views: all self time (compute + data + untraced), and host time alone (data + untraced), whose jitter
    is far smaller than compute's on a busy machine, so a pause or a late arrival stands out there first."""
    out = _rank_view(tb, ph, th, ph.self_time, host=False)
    seen = {(f.kind, f.ranks) for f in out}
    return out + [f for f in _rank_view(tb, ph, th, ph.data + ph.gap, host=True) if (f.kind, f.ranks) not in seen]


def _rank_view(tb: Table, ph: Phases, th: Thresholds, st: np.ndarray, host: bool) -> list[Finding]:
    stage = tb.coords[:, 1]
    present = np.zeros(tb.world, bool)
    present[np.unique(tb.rank)] = True
    groups = np.where(present, stage, -1)
    # The run's jitter, measured on what is judged: each rank against its stage peers in the same iteration, so an
    # iteration the whole machine was slow in (every rank and its reference alike) is no noise. Only where a stage
    # has 3+ ranks: the leave-one-out reference of a pair is the other rank, the two residuals mirror each other,
    # and a paused rank's peer would look as noisy as it; there the rank's own values are used, as before.
    _, resid, _ = robust_excess(st, groups, th.scale_floor)
    sizes = np.bincount(groups[groups >= 0], minlength=int(groups.max(initial=0)) + 1)
    big_stage = (groups >= 0) & (sizes[np.maximum(groups, 0)] >= 3)
    noise = excursion_noise(np.where(big_stage[:, None], resid, st), present)
    # A pair's one-off is judged on the DIFFERENCE of two ranks: one's upward swing plus the other's downward
    # swing in the same iteration, two independent jitters that add in quadrature. The own-value noise above
    # holds only the upward half (CI: a healthy 2-rank FSDP run, upward jitter 4.1 ms, read +13.3 ms against
    # its peer in 2 of 8 iterations and passed the 3x bar as a pause). Persistent findings take a median over
    # most iterations, where the peer's swings cancel; they keep the plain noise.
    pair = (groups >= 0) & (sizes[np.maximum(groups, 0)] == 2)
    spread = np.where(pair, math.hypot(noise, excursion_noise(-st, present)), noise)[:, None]
    one_off = np.maximum(th.transient_abs_ms, th.transient_noise * spread)
    ref, exc, z = robust_excess(st, groups, th.scale_floor, noise / 2)
    n_it = st.shape[1]
    zmin = th.z_for(th.z, int(present.sum()) * n_it)  # every (rank, iteration) cell is one comparison
    with np.errstate(invalid="ignore"):
        rel = exc / ref
        base = (z >= zmin) & (rel >= th.rel) & (exc >= max(th.abs_ms, th.persistent_noise * noise))
        big = (z >= zmin) & (rel >= th.transient_rel) & (exc >= one_off)
    out = []
    for r in np.flatnonzero((base | big).any(axis=1)):
        hit = np.flatnonzero(base[r])
        frac = len(hit) / n_it
        peers = np.flatnonzero((groups == groups[r]) & (np.arange(tb.world) != r))
        ev = {"peers": len(peers), "noise_ms": round(noise, 3), "view": "host" if host else "self"}
        hb = np.flatnonzero(big[r])
        calm = np.setdiff1d(np.arange(n_it), hb)
        # Pauses every other iteration reach the persistent fraction with one noisy iteration more; what tells
        # them apart is the iterations in between, which a persistent fault slows too and a pause does not.
        intermittent = len(hb) > 0 and len(calm) >= 2 and \
            np.nanmedian(exc[r, calm]) < np.nanmedian(exc[r, hb]) / 3
        if frac >= th.persistent and n_it >= 1 and not intermittent:
            parts = _parts(ph, r, peers, hit)
            zr = float(np.nanmedian(z[r, hit]))
            ev.update(iterations=[int(ph.iters[i]) for i in hit], z=round(zr, 1),
                      excess_ms_by_part={k: round(v, 3) for k, v in parts.items()},
                      ops=op_excess(tb, ph, [int(r)])[int(r)])
            excess = float(np.nanmedian(exc[r, hit]))
            conf = _confidence(zr, frac, zmin) * (0.85 if len(peers) == 1 else 1.0)
            if not host and parts["compute"] >= parts["data"] + parts["gap"]:
                peer_c = np.nanmedian(ph.compute[peers], axis=0)
                factor = float(np.nanmedian(ph.compute[r, hit] / peer_c[hit]))
                out.append(Finding("slow-compute", (int(r),), [_coord(tb, r)], f"{factor:.2f}x compute "
                                   f"(+{excess:.1f} ms per iteration)", round(factor, 3), round(excess, 3),
                                   round(conf, 3), ev))
            else:
                factor = float(np.nanmedian(ph.self_time[r, hit] / np.nanmedian(ph.self_time[peers][:, hit], axis=0)))
                out.append(Finding("late-arrival", (int(r),), [_coord(tb, r)], f"+{excess:.1f} ms per iteration "
                                   "before reaching the collectives (data / untraced time)", round(factor, 3),
                                   round(excess, 3), round(conf, 3), ev))
            continue
        if len(hb) == 1 and exc[r, hb[0]] < 2 * one_off[r, 0]:
            continue  # a one-off on a busy machine needs twice the margin of a repeated pattern
        if not len(hb):
            continue  # a small, rare excess: noise
        excess = float(np.nanmedian(exc[r, hb]))
        parts = _parts(ph, r, peers, hb)
        ev.update(iterations=[int(ph.iters[i]) for i in hb], z=round(float(np.nanmedian(z[r, hb])), 1),
                  excess_ms_by_part={k: round(v, 3) for k, v in parts.items()},
                  ops=op_excess(tb, ph, [int(r)])[int(r)])
        factor = float(np.nanmedian(ph.self_time[r, hb] / np.nanmedian(ph.self_time[peers][:, hb], axis=0)))
        # A single iteration on a busy machine could be the machine; a repeated one is a pattern.
        conf = _confidence(float(np.nanmedian(z[r, hb])), 1.0, zmin) * (1.0 if len(hb) > 1 else 0.7)
        out.append(Finding("transient-pause", (int(r),), [_coord(tb, r)],
                           f"+{excess:.1f} ms in {len(hb)} of {n_it} iterations", round(factor, 3),
                           round(excess, 3), round(conf, 3), ev))
    return out


def _parts(ph: Phases, r: int, peers: np.ndarray, cols: np.ndarray) -> dict[str, float]:
    """Mean excess of each self-time part over the peers' median, in the given iterations."""
    return {name: float(np.nanmean(arr[r, cols] - np.nanmedian(arr[peers][:, cols], axis=0)))
            for name, arr in (("compute", ph.compute), ("data", ph.data), ("gap", ph.gap))}


def op_excess(tb: Table, ph: Phases, ranks: list[int]) -> dict[int, dict[str, float]]:
    """For the given ranks: ratio of each op's mean exclusive time to the same op on stage peers (evidence)."""
    out: dict[int, dict[str, float]] = {}
    work = np.isin(tb.cat, (_COMPUTE, _OPT, _DATA))
    for r in ranks:
        peers = np.flatnonzero(tb.coords[:, 1] == tb.coords[r, 1])
        m = work & np.isin(tb.rank, peers)
        res = {}
        for nid in np.unique(tb.name[m & (tb.rank == r)]):
            mm = m & (tb.name == nid)
            mine = ph.excl[mm & (tb.rank == r)].mean()
            per_peer = np.bincount(tb.rank[mm], ph.excl[mm], tb.world)[peers] / np.maximum(
                np.bincount(tb.rank[mm], minlength=tb.world)[peers], 1)
            res[tb.names[nid]] = round(float(mine / max(np.median(per_peer), 1.0)), 3)
        out[int(r)] = res
    return out


# ----------------------------------------------------------------------------- 2. links and 3. waits
def group_median(keys: np.ndarray, vals: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(unique keys, median of vals per key, count per key), vectorised by one sort."""
    if not len(keys):
        return keys, vals.astype(float), keys
    o = np.lexsort((vals, keys))
    k, v = keys[o], vals[o].astype(float)
    uk, start, cnt = np.unique(k, return_index=True, return_counts=True)
    med = (v[start + (cnt - 1) // 2] + v[start + cnt // 2]) / 2
    return uk, med, cnt


def _lookup(uk: np.ndarray, values: np.ndarray, keys: np.ndarray) -> np.ndarray:
    return values[np.searchsorted(uk, keys)]


def group_name_ids(tb: Table) -> np.ndarray:
    """Per group key (plus -1 at the end): an id of the group's NAME, shared by every column's copy of it."""
    ids: dict[str, int] = {}
    return np.array([ids.setdefault(g, len(ids)) for g, _ in tb.groups] + [-1], np.int64)


def match_p2p(tb: Table, send: np.ndarray, recv: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Row indices (send, recv) of matched P2P transfers: same channel, sender, receiver and sequence number.

    Sequence numbers count per channel (the engine's pp.act.up, pp.grad.down, ... or a user's groups), so two
    channels between the same ranks both have a transfer number k: the channel is part of the key."""
    name = group_name_ids(tb)
    src = np.r_[tb.rank[send], tb.peer[recv]]
    dst = np.r_[tb.peer[send], tb.rank[recv]]
    chan = np.r_[name[tb.gkey[send]], name[tb.gkey[recv]]]
    _, pid = np.unique((chan * tb.world + src) * tb.world + dst, return_inverse=True)  # 1-D: fast
    S = int(tb.seq[np.r_[send, recv]].max()) + 1
    key = pid.ravel() * S + tb.seq[np.r_[send, recv]]
    ks, kr = key[:len(send)], key[len(send):]
    o = np.argsort(ks)
    pos = np.searchsorted(ks[o], kr).clip(0, len(ks) - 1)
    hit = ks[o][pos] == kr
    return send[o][pos][hit], recv[hit]


@dataclass
class Waits:
    """Wait analysis: per (rank, iteration) ms waited and ms others waited for the rank (direct, victims out)."""

    waited: np.ndarray
    caused: np.ndarray
    caused_count: np.ndarray  # per rank, instances where it was the root late arrival


def _seg_cumwait(tb: Table, w: np.ndarray) -> np.ndarray:
    """Wait a rank had accumulated in the current iteration before each row."""
    cs = np.cumsum(w)
    new = np.ones(len(w), bool)
    new[1:] = (tb.rank[1:] != tb.rank[:-1]) | (tb.it[1:] != tb.it[:-1])
    seg_start = np.maximum.accumulate(np.where(new, np.arange(len(w)), 0))
    return cs - w - (cs[seg_start] - w[seg_start])


def links_and_waits(tb: Table, ph: Phases, th: Thresholds, offsets: dict[int, int] | None,
                    clock: dict | None = None) -> tuple[list[Finding], Waits]:
    """Slow P2P links and slow collective groups, and who made whom wait (clock: estimate_offsets' drift report)."""
    W, n_it = tb.world, len(ph.iters)
    off_row = row_offsets(tb.rank, tb.ts, {int(r): o for r, o in (offsets or {}).items() if 0 <= int(r) < W}, clock)
    iti = np.searchsorted(ph.iters, tb.it).clip(0, max(n_it - 1, 0))
    in_it = np.isin(tb.it, ph.iters)
    wait = np.zeros(len(tb.ts))
    findings: list[Finding] = []
    deferred = []  # blame needs every wait first (a rank's earlier waits decide if it is a victim)
    comm = tb.cat == _COMM
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
            s_at = tb.ts[si] + np.where(shared, 0, _lookup(up, dmed, pair)).astype(np.int64)
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
        ratio = xfer / np.maximum(_lookup(ui, imed, inst), 1.0)
        findings += _link_findings(tb, th, pair, cls, ratio, xfer, lambda p: (int(p // W), int(p % W)), "P2P")
        seen = {f.ranks for f in findings}
        findings += [f for f in _cross_stage_links(tb, th, si, pair, shared, xfer) if f.ranks not in seen]
        # Blame: the sender, for wait beyond what this transfer usually costs, unless it was itself held up.
        def p2p_blame(cw_all, si=si, inst=inst, w=w):
            uw, wmed, _ = group_median(inst, w)
            excess = w - _lookup(uw, wmed, inst)
            cw = cw_all[si]
            uc, cmed, _ = group_median(inst, cw)
            m = (excess > 0) & ~(cw - _lookup(uc, cmed, inst) >= 0.5 * excess)
            return si[m], excess[m]
        deferred.append(p2p_blame)

    # --- collectives: same (group, seq) on every member.
    coll = np.flatnonzero(comm & (tb.peer < 0) & (tb.gkey >= 0) & (tb.seq >= 0))
    if len(coll):
        S = int(tb.seq[coll].max()) + 1
        inst = tb.gkey[coll] * S + tb.seq[coll]
        ui, cnt = np.unique(inst, return_counts=True)
        size = np.array([len(tb.groups[g][1]) for g in range(len(tb.groups))])
        full = _lookup(ui, cnt, inst) == size[tb.gkey[coll]]
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
        kinds: dict[tuple[str, int], int] = {}
        gname = np.array([kinds.setdefault((tb.groups[g][0], len(tb.groups[g][1])), len(kinds)) for g in g_of])
        cls = gname * (1 << 20) + _size_classes(tb.name[coll][first], tb.nbytes[coll][first])
        ci = cls * S + tb.seq[coll][first]
        uc, cm, _ = group_median(ci, ctime)
        ratio = ctime / np.maximum(_lookup(uc, cm, ci), 1.0)
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
    waited = np.zeros((W, max(n_it, 1)))
    np.add.at(waited, (tb.rank[in_it], iti[in_it]), wait[in_it] / MS)
    caused = np.zeros((W, max(n_it, 1)))
    count = np.zeros(W, np.int64)
    for rows, ns in blame_rows:
        ok = in_it[rows]
        np.add.at(caused, (tb.rank[rows][ok], iti[rows][ok]), ns[ok] / MS)
        np.add.at(count, tb.rank[rows][ok], 1)
    return findings, Waits(waited, caused, count)


def _size_classes(name: np.ndarray, nbytes: np.ndarray, within: float = 0.05) -> np.ndarray:
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
    _, dev, _ = group_median(unit, np.abs(t - _lookup(uu, tmed, unit)))
    jitter = 1.4826 * float(np.median(dev)) if len(dev) else 0.0
    ucls = cls[np.unique(unit, return_index=True)[1]]
    zmin = th.z_for(th.link_z, len(uu))
    out = []
    for c in np.unique(ucls):
        rows = np.flatnonzero(ucls == c)
        if len(rows) < 2:
            continue  # a link with no peer doing the same transfer cannot be judged
        if len(rows) == 2 and inst is not None:
            f = _slower_of_two(tb, th, uu[rows], unit, t, inst, zmin, ranks_of, what)
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
            label = f"{rks[0]}-{rks[1]}" if len(rks) == 2 else f"group {list(rks)}"
            out.append(Finding("slow-link", rks, [_coord(tb, r) for r in rks],
                               f"{factor:.2f}x transfer time on {what} {label}", round(factor, 3),
                               round((tmed[k] - peer_t) / MS, 4), _confidence(float(z[i, 0]), 1.0, zmin), ev))
    return out


_PAIR_NOISE = 2.0  # a pair's median difference must reach twice the spread of one instance's difference


def _slower_of_two(tb: Table, th: Thresholds, units: np.ndarray, unit: np.ndarray, t: np.ndarray, inst: np.ndarray,
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
    label = f"{rks[0]}-{rks[1]}" if len(rks) == 2 else f"group {list(rks)}"
    return Finding("slow-link", rks, [_coord(tb, r) for r in rks],
                   f"{factor:.2f}x transfer time on {what} {label} (+{med / MS:.1f} ms in {slower} of {n} "
                   f"instances against its only peer)", round(factor, 3), round(med / MS, 4),
                   _confidence(z, slower / n, zmin), ev)


def _cross_stage_links(tb: Table, th: Thresholds, si: np.ndarray, pair: np.ndarray, shared: np.ndarray,
                       xfer: np.ndarray) -> list[Finding]:
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
    is not seen here."""
    W = tb.world
    if shared.sum() < 3:
        return []
    # Same bytes on the same kind of wire, whichever way (activations up, gradients down: one tensor shape).
    kind = np.unique(tb.nbytes[si[shared]], return_inverse=True)[1]
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
    # runs. (Interleaved schedules' wrap-around sends, last stage to first, count as 'up': an approximation.)
    stage = tb.coords[:, 1]
    down = stage[uu // tb.world] < stage[uu % tb.world]
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
            rks = (int(uu[k] // W), int(uu[k] % W))
            factor = floor[k] / max(ref, 1.0)
            ev = {"what": "P2P", "peers": "other stage pairs and directions, same size, one clock",
                  "transfers": int(n[k]), "floor_ms": round(floor[k] / MS, 4), "peer_floor_ms": round(ref / MS, 4),
                  "median_ms": round(tmed[k] / MS, 4), "noise_ms": round(noise[k] / MS, 4), "z": round(float(z), 1)}
            out.append(Finding("slow-link", rks, [_coord(tb, r) for r in rks],
                               f"{factor:.2f}x fastest transfer on P2P {rks[0]}-{rks[1]} (other stage pairs)",
                               round(factor, 3), round(exc / MS, 4), _confidence(float(z), 1.0, zmin), ev))
    return out


def _merge_directions(found: list[Finding]) -> list[Finding]:
    """One finding per link: a slow cable is slow both ways; keep the stronger direction, note both."""
    best: dict[tuple[int, ...], Finding] = {}
    for f in found:
        key = tuple(sorted(f.ranks))
        other = best.get(key)
        if other is None:
            best[key] = f
            continue
        keep, drop = (f, other) if f.confidence > other.confidence else (other, f)
        keep.evidence["directions"] = [list(keep.ranks), list(drop.ranks)]
        if drop.excess_ms > keep.excess_ms:
            # Views measure the cost differently (a floor's excess is the fastest transfer's, a stall is paid by
            # every send): the link costs at least the larger; the more confident view still leads.
            keep.evidence["excess_ms_of_lead_view"] = keep.excess_ms
            keep.excess_ms = drop.excess_ms
        best[key] = keep
    return list(best.values())


def _combine(per_iteration: list[Finding], floors: list[Finding]) -> list[Finding]:
    """One finding per (kind, ranks): the more confident view leads, the other is kept as its evidence."""
    best: dict[tuple, Finding] = {}
    for f in per_iteration + floors:
        key = (f.kind, f.ranks)
        other = best.get(key)
        if other is None:
            best[key] = f
            continue
        keep, drop = (f, other) if f.confidence > other.confidence else (other, f)
        keep.evidence["also"] = {"slowdown": drop.slowdown, "confidence": drop.confidence, **drop.evidence}
        best[key] = keep
    return list(best.values())


def _fold_into(findings: list[Finding], lead_of: Callable[[Finding], Finding | None], key: str) -> list[Finding]:
    """One fault seen twice: each finding that `lead_of` gives a lead for moves into that lead's evidence[key]
    (a list of its slowdown, confidence and evidence); the others are kept."""
    kept = []
    for f in findings:
        lead = lead_of(f)
        if lead is None:
            kept.append(f)
        else:
            lead.evidence.setdefault(key, []).append({"kind": f.kind, "ranks": list(f.ranks), "slowdown": f.slowdown,
                                                      "confidence": f.confidence, **f.evidence})
    return kept


def _pauses_of_slow_ranks(findings: list[Finding], ph: Phases, tb: Table) -> list[Finding]:
    """Fold a rank's 'pauses' into its slow-compute finding when the slowness accounts for them.

    A rank that computes 3x slower falls further behind in some iterations than in others (queueing, which
    micro-batches a window catches), so the per-iteration view can call it paused in 4 of 6 iterations while
    the floors say every repeat of its ops is slow: one fault, and the slowness is its cause. A pause kept
    apart must exceed 3x what the slow compute alone costs an iteration ((factor - 1) x its peers' compute, or
    the finding's own excess where the rank has no peers). Generous on purpose: the rank is named either way,
    the folded pause stays in the finding's evidence, and its confidence carries over (two views agree)."""
    slow = {f.ranks[0]: f for f in findings if f.kind == "slow-compute"}

    def lead_of(f: Finding) -> Finding | None:
        g = slow.get(f.ranks[0]) if f.kind == "transient-pause" else None
        if g is None:
            return None
        r = f.ranks[0]
        peers = np.flatnonzero((tb.coords[:, 1] == tb.coords[r, 1]) & (np.arange(tb.world) != r))
        peer_c = float(np.nanmedian(ph.compute[peers])) if len(peers) else 0.0
        expected = max(g.excess_ms, (g.factor - 1.0) * peer_c if np.isfinite(peer_c) else 0.0)
        if f.excess_ms > 3.0 * expected:
            return None
        f.evidence["expected_ms"] = round(expected, 3)  # what the slowness alone costs an iteration
        g.confidence = max(g.confidence, f.confidence)
        return g
    return _fold_into(findings, lead_of, "pauses_explained")


def _links_of_slow_ranks(findings: list[Finding]) -> list[Finding]:
    """Fold a link's slow transfers into a slow-compute finding of the rank that makes them look slow.

    The pure time of a collective is its last arriver's duration, and an async one (gradient buckets) is timed
    until its rank waits for it: a rank that computes slowly waits late, so its group's collectives look slow too
    (seen on real runs: a 2x slow rank's DP pair at 3.9x transfer time). Likewise a receive posted ahead ends when
    its rank waits for it: every transfer TO a slow rank looks slow (seen on a perturbed real run: 38x, the floor
    included). One fault, named by its cause; the link stays in the finding's evidence. A link found by the
    stalls of its ends before posting (P2P or collective), or slow only towards a rank that computes at normal
    speed, is kept (_explained_by_links goes the other way for those)."""
    slow = {f.ranks[0]: f for f in findings if f.kind == "slow-compute"}

    def cause(f: Finding) -> Finding | None:
        if f.kind != "slow-link":
            return None
        if f.evidence.get("method") in ("send stalls", "collective stalls"):
            return None  # both ends stall before posting: the link's own evidence, not its ends' speed
        if f.evidence.get("what") == "collective":
            return next((slow[r] for r in f.ranks if r in slow), None)
        if f.evidence.get("what") == "P2P":
            receivers = [int(d[1]) for d in f.evidence.get("directions", [f.ranks])]
            return next((slow[r] for r in receivers if r in slow), None)
        return None
    return _fold_into(findings, cause, "links_also_slow")


def _explained_by_links(findings: list[Finding], links: list[Finding]) -> list[Finding]:
    """Drop a link end's late arrival, pause or slow compute that its stalls before posting over the link account
    for (a collective posted inside a compute span, a gradient all-reduce issued from backward, stalls inside that
    span: its rank's compute looks slow by the stall)."""
    def link_of(f: Finding) -> Finding | None:
        r = f.ranks[0]
        link = next((x for x in links if r in x.ranks), None)
        if link is not None and f.kind in ("late-arrival", "transient-pause", "slow-compute") and \
                f.excess_ms <= 1.5 * link.evidence["stall_ms_per_iteration"][r]:
            return link
        return None
    return _fold_into(findings, link_of, "explains")


# ----------------------------------------------------------------------------- entry point
@dataclass
class Analysis:
    """Everything detect computed: views (heat-map, summary) reuse it."""

    table: Table
    phases: Phases
    waits: Waits
    report: Report


def analyse(traces: list[RankTrace], offsets: dict[int, int] | None = None,
            thresholds: Thresholds | None = None, clock: dict | None = None) -> Analysis:
    """Run all detectors; return the report together with the per-rank phase and wait matrices."""
    if not traces:
        raise ValueError("no rank traces to analyse (empty trace directory?)")
    th = thresholds or Thresholds()
    hangs = hang_findings(traces)
    if hangs:  # what a hang cut short is no evidence of speed: judge the iterations every rank finished
        traces = _finished_iterations(traces)
    tb = join(traces)
    ph = phases(tb)
    # Stage costs: the headers' cost model (the engine writes its FLOPs), else measured from per-layer spans (any
    # job traced per layer). A declared model goes first: measured units are noisy by 15-25% per rank on a busy
    # host (a healthy real pp4 run got a false wait-structure finding from them in 1 of 5 repeats, FLOPs in
    # none), and a lone stage's own slowness is judged by its layers either way (layer_findings).
    is_layer = tb.cat == _LAYER
    layer_excl = exclusive_time(tb, is_layer) if is_layer.any() else None  # coarse traces: no layer pass
    declared = _stage_work(traces)
    measured = None if declared else measured_stage_work(tb, ph, layer_excl, th.floor_q)
    work = declared or measured
    findings = _combine(rank_findings(tb, ph, th), floor_findings(tb, ph.excl, ph.iters, th, work))
    findings = _combine(findings, layer_findings(tb, ph, layer_excl, th))
    link_f, waits = links_and_waits(tb, ph, th, offsets, clock)
    findings = _combine(findings, lone_stage_findings(tb, ph, waits, th, work))  # one per rank
    findings = _combine(findings, lone_stage_pauses(tb, ph, th))
    findings = _pauses_of_slow_ranks(findings, ph, tb)
    stall = posting_stall(tb)
    stall_f = stall_link_findings(tb, stall, ph.iters, th) + \
        collective_stall_findings(tb, posting_stall(tb, comm_ends=True), ph.iters, th)
    findings = _links_of_slow_ranks(_explained_by_links(findings, stall_f) + _merge_directions(link_f + stall_f))
    caused_total = waits.caused.sum(axis=1)
    for f in findings:
        f.evidence["others_waited_ms"] = round(float(caused_total[list(f.ranks)].sum()), 3)
    findings.sort(key=lambda f: (-f.confidence, -f.evidence["others_waited_ms"], f.ranks))
    findings = hangs + _fold_into_hangs(findings, hangs)  # a hung job: what it hangs in comes before how it was slow
    top = np.argsort(-caused_total)[:10]
    waited_for = [{"rank": int(r), "ms": round(float(caused_total[r]), 3), "instances": int(waits.caused_count[r])}
                  for r in top if caused_total[r] > 0]
    notes = []
    named = {r for f in findings for r in f.ranks}
    if waited_for and waited_for[0]["rank"] not in named:
        notes.append(f"rank {waited_for[0]['rank']} made others wait most, but nothing it did itself stands out from "
                     "its peers: waits alone follow whichever rank the machine happened to delay, not a fault")
    lonely = [int(s) for s in np.unique(tb.coords[:, 1]) if (tb.coords[:, 1] == s).sum() < 2]
    if lonely:
        notes.append(f"stages {lonely} have a single rank (dp*tp == 1): judged through the wait structure against "
                     "the other stages" + (" (scaled by the headers' stage_work)" if declared else
                                           f" (scaled by the stage work measured in per-layer spans: {measured})"
                                           if measured else
                                           ", assuming stages do equal work (no stage_work in the headers)"))
    starved = starved_note(cpu_wait_share(tb))
    if starved:
        notes.append(starved)
    step_ms = float(np.nanmedian(ph.window)) if np.isfinite(ph.window).any() else 0.0
    report = Report(findings, tb.world, len(ph.iters), round(step_ms, 3), waited_for, notes)
    return Analysis(tb, ph, waits, report)


def _finished_iterations(traces: list[RankTrace]) -> list[RankTrace]:
    """The traces cut to the iterations whose step every rank closed (and spans outside any iteration)."""
    done = [set(np.unique(t.it[t.cat == _STEP]).tolist()) for t in traces]
    common = np.array(sorted(set.intersection(*done)) if done else [], np.int64)
    if not len(common):
        return traces  # no iteration all finished (different windows): nothing to cut to
    out = []
    for t in traces:
        keep = (t.it < 0) | np.isin(t.it, common)
        out.append(dataclasses.replace(t, **{c: getattr(t, c)[keep] for c in COLUMNS}))
    return out


def _fold_into_hangs(findings: list[Finding], hangs: list[Finding]) -> list[Finding]:
    """A hung rank's other findings are the same fault seen before it stopped: kept as the hang's evidence."""
    hung = {r: h for h in hangs for r in h.ranks}
    return _fold_into(findings, lambda f: hung[f.ranks[0]] if set(f.ranks) <= hung.keys() else None,
                      "before_the_hang")


def _stage_work(traces: list[RankTrace]) -> dict[int, float] | None:
    """Expected relative cost of each pipeline stage, when a header carries one (a cost model's output)."""
    for t in traces:
        w = t.header.get("stage_work")
        if w:
            return {int(k): float(v) for k, v in (w.items() if isinstance(w, dict) else enumerate(w))}
    return None


def detect(traces: list[RankTrace], offsets: dict[int, int] | None = None,
           thresholds: Thresholds | None = None, clock: dict | None = None) -> Report:
    """Ranked root-cause findings for a set of rank traces (offsets: ns to subtract per rank, optional; clock:
    the report of align.estimate_offsets, whose per-rank drift then applies too)."""
    return analyse(traces, offsets, thresholds, clock).report
