"""Host CPU contention in the report: ranks that waited for a CPU most of their work time (scan/detect/contention.py).

On stored real recordings (benchmarks/data): "loaded" was recorded beside 10 CPU-spinning processes, "quiet" with
nothing else running (4-8 ranks on 2 cores), "busy" in trace format 1 (no CPU waits recorded).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from megatronapp.scan.detect.analysis import detect
from megatronapp.scan.detect.contention import STARVED, cpu_wait_share, starved_note
from megatronapp.scan.detect.table import join
from megatronapp.scan.read.format import read_dir

DATA = Path(__file__).resolve().parent.parent / "benchmarks" / "data"


def _traces(recording, layout):
    traces, problems = read_dir(DATA / recording / layout)
    assert problems == [] and traces
    return traces


def test_an_oversubscribed_host_is_said_in_the_report():
    share = cpu_wait_share(join(_traces("scan_real_loaded", "dp4")))
    assert np.all(share > 0.8), share  # 4 ranks beside 10 spinning processes on 2 cores
    text = detect(_traces("scan_real_loaded", "dp4")).to_text()
    assert "every rank waited for a CPU" in text and "oversubscribed" in text, text


def test_a_quiet_host_and_an_unmeasured_one_say_nothing():
    share = cpu_wait_share(join(_traces("scan_real_quiet", "dp4")))
    assert np.all((share > 0.1) & (share < STARVED)), share  # 4 ranks on 2 cores: waits, but less than half
    assert "waited for a CPU" not in detect(_traces("scan_real_quiet", "dp4")).to_text()
    assert np.all(np.isnan(cpu_wait_share(join(_traces("scan_real", "dp4")))))  # format 1: not measured


def test_the_note_names_only_the_starved_ranks():
    note = starved_note(np.array([0.1, 0.7, np.nan, 0.2]))
    assert note.startswith("ranks [1] waited for a CPU 70-70%")
    assert starved_note(np.array([0.1, 0.4])) is None
