"""Normalisation layers: LayerNorm (GPT-2) and RMSNorm (Llama, computed in fp32 like Hugging Face)."""
from __future__ import annotations

import torch
from torch import nn

from megatronapp.config import ModelConfig


class RMSNorm(nn.Module):
    """x / rms(x) * weight, with the statistics in fp32 whatever the input dtype."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


def make_norm(cfg: ModelConfig) -> nn.Module:
    """The norm of the model family: LayerNorm (bias per cfg.bias) for gpt2, RMSNorm for llama."""
    if cfg.family == "gpt2":
        return nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps, bias=bool(cfg.bias))
    return RMSNorm(cfg.hidden_size, eps=cfg.norm_eps)


def is_norm(module: nn.Module) -> bool:
    """True for the norm layers this package builds (their weights start at one, biases at zero)."""
    return isinstance(module, (nn.LayerNorm, RMSNorm))
