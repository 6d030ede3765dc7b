"""MegaScan on plain PyTorch jobs (no engine): FSDP2 and DDP traced through `scan.instrument()` in real 2-rank gloo
runs, a slow rank injected and named by `scan.detect`, a healthy run quiet, training results bit for bit unchanged.

Each launch runs three trainings of the same seeded model in the same processes (benchmarks/anyjob.py, shared with
bench_scan_real's repeats): without instrumentation, traced and healthy, traced with rank 1 slowed 3x in every
layer's forward and backward (real compute, the extra results thrown away: the same parameters). The assertions
are about WHO, never timings.
"""
from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import pytest
import torch
from benchmarks.anyjob import MICROBATCHES, STEPS, job

from megatronapp.launch import spawn
from megatronapp.scan.detect.analysis import detect
from megatronapp.scan.read.format import read_dir
from tests.tmpdirs import session_dir


@functools.lru_cache(maxsize=2)
def _launched(kind: str) -> Path:
    out = session_dir(f"megascan-{kind}-")
    spawn(job, 2, str(out), kind)
    return out


@pytest.mark.parametrize("kind", ["fsdp", "ddp"])
def test_training_results_unchanged_by_instrumentation(kind):
    out = _launched(kind)
    for rank in range(2):
        res = torch.load(out / f"params{rank}.pt", weights_only=True)
        for run in ("healthy", "slow"):  # the drill's extra forwards are thrown away: same results too
            assert all(torch.equal(a, b) for a, b in zip(res["plain"], res[run])), (kind, rank, run)


@pytest.mark.parametrize("kind", ["fsdp", "ddp"])
def test_collectives_of_the_framework_are_traced(kind):
    traces, problems = read_dir(_launched(kind) / "healthy")
    assert problems == [] and len(traces) == 2
    want = {"fsdp": {"all_gather_single", "reduce_scatter_single"}, "ddp": {"all_reduce"}}[kind]
    for t in traces:
        names = np.array(t.names)[t.name]
        assert want <= set(names.tolist()), set(names.tolist())
        assert (names == "forward").sum() == (names == "backward").sum() == STEPS * MICROBATCHES
        assert (t.dur >= 0).all()  # every collective closed by its completion
    seqs = [sorted((t.names[n], int(s)) for n, s, g in zip(t.name, t.seq, t.gid) if g >= 0) for t in traces]
    assert seqs[0] == seqs[1] and seqs[0]  # the same instances on both ranks, so they match


@pytest.mark.parametrize("kind", ["fsdp", "ddp"])
def test_slow_rank_is_named_and_healthy_run_is_quiet(kind):
    out = _launched(kind)
    healthy = detect(read_dir(out / "healthy")[0])
    # Quiet by the project's bar for healthy runs: nothing at confidence 0.5 or more. A weaker finding says "not
    # sure" and is reported as such: on 2 busy cores a healthy 2-rank DDP job once read slow-compute 1.18x at c 0.29
    # (5 of 8 iterations, one peer), which a test asking for no finding at all failed on (1 run in 4, 2026-12-03).
    assert [f for f in healthy.findings if f.confidence >= 0.5] == [], healthy.to_text()
    slow = detect(read_dir(out / "slow")[0])
    assert slow.findings, slow.to_text()
    top = slow.findings[0]
    assert top.kind == "slow-compute" and top.ranks == (1,), slow.to_text()
