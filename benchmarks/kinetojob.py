"""A plain PyTorch job profiled with `torch.profiler` (Kineto Chrome traces, no MegaScan tracing): DDP or FSDP2
on gloo ranks, healthy or with one rank at fault. Used by tests/test_scan_kineto.py: `scan detect` must name the
faulty rank from the traces users already hold.

Faults (one rank, every step):
- `slow`: each layer's forward and backward do their matmuls SLOW more times (a slow device: real compute, results
  thrown away). The extra work is plain `aten::linear` / `aten::mm` ops in the layer's own forward and in the
  backward of its output, named as the layer's own work is: no op of its own for a reader to look for.
- `stall`: sleeps STALL_MS before each micro-batch (an input pipeline waiting for storage: time in no op, as a
  slow input pipeline shows in a profile);
- `decode`: spins in Python for STALL_MS before each micro-batch (CPU-bound input preparation in the training
  process: time in no op too, but holding a core, so the rank gets no scheduler credit for having slept).
Loops of two styles: DDP jobs mark forward and backward with record_function (as profiled training loops often
do); FSDP2 jobs mark nothing, so the trace holds only FSDP's own annotations (`FSDP::pre_forward`,
`FSDP::all_gather`, `FSDP::post_backward_reduce` ...), the aten ops and the autograd engine's.
Profiling windows: two per run (schedule repeat=2), so each rank writes two files; odd ranks write .json.gz.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from benchmarks.anyjob import _build

MICROBATCHES = 2
SLOW = 12  # extra matmuls per layer matmul on the slow rank: 13x the layer work, above a busy machine's noise
STALL_MS = 60.0
WAIT, WARMUP, ACTIVE, REPEAT = 0, 1, 4, 2  # 8 profiled steps: the consistency test needs 7+
STEPS = REPEAT * (WAIT + WARMUP + ACTIVE)


def _slow_down(layer: torch.nn.Linear, times: int) -> None:
    """Make `layer` a slow device's: its forward and the backward of its output redo their matmuls `times` more
    times through hooks (results thrown away, the job's results unchanged)."""
    w = torch.randn(layer.out_features, layer.in_features)  # own weights: FSDP2 frees the layer's after forward
    seen: list[torch.Tensor] = []

    def forward(_m: torch.nn.Module, args: tuple, out: torch.Tensor) -> None:
        x = args[0].detach()
        with torch.no_grad():
            for _ in range(times):
                torch.nn.functional.linear(x, w)
        seen[:] = [x]
        if out.requires_grad:
            out.register_hook(backward)

    def backward(grad: torch.Tensor) -> None:
        with torch.no_grad():
            for _ in range(times):
                grad @ w
                grad.t() @ seen[0]

    layer.register_forward_hook(forward)


def run_queue_s() -> float:
    """Seconds this thread has waited runnable for a core (Linux schedstat); 0 where unknown."""
    try:
        return int(Path("/proc/thread-self/schedstat").read_text().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return 0.0


def job(rank: int, world: int, out: str, runs: list[tuple[str, str, str | None, int]]) -> None:
    """One rank (under `megatronapp.launch.spawn`): for each (run name, 'ddp' or 'fsdp', fault or None, faulty
    rank) train the same seeded model, profiled, writing out/<run>/rank<r>.w<window>.pt.trace.json[.gz]."""
    import contextlib

    from torch.profiler import ProfilerActivity, profile, record_function, schedule

    torch.set_num_threads(1)
    for run, kind, fault, bad in runs:
        m = _build(kind)
        inner = m.module if kind == "ddp" else m
        if fault == "slow" and rank == bad:
            for block in inner:
                _slow_down(block.lin, SLOW)
        stall = STALL_MS / 1e3 if fault in ("stall", "decode") and rank == bad else 0.0
        spin = fault == "decode"
        mark = record_function if kind == "ddp" else lambda _name: contextlib.nullcontext()
        opt = torch.optim.SGD(m.parameters(), lr=0.05)
        gen = torch.Generator().manual_seed(1000 + rank)
        d = Path(out) / run
        d.mkdir(parents=True, exist_ok=True)
        windows = []

        def ready(prof, d=d, windows=windows) -> None:  # noqa: ANN001
            ext = ".json.gz" if rank % 2 else ".json"
            prof.export_chrome_trace(str(d / f"rank{rank}.w{len(windows)}.pt.trace{ext}"))
            windows.append(1)

        queued = run_queue_s()
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True, on_trace_ready=ready,
                     schedule=schedule(wait=WAIT, warmup=WARMUP, active=ACTIVE, repeat=REPEAT)) as prof:
            for _ in range(STEPS):
                for _ in range(MICROBATCHES):
                    if stall and spin:
                        until = time.perf_counter() + stall
                        while time.perf_counter() < until:
                            pass
                    elif stall:
                        time.sleep(stall)
                    x = torch.randn(384, 256, generator=gen)
                    with mark("forward"):
                        loss = m(x).square().mean()
                    with mark("backward"):
                        loss.backward()
                opt.step()
                opt.zero_grad()
                prof.step()
        # The ground truth of a healthy job on a shared host: how long this rank waited for a core (a profiler trace
        # does not record it), next to the traces, not among them.
        (Path(out) / f"{run}.rank{rank}.cpuwait.json").write_text(json.dumps(
            {"run_queue_ms_per_step": (run_queue_s() - queued) * 1e3 / STEPS}))
        torch.distributed.barrier()
