"""Optimizers (AdamW, LAMB) and the learning-rate schedule (linear warmup, cosine decay).

Weight decay skips 1-D parameters (biases, norm gains), as in GPT-2/Megatron. LAMB scales each parameter's
Adam update by ||w|| / ||update||; under tensor parallelism a parameter marked `tensor_parallel = True` is a
shard, so its norms are summed over the TP group (one batched all-reduce per step) to get the norm of the
whole parameter, and every shard takes the same trust ratio as the unsharded run.
"""
from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from megatronapp.config import ConfigError, TrainConfig
from megatronapp.eager_optim import AdamW, Eager
from megatronapp.parallel import comm
from megatronapp.parallel.topology import Group


def param_groups(params: Iterable[torch.nn.Parameter], weight_decay: float) -> list[dict]:
    """Two groups: matrices and embeddings decay, 1-D parameters (biases, norms) do not."""
    decay, no_decay = [], []
    for p in params:
        if not p.requires_grad:
            continue
        (decay if p.dim() >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    groups = [g for g in groups if g["params"]]
    if not groups:
        raise ValueError("the optimizer got no trainable parameters (none has requires_grad=True)")
    return groups


class LAMB(Eager, torch.optim.Optimizer):
    """Layer-wise adaptive moments (You et al., 2019) with bias correction and decoupled decay in the update."""

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-6, weight_decay: float = 0.0, tp_group: Group | None = None):
        if lr < 0 or eps < 0 or not (0 <= betas[0] < 1 and 0 <= betas[1] < 1):
            raise ValueError(f"invalid LAMB hyper-parameters lr={lr} betas={betas} eps={eps}")
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})
        self.tp_group = tp_group

    def _is_shard(self, p: torch.Tensor) -> bool:
        return self.tp_group is not None and self.tp_group.size > 1 and getattr(p, "tensor_parallel", False)

    @torch.no_grad()
    def step(self, closure=None):  # torch's signature
        """One LAMB update of every parameter that has a gradient."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # Adam moments and the raw update of every parameter, with squared norms collected for one reduction.
        entries: list[tuple[torch.Tensor, torch.Tensor, float]] = []
        sq_norms: list[torch.Tensor] = []
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("LAMB does not support sparse gradients")
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"] += 1
                t = state["step"]
                m, v = state["exp_avg"], state["exp_avg_sq"]
                g = p.grad.to(m.dtype)
                m.mul_(beta1).add_(g, alpha=1 - beta1)
                v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
                m_hat = m / (1 - beta1 ** t)
                v_hat = v / (1 - beta2 ** t)
                update = m_hat / (v_hat.sqrt() + group["eps"])
                if group["weight_decay"]:
                    update.add_(p.to(update.dtype), alpha=group["weight_decay"])
                entries.append((p, update, group["lr"]))
                sq_norms.append(torch.stack([p.detach().float().pow(2).sum(), update.float().pow(2).sum()]))
        if not entries:
            return loss
        norms = torch.stack(sq_norms)  # [n_params, 2]: ||w||^2, ||update||^2
        is_shard = [self._is_shard(p) for p, _, _ in entries]
        if any(is_shard):
            # One collective for all shards: replicated parameters contribute zeros and keep their local norms.
            shard = torch.tensor(is_shard, device=norms.device)
            summed = comm.all_reduce(norms * shard[:, None], self.tp_group)
            norms = torch.where(shard[:, None], summed, norms)
        norms = norms.sqrt()
        w_norm, u_norm = norms[:, 0], norms[:, 1]
        # Trust ratio 1 where either norm is zero (fresh zero-initialised params, zero updates).
        trust = torch.where((w_norm > 0) & (u_norm > 0), w_norm / u_norm.clamp_min(1e-30), torch.ones_like(w_norm))
        for i, (p, update, lr) in enumerate(entries):
            # A 0-dim tensor factor keeps the step free of device-to-host syncs on GPU.
            p.add_((update * trust[i]).to(p.dtype), alpha=-lr)
        return loss


def build_optimizer(params: Iterable[torch.nn.Parameter], tcfg: TrainConfig,
                    tp_group: Group | None = None) -> torch.optim.Optimizer:
    """AdamW (torch's, unguarded: eager_optim.py) or LAMB as `tcfg.optimizer` says; no decay on 1-D parameters."""
    groups = param_groups(params, tcfg.weight_decay)
    betas = (tcfg.beta1, tcfg.beta2)
    if tcfg.optimizer == "adamw":
        return AdamW(groups, lr=tcfg.lr, betas=betas, eps=tcfg.eps)
    if tcfg.optimizer == "lamb":
        return LAMB(groups, lr=tcfg.lr, betas=betas, eps=tcfg.eps, tp_group=tp_group)
    raise ConfigError(f"train.optimizer={tcfg.optimizer!r}: choose adamw or lamb")


def lr_at(step: int, tcfg: TrainConfig) -> float:
    """Learning rate of the optimizer step with 0-based index `step`.

    Megatron's convention: step i uses progress s = i + 1, so the first step gets lr/warmup_steps (a line from
    0), step warmup_steps-1 the peak lr, then cosine decay reaches min_lr at the last step (steps-1) and stays.
    """
    s = step + 1
    warmup = max(0, tcfg.warmup_steps)
    if warmup and s <= warmup:
        return tcfg.lr * s / warmup
    decay_steps = tcfg.steps - warmup
    if decay_steps <= 0:
        return tcfg.lr
    progress = min(1.0, (s - warmup) / decay_steps)
    return tcfg.min_lr + 0.5 * (tcfg.lr - tcfg.min_lr) * (1.0 + math.cos(math.pi * progress))


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Set the learning rate of every parameter group."""
    for group in optimizer.param_groups:
        group["lr"] = lr
