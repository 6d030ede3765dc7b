"""How many bytes a generation will stream and hold, estimated from shapes and the capture spec before it runs.

One small message can ask for a lot: attention probabilities of every layer grow with the square of the sequence
and logits with the vocabulary, and the host holds each step's captures uncompressed (fp32) before shrinking them.
`estimate` adds up, per capture point, the bytes of every step's compressed message (base64 of the quantised,
pooled, top-k'd tensor) and the largest step's raw host copies; `check` refuses a request over the budget with a
message naming the point that costs most and how to shrink it.
"""
from __future__ import annotations

from dataclasses import dataclass

from megatronapp.config import ModelConfig
from megatronapp.scope.compress import Compression

DEFAULT_MAX_REQUEST_BYTES = 512 * 2**20  # sized for a laptop: a request may take this much, streamed plus held
POOL_ATTENTION_ABOVE = 256  # attention probabilities are pooled over keys by default beyond this many positions
_QUANT_BYTES = {"fp32": 4, "fp16": 2, "int8": 1}
_B64 = 4 / 3  # base64 expansion of the payload in JSON


@dataclass
class Estimate:
    """Bytes a request streams in total and holds at its largest step, per short point name."""

    streamed: dict[str, float]
    held: dict[str, float]


def _per_position(point: str, cfg: ModelConfig, kv_len: int) -> int:
    """Elements one position of one row contributes at `point` (before compression)."""
    if point == "attn.q":
        return cfg.num_heads * cfg.head_dim
    if point in ("attn.k", "attn.v"):
        return int(cfg.num_kv_heads) * cfg.head_dim
    if point == "attn.probs":
        return cfg.num_heads * kv_len
    if point == "logits":
        return cfg.vocab_size
    return cfg.hidden_size


def _last_dim(point: str, cfg: ModelConfig, kv_len: int) -> int:
    if point in ("attn.q", "attn.k", "attn.v"):
        return cfg.head_dim
    if point == "attn.probs":
        return kv_len
    if point == "logits":
        return cfg.vocab_size
    return cfg.hidden_size


def _compressed(elements: int, last: int, c: Compression) -> float:
    """Bytes of one compressed tensor of `elements` whose last dim is `last`."""
    if c.pool != "none" and c.axis == -1 and last > c.buckets:
        elements = elements // last * c.buckets  # pooling along another axis is counted unpooled (an upper bound)
    if c.topk is not None:
        elements = min(elements, c.topk) * 2  # values plus their indices (JSON ints, a few bytes each)
    return elements * _QUANT_BYTES[c.quant] * _B64


def estimate(cfg: ModelConfig, rows: int, start: int, total: int, names: list[str],
             compression_of: dict[str, Compression], pca: bool = False) -> Estimate:
    """Streamed and held bytes of a generation of `rows` prompts prefilled to `start`, run to `total` positions.

    names: full capture-point names; compression_of: short point name -> the compression it will get."""
    streamed: dict[str, float] = {}
    held: dict[str, float] = {}
    for name in names:
        short = name.split(".", 2)[2] if name.startswith("layers.") else name
        c = compression_of[short]
        # step 0 computes positions [0, start) against `start` keys; then one position per step
        steps = [(start, start)] + [(1, p + 1) for p in range(start, total)]
        s_bytes = sum(_compressed(rows * n * _per_position(short, cfg, kv), _last_dim(short, cfg, kv), c)
                      for n, kv in steps)
        h_bytes = max(rows * n * _per_position(short, cfg, kv) * 4 for n, kv in steps)  # fp32 on the host
        streamed[short] = streamed.get(short, 0.0) + s_bytes
        held[short] = held.get(short, 0.0) + h_bytes
    if pca:
        held["pca"] = rows * total * cfg.hidden_size * 4.0  # the PCA layer's states are kept for the whole run
    return Estimate(streamed, held)


def check(est: Estimate, budget: int) -> None:
    """Raise a ValueError saying which capture to pool or drop when `est` exceeds `budget` bytes."""
    streamed, held = sum(est.streamed.values()), sum(est.held.values())
    if streamed + held <= budget:
        return
    cost = {k: est.streamed.get(k, 0.0) + est.held.get(k, 0.0) for k in {*est.streamed, *est.held}}
    worst = max(cost, key=lambda k: cost[k])
    mb = 2**20
    fix = (f'pool it (capture.per_point["{worst}"] = {{"pool": "mean", "buckets": 16}}) or drop it from '
           f"capture.points" if worst != "pca" else "turn off PCA (capture.pca_layer)")
    raise ValueError(f"this generation would stream about {streamed / mb:.1f} MB and hold {held / mb:.1f} MB, over "
                     f"the server's budget of {budget / mb:.1f} MB (--max-request-mb); capture {worst!r} alone "
                     f"costs {cost[worst] / mb:.1f} MB: {fix}, or ask for fewer layers, prompts or tokens")
