"""Findings of the wrong kind (scan/detect/fold_kinds.py): a slow rank's pauses are its slowness; a short window
beside a hang names no bystander. Cheap: synthetic findings and the stored real recordings, no process launch."""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np

from megatronapp.scan.detect.analysis import analyse
from megatronapp.scan.detect.evidence import _minor_tail
from megatronapp.scan.detect.findings import Finding
from megatronapp.scan.detect.fold import pauses_of_slow_ranks
from megatronapp.scan.detect.fold_kinds import (
    MIN_JUDGED,
    beside_a_short_hang,
    echoes,
    pauses_of_ranks_slow_throughout,
)
from megatronapp.scan.read.format import read_dir
from megatronapp.scan.read.traces import read_traces
from megatronapp.scan.synth.perturb import Perturbation, perturb

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


def _p(rank: int, dp: int, pp: int, tp: int, excess: float, its: list[int], waited: float) -> Finding:
    return Finding("transient-pause", (rank,), [{"rank": rank, "dp": dp, "pp": pp, "tp": tp}], "+ms", 1.5, excess,
                   0.6, {"iterations": its, "others_waited_ms": waited})


def test_a_pause_echoed_by_a_pipeline_neighbours_compute_folds_into_the_paused_rank():
    # 8,192 simulated ranks: rank 673 (DP20 PP1) paused 31 ms in iterations 1 and 3; the TP group of DP20 PP0
    # timed the wait as compute and read 8 more pauses of the same size in the same iterations.
    cause = _p(673, 20, 1, 1, 33.6, [1, 3], 4544.0)
    copies = [_p(160 + t, 20, 0, t, 27.0 + t, [1, 3], 100.0 - t) for t in range(8)]
    kept = echoes(copies + [cause])
    assert kept == [cause] and len(cause.evidence["echoes"]) == 8
    # Not an echo: another DP replica, two stages away, other iterations, or a pause far bigger than the lead's.
    for other in (_p(200, 25, 0, 0, 30.0, [1, 3], 10.0), _p(2000, 20, 3, 0, 30.0, [1, 3], 10.0),
                  _p(161, 20, 0, 1, 30.0, [2, 4], 10.0), _p(162, 20, 0, 2, 80.0, [1, 3], 10.0)):
        assert len(echoes([other, _p(673, 20, 1, 1, 33.6, [1, 3], 4544.0)])) == 2


def test_a_tp_peer_echoing_a_slow_rank_folds_but_a_second_slow_device_of_the_node_stays():
    def slow(rank: int, tp: int, excess: float, waited: float) -> Finding:
        return Finding("slow-compute", (rank,), [{"rank": rank, "dp": 55, "pp": 0, "tp": tp}], "x", 1.2, excess, 0.6,
                       {"iterations": [0, 1, 2, 3, 4], "others_waited_ms": waited})
    cause = slow(443, 3, 84.7, 9000.0)
    assert echoes([slow(447, 7, 31.3, 50.0), cause]) == [cause]  # 8,192 ranks: +31 ms beside +85 ms
    # Two slow devices of one node (perturbed real run: +24.8 and +16.8 ms) are both named.
    assert len(echoes([slow(4, 0, 24.8, 300.0), slow(5, 1, 16.8, 100.0)])) == 2


def test_a_pipeline_neighbour_of_a_slow_rank_echoes_it_within_what_the_slow_rank_costs():
    """Real 8-rank gloo runs (tp2 pp2 dp2, load 12-30): beside a slow stage-1 rank of replica 0, its stage-0
    neighbour read 1.40x floors (+4.8 against +8.4 ms) or a one-off pause (+30 ms in 1 of 8 iterations while
    others waited 54 ms per iteration for the slow rank). Both fold; a neighbour slower than that, another
    replica's rank, or a pause outside the slow iterations stays named."""
    def slow(rank: int, dp: int, pp: int, excess: float, waited: float, its: list[int]) -> Finding:
        return Finding("slow-compute", (rank,), [{"rank": rank, "dp": dp, "pp": pp, "tp": rank % 2}], "x", 1.4,
                       excess, 0.8, {"iterations": its, "others_waited_ms": waited})
    every = list(range(8))
    cause = slow(5, 0, 1, 8.4, 408.6, every)
    assert echoes([slow(0, 0, 0, 4.8, 204.1, every), cause]) == [cause]
    cause = slow(5, 0, 1, 11.3, 433.0, every)
    assert echoes([_p(0, 0, 0, 0, 29.9, [3], 383.7), cause]) == [cause]
    assert cause.evidence["echoes"][0]["kind"] == "transient-pause"
    for other in (slow(0, 0, 0, 9.5, 204.1, every), slow(2, 1, 0, 4.8, 204.1, every),  # 0.84 of it; replica 1
                  _p(0, 0, 0, 0, 80.0, [3], 383.7)):  # +80 ms: more than the slow rank costs an iteration (54)
        assert len(echoes([other, slow(5, 0, 1, 11.3, 433.0, every)])) == 2
    partial = slow(5, 0, 1, 11.3, 433.0, [0, 1, 2])
    assert len(echoes([_p(0, 0, 0, 0, 29.9, [3], 383.7), partial])) == 2  # paused where the rank was not slow


def test_a_host_time_blip_within_the_swing_of_the_whole_self_time_is_no_pause():
    # A healthy 3-rank DDP job under torch.profiler on 2 cores (recorded 2026-12-03, benchmarks/data/
    # kineto_ddp_healthy): self time 15-33 ms an iteration, swinging +-14 ms against the peers; rank 0 read +4.5 ms
    # of untraced time in 1 of 8 iterations (z 57) and was named transient-pause at confidence 0.70. Its whole self
    # time that iteration was within the run's swing: the OS took its CPU, as it took its peers' in other ones.
    traces, problems = read_traces(DATA / "kineto_ddp_healthy")
    assert problems == [] and [t.rank for t in traces] == [0, 1, 2]
    assert analyse(traces).report.findings == []


def _table(world: int = 3):
    coords = np.array([[0, 0, r] for r in range(world)])
    return SimpleNamespace(coords=coords, world=world)


def _phases(host_ms: float, iters: int = 8, world: int = 3):
    full = np.full((world, iters), host_ms)
    return SimpleNamespace(data=np.zeros((world, iters)), gap=full, compute=np.full((world, iters), 40.0))


def _late(rank: int, excess: float) -> Finding:
    return Finding("late-arrival", (rank,), [{"rank": rank, "dp": 0, "pp": 0, "tp": rank}],
                   f"+{excess:.1f} ms per iteration before reaching the collectives", 1.1, excess, 0.59, {})


def _slow_rank(rank: int, factor: float) -> Finding:
    return Finding("slow-compute", (rank,), [{"rank": rank, "dp": 0, "pp": 0, "tp": rank}],
                   f"{factor:.2f}x compute", factor, 130.0, 1.0, {})


def test_a_slow_ranks_slower_host_work_is_its_slowness_and_a_real_late_arrival_stays():
    # A real FSDP job, rank 2 stretched to 3.55x: it also read +1.6 ms of untraced time an iteration, a second
    # finding (late-arrival, c 0.59) of the same fault. Its peers spend ~1 ms between spans; 3.55x of that is
    # +2.6 ms, so +1.6 ms is the slowness. A data loader stalling 100 ms on the slow rank is a fault of its own.
    tb, ph = _table(), _phases(host_ms=1.0)
    folded = pauses_of_slow_ranks([_slow_rank(2, 3.55), _late(2, 1.6)], ph, tb)
    assert [(f.kind, f.ranks) for f in folded] == [("slow-compute", (2,))]
    (late,) = folded[0].evidence["host_time_explained"]
    assert late["kind"] == "late-arrival" and late["expected_ms"] == 2.55
    kept = pauses_of_slow_ranks([_slow_rank(2, 3.55), _late(2, 100.0)], ph, tb)
    assert sorted(f.kind for f in kept) == ["late-arrival", "slow-compute"]
    # Another rank's late arrival is not this rank's slowness; nor is one beside a rank with no host time at all.
    assert len(pauses_of_slow_ranks([_slow_rank(2, 3.55), _late(1, 1.6)], ph, tb)) == 2
    assert len(pauses_of_slow_ranks([_slow_rank(2, 3.55), _late(2, 1.6)], _phases(host_ms=0.0), tb)) == 2


def _pause_of(rank: int, excess: float, confidence: float = 0.71) -> Finding:
    return Finding("transient-pause", (rank,), [{"rank": rank, "dp": 0, "pp": 0, "tp": rank}],
                   f"+{excess:.1f} ms in 4 of 8 iterations", 1.9, excess, confidence, {"iterations": [3, 6, 7, 8]})


def test_a_late_ranks_pauses_are_its_lateness_and_a_far_bigger_one_stays():
    # A real DDP job whose rank 2 prepares its input on the CPU (2 x 60 ms an iteration): late by +120 ms in 8 of
    # 8 iterations by its host time, and by its whole self time, where its peers' compute swung by 24 ms, "paused"
    # by +108 ms in 4 of 8 at confidence 0.71; in one CI run that pause was listed first.
    tb, ph = _table(), _phases(host_ms=1.0)
    late = _late(2, 120.0)
    folded = pauses_of_slow_ranks([_pause_of(2, 107.7, confidence=0.9), late], ph, tb)
    assert [(f.kind, f.ranks) for f in folded] == [("late-arrival", (2,))]
    assert folded[0].confidence == 0.9 and folded[0].evidence["pauses_explained"][0]["expected_ms"] == 120.0
    # A pause beyond twice what the lateness costs is a fault of its own (lateness does not amplify as slowness
    # does: a slow rank's lead takes 3x); another rank's pause is not this lateness.
    assert len(pauses_of_slow_ranks([_pause_of(2, 300.0), _late(2, 120.0)], ph, tb)) == 2
    assert len(pauses_of_slow_ranks([_pause_of(2, 200.0), _late(2, 120.0)], ph, tb)) == 1
    assert len(pauses_of_slow_ranks([_pause_of(1, 107.7), _late(2, 120.0)], ph, tb)) == 2
    # Slow compute leads where a rank has both.
    both = pauses_of_slow_ranks([_pause_of(2, 107.7), _late(2, 1.0), _slow_rank(2, 3.0)], ph, tb)
    assert [f.kind for f in both] == ["slow-compute"]


def test_real_kineto_faults_are_one_finding_of_the_right_kind():
    # Recorded 2026-12-04 by benchmarks/kinetojob.py (3 gloo ranks on 2 cores, torch.profiler, gzipped here):
    # - kineto_ddp_slow_noisy: rank 0 does 13x the layer work; one window's two iterations slowed every rank
    #   (220-860 ms of compute against 25-150 ms), which set the run's jitter so high that its per-iteration view
    #   saw rank 0 slow in too few iterations, and the one where it was +678 ms as a pause that hid the slowness
    #   (intermittent by its calm iterations, which were all slow). Its op floors (forward 9.7x, backward 8.0x)
    #   were kept from naming it by the input's aten::randn (5% of the work, 1.00x).
    # - kineto_ddp_decode: rank 2 spins 2 x 60 ms an iteration preparing its input: late-arrival, and its +108 ms
    #   "pause" in 4 of 8 iterations of the whole self time is that lateness.
    for name, kind, rank in (("kineto_ddp_slow_noisy", "slow-compute", 0), ("kineto_ddp_decode", "late-arrival", 2)):
        traces, problems = read_traces(DATA / name)
        assert problems == [] and [t.rank for t in traces] == [0, 1, 2]
        report = analyse(traces).report
        assert [(f.kind, f.ranks) for f in report.findings] == [(kind, (rank,))], (name, report.to_text())


def test_contention_on_an_oversubscribed_host_is_no_slow_rank():
    # Recorded 2026-12-04 beside two CPU-spinning processes (5 busy processes on 2 cores): one rank's backward
    # 1.5-2.2x at its fastest, its forward at 0.90-1.01x, its compute above its peers in every iteration; it was
    # named slow-compute at confidence 0.69 on the healthy job and 1.00 beside the decode job's true late arrival.
    # A slow device is slow at every major kind of op; contention inflates the long ones.
    for name, want in (("kineto_ddp_healthy_loaded", []), ("kineto_ddp_decode_loaded", [("late-arrival", (2,))])):
        traces, problems = read_traces(DATA / name)
        assert problems == [] and [t.rank for t in traces] == [0, 1, 2]
        report = analyse(traces).report
        assert [(f.kind, f.ranks) for f in report.findings] == want, (name, report.to_text())


def test_a_finding_both_rank_views_make_leads_with_the_surer_one():
    # kineto_ddp_decode_noisy (recorded 2026-12-04, quiet): rank 2 spins 2 x 60 ms an iteration on its input. Its
    # host time reads +120 ms in 8 of 8 iterations (z 86); its whole self time, where the peers' compute swung by
    # 43 ms, in 6 of 8 at confidence 0.49. The self view's finding was listed, the host view's dropped as a repeat.
    traces, _ = read_traces(DATA / "kineto_ddp_decode_noisy")
    (late,) = analyse(traces).report.findings
    assert (late.kind, late.ranks) == ("late-arrival", (2,)) and late.confidence >= 0.9
    assert late.evidence["view"] == "host" and late.evidence["also"]["view"] == "self"


def test_the_ops_left_out_of_slow_at_every_op_are_a_small_tail_not_every_small_kind():
    # The smallest kinds whose shares add up to under 10% of the work: an input's randn beside forward and backward
    # is left out; twelve even kernels of a GPU trace (8% each) are all the work, and only one of them goes.
    tail = _minor_tail(np.array([[0.05, 0.45, 0.5], [0.06, 0.06, 0.88], [0.45, 0.5, 0.05]]))
    assert tail.tolist() == [[True, False, False], [True, False, False], [False, False, True]]
    assert _minor_tail(np.full((1, 12), 1.0)).sum() == 1  # 12 even kinds: 1/12 under 10%, 2/12 over
