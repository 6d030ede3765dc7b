"""AdamW/LAMB construction, LAMB against a hand-written reference and under TP=2, and the LR schedule."""
from __future__ import annotations

import itertools
import math

import pytest
import torch

from megatronapp.config import ConfigError, TrainConfig
from megatronapp.launch import spawn
from megatronapp.train.optim import LAMB, build_optimizer, lr_at, set_lr


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.LayerNorm(5), torch.nn.Linear(5, 3))


def _grads(params: list[torch.Tensor], step: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(p.shape, generator=g) for p in params]


def reference_lamb(params: list[torch.Tensor], grads_per_step: list[list[torch.Tensor]], decays: list[float],
                   lr: float, b1: float, b2: float, eps: float) -> list[torch.Tensor]:
    """LAMB written out from the paper (You et al. 2019, Algorithm 2, with Adam bias correction), in float64."""
    w = [p.detach().double().clone() for p in params]
    m = [torch.zeros_like(x) for x in w]
    v = [torch.zeros_like(x) for x in w]
    for t, grads in enumerate(grads_per_step, start=1):
        for i, g in enumerate(grads):
            g = g.double()
            m[i] = b1 * m[i] + (1 - b1) * g
            v[i] = b2 * v[i] + (1 - b2) * g * g
            r = (m[i] / (1 - b1 ** t)) / ((v[i] / (1 - b2 ** t)).sqrt() + eps) + decays[i] * w[i]
            wn, rn = math.sqrt(float((w[i] ** 2).sum())), math.sqrt(float((r ** 2).sum()))
            trust = wn / rn if wn > 0 and rn > 0 else 1.0
            w[i] = w[i] - lr * trust * r
    return w


def test_lamb_matches_reference():
    model = _model()
    with torch.no_grad():
        model[1].bias.zero_()  # a zero-norm parameter takes trust ratio 1
    tcfg = TrainConfig(optimizer="lamb", lr=0.02, weight_decay=0.1, beta1=0.9, beta2=0.99, eps=1e-6)
    params = list(model.parameters())
    start = [p.detach().clone() for p in params]
    opt = build_optimizer(params, tcfg)
    assert isinstance(opt, LAMB)
    grads = [_grads(params, s) for s in range(4)]
    for s in range(4):
        for p, g in zip(params, grads[s]):
            p.grad = g.clone()
        opt.step()
    decays = [0.1 if p.dim() >= 2 else 0.0 for p in params]
    expected = reference_lamb(start, grads, decays, 0.02, 0.9, 0.99, 1e-6)
    for p, e in zip(params, expected):
        torch.testing.assert_close(p.detach().double(), e, rtol=1e-5, atol=1e-6)


def test_adamw_groups_skip_decay_on_one_dimensional_params():
    model = _model()
    tcfg = TrainConfig(optimizer="adamw", lr=0.1, weight_decay=0.5)
    opt = build_optimizer(model.parameters(), tcfg)
    assert isinstance(opt, torch.optim.AdamW)
    by_decay = {g["weight_decay"]: g["params"] for g in opt.param_groups}
    assert {p.dim() for p in by_decay[0.5]} == {2} and {p.dim() for p in by_decay[0.0]} == {1}
    assert sum(len(g["params"]) for g in opt.param_groups) == len(list(model.parameters()))
    # Behaviour, not just bookkeeping: with zero gradients only decayed parameters move.
    before = [p.detach().clone() for p in model.parameters()]
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    for p, b in zip(model.parameters(), before):
        if p.dim() >= 2:
            torch.testing.assert_close(p.detach(), b * (1 - 0.1 * 0.5))
        else:
            assert torch.equal(p.detach(), b)


def test_lamb_decay_groups_and_frozen_params():
    model = _model()
    model[0].bias.requires_grad_(False)
    opt = build_optimizer(model.parameters(), TrainConfig(optimizer="lamb", weight_decay=0.2))
    params = [p for g in opt.param_groups for p in g["params"]]
    assert len(params) == 5 and all(p is not model[0].bias for p in params)
    assert all((g["weight_decay"] == 0.2) == (g["params"][0].dim() >= 2) for g in opt.param_groups)


def test_build_optimizer_rejects_unknown_and_empty():
    with pytest.raises(ConfigError, match="train.optimizer='sgd'"):
        build_optimizer(_model().parameters(), TrainConfig(optimizer="sgd"))
    with pytest.raises(ValueError, match="no trainable parameters"):
        build_optimizer([torch.nn.Parameter(torch.ones(2), requires_grad=False)], TrainConfig())


# ---------------------------------------------------------------- LAMB under tensor parallelism


def _tp_lamb_worker(rank: int, world: int) -> None:
    from megatronapp.parallel import comm, topology

    topo = topology.build(tp=2, pp=1, dp=1)
    torch.manual_seed(0)
    col = torch.randn(8, 4)  # column-parallel weight: rows split over TP
    row = torch.randn(3, 8)  # row-parallel weight: columns split over TP
    norm = torch.randn(3)  # replicated on both ranks
    fulls = [col, row, norm]
    grads = [[torch.randn(p.shape) for p in fulls] for _ in range(3)]

    def shard(t: torch.Tensor, i: int) -> torch.Tensor:
        if i == 2:
            return t.clone()
        return t.chunk(2, dim=i)[rank].clone()

    tcfg = TrainConfig(optimizer="lamb", lr=0.05, weight_decay=0.1, eps=1e-6)
    full_params = [torch.nn.Parameter(p.clone()) for p in fulls]
    shards = [torch.nn.Parameter(shard(p, i)) for i, p in enumerate(fulls)]
    shards[0].tensor_parallel = shards[1].tensor_parallel = True
    naive = [torch.nn.Parameter(s.detach().clone()) for s in shards]
    opt_full, opt_tp = build_optimizer(full_params, tcfg), build_optimizer(shards, tcfg, topo.tp_group)
    opt_naive = build_optimizer(naive, tcfg)  # shards treated as whole parameters: the bug TP must avoid

    ops: list = []
    comm.add_interceptor(ops.append)
    for s in range(3):
        for i in range(3):
            full_params[i].grad = grads[s][i].clone()
            shards[i].grad = shard(grads[s][i], i)
            naive[i].grad = shard(grads[s][i], i)
        opt_full.step()
        opt_tp.step()
        opt_naive.step()
    comm.remove_interceptor(ops.append)
    assert [op.name for op in ops] == ["all_reduce"] * 3, f"expected one batched all-reduce per step, got {ops}"

    for i in range(3):
        torch.testing.assert_close(shards[i].detach(), shard(full_params[i].detach(), i), rtol=1e-5, atol=1e-6)
    assert not torch.allclose(naive[0].detach(), shards[0].detach(), rtol=1e-5, atol=1e-6), \
        "local norms of shards gave the right answer: the test cannot tell TP LAMB from plain LAMB"


def test_lamb_tensor_parallel_equals_unsharded():
    spawn(_tp_lamb_worker, 2)


# ---------------------------------------------------------------- schedule


def test_lr_schedule_warmup_then_cosine():
    t = TrainConfig(lr=1.0, min_lr=0.1, warmup_steps=4, steps=24)
    lrs = [lr_at(s, t) for s in range(30)]
    assert lrs[:4] == pytest.approx([0.25, 0.5, 0.75, 1.0])  # a line from 0, peak at the last warmup step
    assert lrs[23] == pytest.approx(0.1) and lrs[29] == pytest.approx(0.1)
    assert lrs[13] == pytest.approx(0.55)  # half-way through the 20 decay steps: mean of lr and min_lr
    decay = lrs[3:24]
    assert all(a > b for a, b in itertools.pairwise(decay))
    assert lr_at(0, TrainConfig(lr=2.0, min_lr=0.0, warmup_steps=0, steps=10)) == pytest.approx(
        0.5 * 2.0 * (1 + math.cos(math.pi / 10)))
    assert lr_at(7, TrainConfig(lr=1.0, min_lr=0.1, warmup_steps=10, steps=5)) == pytest.approx(0.8)


def test_set_lr_sets_every_group():
    opt = build_optimizer(_model().parameters(), TrainConfig(lr=1.0))
    set_lr(opt, 0.125)
    assert [g["lr"] for g in opt.param_groups] == [0.125, 0.125]
