"""A plain PyTorch job (no engine) traced through `scan.instrument()`: FSDP2 or DDP on 2 gloo ranks, optionally
with a slow rank. Shared by tests/test_scan_anyjob.py (results unchanged, collectives traced, slow rank named) and
benchmarks/bench_scan_real.py (the same verdicts over repeats in fresh processes).

The drill: the slow rank's every layer redoes its forward and backward work SLOW - 1 more times, the extra results
thrown away: real compute, slow in every kind of op as on a slow device, and the same parameters. Two ranks of
one stage: detection rests on the two-peer rule (op floors, docs/megascan.md "Real runs"), so the drill is 3x,
far above a busy 2-core machine's noise (healthy ranks reach 1.3-2.6x on ONE kind of op there, which the
every-kind rule rejects). Module spans: `forward` and `backward` of the model.
"""
from __future__ import annotations

import contextlib
from pathlib import Path

import torch

STEPS = 8
MICROBATCHES = 4  # forwards and backwards per step: repeats for the op floors
SLOW = 3  # the slow rank's forward costs this many forwards
SLOW_RANK = 1
RUNS = ("plain", "healthy", "slow")  # plain: untraced, the reference for bit-identical results


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


def _build(kind: str) -> torch.nn.Module:
    m = _model()
    if kind == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for block in m:
            fully_shard(block)
        return fully_shard(m)
    if kind == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        return DDP(m)
    raise ValueError(f"unknown job kind {kind!r}; expected 'fsdp' or 'ddp'")


def _full_params(m: torch.nn.Module) -> list[torch.Tensor]:
    return [(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone() for p in m.parameters()]


def job(rank: int, world: int, out: str, kind: str, runs: tuple[str, ...] = RUNS, slow: int = SLOW) -> None:
    """One rank (under `megatronapp.launch.spawn`): train the same seeded model once per entry of `runs`, in this
    process, rank SLOW_RANK `slow` times slower in the "slow" run; traced runs write `out/<run>/`; every run's
    final parameters go to `out/params<rank>.pt`."""
    from megatronapp import scan

    torch.set_num_threads(1)
    results = {}
    for run in runs:
        m = _build(kind)
        if run == "plain":
            _train(m, rank, contextlib.nullcontext)
        else:
            inner = m.module if kind == "ddp" else m
            if run == "slow" and rank == SLOW_RANK:
                for block in inner:
                    block.repeat = slow
            scan.instrument(Path(out) / run, modules={"forward": inner})
            if kind == "ddp":
                scan.trace_ddp(m)
            _train(m, rank, scan.step)
            scan.uninstrument()
        results[run] = _full_params(m)
    torch.save(results, Path(out) / f"params{rank}.pt")
