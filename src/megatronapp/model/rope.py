"""Rotary position embeddings in Hugging Face's rotate-half convention (so HF Llama weights load unchanged)."""
from __future__ import annotations

import torch


def inv_frequencies(head_dim: int, theta: float) -> torch.Tensor:
    """1 / theta^(2i/d) for i < d/2, computed exactly as Hugging Face does."""
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))


def rope_tables(inv_freq: torch.Tensor, start: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [length, head_dim] for absolute positions start .. start+length-1."""
    positions = torch.arange(start, start + length, device=inv_freq.device, dtype=torch.float32)
    freqs = torch.outer(positions, inv_freq.float())
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [b, heads, s, d] by the tables [s, d]."""
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return x * cos + rotate_half(x) * sin
