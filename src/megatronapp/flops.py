"""One FLOP model: the parameters and FLOPs of the transformer, counted here once for MFU (`ModelConfig.num_params`
and `flops_per_token`), emulated devices (parallel/device_emulation.py) and MegaScan's stage costs
(scan/record/costmodel.py).

FLOPs are counted as PaLM (appendix B) and MegaScale count them: a weight that takes part in a matmul costs 2 FLOPs
per token in the forward, 2 in the input-gradient backward (B) and 2 in the weight-gradient backward (W): 6N per
trained token. The attention core (scores and their weighted sum) costs 4*H*Q*T per token and layer forward and
twice that in B: 12*L*H*Q*T in all, where H*Q is the attention width (num_heads*head_dim) and T the full sequence
length (PaLM's convention: causal masking is not halved). Embedding lookups (token and position) are gathers, not
matmuls: no FLOPs. The output projection (the h x V logits GEMM) is a matmul and counts once, tied to the input
embedding or not; V is the model's vocab_size, not the TP-padded one (padding is an implementation choice, not
model work). Every count here is an integer-valued float far below 2**53, so sums are exact in any order.

Below config.py (which delegates to it): a model shape is anything with ModelConfig's fields.
"""
from __future__ import annotations

from typing import Protocol

from megatronapp.partition import split_layers

OPTIMIZER_FLOPS_PER_PARAM = 12.0  # AdamW: moments, bias corrections, sqrt, divide, decay, update


class ModelShape(Protocol):
    """The fields of `config.ModelConfig` that the counts read."""

    family: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    ffn_hidden_size: int
    max_seq_len: int
    tie_embeddings: bool

    @property
    def head_dim(self) -> int: ...


def layer_weights(m: ModelShape) -> int:
    """Matmul weights of one transformer layer: QKV and output projections, and the MLP (SwiGLU: gate, up, down)."""
    h, f = m.hidden_size, m.ffn_hidden_size
    kv = m.num_kv_heads * m.head_dim
    attn = h * (h + 2 * kv) + h * h
    mlp = (3 if m.family == "llama" else 2) * h * f
    return attn + mlp


def output_weights(m: ModelShape) -> int:
    """Weights of the output projection (h x V logits GEMM)."""
    return m.hidden_size * m.vocab_size


def attention_flops(m: ModelShape, seq_len: int) -> float:
    """Forward FLOPs per token of one layer's attention core: 4*H*Q*T."""
    return 4.0 * m.num_heads * m.head_dim * seq_len


def layer_flops(m: ModelShape, seq_len: int) -> tuple[float, float, float, float]:
    """Per token of one layer: (forward, B input-gradient, W weight-gradient, attention core forward) FLOPs."""
    n, core = layer_weights(m), attention_flops(m, seq_len)
    return 2.0 * n + core, 2.0 * n + 2.0 * core, 2.0 * n, core


def layer_flops_per_token(m: ModelShape, seq_len: int) -> float:
    """Forward + backward FLOPs of one transformer layer per token: 6n + 12*H*Q*T."""
    f, b, w, _ = layer_flops(m, seq_len)
    return f + b + w


def num_params(m: ModelShape) -> int:
    """Parameter count (embeddings included once when tied; learned positions for gpt2)."""
    h = m.hidden_size
    emb = m.vocab_size * h * (1 if m.tie_embeddings else 2)
    pos = m.max_seq_len * h if m.family == "gpt2" else 0
    return m.num_layers * layer_weights(m) + emb + pos


def flops_per_token(m: ModelShape, seq_len: int) -> float:
    """Model FLOPs per trained token (forward + backward): 6N + 12*L*H*Q*T (see the module docstring)."""
    return m.num_layers * layer_flops_per_token(m, seq_len) + 6.0 * output_weights(m)


def virtual_stage_flops(m: ModelShape, seq_len: int, tokens: int, pp: int, vpp: int, tp: int,
                        recompute: str) -> list[tuple[float, float, float]]:
    """(F, B, W) FLOPs of one microbatch of `tokens` tokens on each virtual stage v = chunk * pp + stage, on one TP
    rank. Recompute is work the device does: full recompute adds the layers' forward to B, selective the attention
    core. The last virtual stage adds the output layer (2hV per token to each of F, B and W)."""
    fl, bl, wl, core = layer_flops(m, seq_len)
    if recompute == "full":
        bl += fl
    elif recompute == "selective":
        bl += core
    head = 2.0 * output_weights(m)
    ranges = split_layers(m.num_layers, pp, vpp)
    out = []
    for v, (start, end) in enumerate(ranges):
        layers = end - start
        f, b, w = layers * fl, layers * bl, layers * wl
        if v == len(ranges) - 1:
            f, b, w = f + head, b + head, w + head
        out.append((f * tokens / tp, b * tokens / tp, w * tokens / tp))
    return out
