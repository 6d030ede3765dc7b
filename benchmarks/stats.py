"""Confidence intervals for the ratios our benchmarks report, and the tables that show them.

A benchmark here measures two sides in one run, interleaved, so each repetition gives one *paired* ratio
(ours / baseline measured back to back, under nearly the same machine load). The figure we report is the
median of those ratios; its 95% interval comes from a percentile bootstrap over the repetitions (resampling
whole repetitions keeps the pairing). A ratio whose interval contains 1.0 is "within noise": the run cannot
tell the two sides apart, whatever the point estimate says.

The bootstrap assumes repetitions are exchangeable. Slow drifts of machine load break that a little; the
pairing removes most of their effect on the ratio, which is why we never bootstrap unpaired medians. Repetitions
inside one run of processes share more than the load (allocator state, thread placement), so a benchmark can
repeat its run in K independent blocks of fresh processes; `two_level_ci` then resamples blocks first and pairs
within each chosen block, so the interval widens when the blocks disagree. With one block it is the plain bootstrap
and the docs say "interval within one run (blocks: 1)".

Counts (precision, recall, false alarms over scenarios) get Wilson's score interval, which stays inside [0, 1] and
is not degenerate at 0/n or n/n. A claim against a target is met only when the whole interval is on the right side.
"""
from __future__ import annotations

import math
import random
import statistics
from collections.abc import Callable, Sequence

CONFIDENCE = 0.95
RESAMPLES = 4000


def paired_ratios(ours: Sequence[float], base: Sequence[float]) -> list[float]:
    """ours[i] / base[i] for each repetition; the sides must have been measured in the same repetitions."""
    if len(ours) != len(base):
        raise ValueError(f"paired samples differ in length: {len(ours)} vs {len(base)}")
    if not ours:
        raise ValueError("no samples")
    if any(b <= 0 for b in base):
        raise ValueError("a baseline sample is not positive: cannot form a ratio")
    return [a / b for a, b in zip(ours, base)]


def bootstrap_ci(values: Sequence[float], stat: Callable[[Sequence[float]], float] = statistics.median,
                 confidence: float = CONFIDENCE, resamples: int = RESAMPLES, seed: int = 0) -> tuple[float, float]:
    """Percentile-bootstrap interval of `stat` over `values` (deterministic for a given seed)."""
    if not values:
        raise ValueError("no samples")
    if len(values) == 1:
        return float(values[0]), float(values[0])
    rng = random.Random(seed)
    n = len(values)
    boots = sorted(stat([values[rng.randrange(n)] for _ in range(n)]) for _ in range(resamples))
    lo_i = int((1 - confidence) / 2 * resamples)
    hi_i = min(resamples - 1, int((1 + confidence) / 2 * resamples))
    return float(boots[lo_i]), float(boots[hi_i])


def two_level_ci(blocks: Sequence[Sequence[float]], stat: Callable[[Sequence[float]], float] = statistics.median,
                 confidence: float = CONFIDENCE, resamples: int = RESAMPLES, seed: int = 0) -> tuple[float, float]:
    """Percentile interval of `stat` over the pooled samples, resampling blocks, then samples within each block."""
    blocks = [list(b) for b in blocks]
    if not blocks or any(not b for b in blocks):
        raise ValueError("no samples (or an empty block)")
    if len(blocks) == 1:
        return bootstrap_ci(blocks[0], stat, confidence, resamples, seed)
    rng = random.Random(seed)
    k = len(blocks)
    boots = []
    for _ in range(resamples):
        pooled: list[float] = []
        for _ in range(k):
            b = blocks[rng.randrange(k)]
            pooled.extend(b[rng.randrange(len(b))] for _ in range(len(b)))
        boots.append(stat(pooled))
    boots.sort()
    lo_i = int((1 - confidence) / 2 * resamples)
    hi_i = min(resamples - 1, int((1 + confidence) / 2 * resamples))
    return float(boots[lo_i]), float(boots[hi_i])


def wilson_ci(successes: int, trials: int, confidence: float = CONFIDENCE) -> tuple[float, float]:
    """Wilson score interval of a proportion successes / trials."""
    if trials <= 0:
        raise ValueError("no trials")
    if not 0 <= successes <= trials:
        raise ValueError(f"successes {successes} outside 0..{trials}")
    z = statistics.NormalDist().inv_cdf((1 + confidence) / 2)
    p, n = successes / trials, trials
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    lo = 0.0 if successes == 0 else max(0.0, centre - half)  # exact ends where rounding would leave 1e-17
    hi = 1.0 if successes == trials else min(1.0, centre + half)
    return lo, hi


def detection_table(res: dict, precision_target: float = 0.97) -> list[str]:
    """Markdown lines of a detection family's result (scan families): precision over all findings, recall, healthy
    scenarios with a finding, each proportion with its Wilson interval, then the misses and false findings."""
    tp, fp, fn = res["true_positives"], res["false_positives"], res["missed"]
    p_lo, p_hi = wilson_ci(tp, tp + fp) if tp + fp else (0.0, 1.0)
    r_lo, r_hi = wilson_ci(tp, tp + fn)
    alarmed = sum(1 for r in res["rows"] if not r["faults"] and r["found"])
    lines = ["| | value [95% Wilson CI] | target |", "|---|---|---|",
             f"| precision over all findings | {res['precision']:.2f} ({tp}/{tp + fp}) [{p_lo:.2f}, {p_hi:.2f}] "
             f"| >= {precision_target} |",
             f"| recall | {res['recall']:.2f} ({tp}/{tp + fn}) [{r_lo:.2f}, {r_hi:.2f}] | >= 0.95 |",
             f"| healthy scenarios with a finding | {alarmed}/{res['healthy_runs']} | 0 |", "",
             "Misses and false findings:", ""]
    for r in res["rows"]:
        if r["missed"] or r["false"]:
            lines.append(f"- {r['scenario']}: missed {r['missed'] or '-'}; false "
                         f"{[x.split(',')[0][:90] for x in r['false']] or '-'}")
    return lines


def claim(lo: float, hi: float, target: float, lower_is_better: bool = True) -> str:
    """'met' when the whole interval is on the right side of the target, 'missed' when it is wholly on the wrong
    side, else 'unresolved' (the interval crosses the target: this run cannot say)."""
    good, bad = (hi <= target, lo > target) if lower_is_better else (lo >= target, hi < target)
    return "met" if good else "missed" if bad else "unresolved"


def blocks_label(blocks: int) -> str:
    """How an interval was formed, for the docs."""
    return "interval within one run (blocks: 1)" if blocks == 1 else f"pooled over {blocks} blocks of fresh processes"


def verdict(lo: float, hi: float, lower_is_better: bool = True) -> str:
    """'within noise' when the interval holds 1.0, else which side it favours."""
    if lo <= 1.0 <= hi:
        return "within noise"
    better = hi < 1.0 if lower_is_better else lo > 1.0
    return "better" if better else "worse"


def summarize_ratios(ratios: Sequence[float], lower_is_better: bool = True) -> dict:
    """Median paired ratio, its bootstrap interval, the sample count and the verdict."""
    lo, hi = bootstrap_ci(ratios)
    return {"ratio": float(statistics.median(ratios)), "ci95": [lo, hi], "n": len(ratios),
            "verdict": verdict(lo, hi, lower_is_better), "ratios": [float(r) for r in ratios]}


def summarize_blocks(blocks: Sequence[Sequence[float]], lower_is_better: bool = True) -> dict:
    """summarize_ratios over K blocks of paired ratios: pooled median, two-level interval, block count."""
    pooled = [float(r) for b in blocks for r in b]
    lo, hi = two_level_ci(blocks)
    return {"ratio": float(statistics.median(pooled)), "ci95": [lo, hi], "n": len(pooled), "blocks": len(blocks),
            "verdict": verdict(lo, hi, lower_is_better), "ratios": pooled}


def fmt(summary: dict, digits: int = 3) -> str:
    """'0.985 [0.971, 1.002] within noise' for a Markdown table cell."""
    lo, hi = summary["ci95"]
    return f"{summary['ratio']:.{digits}f} [{lo:.{digits}f}, {hi:.{digits}f}] {summary['verdict']}"


def interval_table(rows: Sequence[dict], digits: int = 3) -> str:
    """A Markdown table of figures with intervals. Each row: figure, value, ci95, n, basis (how the interval was
    formed), and optionally target and claim (see `claim`)."""
    lines = ["| figure | value [95% CI] | n | interval | target | claim |", "|---|---|---:|---|---|---|"]
    for r in rows:
        lo, hi = r["ci95"]
        lines.append(f"| {r['figure']} | {r['value']:.{digits}f} [{lo:.{digits}f}, {hi:.{digits}f}] | {r['n']} "
                     f"| {r['basis']} | {r.get('target', '-')} | {r.get('claim', '-')} |")
    return "\n".join(lines)
