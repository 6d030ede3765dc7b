"""Split-independent initialisation: each full weight comes from a generator seeded by (seed, parameter name).

A rank generates the full tensor of each of its parameters and keeps its own TP slice, so any tp/pp/vpp split
holds exactly the weights of the one-process model.
"""
from __future__ import annotations

import hashlib
import math

import torch
from torch import nn

from megatronapp.config import ModelConfig
from megatronapp.model.norms import is_norm
from megatronapp.parallel.tensor_parallel import shard, tp_size
from megatronapp.parallel.topology import Group

# Output projections of residual branches get std / sqrt(2 * num_layers) (GPT-2, Megatron).
_RESIDUAL_OUTPUTS = ("attn.proj.weight", "mlp.fc2.weight", "mlp.down.weight")


def param_seed(seed: int, name: str) -> int:
    """A stable 63-bit seed for one parameter (Python's hash() is salted per process, so not that)."""
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def full_shape(p: nn.Parameter, group: Group | None) -> tuple[int, ...]:
    """Shape of the unsharded tensor behind a (possibly TP-sharded) parameter."""
    shape = list(p.shape)
    if getattr(p, "tensor_parallel", False):
        shape[p.partition_dim] *= tp_size(group)
    return tuple(shape)


def full_init(name: str, shape: tuple[int, ...], cfg: ModelConfig, seed: int, is_norm_weight: bool) -> torch.Tensor:
    """The full initial value of parameter `name` (fp32, CPU)."""
    if name.endswith(".bias"):
        return torch.zeros(shape)
    if is_norm_weight:
        return torch.ones(shape)
    std = cfg.init_std
    if name.endswith(_RESIDUAL_OUTPUTS):
        std = std / math.sqrt(2.0 * cfg.num_layers)
    gen = torch.Generator().manual_seed(param_seed(seed, name))
    return torch.randn(shape, generator=gen) * std


def reset_parameters(module: nn.Module, cfg: ModelConfig, seed: int, tp_group: Group | None,
                     init_name=lambda name: name) -> None:
    """Initialise every parameter of `module` from its full tensor; `init_name` maps a parameter to the name
    that seeds it (a tied embedding copy is seeded like the embedding it copies)."""
    norm_weights = {id(m.weight) for m in module.modules() if is_norm(m)}
    with torch.no_grad():
        for name, p in module.named_parameters():
            full = full_init(init_name(name), full_shape(p, tp_group), cfg, seed, id(p) in norm_weights)
            p.copy_(shard(full, p, tp_group).to(device=p.device, dtype=p.dtype))
