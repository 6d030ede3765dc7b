"""Split backward for zero-bubble pipelines: B computes input gradients now, W computes weight gradients later.

A pipeline stage's backward has two parts: the gradient with respect to its input, which the previous stage
waits for (B), and the gradients with respect to its weights, which nobody waits for (W). Zero-bubble schedules
(Qi et al., 2024) run B as early as possible and W in what would otherwise be bubbles.

The linear layers (column- and row-parallel, so every GEMM of attention and MLP, with or without sequence
parallelism) go through `linear()`. When split mode is on, its backward returns the input gradient at once and,
inside a `defer()` block, files the weight-gradient work as the two tensors it needs (the layer's input as the
GEMM saw it, e.g. all-gathered under sequence parallelism, and the output gradient): compact, no closures and no
autograd graph kept alive. `run()` later computes dW = g^T x (and db = sum g) and accumulates it into `.grad`,
which may be a view into a data-parallel gradient buffer. Outside a `defer()` block the same backward computes
everything at once, so a forward built in split mode can also be back-propagated normally. Other parameters
(norms, embeddings, biases of non-linear ops) get their gradients in B: they are a small share of the work.

With split mode off, `linear()` is `F.linear`: no cost on the ordinary path.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

_split = False  # set by the executor of a schedule with W tasks
_pending: list[_Deferred] | None = None  # the W work being collected by the current B


@dataclass
class _Deferred:
    weights: tuple[torch.nn.Parameter, ...]  # stacked along the output dim: one GEMM (e.g. SwiGLU's gate and up)
    biases: tuple[torch.nn.Parameter, ...] | None
    x: torch.Tensor  # [..., in]
    g: torch.Tensor  # [..., out]


@dataclass
class WeightWork:
    """The deferred weight gradients of one B task (one chunk, one microbatch)."""

    items: list[_Deferred] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        """Memory held until the W task runs."""
        return sum(d.x.numel() * d.x.element_size() + d.g.numel() * d.g.element_size() for d in self.items)


def set_split(on: bool) -> None:
    """Turn split mode on (layers record deferrable work) or off (plain F.linear)."""
    global _split
    _split = on


def split_enabled() -> bool:
    return _split


class _StackedLinear(torch.autograd.Function):
    """y = x [W_1; W_2; ...]^T + [b_1; b_2; ...]: one GEMM over weights stacked along the output dim. Saves the
    weights themselves, not their concatenation (which would hold a copy of them per microbatch in flight)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, n: int, *params: torch.Tensor) -> torch.Tensor:
        weights, biases = params[:n], params[n:] or None
        ctx.save_for_backward(x, *weights)
        ctx.params = (weights, biases)
        return F.linear(x, cat_rows(weights), None if biases is None else cat_rows(biases))

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        x, *weights = ctx.saved_tensors
        grad_x = g.matmul(cat_rows(weights).to(g.dtype)) if ctx.needs_input_grad[0] else None
        return (grad_x, None, *weight_grads(*ctx.params, x, g))


def cat_rows(ts: tuple[torch.Tensor, ...] | list[torch.Tensor]) -> torch.Tensor:
    """Weights (or biases) stacked along the output dim; the tensor itself when there is one."""
    return ts[0] if len(ts) == 1 else torch.cat(ts)


def weight_grads(weights: tuple[torch.nn.Parameter, ...], biases: tuple[torch.nn.Parameter, ...] | None,
                 x: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    """The gradients of a linear layer's weights (then biases), stacked along the output dim, for autograd to
    accumulate; or, inside a B task's `defer()` block, Nones, the work being filed for its W task."""
    if _pending is not None:
        _pending.append(_Deferred(tuple(weights), None if biases is None else tuple(biases), x.detach(), g.detach()))
        return (None,) * (len(weights) + (len(biases) if biases is not None else 0))
    gw, gb = _weight_grads(x, g, biases is not None)
    rows = [w.shape[0] for w in weights]
    out = [d.to(w.dtype) for d, w in zip(gw.split(rows), weights)]
    if biases is not None:
        out += list(gb.split(rows))
    return tuple(out)


def _weight_grads(x: torch.Tensor, g: torch.Tensor, has_bias: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    g2, x2 = g.reshape(-1, g.shape[-1]), x.reshape(-1, x.shape[-1]).to(g.dtype)
    return g2.t().matmul(x2), (g2.sum(0) if has_bias else None)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, with a backward that can defer its weight gradient in split mode."""
    if not _split or not torch.is_grad_enabled():
        return F.linear(x, weight, bias)
    # Under autocast the forward's F.linear runs in the autocast dtype; the backward casts to the output
    # gradient's dtype, as autocast's own backward GEMMs do.
    return _StackedLinear.apply(x, 1, weight, *(() if bias is None else (bias,)))


def linear_stacked(x: torch.Tensor, weights: tuple[torch.Tensor, ...],
                   biases: tuple[torch.Tensor, ...] | None = None) -> torch.Tensor:
    """One GEMM of `x` with weights stacked along the output dim: the outputs side by side, [..., sum of outs]."""
    if len(weights) == 1:
        return linear(x, weights[0], None if biases is None else biases[0])
    if not torch.is_grad_enabled():
        return F.linear(x, cat_rows(weights), None if biases is None else cat_rows(biases))
    return _StackedLinear.apply(x, len(weights), *weights, *(biases or ()))


@contextmanager
def defer():
    """Collect the weight-gradient work of the backward run inside this block (a B task)."""
    global _pending
    work, outer = WeightWork(), _pending
    _pending = work.items
    try:
        yield work
    finally:
        _pending = outer


def run(work: WeightWork) -> None:
    """The W task: compute the deferred weight gradients and accumulate them into `.grad`."""
    for d in work.items:
        gw, gb = _weight_grads(d.x, d.g, d.biases is not None)
        rows = [w.shape[0] for w in d.weights]
        for w, part in zip(d.weights, gw.split(rows)):
            _accumulate(w, part)
        for b, part in zip(d.biases or (), gb.split(rows) if gb is not None else ()):
            _accumulate(b, part)
    work.items.clear()


def _accumulate(p: torch.nn.Parameter, grad: torch.Tensor) -> None:
    grad = grad.to(p.dtype) if p.grad is None else grad.to(p.grad.dtype)
    if p.grad is None:
        p.grad = grad.reshape(p.shape).clone()
    else:
        p.grad.add_(grad.reshape(p.shape))
