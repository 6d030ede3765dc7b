"""MegaScan detection on REAL training runs: gloo ranks of the engine with injected faults, traced and analysed.

Each case is one launch of `megatronapp.train.trainer.train` (tiny GPT-2, 8 steps, every step traced) with a
fault drill from `megatronapp.faults`. The machine is small and busy, so the drills are sized well above its
noise (a slow rank at 2x, a link delaying each send by 20 ms, 100 ms pauses) and the assertions are about WHO
and WHAT (top finding, kind, ranks), never about timings. Layouts: 4 ranks tp=1 pp=2 dp=2 (two ranks per
pipeline stage: the few-peers case) and 8 ranks tp=2 pp=2 dp=2. rank = tp + tp_size * (dp + dp_size * pp).
"""
from __future__ import annotations

from pathlib import Path

import pytest

from megatronapp.config import ModelConfig, ParallelConfig, RunConfig, TraceConfig, TrainConfig
from megatronapp.scan.detect.analysis import Report, analyse
from megatronapp.scan.read.format import read_dir
from megatronapp.train.trainer import train

STEPS = 8
LAYOUTS = {4: (1, 2, 2), 8: (2, 2, 2)}  # world -> (tp, pp, dp)


@pytest.fixture(scope="module")
def traced_run(tmp_path_factory):
    """traced_run(world, faults): train a tiny model on `world` real ranks with the given faults, trace every step,
    return the detection report (each configuration launched once per module)."""
    done: dict[tuple, Report] = {}

    def run(world: int, inject: tuple[str, ...]) -> Report:
        if (world, inject) not in done:
            done[(world, inject)] = _launch(tmp_path_factory.mktemp("megascan-real"), world, inject)
        return done[(world, inject)]
    return run


def _launch(out: Path, world: int, inject: tuple[str, ...]) -> Report:
    tp, pp, dp = LAYOUTS[world]
    cfg = RunConfig(model=ModelConfig(family="gpt2", hidden_size=64, num_layers=4, num_heads=4, max_seq_len=32),
                    parallel=ParallelConfig(tp=tp, pp=pp, dp=dp, microbatches=4, schedule="1f1b"),
                    train=TrainConfig(steps=STEPS, global_batch_size=8, seq_len=32, warmup_steps=1, out=str(out),
                                      progress=False),
                    trace=TraceConfig(enabled=True, dir=str(out / "trace"), interval=STEPS, iterations=STEPS),
                    inject=list(inject))
    summary = train(cfg)
    assert summary["steps"] == STEPS
    traces, problems = read_dir(out / "trace")
    assert problems == [] and len(traces) == world
    assert all(t.header["first_step"] == 0 for t in traces)  # where the processes started: their warm-up step
    return analyse(traces).report


def _top(report: Report):
    assert report.findings, "no finding:\n" + report.to_text()
    return report.findings[0]


def test_healthy_run_raises_no_alarm(traced_run):
    report = traced_run(4, ())
    assert report.findings == [], report.to_text()
    assert "no root cause found" in report.to_text()


def test_slow_compute_with_one_peer_per_stage(traced_run):
    # Rank 3 = (dp1, pp1): its only stage peer is rank 2; ranks 1 (its pipeline neighbour) and 2 are victims.
    report = traced_run(4, ("slow-compute=3:2.0",))
    top = _top(report)
    assert (top.kind, top.ranks) == ("slow-compute", (3,)), report.to_text()
    assert top.factor > 1.4 and top.evidence["peers"] == 1
    # Either view may lead (op floors, or per-iteration compute now that CPU waits are taken out of it).
    assert "rank 3 (DP1 PP1 TP0)" in report.to_text()
    assert not [f for f in report.findings if f.kind == "slow-compute" and f.ranks != (3,)], report.to_text()


def test_slow_p2p_link_between_stages(traced_run):
    # Link 0-2 joins stage 0 and stage 1 of DP column 0; each send over it waits 20 ms at its sender.
    report = traced_run(4, ("slow-link=0-2:20",))
    top = _top(report)
    assert (top.kind, tuple(sorted(top.ranks))) == ("slow-link", (0, 2)), report.to_text()
    assert top.excess_ms > 10
    # Its ends are not blamed on their own for the time the link cost them.
    assert not [f for f in report.findings if f.kind == "late-arrival" and f.ranks[0] in (0, 2)], report.to_text()


def test_transient_pause(traced_run):
    report = traced_run(4, ("pause=1:100:2",))  # rank 1 pauses 100 ms at iterations 0, 2, 4, 6
    top = _top(report)
    assert (top.kind, top.ranks) == ("transient-pause", (1,)), report.to_text()
    # The pattern is found; one busy-machine hiccup of the same rank may join it, not more.
    its, paused = set(top.evidence["iterations"]), {0, 2, 4, 6}
    assert len(its & paused) >= 3 and len(its - paused) <= 1, report.to_text()
    assert 60 < top.excess_ms < 200


def test_slow_compute_on_eight_ranks_with_tensor_parallel(traced_run):
    # Rank 5 = (dp0, pp1, tp1): its TP peer 4 waits in every all-reduce of the layer, and is not blamed.
    report = traced_run(8, ("slow-compute=5:2.0",))
    top = _top(report)
    assert (top.kind, top.ranks) == ("slow-compute", (5,)), report.to_text()
    assert not [f for f in report.findings if f.ranks == (4,)], report.to_text()


def test_slow_link_between_data_parallel_peers(traced_run):
    # Ranks 1 and 3 are DP peers (pp0, tp1); every collective holding both waits 20 ms on each end. The DP
    # group is just the two of them, and the same ops of the other DP groups do not stall: the link is named.
    report = traced_run(8, ("slow-link=1-3:20",))
    top = _top(report)
    assert (top.kind, tuple(sorted(top.ranks))) == ("slow-link", (1, 3)), report.to_text()
    assert top.evidence["method"] == "collective stalls" and top.evidence["group"] == "dp"
    # The link delays both DP collectives of an iteration, one of them posted inside backward (its stall shows as
    # compute): the ends' late arrivals are the link's, not findings of their own.
    assert not [f for f in report.findings if f.kind in ("late-arrival", "transient-pause")
                and f.ranks[0] in (1, 3)], report.to_text()
    assert set(top.evidence["stall_ms_per_iteration"].values()) and \
        min(top.evidence["stall_ms_per_iteration"].values()) >= 35
