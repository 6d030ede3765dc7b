"""Two-level detection for jobs too large for one table: a cheap pass over every rank, then the full detector on the
ranks that matter.

At 100,096 ranks x 10 iterations a job has 128 million spans (7.8 GB of rank files); the full detector holds about
175 bytes a span. So every rank file is read once, in worker processes, and reduced to a few numbers per rank and
iteration, the quantities the full detector's views start from:

- own work: compute and optimizer time less the comm nested in it (slow-compute, pauses),
- host time: data loading plus the iteration's window less the union of its spans (late arrival, untraced
  stalls),
- per P2P direction, the fastest transfer, and per collective kind, the fastest instance (slow links: a healthy
  link's fastest transfer is its cost, whatever the waits),
- spans finished and ops left open (hangs).

Each is compared with the rank's stage peers (median and MAD over the stage, per iteration where it has one). The
ranks furthest above their peers are the suspects; the full detector (detect.analyse) then reads them with their
context (TP group, the pipeline they belong to, DP ring neighbours and, for a collective that is slow group-wide,
the whole group) and a few whole pipelines as reference peers. Its report is the report: the triage only chooses
what is read, never what is found. What it cannot see is what it never selects, so its bar is low (a rank a few
MADs above its peers in one iteration) and the zoomed set is bounded (`budget` ranks); the report notes both.
"""
from __future__ import annotations

import os
import warnings
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from megatronapp.scan import rank_summary
from megatronapp.scan.evidence import group_quantile
from megatronapp.scan.format import CAT_INDEX, FILE_PATTERN, TraceFormatError, cells_problem, dropped_problem, read_rank

COMPUTE, COMM, DATA, OPT, STEP = (CAT_INDEX[c] for c in ("compute", "comm", "data", "optimizer", "step"))
KINDS = ("tp", "pp", "dp")  # group name prefixes of the engine's (and the simulator's) collectives
_NEST_SLACK_NS = 2_000
_BATCH = 256  # rank files reduced together: one set of numpy passes per batch, not per file
LARGE_SPANS = 50_000_000  # spans above this in a directory: `scan detect` triages first (the table: ~9 GB)


@dataclass
class Features:
    """Per rank (rows: every rank of the world) and iteration (columns), in ms; NaN where the rank has no data."""

    world: int
    iters: np.ndarray
    coords: np.ndarray  # [rank] -> (dp, pp, tp); -1 for ranks with no file
    topo: tuple[int, int, int]  # (tp, pp, dp)
    work: np.ndarray  # [rank, it]
    host: np.ndarray  # [rank, it]
    p2p: np.ndarray  # [rank, 4]: fastest send down, send up, recv from down, recv from up (down: lower rank)
    peer_up: np.ndarray  # [rank]: its P2P peer above (the highest it exchanged with), -1 if none
    coll: np.ndarray  # [rank, len(KINDS)]: fastest collective instance of each kind
    opened: np.ndarray  # [rank]: comm ops written as opened beyond those closed (in flight at the end)
    spans: np.ndarray  # [rank]: spans finished (how far the rank got)
    problems: list[str]
    paths: dict[int, str]  # rank -> its file
    summarised: int = 0  # ranks whose numbers came from their files' summary blocks (rank_summary.py)


def estimated_spans(trace_dir: str | Path) -> int:
    """Spans in a directory's rank files, from their sizes and the bytes a span takes in a few of them (first, middle
    and last by name, read whole): format 3's column blocks take 22-64 bytes a span, row blocks 56-64, so bytes
    alone misjudge by 3x. The densest sample counts (a large job is not taken for a small one)."""
    d = os.fspath(trace_dir)
    sizes: dict[str, int] = {}
    with os.scandir(d) as it:
        for e in it:
            if FILE_PATTERN.search(e.name):
                sizes[e.name] = e.stat().st_size
    if not sizes:
        return 0
    names = sorted(sizes)
    per_byte = 0.0
    for name in {names[0], names[len(names) // 2], names[-1]}:
        try:
            t = read_rank(os.path.join(d, name))
        except TraceFormatError:
            continue
        if sizes[name]:
            per_byte = max(per_byte, (len(t) + len(t.opened.get("ts", ()))) / sizes[name])
    if not per_byte:
        per_byte = 1 / 56  # no sample readable: the widest record (the reader names the bad files)
    return int(sum(sizes.values()) * per_byte)


def _kind_lut(groups: tuple[str, ...]) -> np.ndarray:
    """Per local group id (and -1 at the end): the index of its kind in KINDS, -1 for other groups."""
    return np.array([KINDS.index(g.split(".")[0]) if g.split(".")[0] in KINDS else -1 for g in groups] + [-1],
                    np.int64)


def _send_lut(names: tuple[str, ...]) -> np.ndarray:
    """Per local name id (and -1 at the end): whether it is a send."""
    return np.array([n == "send" for n in names] + [False])


def _through_luts(traces: list, column: str, key, make) -> np.ndarray:
    """A batch's `column` (file-local ids, -1 for none) through each file's lookup table, made once per distinct
    table (`key` of a trace -> `make(key)`): a job's files mostly share their tables, so usually one lookup."""
    luts: dict = {}
    keys = [key(t) for t in traces]
    for k in keys:
        if k not in luts:
            luts[k] = make(k)
    if len(luts) == 1:
        return next(iter(luts.values()))[np.concatenate([getattr(t, column) for t in traces], dtype=np.int64)]
    return np.concatenate([luts[k][np.asarray(getattr(t, column), np.int64)] for k, t in zip(keys, traces)])


def _reduce(paths: list[str], use_summaries: bool = True) -> dict:
    """Features of the rank files `paths` (one worker's share), batch by batch; per-batch iteration numbers. A file
    that ends in a valid summary block (rank_summary.py) gives its numbers from there, without its spans."""
    parts: list[dict] = []
    problems: list[str] = []
    shared: dict = {}
    summed: dict[tuple, list] = {}  # iterations -> [(path, summary)]: one part per set of iterations
    todo = []
    for p in paths:
        got, why = rank_summary.read(p) if use_summaries else (None, None)
        if why:
            problems.append(why)
        if got is None:
            todo.append(p)
            continue
        if got["dropped"]:
            problems.append(dropped_problem(os.path.basename(p), got["dropped"]))
        summed.setdefault(tuple(got["iters"].tolist()), []).append((p, got))
    for group in summed.values():
        parts.append(_summary_part(group))
    for lo in range(0, len(todo), _BATCH):
        traces, read = [], []
        for p in todo[lo:lo + _BATCH]:
            try:
                t = read_rank(p, shared, _views=True)
            except TraceFormatError as e:
                problems.append(str(e))
                continue
            too_big = cells_problem(t.world, len(np.unique(t.it[t.cat == STEP])))
            if too_big:  # its world and iterations would size the arrays of every rank
                problems.append(f"{os.path.basename(p)}: {too_big}; skipped")
                continue
            problems.extend(t.problems)
            traces.append(t)
            read.append(p)
        if traces:
            parts.append({**_batch(traces), "path": read})
    return {"problems": problems, "parts": parts}


def _summary_part(group: list[tuple[str, dict]]) -> dict:
    """A part (as _batch makes, plus paths) from summaries of the same iterations."""
    rows = [g for _, g in group]

    def stack(k: str, dtype=np.float64) -> np.ndarray:
        return np.array([r[k] for r in rows], dtype)

    W = len(rows[0]["iters"])
    return {"summarised": True, "iters": rows[0]["iters"], "rank": stack("rank", np.int64),
            "coord": stack("coord", np.int64),
            "topo": rows[0]["topo"], "world": max(r["world"] for r in rows),
            "work": stack("work").reshape(len(rows), W), "host": stack("host").reshape(len(rows), W),
            "p2p": stack("p2p"), "peer_up": stack("peer_up", np.int64), "coll": stack("coll"),
            "opened": stack("opened", np.int64), "spans": stack("spans", np.int64), "path": [p for p, _ in group]}


def summary_blocks(traces: list, uniform: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None) -> list[bytes]:
    """SUMS blocks (rank_summary.encode) for a batch of RankTraces (read back, or a writer's own columns): the
    numbers the triage would work out from their files, by the same code. `uniform`: (ts, dur, peer) as (ranks,
    spans) arrays, from a writer that knows what `_uniform` checks (every rank's spans the same in the same order,
    each row in time order), so the batch is not stacked and compared again."""
    f = _batch_uniform(traces, *uniform) if uniform is not None else _batch(traces)
    W = len(f["iters"])  # (a batch without steps has one column of NaN: no iterations to summarise)
    dropped = [int((t.header.get("footer") or {}).get("dropped") or 0) for t in traces]
    B = len(traces)
    ints = np.column_stack([f["rank"], np.full(B, f["world"]), f["coord"], np.tile(np.asarray(f["topo"]), (B, 1)),
                            f["peer_up"], f["opened"], f["spans"], dropped]).astype(np.int64)
    floats = np.concatenate([f["work"][:, :W], f["host"][:, :W], f["p2p"], f["coll"]], axis=1)
    return rank_summary.encode_batch(ints, np.asarray(f["iters"], np.int64), floats)


def write_summary(path: str | Path) -> bool:
    """Append the summary block to a closed rank file (the tracer, at its end): its spans read back and reduced as
    the triage would. False, and the file untouched, where it already ends in one, where its reader found anything
    but dropped spans (a file that does not end where its writer left it gets no block after the damage), or where
    it has more iterations than a summary holds. A write that fails part-way is cut back off."""
    p = os.fspath(path)
    if rank_summary.read(p) != (None, None):
        return False
    t = read_rank(p)
    dropped = int((t.header.get("footer") or {}).get("dropped") or 0)
    if len(t.problems) > (1 if dropped else 0):
        return False
    block = summary_blocks([t])[0]
    if len(block) - 12 > rank_summary.payload_size(rank_summary.MAX_ITERS):
        return False  # every reader would refuse it
    with open(p, "r+b") as fh:
        size = fh.seek(0, os.SEEK_END)
        try:
            fh.write(block)
            fh.flush()
        except OSError:
            fh.truncate(size)
            raise
    return True


def _batch(traces: list) -> dict:
    """The features of one batch of rank traces: by slot where the ranks share their spans' order, else span by
    span."""
    same = _uniform(traces)
    return _batch_uniform(traces, *same) if same is not None else _batch_spans(traces)


def _batch_spans(traces: list) -> dict:
    """The features of one batch of rank traces, whatever their spans: all of them concatenated, one pass each."""
    B = len(traces)
    lens = np.array([len(t) for t in traces], np.int64)
    local = np.repeat(np.arange(B), lens)
    ts = np.concatenate([t.ts for t in traces], dtype=np.int64)
    dur = np.concatenate([t.dur for t in traces], dtype=np.int64)
    cat = np.concatenate([t.cat for t in traces])
    it = np.concatenate([t.it for t in traces], dtype=np.int64)
    peer = np.concatenate([t.peer for t in traces], dtype=np.int64)
    kind = _through_luts(traces, "gid", lambda t: tuple(g for g, _ in t.groups), _kind_lut)
    send = _through_luts(traces, "name", lambda t: tuple(t.names), _send_lut)
    end = ts + dur
    # Rank files are mostly in time order (the simulator's); a tracer writes a parent after its children.
    if len(ts) and not np.all((local[1:] > local[:-1]) | ((local[1:] == local[:-1]) & (ts[1:] >= ts[:-1]))):
        o = np.lexsort((ts, local))
        local, ts, dur, cat, it, peer, kind, send, end = (a[o] for a in (local, ts, dur, cat, it, peer, kind, send,
                                                                          end))
    step = cat == STEP
    iters = np.unique(it[step])
    W = max(len(iters), 1)
    if len(iters) and iters[-1] - iters[0] == len(iters) - 1:  # consecutive steps (always, but for gaps): no search
        col = it - iters[0]
        ok = (col >= 0) & (col < W)
    else:
        col = np.searchsorted(iters, it).clip(0, W - 1)
        ok = (iters[col] == it) if len(iters) else np.zeros(len(it), bool)
    cell = local * W + np.clip(col, 0, W - 1)
    n = B * W
    # A span counts only in an iteration its OWN rank has a step for: a rank's numbers must not depend on which
    # ranks share its batch (a summary is made from a batch of one; second review).
    own_step = np.zeros(n, bool)
    own_step[cell[step & ok]] = True
    ok &= own_step[cell]

    def per_cell(mask: np.ndarray, values: np.ndarray) -> np.ndarray:
        m = mask & ok
        return np.bincount(cell[m], values[m], n).reshape(B, W)

    work = (cat == COMPUTE) | (cat == OPT)
    comm = cat == COMM
    # Comm nested in a work span (a TP all-reduce inside a layer's forward) is not the rank's own time.
    idx = np.where(work, np.arange(len(ts)), -1)
    last = np.maximum.accumulate(idx) if len(idx) else idx
    lw = np.maximum(last, 0)
    nested = comm & (last >= 0) & (local[lw] == local) & (end <= end[lw] + _NEST_SLACK_NS)
    fdur = dur.astype(np.float64)
    own = np.maximum(per_cell(work, fdur) - per_cell(nested, fdur), 0)
    # Host time as phases() has it: data loading plus the window's untraced part (the window less the union of every
    # span in it; async sends overlap the work that follows, so sums would count them twice).
    cov = ~step & ok
    busy = np.zeros((B, W))
    if cov.any():
        c_ts, c_end = ts[cov], end[cov]
        base = int(c_ts.min())
        shift = local[cov] * (int(c_end.max()) - base + 1) - base  # each rank on its own stretch of one line
        s_, e_ = c_ts + shift, c_end + shift
        run = np.maximum.accumulate(e_)
        prev = np.concatenate([[np.iinfo(np.int64).min], run[:-1]])
        busy = np.bincount(cell[cov], np.maximum(e_ - np.maximum(s_, prev), 0).astype(np.float64), n).reshape(B, W)
    data = per_cell(cat == DATA, fdur)
    sm = step & ok
    w_end = np.full(n, np.nan)
    w_end[cell[sm]] = end[sm]
    w_start = np.full(n, np.nan)
    w_start[cell[sm]] = ts[sm]
    w_end, w_start = w_end.reshape(B, W), w_start.reshape(B, W)
    rank_of = np.array([t.rank for t in traces], np.int64)
    # Fastest transfer per P2P direction (send/recv x peer below/above): a healthy link's fastest is its cost.
    p2p = comm & (peer >= 0)
    up = peer > rank_of[local]
    fast = np.stack([_min_per_rank(p2p & send & ~up, local, fdur, B), _min_per_rank(p2p & send & up, local, fdur, B),
                     _min_per_rank(p2p & ~send & ~up, local, fdur, B), _min_per_rank(p2p & ~send & up, local, fdur, B)],
                    axis=1)
    coll = np.stack([_min_per_rank(comm & (peer < 0) & (kind == k), local, fdur, B) for k in range(len(KINDS))],
                    axis=1)
    peer_up = -_min_per_rank(p2p & up, local, -peer.astype(np.float64), B)
    return _features(traces, iters, own, data, busy, w_start, w_end, fast, coll, peer_up,
                     np.bincount(local[comm], minlength=B), lens)


def _features(traces: list, iters: np.ndarray, own, data, busy, w_start, w_end, fast, coll, peer_up, comm_closed,
              spans) -> dict:
    """A batch's features from its per-(rank, iteration) sums and step windows and its per-rank fastest
    transfers (ns): what both paths hand back."""
    B, W = w_end.shape
    # As phases(): an iteration starts where the previous one (by number) ended, so a stall between steps (a late
    # arrival before the step opens) is the rank's own host time.
    prev = np.concatenate([np.full((B, 1), np.nan), w_end[:, :-1]], axis=1)
    if len(iters):
        prev[:, np.r_[True, np.diff(iters) != 1][:W]] = np.nan
    window = w_end - np.where(np.isnan(prev), w_start, prev)
    has = np.isfinite(window)
    return {"iters": iters, "rank": np.array([t.rank for t in traces], np.int64),
            "coord": np.array([t.coord[:3] for t in traces], np.int64).reshape(B, 3),
            "topo": tuple(int(x) for x in traces[0].topo[:3]),
            "world": max(int(t.world) for t in traces),
            "work": np.where(has, own, np.nan) / 1e6,
            "host": np.where(has, data + np.maximum(window - busy, 0), np.nan) / 1e6,
            "p2p": fast / 1e6, "peer_up": np.nan_to_num(peer_up, nan=-1).astype(np.int64),
            "coll": coll / 1e6,
            # The tracer writes every comm op when opened; opened beyond closed is what was in flight at the end.
            "opened": np.maximum(np.array([len(t.opened.get("ts", ())) for t in traces], np.int64) - comm_closed, 0),
            "spans": spans}


def _uniform(traces: list) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """(start times, durations, peers) as (ranks, spans) arrays when every trace of the batch has the same spans in
    the same order (names, categories, iterations and groups alike, times sorted), as the ranks of one pipeline
    stage have: the simulator's, and a real job's DP replicas. None otherwise."""
    n = len(traces[0])
    t0 = traces[0]
    if n == 0 or any(len(t) != n for t in traces):
        return None
    names, kinds = tuple(t0.names), tuple(g for g, _ in t0.groups)
    if any(tuple(t.names) != names or tuple(g for g, _ in t.groups) != kinds for t in traces):
        return None
    for c in ("name", "cat", "it", "gid"):
        col = np.stack([getattr(t, c) for t in traces])
        if not (col == col[:1]).all():
            return None
    ts = np.stack([t.ts for t in traces]).astype(np.int64, copy=False)
    if (ts[:, 1:] < ts[:, :-1]).any():
        return None  # a row out of time order: the general path sorts
    dur = np.stack([t.dur for t in traces]).astype(np.int64, copy=False)
    return ts, dur, np.stack([t.peer for t in traces]).astype(np.int64)


def _batch_uniform(traces: list, ts: np.ndarray, dur: np.ndarray, peer: np.ndarray) -> dict:
    """`_batch` for a batch whose ranks share their spans' metadata (`_uniform`): every mask is one row of slots,
    the times are (ranks, slots) arrays, and a sum per iteration is a reduceat over the slots grouped by iteration.
    Sums and minima stay in integer nanoseconds until the end (a sum of integers below 2^53 is the same in float64
    whatever the order): the same numbers as `_batch_spans` (tested). Each step touches only the slots it needs
    (comm slots for transfers, comm-in-work slots for nesting): this runs once per rank file written by the
    simulator (its summary blocks) and per file read without one."""
    t0 = traces[0]
    B, S = ts.shape
    cat, it = np.asarray(t0.cat), np.asarray(t0.it, np.int64)
    kind = _kind_lut(tuple(g for g, _ in t0.groups))[np.asarray(t0.gid, np.int64)]
    send = _send_lut(tuple(t0.names))[np.asarray(t0.name, np.int64)]
    end = ts + dur
    step = cat == STEP
    iters = np.unique(it[step])
    W = max(len(iters), 1)
    col = np.searchsorted(iters, it).clip(0, W - 1)
    ok = (iters[col] == it) if len(iters) else np.zeros(S, bool)

    def per_iter(values: np.ndarray, slots: np.ndarray) -> np.ndarray:
        """(ranks, W) float: `values` (ranks, len(slots)) summed per iteration of their slots (all in an
        iteration). Not a matrix product: BLAS threads in each of the two worker processes spun and doubled the
        triage's CPU."""
        out = np.zeros((B, W))
        if len(slots):
            c = col[slots]
            if (np.diff(c) < 0).any():
                o = np.argsort(c, kind="stable")
                values, c = values[:, o], c[o]
            starts = np.flatnonzero(np.r_[True, c[1:] != c[:-1]])
            out[:, c[starts]] = np.add.reduceat(values, starts, axis=1)
        return out

    is_work = (cat == COMPUTE) | (cat == OPT)
    work = np.flatnonzero(is_work & ok)
    comm = cat == COMM
    # The last work span at or before each slot (the same slot on every rank: one order).
    last = np.maximum.accumulate(np.where(is_work, np.arange(S), -1))
    nest_cand = np.flatnonzero(comm & (last >= 0) & ok)
    nested = end[:, nest_cand] <= end[:, last[nest_cand]] + _NEST_SLACK_NS
    own = np.maximum(per_iter(dur[:, work], work) - per_iter(np.where(nested, dur[:, nest_cand], 0), nest_cand), 0)
    cov = np.flatnonzero(~step & ok)
    busy = np.zeros((B, W))
    if len(cov):
        # The running end along each rank's row (contiguous: a row-wise accumulate and reduceat are 20x faster
        # than the same on a transposed view).
        s_, e_ = ts[:, cov], end[:, cov]
        run = np.maximum.accumulate(e_, axis=1)
        gain = e_
        gain[:, 1:] -= np.maximum(s_[:, 1:], run[:, :-1])
        gain[:, 0] -= s_[:, 0]
        np.maximum(gain, 0, out=gain)
        busy = per_iter(gain, cov)
    data = np.flatnonzero((cat == DATA) & ok)
    data = per_iter(dur[:, data], data)
    w_end = np.full((B, W), np.nan)
    w_start = np.full((B, W), np.nan)
    for j in np.flatnonzero(step & ok):  # in slot order: a repeated step of one iteration counts its last
        w_end[:, col[j]] = end[:, j]
        w_start[:, col[j]] = ts[:, j]
    rank_of = np.array([t.rank for t in traces], np.int64)
    # Transfers and collectives: the comm slots only.
    cs = np.flatnonzero(comm)
    c_dur, c_peer, c_send, c_kind = dur[:, cs], peer[:, cs], send[cs], kind[cs]
    p2p = c_peer >= 0
    up = c_peer > rank_of[:, None]
    big = np.iinfo(np.int64).max

    def fastest(mask: np.ndarray, values: np.ndarray = c_dur) -> np.ndarray:
        v = np.where(mask, values, big).min(axis=1, initial=big)
        return np.where(v < big, v, np.nan)

    fast = np.stack([fastest(p2p & c_send & ~up), fastest(p2p & c_send & up), fastest(p2p & ~c_send & ~up),
                     fastest(p2p & ~c_send & up)], axis=1)
    coll = np.stack([fastest(~p2p & (c_kind == k)) for k in range(len(KINDS))], axis=1)
    peer_up = -fastest(p2p & up, -c_peer)
    return _features(traces, iters, own, data, busy, w_start, w_end, fast, coll, peer_up, len(cs),
                     np.full(B, S, np.int64))


def _min_per_rank(mask: np.ndarray, local: np.ndarray, values: np.ndarray, B: int) -> np.ndarray:
    """Per batch rank: the smallest of `values` where `mask` (rows in rank order), NaN where none."""
    out = np.full(B, np.nan)
    r, v = local[mask], values[mask]
    if len(r):
        starts = np.flatnonzero(np.r_[True, r[1:] != r[:-1]])
        out[r[starts]] = np.minimum.reduceat(v, starts)
    return out


def features(trace_dir: str | Path, workers: int = 2, use_summaries: bool = True) -> Features:
    """Read every rank file of a directory in `workers` processes and reduce it to Features (from the files'
    summary blocks where they end in one and `use_summaries`)."""
    d = os.fspath(trace_dir)
    names = sorted(n for n in os.listdir(d) if FILE_PATTERN.search(n))
    paths = [os.path.join(d, n) for n in names]
    if not paths:
        raise ValueError(f"no rank*.mst files in {d}")
    shares = [paths[i::workers] for i in range(workers)] if workers > 1 else [paths]
    if workers > 1:
        with ProcessPoolExecutor(workers) as pool:
            results = list(pool.map(_reduce, shares, [use_summaries] * len(shares)))
    else:
        results = [_reduce(paths, use_summaries)]
    parts = [p for r in results for p in r["parts"]]
    problems = [x for r in results for x in r["problems"]]
    if not parts:
        raise ValueError(f"no readable rank files in {d}: " + "; ".join(problems[:3]))
    world = max(p["world"] for p in parts)
    iters = np.unique(np.concatenate([p["iters"] for p in parts]))
    W = max(len(iters), 1)
    too_big = cells_problem(world, W)
    if too_big:  # each file fits, their union of iterations does not
        raise ValueError(f"the rank files in {d} together claim {too_big}; are they of one job?")
    f = Features(world, iters, np.full((world, 3), -1, np.int64), parts[0]["topo"],
                 np.full((world, W), np.nan), np.full((world, W), np.nan), np.full((world, 4), np.nan),
                 np.full(world, -1, np.int64),
                 np.full((world, len(KINDS)), np.nan), np.zeros(world, np.int64), np.zeros(world, np.int64),
                 problems, {})
    # As read_dir: the first file by name that claims a rank is the rank (the workers' shares interleave).
    order = {path: i for i, path in enumerate(paths)}
    for p in parts:
        for rank, path in zip(p["rank"].tolist(), p["path"]):
            if rank not in f.paths or order[path] < order[f.paths[rank]]:
                f.paths[rank] = path
    for p in parts:
        first = np.array([f.paths[rank] == path for rank, path in zip(p["rank"].tolist(), p["path"])], bool)
        for rank, path in zip(p["rank"][~first].tolist(), np.asarray(p["path"], object)[~first]):
            problems.append(f"{os.path.basename(path)} claims rank {rank}, already read from "
                            f"{os.path.basename(f.paths[rank])}; ignored")
        p = {k: (v[first] if isinstance(v, np.ndarray) and k != "iters" else v) for k, v in p.items()}
        r = p["rank"]
        f.coords[r] = p["coord"]
        cols = np.searchsorted(iters, p["iters"])
        if len(cols):
            f.work[np.ix_(r, cols)] = p["work"][:, :len(cols)]
            f.host[np.ix_(r, cols)] = p["host"][:, :len(cols)]
        f.p2p[r], f.coll[r], f.opened[r] = p["p2p"], p["coll"], p["opened"]
        f.spans[r] = p["spans"]
        f.peer_up[r] = np.where(p["peer_up"] < world, p["peer_up"], -1)
        if p.get("summarised"):
            f.summarised += len(r)
    return f


Z_SUSPECT = 5.0  # MADs above the stage's peers: low on purpose (the full detector judges; this only selects)
PER_VIEW = 8  # suspects each view (own work, host time, links, collectives) brings, the highest first
HANG_CANDIDATES = 32  # in a hung job: ranks taken that got least far against their stage peers
WITH_PIPELINE = 8  # of them, the first this many bring their whole pipeline (every stage and TP rank of their replica)
REFERENCE_PIPELINES = 4  # whole pipelines read as reference peers for every stage
BUDGET = 8192  # ranks the full detector reads at most (about 10 million spans at 1,280 a rank: 1.8 GB)
# Floors under the peers' spread: an excess is measured against at least 2% of the stage's median and 50 us (host
# time is ~1 ms an iteration with a spread of microseconds in a simulation: every rank would stand out otherwise).
REL_FLOOR, ABS_FLOOR_MS = 0.02, 0.05
LINK_ABS_FLOOR_MS = 0.005  # links and collectives: their fastest instance is steady to microseconds
GROUP_QUANTILE, GROUP_REL_FLOOR = 0.05, 0.005
# A slow group costs its stage in the full pass (6,256 ranks at 100,096): healthy 100,096-rank jobs had a DP group at
# 5 MADs, the weak (1.5x) DP links 19 and 40, and 9.2 in a third job (seed 2), which a bar of 10 missed. The triage
# only chooses what is read (a group read for nothing costs time, never a finding), so the bar sits between.
Z_GROUP = 7.0


def _robust_z(x: np.ndarray, stage: np.ndarray, rel_floor: float | None = None,
              abs_floor: float = ABS_FLOOR_MS) -> np.ndarray:
    """Per value: how many robust spreads (1.4826 MAD, with the floors above) it lies above the median
    of its stage's values in the same column; NaN stays NaN. (stats.robust_excess is the detector's version: its
    leave-one-out references for stages under 5 ranks are a judgement the selection does not need to make.)"""
    z = np.full(x.shape, np.nan)
    for s in np.unique(stage[stage >= 0]):
        rows = stage == s
        v = x[rows]
        if not np.isfinite(v).any():
            continue
        with np.errstate(all="ignore"), warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # an all-NaN column: NaN, as meant
            med = np.nanmedian(v, axis=0)
            mad = np.nanmedian(np.abs(v - med), axis=0) * 1.4826
            rel = REL_FLOOR if rel_floor is None else rel_floor
            scale = np.maximum(mad, np.maximum(np.abs(med) * rel, abs_floor))
            z[rows] = (v - med) / scale
    return z


def _link_scores(f: Features, stage: np.ndarray) -> np.ndarray:
    """Per rank: how far its P2P links' cost stands above the same links of its stage peers (robust z, the worse of
    its link up and its link down).

    A transfer's duration holds the wait for the other end: behind a slow receiver every send waits, so a sender's
    fastest send is no measure of its link. The link's cost is the smaller of the sender's fastest send and the
    receiver's fastest receive: whichever end came second did not wait (per direction, the two ends' files)."""
    up = f.peer_up
    ok = up >= 0
    link = np.full((f.world, 2), np.nan)
    u = up[ok]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # a link one end never used: NaN, as meant
        link[ok, 0] = np.fmin(f.p2p[ok, 1], f.p2p[u, 2])  # r -> up: r's send up, up's recv from below
        link[ok, 1] = np.fmin(f.p2p[u, 0], f.p2p[ok, 3])  # up -> r: up's send down, r's recv from above
        z = np.nanmax(_robust_z(link, stage, abs_floor=LINK_ABS_FLOOR_MS), axis=1, initial=-np.inf)
    score = np.where(ok, z, -np.inf)
    np.maximum.at(score, u, z[ok])  # the upper end of the link scores the same
    return score


def _group_z(key: np.ndarray, value: np.ndarray, per_stage: int) -> list[tuple[int, float]]:
    """Groups (key >= 0) whose low member value (GROUP_QUANTILE) stands Z_GROUP+ robust spreads above the other
    groups of the same stage (a group's key // per_stage): [(group key, z)], the highest first.

    A low quantile, not the median: behind a slow MEMBER every other member waits in every instance, but the slow
    member itself arrives last and waits for no one, so the group's fastest members are as fast as anywhere. Behind
    a slow ring link even the last to arrive waits for the ring ((1+f)/2 of the cost at least, simulate.ring_shift).
    A quantile over hundreds of members is steady, so its floor is finer than a rank's."""
    m = (key >= 0) & np.isfinite(value)
    if not m.any():
        return []
    # The lower quantile: a member's own value, never one pulled up by the next (of 8 TP members, the fastest).
    keys, low, _ = group_quantile(key[m], value[m], GROUP_QUANTILE)
    z = _robust_z(low[:, None], keys // per_stage, GROUP_REL_FLOOR, LINK_ABS_FLOOR_MS)[:, 0]
    hot = np.flatnonzero(np.nan_to_num(z, nan=-np.inf) >= Z_GROUP)
    return [(int(keys[i]), float(z[i])) for i in hot[np.argsort(-z[hot])]]


@dataclass
class Selection:
    """What the full detector reads: ranks, and why (suspect scores and group-wide anomalies)."""

    ranks: list[int]
    suspects: list[tuple[int, str, float]]  # (rank, feature, z)
    groups: list[str]
    truncated: bool


def select(f: Features, budget: int = BUDGET) -> Selection:
    """The ranks worth reading in full: suspects by how far they stand above their stage peers, their context, and
    reference pipelines, at most `budget` ranks."""
    present = f.coords[:, 0] >= 0
    stage = np.where(present, f.coords[:, 1], -1)
    tp, pp, dp = f.topo
    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        scores = {k: np.nanmax(_robust_z(getattr(f, k), stage), axis=1, initial=-np.inf) for k in ("work", "host")}
        scores["coll"] = np.nanmax(_robust_z(f.coll, stage, abs_floor=LINK_ABS_FLOOR_MS), axis=1, initial=-np.inf)
        scores["p2p"] = _link_scores(f, stage)
    # A hung job (comm ops left in flight): the rank everyone waits for stopped first, in its own work or in an op
    # its peers never reach, so it finished fewer spans than its stage peers, who ran on until they blocked on it.
    hung: list[int] = []
    if (f.opened[present] > 0).any():
        behind = -_robust_z(f.spans[:, None].astype(float), stage)[:, 0]
        behind = np.where(present, np.nan_to_num(behind, nan=-np.inf), -np.inf)
        hung = [int(r) for r in np.argsort(-behind, kind="stable")[:HANG_CANDIDATES] if behind[r] > 0]
    # Each view's own top ranks, taken in turns (every view's first, then every view's second, ...): one view's
    # noise or victims (a slow rank's TP peers wait in every all-reduce, 70 MADs out) must not crowd out another
    # view's fault (the slow rank itself, 17 MADs out in own work).
    best: dict[int, tuple[int, str, float]] = {}
    for k, sc in scores.items():
        sc = np.where(present & np.isfinite(sc), sc, -np.inf)
        for place, r in enumerate(np.argsort(-sc, kind="stable")[:PER_VIEW]):
            if sc[r] < Z_SUSPECT:
                break  # the rest of this view is lower still
            old = best.get(int(r))
            if old is None or (place, -sc[r]) < (old[0], -old[2]):
                best[int(r)] = (place, k, float(sc[r]))
    suspects = [(r, k, z) for r, (_, k, z) in sorted(best.items(), key=lambda x: (x[1][0], -x[1][2]))]

    chosen: list[int] = []
    seen: set[int] = set()

    def add(ranks) -> bool:
        for r in ranks:
            r = int(r)
            if 0 <= r < f.world and r not in seen and present[r]:
                if len(chosen) >= budget:
                    return False
                seen.add(r)
                chosen.append(r)
        return True

    def rank_at(d: int, s: int, t: int) -> int:
        return t + tp * (d + dp * s)

    def pipeline(d: int) -> list[int]:
        return [rank_at(d, s, t) for s in range(pp) for t in range(tp)]

    def context(r: int) -> list[int]:
        d, s, t = (int(x) for x in f.coords[r])
        near = [rank_at(d, s, x) for x in range(tp)]  # TP group
        near += [rank_at(d, s + k, t) for k in (-1, 1) if 0 <= s + k < pp]  # pipeline neighbours
        near += [rank_at((d + k) % dp, s, t) for k in (-1, 1)] if dp > 1 else []  # DP ring neighbours
        return near

    groups: list[str] = []
    ok = add([r for r, _, _ in suspects[:1]] + hung[:1])
    # Reference peers first: without them no stage has the peers the full detector compares against.
    for d in np.unique(np.linspace(0, dp - 1, min(REFERENCE_PIPELINES, dp)).round().astype(int)):
        ok = ok and add(pipeline(int(d)))
    # A hang next: the job is stuck, and how it was slow before matters less (detect puts hangs first too).
    for r in hung:
        ok = ok and add([r] + context(r))
    for r, _, _ in suspects:
        ok = ok and add([r] + context(r))
    # A collective slow for a whole group (a slow ring link, a slow switch): the group's low members (their own
    # fastest instances) above the other groups of its kind in the same stage. A weak link hardly moves any one
    # member (1.5x on one DP link: +1.5 ms in a 6 ms all-reduce beside arrival skews of several ms), but a quantile
    # of hundreds of members is steady. The group is read whole, then its stage: its members are put on one clock
    # through the groups that leave together (ring.bridge_offsets), each member's TP peers and their DP groups.
    slow_groups = []
    for k, kind in enumerate(KINDS):
        if kind == "pp" or not np.isfinite(f.coll[:, k]).any():
            continue
        key = (f.coords[:, 1] * dp + f.coords[:, 0]) if kind == "tp" else (f.coords[:, 1] * tp + f.coords[:, 2])
        key = np.where(present, key, -1)
        size = tp if kind == "tp" else dp
        if size < 3:
            continue  # a pair's link is a P2P-like pair: the members' own scores cover it
        for g, z in _group_z(key, f.coll[:, k], dp if kind == "tp" else tp)[:4]:
            slow_groups.append((z, kind, np.flatnonzero(key == g)))
    slow_groups.sort(key=lambda x: -x[0])
    for z, kind, members in slow_groups:
        groups.append(f"{kind} group of rank {int(members[0])} (its low members {z:.0f} MADs above its stage's "
                      "groups)")
        ok = ok and add(members)
    for _, _, members in slow_groups:
        ok = ok and add(np.flatnonzero(present & (stage == f.coords[members[0], 1])))
    for r, _, _ in suspects[:WITH_PIPELINE]:
        ok = ok and add(pipeline(int(f.coords[r, 0])))
    return Selection(sorted(chosen), suspects, groups, not ok)


def analyse_two_level(trace_dir: str | Path, thresholds=None, workers: int = 2, budget: int = BUDGET,
                      align: bool = False, with_features: bool = False, use_summaries: bool = True):
    """detect.analyse for a job too large for one table: triage every rank (features, select), then the full
    detector on the selected ranks. Returns (analysis, problems), plus the Features with `with_features`; the
    report's notes say what was read. `align`: clock offsets estimated on the selected ranks (as `scan detect
    --align` on all of them). `use_summaries`: False works every rank's numbers out from its spans, whatever
    summary blocks the files end in."""
    from megatronapp.scan.detect import analyse

    if not os.path.isdir(trace_dir):
        raise FileNotFoundError(f"trace directory {trace_dir} does not exist")
    f = features(trace_dir, workers, use_summaries)
    sel = select(f, budget)
    shared: dict = {}
    traces = [read_rank(f.paths[r], shared) for r in sel.ranks]
    offsets = clock = None
    if align:
        from megatronapp.scan.align import estimate_offsets

        offsets, _, clock = estimate_offsets(traces)
    an = analyse(traces, offsets, thresholds=thresholds, clock=clock, release_traces=True,
                 partial=len(sel.ranks) < len(f.paths))
    present = int((f.coords[:, 0] >= 0).sum())
    why = f"{len(sel.suspects)} suspects (each view's top {PER_VIEW} at {Z_SUSPECT:g}+ MADs above their stage " \
          "peers: own work, host time, P2P link cost, collective cost)"
    from_summaries = (f" ({f.summarised} from the summary blocks their writers left: damage to those files' span "
                      "blocks shows only in the ranks read in full; --no-summaries reads every block)"
                      if f.summarised else "")
    note = (f"two-level analysis of {present} ranks: every rank reduced to per-iteration own work and host time and "
            f"its fastest transfers and collectives{from_summaries}, then {len(sel.ranks)} ranks analysed in full: "
            f"{why} with their TP groups, pipeline and ring neighbours, and {REFERENCE_PIPELINES} reference "
            "pipelines")
    if sel.groups:
        note += "; whole groups: " + ", ".join(sel.groups)
    if sel.truncated:
        note += f"; the selection stopped at its budget of {budget} ranks (a cause outside it is not seen)"
    an.report.notes.insert(0, note)
    return (an, f.problems, f) if with_features else (an, f.problems)
