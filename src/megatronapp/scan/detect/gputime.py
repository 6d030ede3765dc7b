"""Where a GPU's time went, per rank: idle, compute, non-compute, and communication overlapped with compute.

The same quantities, by the same definitions, as Holistic Trace Analysis' `get_temporal_breakdown` and
`get_comm_comp_overlap` (so a user can set one next to the other; benchmarks/bench_scan_hta.py does):
- the window: device events launched before the last profiler step began (the last step's work may run past the
  trace's end), from the first event's start to the last one's end (`kernel` time);
- idle: the window less the union of every device event;
- compute: the union of compute kernels (neither NCCL kernels, memcpys and memsets, nor kernels named `...Sync`);
- non-compute: the rest (communication and memory copies, less what overlaps compute);
- overlap: the part of the union of communication kernels that overlaps the union of compute kernels, over the
  union of communication kernels.
"""
from __future__ import annotations

import re

import numpy as np

from megatronapp.scan.detect.table import COMM, STEP, Table

_NOT_COMPUTE = re.compile(r"^Memset|Memcpy|Sync")  # HTA's: memory kernels and synchronisations are no compute


def _union(s: np.ndarray, e: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The union of intervals [s, e) as sorted disjoint intervals."""
    if not len(s):
        return s, e
    o = np.argsort(s, kind="stable")
    s, e = s[o], np.maximum.accumulate(e[o])
    new = np.r_[True, s[1:] > e[:-1]]
    idx = np.flatnonzero(new)
    return s[idx], np.r_[e[idx[1:] - 1], e[-1]]


def _length(s: np.ndarray, e: np.ndarray) -> float:
    return float((e - s).sum())


def _intersection(a: tuple[np.ndarray, np.ndarray], b: tuple[np.ndarray, np.ndarray]) -> float:
    """Length of the intersection of two unions of disjoint sorted intervals."""
    (s1, e1), (s2, e2) = a, b
    if not len(s1) or not len(s2):
        return 0.0
    pts = np.r_[s1, e1, s2, e2]
    step = np.r_[np.ones(len(s1)), -np.ones(len(e1)), np.full(len(s2), 2.0), np.full(len(e2), -2.0)]
    o = np.lexsort((step, pts))  # ends before starts at one instant
    level = np.cumsum(step[o])
    t = pts[o]
    return float(((level[:-1] == 3) * np.diff(t)).sum())


def gpu_breakdown(tb: Table) -> list[dict]:
    """Per rank whose comm runs beside its compute (a GPU trace): kernel, idle, compute and non-compute ms and
    percentages and the comm/compute overlap percentage, as HTA defines them (module docstring)."""
    if tb.comm_beside is None:
        return []
    names = np.array(tb.names, object)
    not_compute = np.array([bool(_NOT_COMPUTE.search(str(n))) for n in tb.names] + [False])
    out = []
    for r in np.flatnonzero(tb.comm_beside & tb.present):
        m = tb.rank == r
        steps = tb.it[m & (tb.cat == STEP)]
        last = int(steps.max()) if len(steps) else None
        ev = m & (tb.cat != STEP)
        if last is not None and len(np.unique(steps)) > 1:
            ev &= (tb.it < last) & (tb.it >= -1)  # launched before the last step (or outside every step, before it)
        if not ev.any():
            continue
        s, e = tb.ts[ev], tb.end[ev]
        comm = tb.cat[ev] == COMM
        compute = ~comm & ~not_compute[tb.name[ev]]
        every = _union(s, e)
        window = float(e.max() - s.min())
        busy = _length(*every)
        comp = _union(s[compute], e[compute])
        comm_u = _union(s[comm], e[comm])
        compute_ms = _length(*comp)
        idle = window - busy
        overlap = _intersection(comp, comm_u) / max(_length(*comm_u), 1.0) if comm.any() else float("nan")
        out.append({"rank": int(r), "kernel_ms": round(window / 1e6, 3), "idle_ms": round(idle / 1e6, 3),
                    "compute_ms": round(compute_ms / 1e6, 3), "non_compute_ms": round((busy - compute_ms) / 1e6, 3),
                    "idle_pct": round(100 * idle / window, 2) if window else float("nan"),
                    "compute_pct": round(100 * compute_ms / window, 2) if window else float("nan"),
                    "non_compute_pct": round(100 * (busy - compute_ms) / window, 2) if window else float("nan"),
                    "overlap_pct": round(100 * overlap, 2), "events": int(ev.sum()),
                    "kinds": len(set(names[tb.name[ev]].tolist()))})
    return out


def gpu_table(rows: list[dict]) -> str:
    """The breakdown as a fixed-width table for `scan summary`."""
    if not rows:
        return ""
    head = ("rank", "kernel ms", "idle %", "compute %", "non-compute %", "comm overlapped %")
    keys = ("rank", "kernel_ms", "idle_pct", "compute_pct", "non_compute_pct", "overlap_pct")
    cells = [[str(r[k]) if k == "rank" else f"{r[k]:.2f}" for k in keys] for r in rows]
    w = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(head)]
    lines = ["GPU time, as Holistic Trace Analysis' temporal breakdown counts it (device events launched before the "
             "last step):", "  ".join(h.rjust(w[i]) for i, h in enumerate(head))]
    lines += ["  ".join(c[i].rjust(w[i]) for i in range(len(head))) for c in cells]
    return "\n".join(lines)
