"""Slow links and the findings they explain: a link end's late arrivals, pauses or stage slowness that the link's
own cost accounts for, and transfers that only look slow because their ends waited for a CPU.

Kept apart from fold.py (ranks: slow ranks' pauses and links, hangs) so the two families of rules stay readable.

1. A slow link costs each of its ends time before it can post an op over it (the drill and a congested NIC alike:
   the send, or the collective holding both ends, is posted late). That time is the end's own, not waiting, so
   the self-time views see the end as late or paused, and in a pure pipeline (one rank per stage) the wait
   structure sees it as a slow stage: victims listed as causes beside the link itself (issue 25: both ends of a
   +20 ms link as `late-arrival`; a pp 4 interleaved run, a lone-stage `slow-compute` +64 ms per iteration beside
   a link costing its end ~360). The cost is measured per end against the end's OWN other posts (sends to other
   peers, collectives without the other end), which needs no second pipeline column.
2. On an oversubscribed host a receive ends when its thread gets a CPU back: a transfer between ranks that
   wait for a CPU carries the run queue, and a link found by transfer times alone (fastest or median transfer,
   not stalls) whose excess is within what its ends wait for a CPU per work span may be the host, not the link
   (issue 25: on the stored loaded recording, pp2dp2 before a hang, 0-2 at 11x its peers' fastest transfer,
   +9.3 ms, beside ends that waited 12-14 ms for a CPU per work span; named first at confidence 1.00). The per-span
   waits do not tell it apart from a real +10 ms link of the same recording (+11.9 ms beside 16 ms waits):
   dropping such links lost 5 of its real links (recall 0.75 -> 0.625). So the evidence is called what it is,
   ambiguous: the link keeps its place in the list below confidence 0.5, after any cause the host cannot explain,
   and the report's notes say to confirm it.
3. A slow rank makes its groups' collectives slow (fold.links_of_slow_ranks folds them into it); the other members
   of such a group then post their NEXT collectives late, or see them queue behind the slow one, so a group that
   shares a member with it looks slow too, one step removed (issue 25's real-run repeats: a 2x rank 5 of tp2pp2dp2,
   its DP pair 5-7 folded into it, and the tied-embedding pair 3-7 at 3.35x beside it, confidence 0.88). Such a
   collective link folds into the slow rank's finding too, noting the member it went through.
"""
from __future__ import annotations

import numpy as np

from megatronapp.scan.detect.contention import STARVED, cpu_wait_share
from megatronapp.scan.detect.evidence import group_quantile
from megatronapp.scan.detect.findings import Finding, link_label
from megatronapp.scan.detect.fold import fold_into
from megatronapp.scan.detect.table import Table
from megatronapp.scan.read.format import CAT_INDEX

MS = 1e6
_COMM = CAT_INDEX["comm"]
_WORK = (CAT_INDEX["compute"], CAT_INDEX["data"], CAT_INDEX["optimizer"])
_STALL_METHODS = ("send stalls", "collective stalls")
# What an end's finding may exceed the link's cost to it by and still be its consequence (the same generosity as
# fold.explained_by_links: the end is named by the link either way, the folded finding stays in its evidence).
_COST_SLACK = 1.5
# Findings of an end that a link's posting cost can produce: self time beyond peers (late arrival, pause) and a
# lone stage judged by the wait structure (its self time includes the stalls). Op floors and layer floors are
# compute spans' own time, which a stall before posting never enters: a slow rank stays a slow rank.
_END_KINDS = ("late-arrival", "transient-pause")
_END_METHODS = ("wait structure", "lone stages against each other")


def link_end_costs(tb: Table, send_stall: np.ndarray, coll_stall: np.ndarray, iters: np.ndarray,
                   a: int, b: int) -> dict[int, float]:
    """Per end of link a-b: ms per iteration it stalled before posting ops over the link (sends to the other end,
    collectives whose group holds both), beyond its own median stall before its other posts."""
    nid = {n: i for i, n in enumerate(tb.names)}
    send_id = nid.get("send", -2)
    holds = np.array([a in r and b in r for _, r in tb.groups] + [False])
    out = {}
    for r, other in ((a, b), (b, a)):
        lo, hi = np.searchsorted(tb.rank, [r, r + 1])  # rows are sorted by rank: this end's rows only, at any scale
        rows = slice(int(lo), int(hi))
        m = (tb.cat[rows] == _COMM) & np.isin(tb.it[rows], iters)
        p2p = m & (tb.peer[rows] >= 0) & (tb.name[rows] == send_id)
        coll = m & (tb.peer[rows] < 0) & (tb.gkey[rows] >= 0)
        over = (p2p & (tb.peer[rows] == other)) | (coll & holds[tb.gkey[rows]])
        rest = (p2p | coll) & ~over
        v = np.where(p2p, send_stall[rows], coll_stall[rows]).astype(float) / MS
        base = float(np.median(v[rest])) if rest.any() else 0.0
        out[r] = round(float(np.maximum(v[over] - base, 0).sum()) / max(len(iters), 1), 3)
    return out


def ends_explained_by_link_cost(findings: list[Finding], tb: Table, send_stall: np.ndarray,
                                coll_stall: np.ndarray, iters: np.ndarray) -> list[Finding]:
    """Fold a link end's late arrival, pause or lone-stage slowness into the slow link whose posting cost to that
    end accounts for it (rule 1 of this module); each link's cost per end is kept in its evidence."""
    links = [f for f in findings if f.kind == "slow-link" and len(f.ranks) == 2]
    for link in links:
        link.evidence["cost_ms_per_iteration"] = link_end_costs(tb, send_stall, coll_stall, iters, *link.ranks)

    def link_of(f: Finding) -> Finding | None:
        if len(f.ranks) != 1 or not (f.kind in _END_KINDS or
                                     (f.kind == "slow-compute" and f.evidence.get("method") in _END_METHODS)):
            return None
        r = f.ranks[0]
        for link in links:
            cost = link.evidence["cost_ms_per_iteration"].get(r, 0.0)
            if r in link.ranks and cost > 0 and f.excess_ms <= _COST_SLACK * cost:
                f.evidence["link_cost_ms_per_iteration"] = cost
                return link
        return None
    return fold_into(findings, link_of, "explains")


def cpu_wait_per_span(tb: Table) -> np.ndarray:
    """Per rank: median ms its work spans waited for a CPU (NaN where not measured)."""
    out = np.full(tb.world, np.nan)
    if tb.cpu_wait is None:
        return out
    m = np.isin(tb.cat, _WORK) & (tb.cpu_wait >= 0) & (tb.dur > 0)
    if m.any():
        ranks, med, _ = group_quantile(tb.rank[m], tb.cpu_wait[m].astype(float), 0.5)  # one sort, any world
        out[ranks] = med / MS
    return out


_STARVED_LINK_CONFIDENCE = 0.45  # below the 0.5 a user acts on: ranked after every cause the host cannot explain


def links_within_cpu_waits(findings: list[Finding], tb: Table) -> tuple[list[Finding], str | None]:
    """Demote links found by transfer times whose excess is within what their ends wait for a CPU on a starved
    host (rule 2 of this module): confidence at most _STARVED_LINK_CONFIDENCE, so a cause the host cannot
    explain ranks first; returns the findings and a report note naming the links demoted (or None)."""
    if tb.cpu_wait is None or not any(f.kind == "slow-link" for f in findings):
        return findings, None
    share = cpu_wait_share(tb)
    per_span = cpu_wait_per_span(tb)
    demoted = []
    for f in findings:
        if f.kind == "slow-link" and f.evidence.get("method") not in _STALL_METHODS:
            ends = list(f.ranks)
            starved = np.nanmax(share[ends]) if np.isfinite(share[ends]).any() else 0.0
            waits = np.nanmax(per_span[ends]) if np.isfinite(per_span[ends]).any() else 0.0
            if starved >= STARVED and f.excess_ms <= waits:
                f.evidence["cpu_wait_ms_per_span"] = round(float(waits), 3)
                f.evidence["confidence_before_cpu_waits"] = f.confidence
                f.confidence = min(f.confidence, _STARVED_LINK_CONFIDENCE)
                demoted.append(f)
    if not demoted:
        return findings, None
    names = ", ".join(link_label(f.ranks) + f" (+{f.excess_ms:.1f} ms)" for f in demoted)
    return findings, (f"slower transfers on {names} by no more than their ends waited for a CPU per work span (up "
                      f"to {max(f.evidence['cpu_wait_ms_per_span'] for f in demoted):.1f} ms) on this "
                      f"oversubscribed host: confidence at most {_STARVED_LINK_CONFIDENCE}, confirm with "
                      "`megatronapp diagnose`")


def links_behind_slow_groups(findings: list[Finding]) -> list[Finding]:
    """Fold a collective link found by its transfer times into a slow-compute finding when one of its members
    belongs to a group already folded into that finding as slowed by the rank (rule 3 of this module); a link
    with a slow-compute member of its own is left to fold.links_of_slow_ranks."""
    slow = {f.ranks[0]: f for f in findings if f.kind == "slow-compute"}
    via: dict[int, Finding] = {}  # member of a group the slow rank slowed -> that rank's finding
    for r, f in slow.items():
        for link in f.evidence.get("links_also_slow", []):
            if link.get("what") == "collective":
                for m in link["ranks"]:
                    if m != r and m not in slow:
                        via.setdefault(int(m), f)

    def cause(f: Finding) -> Finding | None:
        if f.kind != "slow-link" or f.evidence.get("what") != "collective" or \
                f.evidence.get("method") in _STALL_METHODS or any(r in slow for r in f.ranks):
            return None
        m = next((r for r in f.ranks if r in via), None)
        if m is None:
            return None
        f.evidence["via_rank"] = m
        return via[m]
    return fold_into(findings, cause, "links_also_slow")
