"""The unguarded optimizers (megatronapp/eager_optim.py): torch's arithmetic and state, without torch._dynamo."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import torch

from megatronapp.eager_optim import AdamW


def _params(seed: int) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(6, 4, generator=g)), torch.nn.Parameter(torch.randn(4, generator=g))]


def _groups(ps: list[torch.nn.Parameter]) -> list[dict]:
    return [{"params": ps[:1], "weight_decay": 0.1}, {"params": ps[1:], "weight_decay": 0.0}]


def _train(opt: torch.optim.Optimizer, ps: list[torch.nn.Parameter], steps: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for p in ps:
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()
        opt.zero_grad()


def test_adamw_updates_and_state_equal_torchs_bit_for_bit_and_checkpoints_cross_load():
    ours, theirs = _params(0), _params(0)
    a = AdamW(_groups(ours), lr=1e-2, betas=(0.9, 0.95), eps=1e-8)
    b = torch.optim.AdamW(_groups(theirs), lr=1e-2, betas=(0.9, 0.95), eps=1e-8)
    _train(a, ours, 4, seed=1)
    _train(b, theirs, 4, seed=1)
    assert all(torch.equal(p, q) for p, q in zip(ours, theirs))
    assert all(p.grad is None for p in ours)  # zero_grad(set_to_none=True), as torch's
    sa, sb = a.state_dict(), b.state_dict()
    assert sa["param_groups"] == sb["param_groups"]
    for i in sb["state"]:
        assert sa["state"][i].keys() == sb["state"][i].keys()
        assert all(torch.equal(sa["state"][i][k], sb["state"][i][k]) for k in sb["state"][i])
    # A checkpoint written with torch's AdamW (older runs) resumes into ours and vice versa, same next steps.
    a2, b2 = AdamW(_groups(ours), lr=1e-2), torch.optim.AdamW(_groups(theirs), lr=1e-2)
    a2.load_state_dict(sb)
    b2.load_state_dict(sa)
    _train(a2, ours, 2, seed=2)
    _train(b2, theirs, 2, seed=2)
    assert all(torch.equal(p, q) for p, q in zip(ours, theirs))


def test_a_training_rank_never_imports_the_compiler_stack():
    """A rank trains with AdamW and with LAMB (ZeRO-1's sharded optimizers use the same classes), saves and loads
    optimizer state, and never imports torch._dynamo (1.6 CPU-s per process). A torch release that drops
    `__wrapped__` makes this fail, not the training."""
    code = textwrap.dedent("""
        import sys
        from tests import engine_cases as ec
        for opt in ("adamw", "lamb"):
            ec.run_case(ec.base_case("gpt2", **{"train.optimizer": opt}), 0)
        import torch
        from megatronapp.eager_optim import AdamW
        p = torch.nn.Parameter(torch.ones(3))
        o = AdamW([p])
        o.load_state_dict(o.state_dict())
        print("dynamo imported:", "torch._dynamo" in sys.modules)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "dynamo imported: False" in out.stdout, out.stdout + out.stderr[-2000:]
