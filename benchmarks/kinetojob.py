"""A plain PyTorch job profiled with `torch.profiler` (Kineto Chrome traces, no MegaScan tracing): DDP or FSDP2
on gloo ranks, healthy or with one rank at fault. Used by tests/test_scan_kineto.py: `scan detect` must name the
faulty rank from the traces users already hold.

Faults (one rank, every step): `slow` redoes each layer's forward and backward SLOW - 1 more times (real compute,
results thrown away: benchmarks/anyjob.py's drill, heavier); `stall` sleeps STALL_MS before each micro-batch (a data
loader that keeps the rank waiting: time in no op, as a slow input pipeline shows in a profile).
The loop marks forward and backward with record_function, as profiled training loops do.
Profiling windows: two per run (schedule repeat=2), so each rank writes two files; odd ranks write .json.gz.
"""
from __future__ import annotations

import time
from pathlib import Path

import torch

from benchmarks.anyjob import _build

MICROBATCHES = 2
SLOW = 12  # the profiler's per-op cost dwarfs these tiny layers: the slow rank's layers do 12x their work
STALL_MS = 60.0
WAIT, WARMUP, ACTIVE, REPEAT = 0, 1, 4, 2  # 8 profiled steps: the consistency test needs 7+
STEPS = REPEAT * (WAIT + WARMUP + ACTIVE)


def job(rank: int, world: int, out: str, runs: list[tuple[str, str, str | None, int]]) -> None:
    """One rank (under `megatronapp.launch.spawn`): for each (run name, 'ddp' or 'fsdp', fault or None, faulty
    rank) train the same seeded model, profiled, writing out/<run>/rank<r>.w<window>.pt.trace.json[.gz]."""
    from torch.profiler import ProfilerActivity, profile, record_function, schedule

    torch.set_num_threads(1)
    for run, kind, fault, bad in runs:
        m = _build(kind)
        inner = m.module if kind == "ddp" else m
        if fault == "slow" and rank == bad:
            for block in inner:
                block.repeat = SLOW
        stall = STALL_MS / 1e3 if fault == "stall" and rank == bad else 0.0
        opt = torch.optim.SGD(m.parameters(), lr=0.05)
        gen = torch.Generator().manual_seed(1000 + rank)
        d = Path(out) / run
        d.mkdir(parents=True, exist_ok=True)
        windows = []

        def ready(prof, d=d, windows=windows) -> None:  # noqa: ANN001
            ext = ".json.gz" if rank % 2 else ".json"
            prof.export_chrome_trace(str(d / f"rank{rank}.w{len(windows)}.pt.trace{ext}"))
            windows.append(1)

        with profile(activities=[ProfilerActivity.CPU], record_shapes=True, on_trace_ready=ready,
                     schedule=schedule(wait=WAIT, warmup=WARMUP, active=ACTIVE, repeat=REPEAT)) as prof:
            for _ in range(STEPS):
                for _ in range(MICROBATCHES):
                    if stall:
                        time.sleep(stall)
                    x = torch.randn(384, 256, generator=gen)
                    with record_function("forward"):
                        loss = m(x).square().mean()
                    with record_function("backward"):
                        loss.backward()
                opt.step()
                opt.zero_grad()
                prof.step()
        torch.distributed.barrier()
