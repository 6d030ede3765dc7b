"""Collective instances matched by call order are checked: every member must have called the same op on as many
bytes.

A profiler trace without `Seq` numbers a group's collectives by their order in each step (read/kineto.py,
read/gpu_kineto.py). That is right when every rank traced the same calls; a rank whose window starts or ends
elsewhere, or that calls a collective the others do not, shifts the order, and the waits split from mismatched
kernels would be fiction. Instances whose members disagree in name or size are left unmatched, and the report
says how many."""
from __future__ import annotations

import numpy as np

from megatronapp.scan.detect.table import COMM, Table
from megatronapp.scan.read.format import RankTrace


def numbered_by_order(traces: list[RankTrace], world: int) -> np.ndarray:
    """[rank] -> whether the rank's collectives were numbered by call order (profiler traces without `Seq`)."""
    out = np.zeros(world, bool)
    for t in traces:
        if t.header.get("source") == "kineto" and t.header.get("seq_source") != "Seq" and 0 <= t.rank < world:
            out[t.rank] = True
    return out


def unmatch_disagreeing(tb: Table, by_order: np.ndarray) -> str | None:
    """Set `seq` to -1 (unmatched) on every row of a collective instance whose members, numbered by order,
    disagree in op name or bytes; the note saying so, None when all agree."""
    rows = np.flatnonzero((tb.cat == COMM) & (tb.gkey >= 0) & (tb.seq >= 0) & (tb.peer < 0) & by_order[tb.rank])
    if not len(rows):
        return None
    key = tb.gkey[rows] * (int(tb.seq[rows].max()) + 1) + tb.seq[rows]
    uk, inv = np.unique(key, return_inverse=True)
    name_lo = np.full(len(uk), np.iinfo(np.int64).max)
    name_hi = np.full(len(uk), -1)
    np.minimum.at(name_lo, inv, tb.name[rows])
    np.maximum.at(name_hi, inv, tb.name[rows])
    size_lo = np.full(len(uk), np.iinfo(np.int64).max)
    size_hi = np.full(len(uk), -1)
    np.minimum.at(size_lo, inv, tb.nbytes[rows])
    np.maximum.at(size_hi, inv, tb.nbytes[rows])
    bad = (name_lo != name_hi) | (size_lo != size_hi)
    if not bad.any():
        return None
    tb.seq[rows[bad[inv]]] = -1
    return (f"{int(bad.sum())} of {len(uk)} collective instances, matched by their order in each step (the traces "
            "carry no sequence numbers), differ across ranks in op or size: left unmatched, their waits not split (a "
            "rank traced other calls, or its window starts elsewhere)")
