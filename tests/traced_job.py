"""The MegaScan test job: 4 ranks (tp=2 x dp=2) trace 12 iterations of compute, TP and DP collectives and P2P
with injected clock errors, so the tracer, aggregate, align and rank-summary tests read one real recording
(launched once per session by the `traced_job` fixture of tests/conftest.py)."""
from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import torch

from megatronapp import tracing
from megatronapp.config import RunConfig
from megatronapp.launch import spawn

# Injected clock errors of the traced job: rank r reads true + SKEW[r] + DRIFT[r] * (true - T0).
SKEW_NS = {0: 0, 1: 50_000_000, 2: -50_000_000, 3: 30_000_000}
DRIFT = {0: 0.0, 1: 1e-3, 2: -1.5e-3, 3: 5e-4}
STEPS = 12  # iterations run; traced: the last 3 of every 4 (i % 4 >= 1)
TRACED = [i for i in range(STEPS) if i % 4 >= 1]


def _job(rank: int, world: int, out: str, t0: int) -> None:
    from megatronapp.parallel import comm
    from megatronapp.parallel.topology import build
    from megatronapp.scan.record.tracer import attach

    def clock() -> int:
        true = time.monotonic_ns()
        return true + SKEW_NS[rank] + int(DRIFT[rank] * (true - t0))

    topo = build(tp=2, pp=1, dp=2)
    cfg = RunConfig()
    cfg.trace.enabled, cfg.trace.interval, cfg.trace.iterations, cfg.trace.granularity = True, 4, 3, "full"
    tracer = attach(cfg, topo, out, clock=clock)
    rng = np.random.default_rng(rank)
    x = torch.randn(64, 64)
    peer = topo.rank_at(1 - topo.coord.dp, 0, topo.coord.tp)  # the other DP replica
    for it in [*range(STEPS), 2]:  # iteration 2 again: must not be traced twice
        with tracing.step(it):
            with tracing.span("data", "data"):
                time.sleep(rng.uniform(0.001, 0.01))  # ranks arrive at collectives at different times
            for mb in range(2):
                with tracing.span("forward", "compute", chunk=0, microbatch=mb):
                    for layer in range(2):
                        with tracing.span(f"layers.{layer}", "layer"):
                            x = torch.tanh(x @ x) * 0.5
                    comm.all_reduce(x, topo.tp_group)
                buf = torch.empty_like(x)
                if topo.coord.dp == 0:  # P2P both ways between the replicas
                    comm.send(x, peer, topo.dp_group)
                    comm.recv(buf, peer, topo.dp_group)
                else:
                    comm.recv(buf, peer, topo.dp_group)
                    comm.send(x, peer, topo.dp_group)
                with tracing.span("backward", "compute", chunk=0, microbatch=mb):
                    time.sleep(rng.uniform(0.002, 0.02))
            h = comm.all_reduce_async(x, topo.dp_group)
            h.wait()
            with tracing.span("optimizer", "optimizer"):
                comm.all_reduce(torch.ones(1), topo.groups["world"])
                for k in range(16):  # small syncs (loss, grad norm, found-inf): more clock anchors
                    comm.all_reduce(torch.ones(1), topo.tp_group if k % 2 else topo.dp_group)
        # Outside any step: not in a window, not recorded.
        with tracing.span("forward", "compute"):
            pass
    tracer.close()
    assert not tracing.enabled()


def launch(out: Path) -> int:
    """Run the job, its traces written to `out`; the T0 of the injected drift."""
    t0 = time.monotonic_ns()
    spawn(_job, 4, str(out), t0)
    return t0
