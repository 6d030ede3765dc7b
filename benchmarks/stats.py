"""Confidence intervals for the ratios our benchmarks report, and the shared writer of docs/benchmarks.md.

A benchmark here measures two sides in one run, interleaved, so each repetition gives one *paired* ratio
(ours / baseline measured back to back, under nearly the same machine load). The figure we report is the
median of those ratios; its 95% interval comes from a percentile bootstrap over the repetitions (resampling
whole repetitions keeps the pairing). A ratio whose interval contains 1.0 is "within noise": the run cannot
tell the two sides apart, whatever the point estimate says.

The bootstrap assumes repetitions are exchangeable. Slow drifts of machine load break that a little; the
pairing removes most of their effect on the ratio, which is why we never bootstrap unpaired medians.
"""
from __future__ import annotations

import random
import statistics
from collections.abc import Callable, Sequence
from pathlib import Path

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


def fmt(summary: dict, digits: int = 3) -> str:
    """'0.985 [0.971, 1.002] within noise' for a Markdown table cell."""
    lo, hi = summary["ci95"]
    return f"{summary['ratio']:.{digits}f} [{lo:.{digits}f}, {hi:.{digits}f}] {summary['verdict']}"


def write_section(path: Path, title: str, body: str) -> None:
    """Replace the section `title` ('## ...') of a Markdown file, or append it; other sections are kept."""
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    section = title + "\n\n" + body.strip("\n") + "\n"
    start = text.find(title + "\n")
    if start < 0:
        text = text.rstrip("\n") + "\n\n" + section
    else:
        nxt = text.find("\n## ", start + len(title))
        text = text[:start] + section + ("" if nxt < 0 else "\n" + text[nxt + 1:])
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
