"""The joined span table of all ranks, the per-(rank, iteration) phases and the wait matrices.

The shared types every detector reads (Table, Phases, Waits) and the joins on them (matched P2P transfers).
Only format, align and stats below it: detectors import this module, never the other way round."""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

from megatronapp.scan.detect.align import clock_domains
from megatronapp.scan.read.format import CAT_INDEX, RankTrace

MS = 1e6
_NEST_SLACK_NS = 2_000  # a child may end a hair after its parent (clock reads in a different order)
COMPUTE, COMM, DATA, OPT, STEP = (CAT_INDEX[c] for c in ("compute", "comm", "data", "optimizer", "step"))
LAYER = CAT_INDEX["layer"]


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

    @cached_property
    def end(self) -> np.ndarray:
        """Span end times; computed once (every detector reads it: 13 sums of 8 million rows at 12,288 ranks).
        Build a new Table (dataclasses.replace) rather than assigning ts or dur of this one."""
        return self.ts + self.dur

    @cached_property
    def present(self) -> np.ndarray:
        """[rank] -> whether the rank has any span: one counting pass, where np.unique sorted the whole rank column
        (8 million rows at 12,288 ranks, ~0.14 s each, asked for by eight views)."""
        seen = np.bincount(self.rank, minlength=self.world)[:self.world] > 0
        seen.setflags(write=False)  # shared by every view that asks
        return seen


# Columns only compared or widened before any arithmetic (category codes, chunk and microbatch numbers) keep a
# narrow type: 118 MB less at 12,288 ranks. Every other column is int64, so sums and products never overflow.
_NARROW = {"cat": np.int8, "chunk": np.int16, "mb": np.int32}


def _consecutive(arrays: list[np.ndarray]) -> np.ndarray | None:
    """The one array these are consecutive pieces of (views of one base, each starting where the previous
    ends), as a view; None when they are not."""
    if not arrays:
        return None
    base = arrays[0].base
    if not isinstance(base, np.ndarray) or base.ndim != 1 or not base.flags.c_contiguous:
        return None
    item = base.itemsize
    start = arrays[0].__array_interface__["data"][0]
    at = start
    for a in arrays:
        if a.base is not base or a.ndim != 1 or a.dtype != base.dtype or not a.flags.c_contiguous or \
                a.__array_interface__["data"][0] != at:
            return None
        at += len(a) * item
    off = (start - base.__array_interface__["data"][0]) // item
    return base[off:off + (at - start) // item]


def join(traces: list[RankTrace], release: bool = False) -> Table:
    """Concatenate rank traces into one table with global string and group ids.

    `release`: empty each trace's span columns once they are in the table (headers, names, groups and opened ops
    stay), so a caller that needs only the table never holds two copies of every span: at 12,288 ranks the
    traces are 500 MB next to the table's 750 MB."""
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
        # Widened while concatenating: no narrow copy of the whole column first (time and peak memory at scale).
        dt = _NARROW.get(k, np.int64)
        whole = _consecutive([getattr(t, k) for t in traces])
        if whole is not None:  # format.read_dir's column store: already one array, in rank order
            c[k] = whole if whole.dtype == dt else whole.astype(dt)
        else:
            c[k] = np.concatenate([np.asarray(getattr(t, k)) for t in traces], dtype=dt, casting="same_kind") \
                if traces else np.zeros(0, dt)
        if release:
            for t in traces:
                setattr(t, k, np.empty(0, getattr(t, k).dtype))  # not a [:0] view: that keeps the column
    names_at = np.array(nmap + [-1], np.int64)
    groups_at = np.array(gmap + [-1], np.int64)
    if traces and len(names) == len(traces[0].names) and all(t.names == traces[0].names for t in traces):
        c["name"] = c["name"].astype(np.int64, copy=False)  # one string table in every file: ids as they are
    else:
        c["name"] = names_at[c["name"] + np.repeat(np.array(noff, np.int64), lens)]
    gid = c.pop("gid")
    c["gkey"] = np.where(gid >= 0, groups_at[np.maximum(gid + np.repeat(np.array(goff, np.int64), lens), 0)], -1)
    c["clock"] = clock_domains(traces, world)
    # Only traces that measured it (format 2, host-timed work spans) carry a column worth its memory at scale.
    if any(len(t.cpu_wait) and t.cpu_wait.max() >= 0 for t in traces):
        c["cpu_wait"] = np.concatenate([np.asarray(t.cpu_wait) for t in traces], dtype=np.int64)
    if release:
        for t in traces:
            t.cpu_wait = np.empty(0, t.cpu_wait.dtype)
    r, ts = c["rank"], c["ts"]
    # Sorted by (rank, ts) already (the simulator's files, most real ones): skip the sort; lexsort is stable, so
    # the order is the same either way.
    # Traces in increasing rank order: then only a step back in time inside one trace is out of order (one
    # comparison over the rows, not five).
    if (np.all(np.diff([t.rank for t in traces]) > 0)
            and np.isin(np.flatnonzero(ts[1:] < ts[:-1]), np.cumsum(lens)[:-1] - 1).all()) \
            or np.all((r[1:] > r[:-1]) | ((r[1:] == r[:-1]) & (ts[1:] >= ts[:-1]))):
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

    @property
    def step_ms(self) -> float:
        """The median iteration (window) in ms; 0 where no iteration has a window."""
        return float(np.nanmedian(self.window)) if np.isfinite(self.window).any() else 0.0


def phases(tb: Table) -> Phases:
    """Split each rank's iterations into own work, untraced gaps and communication."""
    step = tb.cat == STEP
    iters = np.unique(tb.it[step] if step.any() else tb.it[tb.it >= 0])
    n_it, W = len(iters), tb.world
    shape = (W, max(n_it, 1))
    ok = np.isin(tb.it, iters)
    flat = tb.rank * shape[1] + np.searchsorted(iters, tb.it).clip(0, max(n_it - 1, 0))

    def per_cell(mask: np.ndarray, values: np.ndarray) -> np.ndarray:
        m = mask & ok
        return np.bincount(flat[m], values[m], W * shape[1]).reshape(shape)

    work = np.isin(tb.cat, (COMPUTE, OPT, DATA))
    excl = exclusive_time(tb, work)
    end, comm = tb.end, tb.cat == COMM
    compute = per_cell(work & (tb.cat != DATA), excl)
    data = per_cell(tb.cat == DATA, excl)
    # Comm time as the union of comm intervals (async spans overlap), rest of the window is untraced gap.
    win_end = np.full(shape, np.nan)
    win_end_flat = win_end.ravel()
    sm = step & ok
    win_end_flat[flat[sm]] = end[sm]
    win_start = np.full(shape, np.nan)
    win_start.ravel()[flat[sm]] = tb.ts[sm]
    # An iteration's window starts where the previous one ended: stalls between iterations count too. Only the
    # previous iteration by number: between two trace windows (iterations 1-4 and 6-9 of a profiler schedule)
    # lie untraced iterations and the export of the first window, no part of the next iteration.
    prev_end = np.concatenate([win_start[:, :1], win_end[:, :-1]], axis=1)
    follows = np.r_[False, np.diff(iters) == 1] if n_it else np.zeros(0, bool)
    prev_end[:, :n_it][:, ~follows] = np.nan
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
    excl = np.empty(len(tb.ts))
    end = tb.end
    for a, b in rank_chunks(tb):  # nesting never crosses ranks: a range of ranks at a time bounds the temporaries
        excl[a:b] = _exclusive_rows(tb.rank[a:b], tb.cat[a:b], tb.ts[a:b], end[a:b], tb.dur[a:b], parent[a:b],
                                    None if tb.cpu_wait is None else tb.cpu_wait[a:b])
    return excl


def _exclusive_rows(rank: np.ndarray, cat: np.ndarray, ts: np.ndarray, end: np.ndarray, dur: np.ndarray,
                    parent: np.ndarray, cpu_wait: np.ndarray | None) -> np.ndarray:
    comm = cat == COMM
    idx = np.where(parent, np.arange(len(ts)), -1)
    last = np.maximum.accumulate(idx) if len(idx) else idx
    del idx
    inside = comm & (last >= 0)
    lw = last[inside]
    nested = (rank[lw] == rank[inside]) & (end[inside] <= end[lw] + _NEST_SLACK_NS)
    parents, busy = _union_by_key(lw[nested], ts[inside][nested], end[inside][nested])
    sub = np.zeros(len(ts))
    sub[parents] = busy
    excl = np.maximum(dur - sub, 0)
    if cpu_wait is not None:
        # Time runnable but without a CPU is the host's, not the op's: on an oversubscribed host it is most of
        # a span's noise, and chance decides which rank waits. The span's wait is spread evenly over its time
        # (its nested comm ops took their share): the exclusive part keeps excl/dur of it.
        known = parent & (cpu_wait > 0) & (dur > 0)
        share = np.where(known, cpu_wait * excl / np.maximum(dur, 1), 0.0)
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


_CHUNK_ROWS = 1 << 20  # rows per pass of the per-rank sweeps: bounded temporaries at any scale


def rank_chunks(tb: Table, rows: int | None = None) -> list[tuple[int, int]]:
    """Row ranges [a, b) of the table, each holding whole ranks and about `rows` rows (one range when the table is
    not sorted by rank). Work that never crosses a rank runs range by range, its temporaries sized by the range."""
    rows = rows or _CHUNK_ROWS
    n = len(tb.rank)
    if n <= rows or np.any(tb.rank[1:] < tb.rank[:-1]):
        return [(0, n)]
    starts = np.searchsorted(tb.rank, np.arange(tb.world + 1))
    out, a = [], 0
    while a < n:
        # The first rank start at least `rows` past a (always past a: whole ranks, at least one).
        b = int(starts[min(np.searchsorted(starts, a + rows), tb.world)])
        b = n if b <= a else b
        out.append((a, b))
        a = b
    return out


def _union_per_cell(tb: Table, mask: np.ndarray, flat: np.ndarray, n: int) -> np.ndarray:
    """Length of the union of the masked spans, summed per (rank, iteration) cell, a range of ranks at a time."""
    out = np.zeros(n)
    if not mask.any():
        return out
    end_all = tb.end
    for a, b in rank_chunks(tb):
        m = mask[a:b]
        if not m.any():
            continue
        rank, ts, end, cell = tb.rank[a:b][m], tb.ts[a:b][m], end_all[a:b][m], flat[a:b][m]
        out += _union_rows(rank, ts, end, cell, tb.world, n)
    return out


def _union_rows(rank: np.ndarray, ts: np.ndarray, end: np.ndarray, cell: np.ndarray, world: int,
                n: int) -> np.ndarray:
    # Put each rank on its own stretch of one line so a single running max never crosses ranks.
    lo = np.full(world, np.iinfo(np.int64).max)
    np.minimum.at(lo, rank, ts)
    hi = np.zeros(world, np.int64)
    np.maximum.at(hi, rank, end)
    span = int(np.max(np.where(hi > 0, hi - np.where(lo == np.iinfo(np.int64).max, 0, lo), 0))) + 1
    base = rank * span - lo[rank]
    s, e = ts + base, end + base
    del base
    if np.any(s[1:] < s[:-1]):  # a table from join is sorted by (rank, ts): no sort needed
        o = np.argsort(s, kind="stable")
        s, e, cell = s[o], e[o], cell[o]
    run = np.maximum.accumulate(e)
    prev = np.concatenate([[np.iinfo(np.int64).min], run[:-1]])
    contrib = np.maximum(e - np.maximum(s, prev), 0)
    return np.bincount(cell, contrib.astype(np.float64), n)


def coord(tb: Table, r: int) -> dict:
    dp, pp, tp = (int(v) for v in tb.coords[r])
    return {"rank": int(r), "dp": dp, "pp": pp, "tp": tp}



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
    raw = (chan * tb.world + src) * tb.world + dst
    seq = tb.seq[np.r_[send, recv]]
    S = int(seq.max()) + 1
    # The key as it is where it fits (the same order as dense ids): no np.unique sort of a million keys.
    if max(-int(raw.min()), int(raw.max()) + 1) * S < 1 << 62:
        key = raw * S + seq
    else:
        _, pid = np.unique(raw, return_inverse=True)  # 1-D: fast
        key = pid.ravel() * S + seq
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
