"""Stage work measured from per-layer spans, and lone stages judged on the layer every stage runs.

On the stored full-granularity recordings (benchmarks/data/scan_real_full: real gloo ranks of the engine, tiny
GPT-2, pp=4 with one rank per stage), re-timed by `scan/synth/perturb.py` with known faults.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from megatronapp.scan.detect.analysis import analyse, detect
from megatronapp.scan.detect.layercost import layer_kind, measured_stage_work
from megatronapp.scan.detect.table import LAYER, exclusive_time, join, phases
from megatronapp.scan.read.format import CAT_INDEX, read_dir
from megatronapp.scan.synth.perturb import Perturbation, perturb

FULL = Path(__file__).resolve().parent.parent / "benchmarks" / "data" / "scan_real_full"


def _traces(layout="pp4"):
    traces, problems = read_dir(FULL / layout)
    assert problems == [] and traces
    return traces


def _work(traces):
    tb = join(traces)
    ph = phases(tb)
    return measured_stage_work(tb, ph, exclusive_time(tb, tb.cat == LAYER))


def _without_stage_work(traces):
    for t in traces:
        t.header.pop("stage_work", None)
    return traces


def _named(report):
    return {(f.kind, tuple(f.ranks)) for f in report.findings}


def test_layer_kind_drops_the_index():
    assert [layer_kind(n) for n in ("layers.3", "blocks.12", "lm_head", "layers.3.mlp")] == \
        ["layers", "blocks", "lm_head", "layers.3.mlp"]


def test_measured_work_is_the_stages_not_the_ranks_speed():
    traces = _traces()
    healthy = _work(traces)
    assert set(healthy) == {0, 1, 2, 3} and abs(sum(healthy.values()) - 4) < 1e-4
    # A slow rank is slow at its layers too: its units (compute floors over its own layer floor) stay.
    for rank in (1, 3):
        slow = _work(perturb(traces, [Perturbation("slow-compute", (rank,), factor=1.5)]))
        assert all(abs(slow[s] - healthy[s]) < 0.05 for s in healthy), (rank, healthy, slow)
    # The FLOPs model in the headers gives the last stage (LM head, loss) more than the run measures.
    flops = traces[0].header["stage_work"]
    assert flops[3] / flops[1] > healthy[3] / healthy[1] + 0.1, (flops, healthy)


def test_no_layer_spans_no_measured_work():
    coarse, _ = read_dir(FULL.parent / "scan_real_quiet" / "pp4")
    assert _work(coarse) is None
    text = detect(_without_stage_work(coarse)).to_text()
    assert "measured in per-layer spans" not in text and "assuming stages do equal work" in text


@pytest.mark.parametrize("rank, factor", [(3, 1.3), (1, 1.3), (0, 1.5)])
def test_a_slow_lone_stage_is_named_by_its_layers(rank, factor):
    # The coarse recordings of the same layout miss a 1.3x last stage: the FLOPs reference overstates its work.
    report = detect(perturb(_traces(), [Perturbation("slow-compute", (rank,), factor=factor)]))
    assert _named(report) == {("slow-compute", (rank,))}, report.to_text()


def test_measured_work_stands_in_when_the_headers_declare_none():
    # Any PyTorch job traced per layer through scan.instrument() has no cost model; the engine declares FLOPs,
    # which go first (measured units are noisier per rank).
    traces = _traces()
    assert "scaled by the headers' stage_work" in detect(traces).to_text()
    bare = detect(_without_stage_work(_traces()))
    assert bare.findings == [] and "stage work measured in per-layer spans" in bare.to_text(), bare.to_text()
    slow = detect(_without_stage_work(perturb(_traces(), [Perturbation("slow-compute", (3,), factor=1.3)])))
    assert _named(slow) == {("slow-compute", (3,))}, slow.to_text()


def test_healthy_and_legitimately_heavier_stages_raise_nothing():
    traces = _traces()
    assert detect(traces).findings == []
    # 1.4x the work, all of it outside the layers (a bigger head): the stage costs more, its device is not slow.
    heavy = perturb(traces, [Perturbation("slow-compute", (3,), factor=1.4, outside_layers=True)])
    report = analyse(heavy).report
    assert report.findings == [], report.to_text()
    assert _work(heavy)[3] > _work(traces)[3] * 1.25


def test_a_heavier_stage_keeps_its_layers_and_stretches_the_rest():
    from megatronapp.scan.synth.perturb import _compute_gaps, _segments

    t = _traces()[3]
    layer = t.cat == CAT_INDEX["layer"]
    o = np.argsort(t.ts, kind="stable")
    compute = sum(b - a for a, b in _compute_gaps(t.ts[o], (t.ts + t.dur)[o], t.cat[o]))
    seg = _segments(t, [Perturbation("slow-compute", (3,), factor=1.4, outside_layers=True)])
    assert abs(sum(x for _, _, x in seg) - 0.4 * compute) < 1e-6 * compute  # the stage does 1.4x the work...
    starts, ends = t.ts[layer], t.ts[layer] + t.dur[layer]
    for a, b, _ in seg:  # ...all of it outside its layers
        assert not np.any((starts < b) & (ends > a))
    heavy = perturb(_traces(), [Perturbation("slow-compute", (3,), factor=1.4, outside_layers=True)])
    after = next(x for x in heavy if x.rank == 3)
    np.testing.assert_allclose(after.dur[after.cat == CAT_INDEX["layer"]], t.dur[layer], atol=2)
