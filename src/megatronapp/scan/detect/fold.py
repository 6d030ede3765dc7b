"""One fault seen by several views, or its consequences seen as faults: findings folded into the one that explains
them (kept in its evidence), so every finding left is a cause."""
from __future__ import annotations

from collections.abc import Callable

import numpy as np

from megatronapp.scan.detect.findings import Finding
from megatronapp.scan.detect.table import Phases, Table


def merge_directions(found: list[Finding]) -> list[Finding]:
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


def combine(per_iteration: list[Finding], floors: list[Finding]) -> list[Finding]:
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


def fold_into(findings: list[Finding], lead_of: Callable[[Finding], Finding | None], key: str) -> list[Finding]:
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


def pauses_of_slow_ranks(findings: list[Finding], ph: Phases, tb: Table) -> list[Finding]:
    """Fold a rank's 'pauses' into its slow-compute (or else late-arrival) finding, and a late arrival its
    slowness explains into its slow-compute finding.

    A rank that computes 3x slower falls further behind in some iterations than in others (queueing, which
    micro-batches a window catches), so the per-iteration view can call it paused in 4 of 6 iterations while
    the floors say every repeat of its ops is slow: one fault, and the slowness is its cause. A pause kept
    apart must exceed 3x what the slow compute alone costs an iteration ((factor - 1) x its peers' compute, or
    the finding's own excess where the rank has no peers). Generous on purpose: the rank is named either way,
    the folded pause stays in the finding's evidence, and its confidence carries over (two views agree)."""
    slow = {f.ranks[0]: f for f in findings if f.kind == "slow-compute"}
    # A rank late in most iterations (a slow input pipeline) is late by more in some: the same 3x rule, against
    # what its lateness costs an iteration. A real CPU-bound input stage (3 gloo ranks, one spinning 2 x 60 ms
    # an iteration): +120 ms late in 8 of 8 iterations by its host time, and by its whole self time, where the
    # peers' compute swung by 24 ms, a "pause" of +108 ms in 4 of 8 at confidence 0.71 (listed first once in CI).
    late = {f.ranks[0]: f for f in findings if f.kind == "late-arrival"}

    def lead_of(f: Finding) -> Finding | None:
        if f.kind != "transient-pause":
            return None
        g = slow.get(f.ranks[0]) or late.get(f.ranks[0])
        if g is None:
            return None
        r = f.ranks[0]
        peers = np.flatnonzero((tb.coords[:, 1] == tb.coords[r, 1]) & (np.arange(tb.world) != r))
        peer_c = float(np.nanmedian(ph.compute[peers])) if len(peers) and g.kind == "slow-compute" else 0.0
        expected = max(g.excess_ms, (g.factor - 1.0) * peer_c if np.isfinite(peer_c) else 0.0)
        # Slowness amplifies (queueing); lateness does not, but a late rank's whole self time carries its peers'
        # compute swing too (+-43 ms beside +120 ms of lateness): a late lead takes pauses within 2x of it.
        if f.excess_ms > (3.0 if g.kind == "slow-compute" else 2.0) * expected:
            return None
        f.evidence["expected_ms"] = round(expected, 3)  # what the slowness alone costs an iteration
        g.confidence = max(g.confidence, f.confidence)
        return g
    findings = fold_into(findings, lead_of, "pauses_explained")

    def slowed_host_work(f: Finding) -> Finding | None:
        # A rank slowed in all it does (a throttled or shared CPU) is slowed in its host work between spans too:
        # a slow-compute rank at 3.55x on a real FSDP job also read +1.6 ms of untraced time an iteration, a
        # separate late-arrival at confidence 0.59. Expected: its factor applied to its peers' host time; a
        # late arrival within 3x of that is the same slowness (kept in the evidence), a bigger one a fault of its own.
        g = slow.get(f.ranks[0]) if f.kind == "late-arrival" else None
        if g is None or not np.isfinite(g.factor):
            return None
        r = f.ranks[0]
        peers = np.flatnonzero((tb.coords[:, 1] == tb.coords[r, 1]) & (np.arange(tb.world) != r))
        host = ph.data[peers] + ph.gap[peers]
        peer_host = float(np.nanmedian(host)) if len(peers) and np.isfinite(host).any() else 0.0
        expected = max(g.factor - 1.0, 0.0) * peer_host
        if not f.excess_ms <= 3.0 * expected:
            return None
        f.evidence["expected_ms"] = round(expected, 3)
        return g
    return fold_into(findings, slowed_host_work, "host_time_explained")


def links_of_slow_ranks(findings: list[Finding]) -> list[Finding]:
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
            pairs = [(int(d[0]), int(d[1])) for d in f.evidence.get("directions", [f.ranks])]
            lead = next((slow[r] for _, r in pairs if r in slow), None)
            if lead is None:
                # A slow rank's own sends: a host that computes slowly also copies and posts its messages
                # slowly, a fraction of a ms per transfer (real pp4 run: a 1.5x last stage's link 3-2 at 1.78x
                # its fastest transfer, +0.1 ms, beside +3.6 ms per iteration of its own). Folded when the
                # link's excess is sub-millisecond and under the sending rank's own.
                lead = next((slow[s] for s, _ in pairs if s in slow
                             and f.excess_ms < min(1.0, slow[s].excess_ms)), None)
            return lead
        return None
    return fold_into(findings, cause, "links_also_slow")


def explained_by_links(findings: list[Finding], links: list[Finding]) -> list[Finding]:
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
    return fold_into(findings, link_of, "explains")



def fold_into_hangs(findings: list[Finding], hangs: list[Finding]) -> list[Finding]:
    """A hung rank's other findings are the same fault seen before it stopped: kept as the hang's evidence."""
    hung = {r: h for h in hangs for r in h.ranks}
    return fold_into(findings, lambda f: hung[f.ranks[0]] if set(f.ranks) <= hung.keys() else None,
                      "before_the_hang")


