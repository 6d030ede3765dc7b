"""The statistics behind every benchmark ratio (paired ratios, bootstrap intervals, verdicts) and the harness's
writers of docs sections."""
from __future__ import annotations

import random

import pytest
from benchmarks import harness, stats


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
    harness.write_section(doc, "## A", "new a")
    harness.write_section(doc, "## C", "added c")
    text = doc.read_text()
    assert "new a" in text and "old a" not in text and "keep b" in text and text.endswith("## C\n\nadded c\n")
    assert text.index("## A") < text.index("## B") < text.index("## C")


def test_two_level_interval_widens_when_blocks_disagree():
    rng = random.Random(7)
    agree = [[1.1 * rng.lognormvariate(0, 0.03) for _ in range(12)] for _ in range(3)]
    disagree = [[s * rng.lognormvariate(0, 0.03) for _ in range(12)] for s in (0.95, 1.1, 1.25)]
    lo_a, hi_a = stats.two_level_ci(agree)
    lo_d, hi_d = stats.two_level_ci(disagree)
    assert lo_a <= 1.1 <= hi_a and hi_d - lo_d > 2 * (hi_a - lo_a)
    assert stats.two_level_ci([agree[0]]) == stats.bootstrap_ci(agree[0])  # one block: the plain bootstrap
    s = stats.summarize_blocks(disagree)
    assert s["blocks"] == 3 and s["n"] == 36 and s["verdict"] == "within noise"
    with pytest.raises(ValueError, match="empty block"):
        stats.two_level_ci([[1.0], []])


def test_wilson_interval_and_claims_against_a_target():
    lo, hi = stats.wilson_ci(104, 104)
    assert hi == 1.0 and 0.96 < lo < 0.97  # all hits still leave room below 1
    lo, hi = stats.wilson_ci(0, 10)
    assert lo == 0.0 and 0.27 < hi < 0.28  # no false alarm in 10 runs bounds the rate only at 28%
    lo, hi = stats.wilson_ci(27, 104)
    assert lo < 27 / 104 < hi
    with pytest.raises(ValueError, match="outside"):
        stats.wilson_ci(5, 4)
    assert stats.claim(0.97, 1.02, 1.03) == "met"
    assert stats.claim(0.97, 1.04, 1.03) == "unresolved"
    assert stats.claim(1.04, 1.08, 1.03) == "missed"
    assert stats.claim(0.96, 1.0, 0.95, lower_is_better=False) == "met"
    assert stats.claim(0.90, 0.94, 0.95, lower_is_better=False) == "missed"
    assert stats.blocks_label(1) == "interval within one run (blocks: 1)"


def test_write_block_replaces_only_between_its_markers(tmp_path):
    doc = tmp_path / "b.md"
    doc.write_text("## S\n\nprose\n<!-- x -->\nold\n<!-- /x -->\nafter\n")
    table = stats.interval_table([{"figure": "a/b", "value": 1.0, "ci95": [0.9, 1.1], "n": 8,
                                   "basis": stats.blocks_label(1), "target": "<= 1.03", "claim": "unresolved"}])
    harness.write_block(doc, "x", table)
    text = doc.read_text()
    assert "old" not in text and "prose\n<!-- x -->\n| figure" in text and text.endswith("<!-- /x -->\nafter\n")
    assert "1.000 [0.900, 1.100] | 8 | interval within one run (blocks: 1) | <= 1.03 | unresolved |" in text
    with pytest.raises(ValueError, match="no block"):
        harness.write_block(doc, "y", "z")
