"""The statistics behind every benchmark ratio: paired ratios, bootstrap intervals, verdicts, docs sections."""
from __future__ import annotations

import random

import pytest
from benchmarks import stats


def test_paired_ratios_refuse_unpaired_or_empty_samples():
    assert stats.paired_ratios([2.0, 3.0], [1.0, 2.0]) == [2.0, 1.5]
    with pytest.raises(ValueError, match="length"):
        stats.paired_ratios([1.0], [1.0, 2.0])
    with pytest.raises(ValueError, match="no samples"):
        stats.paired_ratios([], [])
    with pytest.raises(ValueError, match="not positive"):
        stats.paired_ratios([1.0], [0.0])


def test_interval_covers_the_true_ratio_and_shrinks_with_samples():
    rng = random.Random(3)
    few = [1.2 * rng.lognormvariate(0, 0.05) for _ in range(8)]
    many = [1.2 * rng.lognormvariate(0, 0.05) for _ in range(200)]
    lo8, hi8 = stats.bootstrap_ci(few)
    lo, hi = stats.bootstrap_ci(many)
    assert lo <= 1.2 <= hi and lo8 <= 1.2 <= hi8
    assert hi - lo < hi8 - lo8
    assert stats.summarize_ratios(many)["verdict"] == "worse"  # clearly above 1: the first side is slower


def test_noise_around_one_is_called_within_noise():
    rng = random.Random(5)
    s = stats.summarize_ratios([rng.gauss(1.0, 0.1) for _ in range(30)])
    assert s["verdict"] == "within noise" and s["ci95"][0] < 1.0 < s["ci95"][1]
    assert stats.summarize_ratios([0.8] * 5)["verdict"] == "better"
    assert stats.summarize_ratios([1.3] * 5, lower_is_better=False)["verdict"] == "better"
    assert "within noise" in stats.fmt(s)


def test_write_section_replaces_only_its_own_section(tmp_path):
    doc = tmp_path / "b.md"
    doc.write_text("# Benchmarks\n\n## A\n\nold a\n\n## B\n\nkeep b\n")
    stats.write_section(doc, "## A", "new a")
    stats.write_section(doc, "## C", "added c")
    text = doc.read_text()
    assert "new a" in text and "old a" not in text and "keep b" in text and text.endswith("## C\n\nadded c\n")
    assert text.index("## A") < text.index("## B") < text.index("## C")
