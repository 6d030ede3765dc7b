"""Host CPU contention: how much of each rank's work time it spent runnable but without a CPU.

The tracer records, for every host-timed work span, the time its thread waited in the run queue (Linux
schedstat, trace format 2). Detection already takes that time out of compute. What it cannot take out is the
same delay inside a TRANSFER or a wait: a receive ends when its thread runs again, so on a host where ranks wait
for a CPU most of the time every transfer carries the scheduler (measured: beside 10 CPU-spinning processes,
ranks waited 61-87% of their work time and a healthy tp2pp2dp2 link's fastest transfer read 24x its peers', named
until link floors were judged per pipeline direction; on the quiet recordings, 4-8 ranks on 2 cores, 23-48%,
links were judged right). Not judging links into such ranks
was tried and not kept: it also lost every real +10-20 ms link of that recording (recall 0.75 -> 0.625). So the
report says it instead: above half ("more often off the CPU than on"), the operator's first fault is the
oversubscribed host, and link findings into those ranks are to be confirmed (`megatronapp diagnose`).
"""
from __future__ import annotations

import numpy as np

from megatronapp.scan.detect.table import Table
from megatronapp.scan.read.format import CAT_INDEX

STARVED = 0.5  # share of work time spent waiting for a CPU above which transfer timings are the scheduler's
_WORK = (CAT_INDEX["compute"], CAT_INDEX["data"], CAT_INDEX["optimizer"])


def cpu_wait_share(tb: Table) -> np.ndarray:
    """Per rank: CPU wait over duration of its work spans where the wait was measured (NaN: not measured)."""
    share = np.full(tb.world, np.nan)
    if tb.cpu_wait is None:
        return share
    m = np.isin(tb.cat, _WORK) & (tb.cpu_wait >= 0) & (tb.dur > 0)
    dur = np.bincount(tb.rank[m], tb.dur[m].astype(float), tb.world)
    wait = np.bincount(tb.rank[m], tb.cpu_wait[m].astype(float), tb.world)
    ok = dur > 0
    share[ok] = wait[ok] / dur[ok]
    return share


def starved_note(share: np.ndarray) -> str | None:
    """A report line when ranks spent more than STARVED of their work time waiting for a CPU."""
    bad = np.flatnonzero(share >= STARVED)
    if not len(bad):
        return None
    which = "every rank" if len(bad) == np.isfinite(share).sum() else f"ranks {bad.tolist()}"
    return (f"{which} waited for a CPU {100 * np.nanmin(share[bad]):.0f}-{100 * np.nanmax(share[bad]):.0f}% of "
            "its work time: the host is oversubscribed (other processes, or more ranks than cores). Compute is "
            "judged without that wait, transfers are not (one ends when its receiver gets a CPU): confirm a "
            "slow link into these ranks with `megatronapp diagnose` before acting on it")
