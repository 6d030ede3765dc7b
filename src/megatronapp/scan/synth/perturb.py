"""Faults with known ground truth, injected into REAL recorded traces by causal re-timing.

A second source of test scenarios, independent of the simulator: a healthy traced run of the engine (real
gloo ranks, real scheduling noise) is re-timed as if a fault had happened. A delay on one rank does not stay
there: every later event of that rank moves, and so does every op of another rank that was waiting on it.
The re-timing follows how a delay propagates in a synchronous job:

- each rank's own clock is mapped by a non-decreasing delay D_r(t): injected delays (a stretched compute
  interval, a pause, a host stall) add to it; time spent waiting absorbs delay (a rank that waited 5 ms for a
  peer loses nothing when that peer is 3 ms later than before);
- a receive ends no earlier than max(its posting, the matching send's posting + the link's extra delay) + its
  transfer time, each posting taken on the re-timed clocks; a collective ends, for each member, no earlier than
  the re-timed last arrival among the members that had arrived before it left (a broadcast root that left before
  the others posted waited for nobody) + the op's own time after that arrival; sends complete at their sender's
  pace;
- ops are processed in order of their original end, so every posting they depend on is final when read.

Faults (`Perturbation.kind`): slow-compute (stretch a rank's exclusive compute, nested comm excluded),
slow-link (extra time on each transfer between two ranks, both directions: a P2P link), slow-collective-link
(extra time on every collective two ranks share: the group's ring is as slow as its slowest link; members of a
larger ring leave in ring order, the receiver of the slow link last), pause (a stall at the start of the first
forward of every EVERY-th iteration), late-arrival (an untraced stall at the start of every iteration), hang
(the rank stops at a time: its later spans vanish, ops of other ranks that can no longer complete are left
OPENED as the tracer writes them). Views of a trace that are not faults: clock offsets and drift per rank,
eager sends (a send returns once buffered), a stage whose work is heavier (declared in `stage_work`).
"""
from __future__ import annotations

import bisect
import dataclasses
from dataclasses import dataclass

import numpy as np

from megatronapp.scan.detect.table import join, match_p2p
from megatronapp.scan.read.format import CAT_INDEX, COLUMNS, RankTrace

_COMPUTE, _COMM, _STEP = CAT_INDEX["compute"], CAT_INDEX["comm"], CAT_INDEX["step"]
_LAYER = CAT_INDEX["layer"]
NEVER = 1e15  # ns of delay standing for "never" (a hang): far beyond any trace window, finite so sums stay exact
KINDS = ("slow-compute", "slow-link", "slow-collective-link", "pause", "late-arrival", "hang")


@dataclass(frozen=True)
class Perturbation:
    """One injected fault: `ranks` (one rank, or the two ends of a link), `factor` (compute stretch), `ms`
    (extra per transfer / collective / pause / stall), `every` (pause period), `at_iteration` (hang start).
    `outside_layers` makes a slow-compute a heavier STAGE rather than a slower rank: the same total stretch,
    put on the compute outside per-layer spans (a bigger head, an extra embedding), its layer spans untouched.
    The engine's layer spans cover the forward only, so the layers' backward counts as outside and takes a
    share of the extra (more than a bigger head would put there; the layer view reads forward spans only)."""

    kind: str
    ranks: tuple[int, ...]
    factor: float = 1.0
    ms: float = 0.0
    every: int = 2
    at_iteration: int = 0
    outside_layers: bool = False  # slow-compute: the extra work lies outside per-layer spans (a heavier stage)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown perturbation {self.kind!r}; expected one of {', '.join(KINDS)}")
        if len(self.ranks) != (2 if "link" in self.kind else 1):
            raise ValueError(f"{self.kind} needs {'two ranks' if 'link' in self.kind else 'one rank'}, "
                             f"got {self.ranks}")


class _Delay:
    """D_r(t) of one rank: injected delay I_r (piecewise linear in original time) plus waits' anchors."""

    def __init__(self, segments: list[tuple[float, float, float]]):
        # Knots of I: a jump at t0 (t0 == t1) applies to times strictly after t0 (1 ns later).
        xs = sorted({x for a, b, _ in segments for x in (a, b if b > a else a + 1)})
        self.x = np.array(xs or [0.0], float)
        y = np.zeros(len(self.x))
        for a, b, extra in segments:
            b = b if b > a else a + 1
            y += extra * np.clip((self.x - a) / (b - a), 0.0, 1.0)
        self.y = y
        self.anchor_t: list[float] = []
        self.anchor_v: list[float] = []

    def injected(self, t: float | np.ndarray) -> float | np.ndarray:
        return np.interp(t, self.x, self.y, left=0.0, right=float(self.y[-1]))

    def at(self, t: float, inclusive: bool = False) -> float:
        """Delay at original time t (inclusive: an anchor AT t counts, for the end of the op that set it)."""
        k = (bisect.bisect_right if inclusive else bisect.bisect_left)(self.anchor_t, t) - 1
        if k < 0:
            return float(self.injected(t))
        return self.anchor_v[k] + float(self.injected(t) - self.injected(self.anchor_t[k]))

    def anchor(self, t: float, v: float) -> None:
        self.anchor_t.append(t)
        self.anchor_v.append(v)

    def many(self, t: np.ndarray, inclusive: bool) -> np.ndarray:
        at = np.asarray(self.anchor_t, float)
        k = np.searchsorted(at, t, side="right" if inclusive else "left") - 1
        inj = self.injected(t)
        if not len(at):
            return inj
        base = np.where(k >= 0, np.asarray(self.anchor_v + [0.0])[k] - self.injected(at[np.maximum(k, 0)]), 0.0)
        return base + inj


def _minus(spans: list[tuple[int, int]], holes: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The parts of sorted, disjoint `spans` outside sorted `holes`."""
    out, k = [], 0
    for a, b in spans:
        while k < len(holes) and holes[k][1] <= a:
            k += 1
        j, t = k, a
        while j < len(holes) and holes[j][0] < b:
            if holes[j][0] > t:
                out.append((t, holes[j][0]))
            t = max(t, holes[j][1])
            j += 1
        if b > t:
            out.append((t, b))
    return out


def _compute_gaps(ts: np.ndarray, end: np.ndarray, cat: np.ndarray) -> list[tuple[int, int]]:
    """One rank's exclusive compute intervals: compute spans minus the comm spans nested in them."""
    comm = np.flatnonzero(cat == _COMM)
    cts, cend = ts[comm], end[comm]
    out = []
    for i in np.flatnonzero(cat == _COMPUTE):
        a, b = int(ts[i]), int(end[i])
        lo, hi = np.searchsorted(cts, a, "left"), np.searchsorted(cts, b, "right")
        t = a
        for j in range(lo, hi):
            if cend[j] <= b:
                if cts[j] > t:
                    out.append((t, int(cts[j])))
                t = max(t, int(cend[j]))
        if b > t:
            out.append((t, b))
    return out


def _segments(t: RankTrace, faults: list[Perturbation]) -> list[tuple[float, float, float]]:
    """Injected delay segments (t0, t1, extra ns) of one rank, on its original clock."""
    seg: list[tuple[float, float, float]] = []
    o = np.argsort(t.ts, kind="stable")
    ts, end, cat, it = t.ts[o], (t.ts + t.dur)[o], t.cat[o], t.it[o]
    fwd = t.name_id("forward")
    for f in faults:
        if f.ranks[0] != t.rank or "link" in f.kind:
            continue
        if f.kind == "slow-compute":
            gaps = _compute_gaps(ts, end, cat)
            stretch = f.factor - 1
            if f.outside_layers and (cat == _LAYER).any():
                total = sum(b - a for a, b in gaps)
                gaps = _minus(gaps, list(zip(ts[cat == _LAYER].tolist(), end[cat == _LAYER].tolist())))
                stretch *= total / max(sum(b - a for a, b in gaps), 1)
            seg += [(a, b, stretch * (b - a)) for a, b in gaps]
        elif f.kind == "pause":
            for k in np.unique(it[it >= 0]):
                first = np.flatnonzero((it == k) & (t.name[o] == fwd))
                if len(first) and k % f.every == 0:
                    seg.append((float(ts[first[0]]), float(ts[first[0]]), f.ms * 1e6))
        elif f.kind == "late-arrival":
            seg += [(float(ts[i]), float(ts[i]), f.ms * 1e6) for i in np.flatnonzero(cat == _STEP)]
        elif f.kind == "hang":
            steps = np.flatnonzero((cat == _STEP) & (it == f.at_iteration))
            if not len(steps):
                raise ValueError(f"hang at iteration {f.at_iteration}: rank {t.rank} has no such traced step")
            # Stuck in its own work just after the step's first forward started (mid-iteration).
            first = np.flatnonzero((it == f.at_iteration) & (t.name[o] == fwd))
            t0 = float(ts[first[0]] if len(first) else ts[steps[0]])
            seg.append((t0, t0, NEVER))
    return seg


def _ring_extra(group: tuple[int, ...], a: int, b: int, ms: float) -> dict[int, float]:
    """Extra exit time (ns) per member of a ring collective whose link a-b (ring neighbours) is slow by `ms`:
    the receiver of the slow link leaves last (+ms), each member after it in ring order a little earlier, the
    sender first (ring of two: both directions of the cable, both +ms)."""
    n = len(group)
    if n <= 2:
        return {r: ms * 1e6 for r in group}
    ia, ib = group.index(a), group.index(b)
    if (ia + 1) % n != ib:
        ia, ib = ib, ia  # the direction whose receiver follows its sender in ring order
    if (ia + 1) % n != ib:
        return {r: ms * 1e6 for r in group}  # not ring neighbours: the whole ring waits evenly
    return {group[(ib + k) % n]: ms * 1e6 * (1 - k / (2 * (n - 1))) for k in range(n)}


def perturb(traces: list[RankTrace], faults: list[Perturbation]) -> list[RankTrace]:
    """Re-time real traces as if `faults` had happened; returns new traces (the inputs are not modified)."""
    world = max(t.world for t in traces)
    for f in faults:
        if any(not 0 <= r < world for r in f.ranks):
            raise ValueError(f"{f.kind} names rank(s) {f.ranks} outside the traced world of {world}")
    tb = join(traces)
    # join sorts by (rank, ts); the same stable sort of the concatenation maps rows back to each trace.
    rank_cat = np.concatenate([np.full(len(t), t.rank) for t in traces])
    ts_cat = np.concatenate([t.ts for t in traces])
    order = np.lexsort((ts_cat, rank_cat))
    delay = {t.rank: _Delay(_segments(t, faults)) for t in traces}
    end = tb.end.astype(float)
    ts = tb.ts.astype(float)
    names = tb.names
    is_send = tb.name == (names.index("send") if "send" in names else -2)
    is_recv = tb.name == (names.index("recv") if "recv" in names else -2)
    comm = (tb.cat == _COMM) & (tb.seq >= 0) & (tb.gkey >= 0)
    coll = comm & ~is_send & ~is_recv
    sends, recvs = np.flatnonzero(comm & is_send), np.flatnonzero(comm & is_recv)
    si, ri = match_p2p(tb, sends, recvs) if len(sends) and len(recvs) else (sends[:0], recvs[:0])
    partner = dict(zip(ri.tolist(), si.tolist()))
    link_ms = {frozenset(f.ranks): f.ms for f in faults if f.kind == "slow-link"}
    coll_links = [f for f in faults if f.kind == "slow-collective-link"]
    key = tb.gkey * (int(tb.seq.max(initial=0)) + 1) + tb.seq
    members: dict[int, list[int]] = {}
    for i in np.flatnonzero(coll):
        members.setdefault(int(key[i]), []).append(int(i))
    # Process every op another rank can hold up, in order of its original end.
    todo = np.r_[np.flatnonzero(coll), ri]
    for i in todo[np.argsort(end[todo], kind="stable")]:
        q, e = int(tb.rank[i]), end[i]
        if coll[i]:
            arrived = [j for j in members[int(key[i])] if ts[j] <= e]
            extra = 0.0
            grp = tb.groups[int(tb.gkey[i])][1]
            for f in coll_links:
                if set(f.ranks) <= set(grp):
                    extra += _ring_extra(grp, *f.ranks, f.ms).get(q, 0.0)
            last = max(ts[j] for j in arrived)
            last_new = max(ts[j] + delay[int(tb.rank[j])].at(ts[j]) for j in arrived) + extra
        else:
            # The data is there `extra` after the send is posted: a receiver that posts later loses less or nothing.
            j = partner[int(i)]
            extra = link_ms.get(frozenset((q, int(tb.rank[j]))), 0.0) * 1e6
            last = max(ts[i], ts[j]) if ts[j] <= e else ts[i]
            last_new = max(ts[i] + delay[q].at(ts[i]),
                           ts[j] + delay[int(tb.rank[j])].at(ts[j]) + extra if ts[j] <= e else -np.inf)
        d = delay[q]
        d.anchor(e, max(d.at(e), last_new - last))
    new_ts = np.empty(len(ts))
    new_end = np.empty(len(ts))
    for r, d in delay.items():
        m = tb.rank == r
        new_ts[m] = ts[m] + d.many(ts[m], inclusive=False)
        new_end[m] = end[m] + d.many(end[m], inclusive=True)
    # Back to each trace's own row order.
    back_ts = np.empty(len(ts))
    back_end = np.empty(len(ts))
    back_ts[order], back_end[order] = new_ts, new_end
    out, at = [], 0
    slow = {f.ranks[0] for f in faults if f.kind == "slow-compute"}
    for t in traces:
        n = len(t)
        a, b = back_ts[at:at + n], back_end[at:at + n]
        at += n
        out.append(_rebuild(_waits_stretched(t, a, b) if t.rank in slow else t, a, b))
    return out


def _waits_stretched(t: RankTrace, new_ts: np.ndarray, new_end: np.ndarray) -> RankTrace:
    """A slow-compute rank's compute and layer spans wait for a CPU in proportion to their new length: more work
    on the same host waits as much longer as it runs. Without this, on a host at 59-79% CPU wait a 1.4x stretch of
    the wall time grew the compute judged without that wait 3.2x (32.8 -> 105.6 ms a step on the loaded pp4
    recording). A pause injected into such a span is scaled too (it is not CPU work): scenarios keep the two kinds
    on different ranks."""
    work = np.isin(t.cat, (_COMPUTE, _LAYER)) & (t.cpu_wait > 0) & (t.dur > 0) & (new_end < NEVER / 2)
    grow = np.where(work, (new_end - new_ts) / np.maximum(t.dur, 1), 1.0)
    waits = np.where(work, np.round(t.cpu_wait * grow), t.cpu_wait).astype(t.cpu_wait.dtype)
    return dataclasses.replace(t, cpu_wait=waits)


def _rebuild(t: RankTrace, new_ts: np.ndarray, new_end: np.ndarray) -> RankTrace:
    """A trace with re-timed spans. The tracer writes every comm op and step when it OPENS (records with dur =
    -1, read into `opened`), so those are re-written for every comm op and step that still starts; a span that
    now never starts is dropped, and one that never ends is not written as closed (a hung rank's open ops)."""
    started = new_ts < NEVER / 2
    keep = started & (new_end < NEVER / 2)
    cols = {c: getattr(t, c) for c in COLUMNS}
    cols["ts"] = np.round(np.where(started, new_ts, 0)).astype(np.int64)
    cols["dur"] = np.maximum(np.round(np.where(keep, new_end - new_ts, 0)), 0).astype(np.int64)
    opens = started & np.isin(t.cat, (_COMM, _STEP))
    opened = {c: v[opens] for c, v in cols.items()}
    opened["dur"] = np.full(int(opens.sum()), -1, np.int64)
    return dataclasses.replace(t, opened=opened, **{c: v[keep] for c, v in cols.items()})


# ----------------------------------------------------------------------------- views that are not faults
def shift_clocks(traces: list[RankTrace], offsets_s: dict[int, float], ppm: dict[int, float]) -> list[RankTrace]:
    """Each rank's clock read as another host's: + offset (seconds; days are realistic) and a drift (ppm)."""
    out = []
    for t in traces:
        off, k = int(offsets_s.get(t.rank, 0.0) * 1e9), 1.0 + ppm.get(t.rank, 0.0) * 1e-6
        t0 = int(t.ts.min()) if len(t) else 0

        def moved(ts: np.ndarray, t0: int = t0, off: int = off, k: float = k) -> np.ndarray:
            return t0 + off + np.round((np.asarray(ts, np.int64) - t0) * k).astype(np.int64)

        def remap(ts: np.ndarray, dur: np.ndarray, k: float = k) -> tuple:
            return moved(ts), np.where(dur < 0, dur, np.round(dur * k)).astype(np.int64)
        ts, dur = remap(t.ts, t.dur)
        opened = dict(t.opened)
        if len(opened.get("ts", ())):
            opened["ts"], opened["dur"] = remap(opened["ts"], opened["dur"])
        header = t.header
        if off or k != 1.0:  # another host's clock: the header must not claim the recording host's
            header = {**header, "host": f"{header.get('host')}~clock{off:+d}ns{k - 1:+.2e}", "boot_id": None}
            hs = header.get("handshake")
            if hs:  # its clock reads are on this rank's clock too (alignment anchors on them)
                header["handshake"] = {**hs, **{key: moved(hs[key]).tolist() for key in ("send", "exit") if key in hs}}
            if "mono_ns" in header:
                header["mono_ns"] = int(moved([header["mono_ns"]])[0])
        out.append(dataclasses.replace(t, ts=ts, dur=dur, opened=opened, header=header))
    return out


def eager_sends(traces: list[RankTrace], buffered_us: float = 20.0) -> list[RankTrace]:
    """Sends that return once their data is buffered (an eager protocol): each send span lasts `buffered_us`
    at most; the time it used to block becomes untraced host time of the sender, on every rank alike."""
    out = []
    for t in traces:
        send = (t.cat == _COMM) & (t.peer >= 0) & (t.name == t.name_id("send"))
        out.append(dataclasses.replace(t, dur=np.where(send, np.minimum(t.dur, int(buffered_us * 1e3)), t.dur)))
    return out


def declare_stage_work(traces: list[RankTrace], stage_work: list[float]) -> list[RankTrace]:
    """Put a cost model's relative stage work into every header (what the engine writes when it knows it)."""
    return [dataclasses.replace(t, header={**t.header, "stage_work": list(stage_work)}) for t in traces]
