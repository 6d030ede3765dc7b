"""What a healthy real run may and may not raise in MegaScan, for the tests that trace real (loaded) runs.

A healthy run raises no finding, with one exception the detector itself reports: on a host where a rank waits for
a CPU more than half its work time (scan/detect/contention.py, STARVED), a transfer into it ends when its thread
gets a CPU again, so a slow link into that rank may be the scheduler's; the report says so and asks to confirm
the link (`megatronapp diagnose`). On a quiet host nothing is excused; a slow compute is never excused.
"""
from __future__ import annotations

import numpy as np

from megatronapp.scan.detect.contention import STARVED, cpu_wait_share
from megatronapp.scan.detect.findings import Finding, Report
from megatronapp.scan.detect.table import join


def starved_ranks(traces: list) -> set[int]:
    """The ranks of a recording that waited for a CPU at least STARVED of their work time."""
    share = cpu_wait_share(join(traces))
    return {int(r) for r in np.flatnonzero(share >= STARVED)}


def unexplained(report: Report, traces: list) -> list[Finding]:
    """The findings of `report` (on `traces`) that a healthy run must not raise: all but a slow link into a rank
    the recording shows starved of CPU (the case the report itself asks to confirm)."""
    starved = starved_ranks(traces)
    return [f for f in report.findings if not (f.kind == "slow-link" and starved & set(f.ranks))]
