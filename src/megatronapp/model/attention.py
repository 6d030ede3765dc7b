"""Causal self-attention with grouped-query heads, tensor-parallel by heads, optional sliding window.

The fused qkv projection is laid out by kv-head group: for each kv head g, the rows of its
num_heads/num_kv_heads query heads, then its key head, then its value head. A contiguous TP slice of that
layout is a whole set of groups, so every rank holds matching q, k and v heads whatever the split.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from megatronapp.config import ModelConfig
from megatronapp.model.capture import Capture
from megatronapp.model.rope import apply_rope
from megatronapp.parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear, tp_size
from megatronapp.parallel.topology import Group

# Called by a layer to store this step's keys/values and get back all keys/values so far.
CacheUpdate = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_heads: int, num_kv_heads: int) -> torch.Tensor:
    """Separate q [H d, ...], k and v [Hkv d, ...] (weights or biases) -> the fused, group-ordered qkv layout."""
    g, rest = num_heads // num_kv_heads, q.shape[1:]
    d = q.shape[0] // num_heads
    parts = (q.reshape(num_kv_heads, g * d, *rest), k.reshape(num_kv_heads, d, *rest),
             v.reshape(num_kv_heads, d, *rest))
    return torch.cat(parts, dim=1).reshape((num_heads + 2 * num_kv_heads) * d, *rest)


def split_qkv(qkv: torch.Tensor, num_heads: int, num_kv_heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The inverse of `fuse_qkv`: the fused, group-ordered qkv (weight or bias) -> separate q, k and v."""
    g, rest = num_heads // num_kv_heads, qkv.shape[1:]
    d = qkv.shape[0] // (num_heads + 2 * num_kv_heads)
    x = qkv.reshape(num_kv_heads, (g + 2) * d, *rest)
    return (x[:, :g * d].reshape(num_heads * d, *rest), x[:, g * d:(g + 1) * d].reshape(num_kv_heads * d, *rest),
            x[:, (g + 1) * d:].reshape(num_kv_heads * d, *rest))


def attention_mask(q_start: int, q_len: int, k_len: int, window: int | None,
                   device: torch.device | None = None) -> torch.Tensor:
    """Boolean [q_len, k_len], True where query at absolute position q_start+i may see key j.

    Causal, and with a window w a query sees only the w most recent positions, itself included
    (Hugging Face's sliding-window convention)."""
    qpos = torch.arange(q_start, q_start + q_len, device=device).unsqueeze(1)
    kpos = torch.arange(k_len, device=device).unsqueeze(0)
    allowed = kpos <= qpos
    if window is not None:
        allowed &= (qpos - kpos) < window
    return allowed


def attention_core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_start: int,
                   window: int | None) -> torch.Tensor:
    """softmax(q k^T / sqrt(d)) v with causal (and window) masking; q [b, H, s, d], k/v [b, Hkv, t, d]."""
    gqa = q.shape[1] != k.shape[1]
    s, t = q.shape[2], k.shape[2]
    if window is None and q_start == 0 and s == t:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    mask = attention_mask(q_start, s, t, window, q.device)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)


def attention_probs(q: torch.Tensor, k: torch.Tensor, q_start: int, window: int | None) -> torch.Tensor:
    """The explicit attention probabilities [b, H, s, t] (only computed when an observer asks for them)."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    scores = (q @ k.transpose(-1, -2)).float() / (q.shape[-1] ** 0.5)
    mask = attention_mask(q_start, q.shape[2], k.shape[2], window, q.device)
    return scores.masked_fill(~mask, float("-inf")).softmax(dim=-1).to(q.dtype)


class Attention(nn.Module):
    """Self-attention of one layer: qkv (column-parallel), core, output projection (row-parallel)."""

    def __init__(self, cfg: ModelConfig, layer: int, tp_group: Group | None = None,
                 sequence_parallel: bool = False, capture: Capture | None = None, tp_comm_overlap: int = 0):
        super().__init__()
        tp = tp_size(tp_group)
        nh, nkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        if nh % nkv:
            raise ValueError(f"model.num_heads={nh} is not divisible by model.num_kv_heads={nkv}")
        if nkv % tp:
            raise ValueError(f"model.num_kv_heads={nkv} is not divisible by the tensor-parallel size {tp}")
        self.layer, self.capture = layer, capture or Capture()
        self.head_dim, self.group = d, nh // nkv
        self.local_heads, self.local_kv = nh // tp, nkv // tp
        self.window = cfg.sliding_window
        self.tp_dim = 1 if tp > 1 else None  # heads are split across TP ranks
        tpkw = {"tp_group": tp_group, "sequence_parallel": sequence_parallel, "tp_comm_overlap": tp_comm_overlap}
        self.qkv = ColumnParallelLinear(cfg.hidden_size, (nh + 2 * nkv) * d, bias=bool(cfg.bias), **tpkw)
        self.proj = RowParallelLinear(nh * d, cfg.hidden_size, bias=bool(cfg.bias), **tpkw)

    def split_qkv(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """[b, s, local (H + 2 Hkv) d] -> q [b, H, s, d], k and v [b, Hkv, s, d] (local heads)."""
        b, s, _ = qkv.shape
        g, d = self.group, self.head_dim
        qkv = qkv.view(b, s, self.local_kv, g + 2, d)
        q = qkv[:, :, :, :g].reshape(b, s, self.local_heads, d).transpose(1, 2)
        k = qkv[:, :, :, g].transpose(1, 2)
        v = qkv[:, :, :, g + 1].transpose(1, 2)
        return q, k, v

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None, start_pos: int = 0,
                cache_update: CacheUpdate | None = None, recompute_core: bool = False) -> torch.Tensor:
        q, k, v = self.split_qkv(self.qkv(x))
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        cap, name = self.capture, f"layers.{self.layer}.attn"
        if cap.active:
            q = cap.point(f"{name}.q", q, tp_dim=self.tp_dim, layer=self.layer, kind="q")
            k = cap.point(f"{name}.k", k, tp_dim=self.tp_dim, layer=self.layer, kind="k")
            v = cap.point(f"{name}.v", v, tp_dim=self.tp_dim, layer=self.layer, kind="v")
        if cache_update is not None:
            k, v = cache_update(k, v)
        if cap.wants(f"{name}.probs"):
            probs = attention_probs(q, k, start_pos, self.window)
            probs = cap.point(f"{name}.probs", probs, tp_dim=self.tp_dim, layer=self.layer, kind="probs")
            group = self.group
            out = probs @ v.repeat_interleave(group, dim=1)
        elif recompute_core:
            # Selective recompute: keep q, k, v; recompute the s x s core in backward.
            out = checkpoint(attention_core, q, k, v, start_pos, self.window, use_reentrant=False)
        else:
            out = attention_core(q, k, v, start_pos, self.window)
        b, _, s, d = out.shape
        return self.proj(out.transpose(1, 2).reshape(b, s, self.local_heads * d))
