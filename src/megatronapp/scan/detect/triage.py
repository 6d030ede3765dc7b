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
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from megatronapp.scan.detect.evidence import group_quantile
from megatronapp.scan.detect.features import KINDS, Features, features
from megatronapp.scan.read.format import FILE_PATTERN, TraceFormatError, read_rank

LARGE_SPANS = 50_000_000  # spans above this in a directory: `scan detect` triages first (the table: ~9 GB)


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
    from megatronapp.scan.detect.analysis import analyse

    if not os.path.isdir(trace_dir):
        raise FileNotFoundError(f"trace directory {trace_dir} does not exist")
    f = features(trace_dir, workers, use_summaries)
    sel = select(f, budget)
    shared: dict = {}
    traces = [read_rank(f.paths[r], shared) for r in sel.ranks]
    offsets = clock = None
    if align:
        from megatronapp.scan.detect.align import estimate_offsets

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
