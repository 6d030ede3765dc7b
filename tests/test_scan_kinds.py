"""Findings of the wrong kind (scan/fold_kinds.py): a slow rank's pauses are its slowness; a short window beside a
hang names no bystander. Cheap: synthetic findings and the stored real recordings, no process launch."""
from __future__ import annotations

from pathlib import Path

from megatronapp.scan.detect import analyse
from megatronapp.scan.findings import Finding
from megatronapp.scan.fold_kinds import MIN_JUDGED, beside_a_short_hang, pauses_of_ranks_slow_throughout
from megatronapp.scan.format import read_dir
from megatronapp.scan.perturb import Perturbation, perturb

DATA = Path(__file__).resolve().parent.parent / "benchmarks" / "data"
COORD = [{"rank": 3, "dp": 0, "pp": 3, "tp": 0}]


def _slow(iterations: list[int], confidence: float = 0.6) -> Finding:
    return Finding("slow-compute", (3,), COORD, "1.60x compute at its fastest", 1.6, 14.0, confidence,
                   {"method": "op floors", "iterations": iterations})


def _pause(excess: float, confidence: float = 0.9) -> Finding:
    return Finding("transient-pause", (3,), COORD, f"+{excess:.1f} ms in 3 of 10 iterations", 2.0, excess,
                   confidence, {"iterations": [1, 4, 7]})


def test_a_pause_of_a_rank_slow_in_nearly_every_iteration_is_its_slowness_whatever_its_size():
    # The held-out miss: a lone slow last stage (pp 4, interleaved) listed first as a transient-pause of that rank
    # (10x what its floor excess says the slowness costs), its slow-compute second.
    folded = pauses_of_ranks_slow_throughout([_pause(140.0), _slow(list(range(10)))], 10)
    assert [(f.kind, f.ranks) for f in folded] == [("slow-compute", (3,))]
    assert folded[0].confidence == 0.9  # two views see the rank: the pause's confidence carries over
    (pause,) = folded[0].evidence["pauses_explained"]
    assert pause["kind"] == "transient-pause" and pause["slow_in_iterations"] == 10
    # Slow in 8 of 10 is nearly every iteration; in 6 of 10 it is not, and the pause stays its own finding.
    assert len(pauses_of_ranks_slow_throughout([_pause(140.0), _slow(list(range(8)))], 10)) == 1
    kept = pauses_of_ranks_slow_throughout([_pause(140.0), _slow(list(range(6)))], 10)
    assert sorted(f.kind for f in kept) == ["slow-compute", "transient-pause"]
    # The view behind the lead counts too (fold.combine keeps the more confident one, the floors as 'also').
    lead = _slow(list(range(6)), confidence=0.7)
    lead.evidence["also"] = {"method": "op floors", "iterations": list(range(10))}
    assert len(pauses_of_ranks_slow_throughout([_pause(140.0), lead], 10)) == 1
    # Another rank's pause is not this rank's slowness.
    other = _pause(140.0)
    other.ranks = (2,)
    assert len(pauses_of_ranks_slow_throughout([other, _slow(list(range(10)))], 10)) == 2


def test_a_slow_rank_on_a_loaded_host_is_one_slow_compute_finding():
    # Stored recording beside 10 CPU hogs, a rank stretched 2x: its uneven iterations once read as a second
    # finding, 'transient-pause ... in 2 of 10 iterations' (a false one: the fault is the slowness).
    traces, _ = read_dir(DATA / "scan_real_loaded" / "tp2pp2dp2")
    found = analyse(perturb(traces, [Perturbation("slow-compute", (2,), factor=2.0)])).report.findings
    assert [(f.kind, f.ranks) for f in found] == [("slow-compute", (2,))]


def test_beside_a_hang_with_few_finished_iterations_no_bystander_is_named():
    # A hang at iteration 4 leaves 4 finished iterations; a healthy pipeline neighbour's op floors over those read
    # 1.66x (busy recording) and were listed as a slow-compute beside the hang.
    traces, _ = read_dir(DATA / "scan_real" / "tp2pp2dp2")
    report = analyse(perturb(traces, [Perturbation("hang", (6,), at_iteration=4)])).report
    assert [(f.kind, f.ranks) for f in report.findings] == [("hang", (6,))], report.to_text()
    beside = report.findings[0].evidence["beside_the_hang"]
    assert beside and all(b["ranks"] != [6] for b in beside)
    assert any("finished before the hang" in n for n in report.notes)


def test_a_long_window_or_no_hang_keeps_every_finding():
    hang = Finding("hang", (1,), [], "hangs", 1.0, 0.0, 0.95, {})
    slow = _slow(list(range(10)))
    assert beside_a_short_hang([slow], [hang], MIN_JUDGED) == ([slow], "")
    assert beside_a_short_hang([slow], [], 2) == ([slow], "")
    kept, note = beside_a_short_hang([slow], [hang], MIN_JUDGED - 1)
    assert kept == [] and hang.evidence["beside_the_hang"][0]["kind"] == "slow-compute" and note
