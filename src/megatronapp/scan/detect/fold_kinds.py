"""Findings of the wrong kind, folded into the fault that explains them (fold.py holds the other folds).

Three families, each a consequence mistaken for a cause:

- A pause of a rank that is slow in (nearly) every iteration is that slowness, not a pause. A slow rank falls
  behind by more in some iterations than in others (queueing, which micro-batches a window catches, a busy
  host stretching its sleep-to-close), and a view that compares a rank with its own calm level (lone stages) or
  with its peers per iteration sees those iterations as pauses. When the rank's slow-compute finding holds in
  nearly every judged iteration (an op-floor finding holds in every repeat), the pause folds into it whatever
  its size: the user must first fix the slowness, and the pause stays in its evidence (`pauses_explained`).
  A slow-compute finding seen in fewer iterations leaves fold.pauses_of_slow_ranks' rule (a pause beyond 3x
  what the slowness costs stays its own) in charge.
- A pause (or slowness) echoed by the ranks that exchange data with the faulty one. Where a wait for a neighbour is
  timed inside compute (the simulator's pipeline; on GPUs a host span that synchronises on a stream blocked in a
  receive), the pipeline neighbours of a paused rank in its DP replica read the same pause as their own compute: at
  8,192 simulated ranks (tp 8, pp 16) a 31 ms pause of one stage-1 rank showed as 8 more transient-pauses, the
  whole TP group of stage 0 of that replica, in the same 2 of 5 iterations, +27-35 ms each, confidence 0.58-0.69
  (held out: a transient-pause at c 0.37 beside two true faults at 8,192 ranks). A pause is folded into another
  rank's pause (`echoes`) when that rank is its TP peer or pipeline neighbour in the same DP replica, paused in
  every iteration it did, by at least 2/3 of its excess, and others waited longer for it (the waits view charges a
  delay to its origin, not to the ranks that pass it on). A whole node paused on its own (no neighbour paused in
  those iterations) stays a finding per rank. The same for slow compute, with a stricter size: the TP peers of a
  rank at 1.52x (+84.7 ms, 8,192 ranks) read 1.16-1.19x (+26-31 ms, at most 0.37 of its excess), and on a real
  8-rank gloo run at load 20+ the TP peer of a 2x rank read 1.75x floors (+9.9 ms) against its 10x (+120 ms, 0.08);
  an echo's excess must stay within half its cause's, since two devices of one slow node are slow alike and both
  stay named (the perturbed real node of two 1.5x TP ranks read +24.8 and +16.8 ms: 0.68). A pipeline
  neighbour is another device, usually on another node, that waits for the slow rank's activations or
  gradients: on real 8-rank gloo runs (tp2 pp2 dp2, load 12-30) the stage-0 rank of a 1.1x stage-1 rank's
  replica read 1.40x floors (+4.8 ms against +8.4 ms: 0.58) and, beside 2x ranks, one-off pauses of +20-30 ms in 1-2
  of 8 iterations while the slow rank cost +130-170 ms in every one. So a pipeline neighbour's slow compute folds
  within 3/4 of the cause's excess, and its pause in iterations where the cause was slow, within what the cause
  costs an iteration (its excess, or others' waits for it per iteration where larger); a neighbour slower than
  that stays named.
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

from megatronapp.scan.detect.findings import Finding
from megatronapp.scan.detect.fold import fold_into

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


# An echo's excess at most this share of its cause's, by (echo kind, cause kind, relation): "tp" a TP peer (same
# stage: possibly the same slow node), "pp" a pipeline neighbour in the same DP replica (module docstring).
ECHO_SHARE = {("transient-pause", "transient-pause", "tp"): 1.5, ("transient-pause", "transient-pause", "pp"): 1.5,
              ("slow-compute", "slow-compute", "tp"): 0.5, ("slow-compute", "slow-compute", "pp"): 0.75,
              ("transient-pause", "slow-compute", "pp"): 1.0}
_KINDS = {k[0] for k in ECHO_SHARE} | {k[1] for k in ECHO_SHARE}


def echoes(findings: list[Finding]) -> list[Finding]:
    """Fold each transient-pause or slow-compute that echoes a neighbour's finding into it (module docstring); the
    lead is the one others waited longest for. Needs `others_waited_ms` in the evidence (set by detect before
    ranking)."""
    leads = sorted((f for f in findings if f.kind in _KINDS),
                   key=lambda f: -f.evidence.get("others_waited_ms", 0.0))

    def relation(a: dict, b: dict) -> str | None:
        if a["dp"] != b["dp"] or a["rank"] == b["rank"] or abs(a["pp"] - b["pp"]) > 1:
            return None
        return "tp" if a["pp"] == b["pp"] else "pp"

    def lead_of(f: Finding) -> Finding | None:
        if f.kind not in _KINDS:
            return None
        its = set(f.evidence.get("iterations") or ())
        for g in leads:
            if g is f or len(f.ranks) != 1 or len(g.ranks) != 1 or \
                    g.evidence.get("others_waited_ms", 0.0) <= f.evidence.get("others_waited_ms", 0.0):
                continue
            share = ECHO_SHARE.get((f.kind, g.kind, relation(f.coords[0], g.coords[0]) or ""))
            g_its = set(g.evidence.get("iterations") or ())
            if share is not None and its and its <= g_its and f.excess_ms <= share * _cost(f, g, len(g_its)):
                return g
        return None
    return fold_into(findings, lead_of, "echoes")


def _cost(echo: Finding, cause: Finding, n_iterations: int) -> float:
    """What the cause costs per iteration, to size an echo against. A pause set against a slow rank: the larger of
    its excess and what others waited for it per iteration (an op-floor finding's excess is at floor speed and
    understates the rank's cost: +11 ms at floor speed beside 54 ms of others' waits per iteration)."""
    if echo.kind == "transient-pause" and cause.kind == "slow-compute" and n_iterations:
        return max(cause.excess_ms, cause.evidence.get("others_waited_ms", 0.0) / n_iterations)
    return cause.excess_ms

