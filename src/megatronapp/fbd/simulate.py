"""A small discrete-event model of one MegaFBD step, for the heterogeneous case: forward instances on devices k
times slower than the backward ones. Pure functions; inputs calibrated from real spans (benchmarks/bench_fbd.py).

Model (no communication time, pp_f = 1, vpp = 1): forward instance i runs its jobs back to back, a job taking
k * (V-1) * t_fwd, and the input of virtual stage v of that job is ready k * v * t_fwd after the job starts.
Backward stage s runs (microbatch m) in order, each task taking t_bwd (recompute + backward), once its input is
ready and (unless last) stage s+1 finished the same microbatch. The coupled 1F1B step is (M + pp - 1) chunk
forward+backward times, the classic bubble formula.
"""
from __future__ import annotations

import itertools
import math
from collections.abc import Sequence


def _per_stage(x: float | Sequence[float], pp: int, name: str) -> list[float]:
    if isinstance(x, Sequence):
        if len(x) != pp:
            raise ValueError(f"{name} has {len(x)} per-stage times; pp={pp} needs {pp}")
        return [float(t) for t in x]
    return [float(x)] * pp


def fbd_step(pp: int, microbatches: int, n_f: int, t_fwd: float | Sequence[float], t_bwd: float | Sequence[float],
             k: float = 1.0) -> float:
    """Simulated step time of MegaFBD (vpp 1, pp_f 1, dp 1) with forward devices `k` times slower. `t_fwd` and
    `t_bwd` are per virtual stage when given as sequences (an emulated run's costs: the first stage has no
    embedding FLOPs, the last adds the output layer)."""
    V = pp
    fwd, bwd = _per_stage(t_fwd, V, "t_fwd"), _per_stage(t_bwd, V, "t_bwd")
    offset = [0.0, *itertools.accumulate(k * t for t in fwd)]  # input of v ready offset[v] after the job starts
    job_start = [0.0] * n_f  # when each instance is free
    ready: dict[tuple[int, int], float] = {}
    for m in range(microbatches):
        i = m % n_f
        for v in range(1, V):
            ready[(m, v)] = job_start[i] + offset[v]
        job_start[i] += offset[V - 1]
    stage_free = [0.0] * pp
    done: dict[tuple[int, int], float] = {}
    for m in range(microbatches):
        for v in reversed(range(V)):
            start = max(stage_free[v], ready.get((m, v), 0.0), done.get((m, v + 1), 0.0))
            done[(m, v)] = stage_free[v] = start + bwd[v]
    return max(stage_free)


def coupled_step(pp: int, microbatches: int, t_fwd: float, t_bwd_only: float) -> float:
    """1F1B on homogeneous devices: (M + pp - 1) chunk forward+backward times."""
    return (microbatches + pp - 1) * (t_fwd + t_bwd_only)


def balanced_instances(pp: int, t_fwd: float, t_bwd: float, k: float) -> int:
    """Forward instances that keep up with the backward side: a backward stage takes a microbatch every t_bwd,
    an instance makes one every k * (pp - 1) * t_fwd."""
    return max(1, math.ceil(k * (pp - 1) * t_fwd / t_bwd - 1e-9))
