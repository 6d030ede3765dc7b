"""Findings of the wrong kind, folded into the fault that explains them (fold.py holds the other folds).

Two families, each a consequence mistaken for a cause:

- A pause of a rank that is slow in (nearly) every iteration is that slowness, not a pause. A slow rank falls
  behind by more in some iterations than in others (queueing, which micro-batches a window catches, a busy
  host stretching its sleep-to-close), and a view that compares a rank with its own calm level (lone stages) or
  with its peers per iteration sees those iterations as pauses. When the rank's slow-compute finding holds in
  nearly every judged iteration (an op-floor finding holds in every repeat), the pause folds into it whatever
  its size: the user must first fix the slowness, and the pause stays in its evidence (`pauses_explained`).
  A slow-compute finding seen in fewer iterations leaves fold.pauses_of_slow_ranks' rule (a pause beyond 3x
  what the slowness costs stays its own) in charge.
- A hung job is judged on the iterations every rank finished before the hang. When those are few, every
  statistic of the run's own jitter rests on a handful of samples, and a healthy rank's noisy window reads as a
  slow rank, a late arrival or a one-off pause. Measured on the perturbed real hangs (every rank of the four
  stored layouts hung at iteration 2, 4, 6, 8): beside hangs that left 2-6 finished iterations, false
  slow-computes from op floors (the 10% quantile of a few iterations' repeats: a DP peer at 1.86x, confidence
  0.83, with 6 finished; a pipeline neighbour at 1.66x with 4), pauses "in 1 of 2 iterations", late arrivals;
  none of them in the same recordings' full 10-iteration windows. Beside a hang with fewer than MIN_JUDGED
  finished iterations, other findings are kept in the hang's evidence (`beside_the_hang`), not
  listed as causes, and a note says why; the hang is the fault to fix first either way.
"""
from __future__ import annotations

from megatronapp.scan.findings import Finding
from megatronapp.scan.fold import fold_into

NEARLY_EVERY = 0.8  # a slow-compute finding in this share of the judged iterations is "slow throughout"
MIN_JUDGED = 8  # finished iterations beside a hang below which other findings are too weakly supported


def slow_throughout(f: Finding, n_iterations: int) -> bool:
    """A slow-compute finding that holds in (nearly) every judged iteration."""
    if f.kind != "slow-compute" or n_iterations <= 0:
        return False
    return _slow_iterations(f) >= NEARLY_EVERY * n_iterations


def _slow_iterations(f: Finding) -> int:
    """In how many iterations a slow-compute finding holds, by its own view or the other view combined into it
    (fold.combine keeps the more confident view; an op-floor view behind it may hold in every iteration)."""
    views = [f.evidence, f.evidence.get("also") or {}]
    return max((len(set(v.get("iterations") or ())) for v in views if isinstance(v, dict)), default=0)


def pauses_of_ranks_slow_throughout(findings: list[Finding], n_iterations: int) -> list[Finding]:
    """Fold every transient-pause of a rank whose slow-compute finding holds in nearly every iteration into that
    finding (its confidence carries over: two views see the rank; the slowness leads)."""
    slow = {f.ranks[0]: f for f in findings if slow_throughout(f, n_iterations)}

    def lead_of(f: Finding) -> Finding | None:
        g = slow.get(f.ranks[0]) if f.kind == "transient-pause" else None
        if g is None:
            return None
        f.evidence["slow_in_iterations"] = _slow_iterations(g)  # why it is the slowness
        g.confidence = max(g.confidence, f.confidence)
        return g
    return fold_into(findings, lead_of, "pauses_explained")


def beside_a_short_hang(findings: list[Finding], hangs: list[Finding], n_finished: int) -> tuple[list[Finding], str]:
    """Beside a hang that left fewer than MIN_JUDGED finished iterations, findings of the ranks that did not hang
    go into the first hang's evidence; returns the findings kept and a note for the report ('' if none moved)."""
    if not hangs or n_finished >= MIN_JUDGED or not findings:
        return findings, ""
    lead = hangs[0]
    kept = fold_into(findings, lambda f: lead, "beside_the_hang")
    moved = len(findings) - len(kept)
    note = (f"{moved} other finding(s) kept in the hang's evidence (beside_the_hang), not listed as causes: only "
            f"{n_finished} iteration(s) finished before the hang, too few to tell a rank's pattern from the run's "
            f"jitter (at least {MIN_JUDGED} are needed)")
    return kept, note
