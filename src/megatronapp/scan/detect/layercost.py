"""What each pipeline stage costs, MEASURED from the job's own per-layer spans (trace granularity `full`).

A cost model's FLOPs are what a stage should cost on an ideal device; small layers on a CPU (or any kernel-
launch-bound model) spend their time elsewhere: on the stored tiny-GPT-2 pipeline the FLOPs give the last
stage (LM head and loss) 1.31x a middle stage's work, the run measures 1.08x, and a 1.3x slow last stage hid in
the difference. Every stage runs the same transformer layer, though, so the layer is a yardstick each rank
carries. Two uses:

- `measured_stage_work`: a stage's work in LAYER UNITS, its compute floors per iteration (each op kind's
  fastest repeats, as `evidence.floor_findings` takes them) over its own layer floor. A slow rank is slow at
  both, so its units stay what its stage costs. Stands in for `stage_work` in the views that compare a lone
  stage with the others when the headers declare none (a declared model goes first: measured units are noisy
  by 15-25% per rank on a busy host).
- `layer_findings`: a rank alone in its stage is compared with the OTHER stages on the one op they all run:
  per iteration, its fastest layer against theirs. No cost model enters; what stays is how far identical ops
  on healthy ranks of one job differ (`Thresholds.layer_rel`).

Floors, not medians: a rank that waits less (the bottleneck) sees less of its nested comm and its exclusive
compute median moves with the pipeline's timing (a 1.3x drill moved the last stage's compute median 1.47x),
while the fastest repeats of an op move with the device only. Layer spans of one KIND are compared: the name
without its index (`layers.3` -> `layers`), the kind most ranks run; their time is exclusive (nested comm such
as a TP all-reduce, and CPU waits, taken out). Layers of different shapes under one name (a hybrid or MoE
stack split unevenly) would need a name per shape.
"""
from __future__ import annotations

import re

import numpy as np

from megatronapp.scan.detect.evidence import op_floors
from megatronapp.scan.detect.findings import Finding, Thresholds
from megatronapp.scan.detect.table import Phases, Table, coord
from megatronapp.scan.read.format import CAT_INDEX

_LAYER = CAT_INDEX["layer"]
_INDEX = re.compile(r"\.\d+$")
_MIN_ITERATIONS = 4  # per rank: iterations with layer spans (a floor per iteration)
MS = 1e6


def layer_kind(name: str) -> str:
    """The kind of a layer span: its name without a trailing `.<index>`."""
    return _INDEX.sub("", name)


def _layer_floors(tb: Table, ph: Phases, layer_excl: np.ndarray | None) -> tuple[np.ndarray, np.ndarray, str]:
    """(per rank x iteration: the fastest layer of the most common kind, ms (NaN: none); per iteration: how
    many such layers a rank runs (its median count); that kind)."""
    W, n_it = tb.world, len(ph.iters)
    per_it = np.full((W, max(n_it, 1)), np.nan)
    count = np.zeros((W, max(n_it, 1)))
    m = (tb.cat == _LAYER) & np.isin(tb.it, ph.iters) & (tb.dur > 0)
    if layer_excl is None or not m.any():  # None: the trace has no layer spans
        return per_it, np.zeros(W), ""
    kinds = np.array([layer_kind(n) for n in tb.names], dtype=object)
    kind = kinds[tb.name[m]]
    rank = tb.rank[m]
    # The kind most ranks run, then the most spans; ties by name (a set's order varies with the hash seed).
    best = max(sorted(set(kind)), key=lambda k: (len(np.unique(rank[kind == k])), int((kind == k).sum())))
    rows = np.flatnonzero(m)[kind == best]
    cell = tb.rank[rows] * per_it.shape[1] + np.searchsorted(ph.iters, tb.it[rows])
    flat = np.full(per_it.size, np.inf)
    np.minimum.at(flat, cell, layer_excl[rows].astype(float) / MS)
    np.add.at(count.ravel(), cell, 1)
    per_it = np.where(np.isinf(flat), np.nan, flat).reshape(per_it.shape)
    return per_it, np.median(count, axis=1), best


def measured_stage_work(tb: Table, ph: Phases, layer_excl: np.ndarray | None,
                        q: float = 0.1) -> dict[int, float] | None:
    """Relative work of each pipeline stage (mean 1.0) in measured layer units, or None when the traces cannot
    say: fewer than three ranks with layer spans of one kind, or a stage none of whose ranks has them."""
    per_it, _, _ = _layer_floors(tb, ph, layer_excl)
    if not np.isfinite(per_it).any():
        return None  # no layer spans (a coarse trace): nothing to measure by
    ops = op_floors(tb, ph.excl, ph.iters, q)
    if ops is None:
        return None
    # Each rank's compute at floor speed per iteration: every op kind at its q-floor, times its repeats.
    floor, count = ops[5], ops[6]
    at_floor = np.nansum(floor * count, axis=1)
    stage = tb.coords[:, 1]
    units: dict[int, list[float]] = {}
    for r in np.flatnonzero(tb.present):
        lf = per_it[r][np.isfinite(per_it[r])]
        if len(lf) < _MIN_ITERATIONS or at_floor[r] <= 0:
            continue
        units.setdefault(int(stage[r]), []).append(float(at_floor[r] / np.quantile(lf, q)))
    present = np.unique(stage[tb.present])
    if sum(len(v) for v in units.values()) < 3 or any(int(s) not in units for s in present):
        return None
    work = {s: float(np.median(v)) for s, v in units.items()}
    mean = sum(work.values()) / len(work)
    return {s: round(w / mean, 6) for s, w in sorted(work.items())}


def layer_findings(tb: Table, ph: Phases, layer_excl: np.ndarray | None, th: Thresholds) -> list[Finding]:
    """Slow ranks alone in their stage, by their fastest layer per iteration against the other stages'."""
    stage = tb.coords[:, 1]
    present = tb.present
    sizes = np.bincount(stage[present], minlength=int(stage.max()) + 1)
    per_it, count, kind = _layer_floors(tb, ph, layer_excl)
    has = np.isfinite(per_it).sum(axis=1) >= _MIN_ITERATIONS
    out = []
    for r in np.flatnonzero(present & has & (sizes[stage] == 1)):
        others = np.flatnonzero(has & (np.arange(tb.world) != r))
        if len(others) < 2:
            continue
        with np.errstate(all="ignore"):
            ref = np.nanmedian(per_it[others], axis=0)
            ratio = per_it[r] / ref
        ok = np.isfinite(ratio)
        if ok.sum() < _MIN_ITERATIONS:
            continue
        factor = float(np.median(ratio[ok]))
        high = ratio[ok] >= 1 + th.layer_rel / 2
        frac = float(high.mean())
        excess = float(np.median((per_it[r] - ref)[ok])) * count[r]  # ms per iteration, at floor speed
        if not (factor >= 1 + th.layer_rel and frac >= th.persistent and excess >= th.abs_ms):
            continue
        conf = min(1.0, 0.5 + (factor - 1 - th.layer_rel) / (2 * th.layer_rel)) * frac * 0.85  # no stage peer
        ev = {"method": "layer floors against the other stages", "peers": 0, "layer_kind": kind,
              "layers_per_iteration": float(count[r]),
              "layer_floor_ms": round(float(np.nanmedian(per_it[r])), 4),
              "other_stages_layer_floor_ms": round(float(np.nanmedian(ref)), 4),
              "iterations": [int(t) for t, h in zip(ph.iters[ok], high) if h]}
        out.append(Finding("slow-compute", (int(r),), [coord(tb, r)],
                           f"{factor:.2f}x the other stages' time for the same layer at its fastest "
                           f"(+{excess:.1f} ms per iteration in its layers alone)", round(factor, 3), round(excess, 3),
                           round(conf, 3), ev))
    return out
