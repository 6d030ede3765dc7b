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

This module is the orchestration on top: the views live in ranks.py (1), links.py (2, 3), evidence.py,
structure.py, layercost.py, ring.py and hang.py; fold.py folds findings that another explains; table.py and
stats.py hold the shared types and statistics at the bottom.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from megatronapp.scan.detect.contention import cpu_wait_share, starved_note
from megatronapp.scan.detect.evidence import floor_findings, posting_stall, stall_link_findings
from megatronapp.scan.detect.findings import KINDS, Finding, Report, Thresholds
from megatronapp.scan.detect.fold import (
    combine,
    explained_by_links,
    fold_into_hangs,
    links_of_slow_ranks,
    merge_directions,
    pauses_of_slow_ranks,
)
from megatronapp.scan.detect.fold_kinds import beside_a_short_hang, echoes, pauses_of_ranks_slow_throughout
from megatronapp.scan.detect.hang import hang_findings
from megatronapp.scan.detect.layercost import layer_findings, measured_stage_work
from megatronapp.scan.detect.linkfold import (
    ends_explained_by_link_cost,
    links_behind_slow_groups,
    links_within_cpu_waits,
)
from megatronapp.scan.detect.links import links_and_waits
from megatronapp.scan.detect.ranks import rank_findings
from megatronapp.scan.detect.structure import collective_stall_findings, lone_stage_findings, lone_stage_pauses
from megatronapp.scan.detect.table import LAYER, STEP, Phases, Table, Waits, exclusive_time, join, phases
from megatronapp.scan.read.format import COLUMNS, RankTrace

__all__ = ["KINDS", "Analysis", "Finding", "Report", "Thresholds", "analyse", "detect"]


@dataclass
class Analysis:
    """Everything detect computed: views (heat-map, summary) reuse it."""

    table: Table
    phases: Phases
    waits: Waits
    report: Report


def analyse(traces: list[RankTrace], offsets: dict[int, int] | None = None,
            thresholds: Thresholds | None = None, clock: dict | None = None,
            release_traces: bool = False, partial: bool = False) -> Analysis:
    """Run all detectors; return the report together with the per-rank phase and wait matrices.

    `partial`: the traces are a selection of the job's ranks (triage.analyse_two_level): ranks without a trace are
    unknown, never blamed for a hang.

    `release_traces`: the traces' span columns are emptied once joined into the table (table.join), for a caller
    that reads the traces only to analyse them (the CLI): one copy of every span in memory instead of two."""
    if not traces:
        raise ValueError("no rank traces to analyse (empty trace directory?)")
    th = thresholds or Thresholds()
    hangs = hang_findings(traces, partial)
    if hangs:  # what a hang cut short is no evidence of speed: judge the iterations every rank finished
        traces = _finished_iterations(traces)
    tb = join(traces, release=release_traces)
    ph = phases(tb)
    # Stage costs: the headers' cost model (the engine writes its FLOPs), else measured from per-layer spans (any
    # job traced per layer). A declared model goes first: measured units are noisy by 15-25% per rank on a busy
    # host (a healthy real pp4 run got a false wait-structure finding from them in 1 of 5 repeats, FLOPs in
    # none), and a lone stage's own slowness is judged by its layers either way (layer_findings).
    is_layer = tb.cat == LAYER
    layer_excl = exclusive_time(tb, is_layer) if is_layer.any() else None  # coarse traces: no layer pass
    declared, bad_work = _stage_work(traces)
    measured = None if declared else measured_stage_work(tb, ph, layer_excl, th.floor_q)
    work = declared or measured
    warm_up = _first_step(traces)
    findings = combine(rank_findings(tb, ph, th, warm_up), floor_findings(tb, ph.excl, ph.iters, th, work))
    findings = combine(findings, layer_findings(tb, ph, layer_excl, th))
    link_f, waits = links_and_waits(tb, ph, th, offsets, clock)
    findings = combine(findings, lone_stage_findings(tb, ph, waits, th, work))  # one per rank
    findings = combine(findings, lone_stage_pauses(tb, ph, th, warm_up))
    findings = pauses_of_slow_ranks(findings, ph, tb)
    findings = pauses_of_ranks_slow_throughout(findings, len(ph.iters))  # slow every iteration: slow-compute first
    stall, coll_stall = posting_stall(tb), posting_stall(tb, comm_ends=True)
    stall_f = stall_link_findings(tb, stall, ph.iters, th) + collective_stall_findings(tb, coll_stall, ph.iters, th)
    findings = links_of_slow_ranks(explained_by_links(findings, stall_f) + merge_directions(link_f + stall_f))
    findings = links_behind_slow_groups(findings)
    findings, host_note = links_within_cpu_waits(findings, tb)
    findings = ends_explained_by_link_cost(findings, tb, stall, coll_stall, ph.iters)
    caused_total = waits.caused.sum(axis=1)
    for f in findings:
        f.evidence["others_waited_ms"] = round(float(caused_total[list(f.ranks)].sum()), 3)
    findings = echoes(findings)  # a neighbour whose compute timed the wait for a paused or slow rank
    findings.sort(key=lambda f: (-f.confidence, -f.evidence["others_waited_ms"], f.ranks))
    # A hung job: what it hangs in comes before how it was slow; beside a hang that left few finished iterations,
    # nothing else is judged a cause (fold_kinds).
    findings, short_hang = beside_a_short_hang(fold_into_hangs(findings, hangs), hangs, len(ph.iters))
    findings = hangs + findings
    top = np.argsort(-caused_total)[:10]
    waited_for = [{"rank": int(r), "ms": round(float(caused_total[r]), 3), "instances": int(waits.caused_count[r])}
                  for r in top if caused_total[r] > 0]
    notes = [short_hang] if short_hang else []
    if bad_work:
        notes.append(bad_work)
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
    if host_note:
        notes.append(host_note)
    step_ms = ph.step_ms
    report = Report(findings, tb.world, len(ph.iters), round(step_ms, 3), waited_for, notes)
    return Analysis(tb, ph, waits, report)


def _finished_iterations(traces: list[RankTrace]) -> list[RankTrace]:
    """The traces cut to the iterations whose step every rank closed (and spans outside any iteration)."""
    done = [set(np.unique(t.it[t.cat == STEP]).tolist()) for t in traces]
    common = np.array(sorted(set.intersection(*done)) if done else [], np.int64)
    if not len(common):
        return traces  # no iteration all finished (different windows): nothing to cut to
    out = []
    for t in traces:
        keep = (t.it < 0) | np.isin(t.it, common)
        out.append(dataclasses.replace(t, **{c: getattr(t, c)[keep] for c in COLUMNS}))
    return out


def _first_step(traces: list[RankTrace]) -> int:
    """The step the traced processes started at (`first_step` in the engine's headers: a resumed run goes on from
    its checkpoint's step, and start-up costs land there, not in step 0); 0 where no header says or the headers
    disagree. Header data is checked, never trusted: anything but a non-negative int is ignored."""
    steps = [t.header.get("first_step") for t in traces]
    ok = {s for s in steps if isinstance(s, int) and not isinstance(s, bool) and 0 <= s < 1 << 62}
    return ok.pop() if len(ok) == 1 else 0  # ranks that disagree: no rank's word decides for the others


def _stage_work(traces: list[RankTrace]) -> tuple[dict[int, float] | None, str | None]:
    """Expected relative cost of each pipeline stage, when a header carries one (a cost model's output), and what
    was wrong with a header's value that had to be ignored. Header data is checked, never trusted: a list, or a
    dict keyed by stage, of finite positive numbers within 1000x of each other, for stages of the header's pp or the
    traces (a crafted header once crashed the detector or named a healthy rank slow-compute)."""
    traced = max(int(x.coord[1]) for x in traces) + 1  # MegaFBD numbers its forward stages after the pp ones
    for t in traces:
        w = t.header.get("stage_work")
        if not w:
            continue
        items = w.items() if isinstance(w, dict) else enumerate(w) if isinstance(w, list) else None
        work: dict[int, float] = {}
        for k, v in items or ():
            key = int(k) if isinstance(k, int) or (isinstance(k, str) and k.isdigit()) else -1
            if not 0 <= key < max(int(t.topo[1]), traced) or isinstance(v, bool) or not isinstance(v, (int, float)) or \
                    not 0 < float(v) < float("inf"):
                work = {}
                break
            work[key] = float(v)
        if items is None or not work or max(work.values()) > 1000 * min(work.values()):
            return None, (f"rank {t.rank}'s header stage_work is not a positive number per pipeline stage (within "
                          "1000x of each other): ignored")
        return work, None
    return None, None


def detect(traces: list[RankTrace], offsets: dict[int, int] | None = None,
           thresholds: Thresholds | None = None, clock: dict | None = None,
           release_traces: bool = False) -> Report:
    """Ranked root-cause findings for a set of rank traces (offsets: ns to subtract per rank, optional; clock:
    the report of align.estimate_offsets, whose per-rank drift then applies too; release_traces: see analyse)."""
    return analyse(traces, offsets, thresholds, clock, release_traces).report
