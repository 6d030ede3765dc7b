"""What a report could judge: ranks of the world present, ranks and groups without a peer, iterations.

A finding is a rank (or link) against its peers over iterations. Given 1 rank of an 8-rank job there is no peer,
and "within noise of its peers" would be a claim about nobody; given 2 ranks of 128 and 2 iterations, a
one-off is a coin toss. So the report says what it judged, names what it could not, and a finding's confidence
shrinks with the iterations it rests on."""
from __future__ import annotations

import numpy as np

from megatronapp.scan.detect.findings import Finding
from megatronapp.scan.detect.table import Table

FULL_ITERATIONS = 5  # from this many judged iterations a confidence stands as computed


def iteration_weight(n_it: int) -> float:
    """How far a confidence resting on `n_it` iterations is kept: 1 from FULL_ITERATIONS on, n_it/5 below."""
    return min(1.0, max(n_it, 0) / FULL_ITERATIONS)


def shrink_for_few_iterations(findings: list[Finding], n_it: int) -> str | None:
    """Scale each finding's confidence (hangs apart: a hang is no statistic) by `iteration_weight`; the note that
    says so, None when nothing was scaled."""
    w = iteration_weight(n_it)
    scaled = [f for f in findings if f.kind != "hang"]
    if w >= 1.0 or not scaled:
        return None
    for f in scaled:
        f.evidence["confidence_before_few_iterations"] = f.confidence
        f.confidence = round(f.confidence * w, 3)
    return (f"only {n_it} iteration{'s' if n_it != 1 else ''} judged: confidences scaled by {n_it}/"
            f"{FULL_ITERATIONS} (with so few, a one-off or a rank's own jitter cannot be told from a fault)")


def peerless_ranks(tb: Table, stage_size: int) -> np.ndarray:
    """Ranks present that the job gave stage peers (`stage_size` ranks a stage) but whose peers have no trace here:
    nothing of the same work to compare them with. (A pipeline stage of one rank by design is judged against the
    other stages, structure.py, and is not counted.)"""
    present = tb.present
    if stage_size < 2:
        return np.zeros(0, np.int64) if present.sum() > 1 else np.flatnonzero(present)
    stage = np.where(present, tb.coords[:, 1], -1)
    counts = np.bincount(stage[stage >= 0], minlength=int(stage.max(initial=0)) + 1)
    return np.flatnonzero(present & (counts[np.maximum(stage, 0)] < 2))


def coverage_notes(tb: Table, stage_size: int, partial: bool = False) -> tuple[list[str], str | None]:
    """Notes on what could not be judged, and (where no rank has a peer) the sentence that replaces "no root cause
    found": (notes, nothing_judged). `stage_size`: ranks a pipeline stage has in the job. `partial`: a selection of
    a job's ranks read on purpose (two-level): the ranks left out were judged by the triage, not missing."""
    notes: list[str] = []
    present = tb.present
    n_present = int(present.sum())
    if not partial and n_present < tb.world:
        notes.append(f"{n_present} of {tb.world} ranks have traces: the other {tb.world - n_present} were not judged, "
                     "and a rank of those could be the cause of any wait seen here")
    alone = peerless_ranks(tb, stage_size)
    nothing = None
    if len(alone) == n_present and n_present:
        who = f"rank {int(alone[0])} has no peer" if n_present == 1 else "no rank has a peer"
        nothing = (f"nothing could be judged: {who} of its stage present to be compared with (trace every rank of "
                   "the job, or at least two of each stage)")
    elif len(alone) and not partial:
        shown = ", ".join(map(str, alone[:8].tolist())) + (f" and {len(alone) - 8} more" if len(alone) > 8 else "")
        notes.append(f"ranks {shown} have no peer of their stage present: their own time was not judged")
    if tb.groups and not partial:
        gk = np.unique(tb.gkey[tb.gkey >= 0])
        lonely = [g for g in gk.tolist() if sum(bool(present[r]) for r in tb.groups[g][1] if r < tb.world) < 2]
        if lonely:
            notes.append(f"{len(lonely)} of {len(gk)} process groups have one member present: no wait inside their "
                         "collectives can be split from the transfer (no peer to match)")
    return notes, nothing
