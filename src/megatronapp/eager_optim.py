"""torch.optim without the torch.compile stack: the optimizers this project builds, minus 1.6 CPU-s per rank.

torch.optim wraps `Optimizer.add_param_group`, `zero_grad`, `state_dict`, `load_state_dict` and every
optimizer's `step` in guards that keep torch.compile out of them (`torch._disable_dynamo`,
`_use_grad_for_differentiable`); the guards import `torch._dynamo` on first call, which pulls in the compiler
stack and sympy: about 1.6 CPU-s per process on this project's CPUs (`python -c "import torch, torch._dynamo"`
against `import torch`), ~40% of a rank's start-up before its first step. Nothing here is compiled, so the
optimizers call the functions those guards wrap (`__wrapped__`, kept by `functools.wraps`). `step` keeps the one
thing its guard does outside compilation: it runs without autograd recording (our optimizers are not
differentiable). Where a torch release no longer exposes `__wrapped__`, the guarded method is used as it is:
slower to start, same results. `tests/test_eager_optim.py` checks both the results (bit-equal to torch's AdamW)
and that a training rank never imports `torch._dynamo`.
"""
from __future__ import annotations

import functools
import inspect
from collections.abc import Callable

import torch

_GUARDED = ("add_param_group", "zero_grad", "state_dict", "load_state_dict")


def unguarded(fn: Callable) -> Callable:
    """The function under torch's compile guards (and under the step-hook wrapper `Optimizer` adds itself)."""
    return inspect.unwrap(fn)


def eager_step(step: Callable) -> Callable:
    """`step` without its compile guard, run as the guard runs it outside compilation: without autograd."""
    raw = unguarded(step)

    @functools.wraps(raw)
    def run(self, *args, **kwargs):
        with torch.no_grad():
            return raw(self, *args, **kwargs)
    return run


class Eager:
    """Mixin, listed before a `torch.optim.Optimizer` subclass: the guarded base methods, unguarded."""


for _name in _GUARDED:
    setattr(Eager, _name, unguarded(getattr(torch.optim.Optimizer, _name)))


class AdamW(Eager, torch.optim.AdamW):
    """torch's AdamW (same arithmetic, same state_dict), without importing the compiler stack."""

    step = eager_step(torch.optim.AdamW.step)
