"""MegaScan on plain PyTorch jobs (no engine): FSDP2 and DDP traced through `scan.instrument()` in real 2-rank gloo
runs, a slow rank injected and named by `scan.detect`, a healthy run quiet, training results bit for bit unchanged.

Each launch runs three trainings of the same seeded model in the same processes: without instrumentation, traced
and healthy, traced with rank 1 slowed (each layer's forward and backward work done SLOW times, the extra results
thrown away: real compute, slow in every kind of op as on a slow device, and the same parameters). Two ranks of
one stage: detection rests on the two-peer rule (op floors, docs/megascan.md "Real runs"), so the drill is 3x, far
above a busy 2-core machine's noise (healthy ranks reach 1.3-2.6x on ONE kind of op there, which the every-kind
rule rejects); the assertions are about WHO, never timings. Module spans: `forward` and `backward` of the model.
"""
from __future__ import annotations

import functools
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch

from megatronapp.launch import spawn
from megatronapp.scan.detect import detect
from megatronapp.scan.format import read_dir

STEPS = 8
MICROBATCHES = 4  # forwards and backwards per step: repeats for the op floors
SLOW = 3  # the slow rank's forward costs this many forwards


class _Burn(torch.autograd.Function):
    """Identity whose forward and backward each redo a layer's work `times` more times (results thrown away):
    a rank with slow compute, its outputs and gradients bit for bit those of a healthy rank."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, times: int) -> torch.Tensor:  # noqa: ANN001
        ctx.save_for_backward(x, w)
        ctx.times = times
        for _ in range(times):
            torch.nn.functional.linear(x, w).relu()
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple:  # noqa: ANN001
        x, w = ctx.saved_tensors
        for _ in range(ctx.times):  # a layer's backward: two matmuls
            grad @ w
            grad.t() @ x
        return grad, None, None


class _Block(torch.nn.Module):
    """A layer whose forward and backward can be made `repeat` times as expensive without changing results."""

    def __init__(self, width: int):
        super().__init__()
        self.lin = torch.nn.Linear(width, width)
        self.repeat = 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.repeat > 1:  # the drill
            w = self.lin.weight
            x = _Burn.apply(x, w.detach().clone(), self.repeat - 1)  # FSDP2 frees w after forward
        return self.lin(x).relu()


def _model(width: int = 256, depth: int = 3) -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[_Block(width) for _ in range(depth)])


def _train(model: torch.nn.Module, rank: int, step: object) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(1000 + rank)  # each DP rank its own data, the same in every training
    for _ in range(STEPS):
        with step():
            for _ in range(MICROBATCHES):
                model(torch.randn(384, 256, generator=gen)).square().mean().backward()
            opt.step()
            opt.zero_grad()


def _job(rank: int, world: int, out: str, kind: str) -> None:
    import contextlib

    from megatronapp import scan

    torch.set_num_threads(1)

    def build() -> torch.nn.Module:
        m = _model()
        if kind == "fsdp":
            from torch.distributed.fsdp import fully_shard

            for block in m:
                fully_shard(block)
            return fully_shard(m)
        from torch.nn.parallel import DistributedDataParallel as DDP

        return DDP(m)

    def full_params(m: torch.nn.Module) -> list[torch.Tensor]:
        return [(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone() for p in m.parameters()]

    plain = build()
    _train(plain, rank, contextlib.nullcontext)
    results = {"plain": full_params(plain)}
    for run in ("healthy", "slow"):
        m = build()
        inner = m.module if kind == "ddp" else m
        if run == "slow" and rank == 1:
            for block in inner:
                block.repeat = SLOW
        scan.instrument(Path(out) / run, modules={"forward": inner})
        if kind == "ddp":
            scan.trace_ddp(m)
        _train(m, rank, scan.step)
        scan.uninstrument()
        results[run] = full_params(m)
    torch.save(results, Path(out) / f"params{rank}.pt")


@functools.lru_cache(maxsize=2)
def _launched(kind: str) -> Path:
    out = Path(tempfile.mkdtemp(prefix=f"megascan-{kind}-"))
    spawn(_job, 2, str(out), kind)
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
    assert healthy.findings == [], healthy.to_text()
    slow = detect(read_dir(out / "slow")[0])
    assert slow.findings, slow.to_text()
    top = slow.findings[0]
    assert top.kind == "slow-compute" and top.ranks == (1,), slow.to_text()
