"""Decoder-only transformer (GPT-2 and Llama families), cut into chunks of layers for pipeline parallelism.

A `TransformerChunk` holds global layers [layer_start, layer_end). The first chunk owns the embedding, the
last the final norm and the output layer; every chunk of every split is initialised from the same per-name
seeds, so the pieces of a split model are exactly the pieces of the whole one.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from megatronapp import tracing
from megatronapp.config import ModelConfig
from megatronapp.model.attention import Attention, CacheUpdate
from megatronapp.model.capture import Capture
from megatronapp.model.init import full_shape, reset_parameters
from megatronapp.model.mlp import MLP
from megatronapp.model.norms import is_norm, make_norm
from megatronapp.model.rope import inv_frequencies, rope_tables
from megatronapp.parallel import host_copy, weight_grad
from megatronapp.parallel.tensor_parallel import (
    SEQ_DIM,
    VocabParallelEmbedding,
    copy_to_tp,
    gather_from_sp,
    gather_from_tp,
    mark_vocab_parallel,
    shard,
    sync_sequence_parallel_grads,
    tp_rank,
    tp_size,
    vocab_parallel_cross_entropy,
)
from megatronapp.parallel.topology import Group

__all__ = ["KVCache", "TransformerChunk", "TransformerLayer", "build_model", "load_unpadded_state_dict",
           "sync_sequence_parallel_grads", "unpadded_state_dict"]

RECOMPUTE = ("none", "selective", "full")
Rope = tuple[torch.Tensor, torch.Tensor] | None


class Embedding(nn.Module):
    """Token embedding (vocab-parallel) plus learned positions for gpt2."""

    def __init__(self, cfg: ModelConfig, tp_group: Group | None, sequence_parallel: bool):
        super().__init__()
        self.tp_group, self.sequence_parallel, self.max_seq_len = tp_group, sequence_parallel, cfg.max_seq_len
        self.word = VocabParallelEmbedding(cfg.padded_vocab_size(tp_size(tp_group)), cfg.hidden_size, tp_group,
                                           sequence_parallel, vocab_size=cfg.vocab_size)
        self.position = nn.Embedding(cfg.max_seq_len, cfg.hidden_size) if cfg.family == "gpt2" else None
        if self.position is not None and sequence_parallel:
            # Each rank adds positions to its own sequence slice only: the gradient is partial.
            self.position.weight.sequence_parallel = True

    def forward(self, ids: torch.Tensor, start_pos: int) -> torch.Tensor:
        x = self.word(ids)
        if self.position is None:
            return x
        s = ids.shape[1]
        if start_pos + s > self.max_seq_len:
            raise ValueError(f"positions {start_pos}..{start_pos + s - 1} exceed model.max_seq_len="
                             f"{self.max_seq_len} (learned position embeddings); use shorter sequences")
        pos = self.position.weight[start_pos:start_pos + s]
        if self.sequence_parallel:
            pos = pos.chunk(tp_size(self.tp_group), dim=0)[tp_rank(self.tp_group)]
        return x + pos


class OutputLayer(nn.Module):
    """The vocab-parallel output projection's own weight [padded vocab/tp, h] (absent when tied on the same chunk)."""

    def __init__(self, cfg: ModelConfig, tp_group: Group | None):
        super().__init__()
        local = cfg.padded_vocab_size(tp_size(tp_group)) // tp_size(tp_group)
        self.weight = mark_vocab_parallel(nn.Parameter(torch.empty(local, cfg.hidden_size)), cfg.vocab_size)


class TransformerLayer(nn.Module):
    """Pre-norm block: x + attn(norm1 x), then + mlp(norm2 .); or x + attn(n) + mlp(n) as a parallel block."""

    def __init__(self, cfg: ModelConfig, index: int, tp_group: Group | None, sequence_parallel: bool,
                 capture: Capture, tp_comm_overlap: int = 0):
        super().__init__()
        self.index, self.capture, self.parallel_block = index, capture, cfg.parallel_block
        self.hidden_tp_dim = SEQ_DIM if sequence_parallel else None
        self.norm1 = make_norm(cfg)
        self.attn = Attention(cfg, index, tp_group, sequence_parallel, capture, tp_comm_overlap)
        self.norm2 = None if cfg.parallel_block else make_norm(cfg)
        self.mlp = MLP(cfg, tp_group, sequence_parallel, tp_comm_overlap)

    def _point(self, what: str, x: torch.Tensor) -> torch.Tensor:
        name = f"layers.{self.index}.{what}"
        return self.capture.point(name, x, tp_dim=self.hidden_tp_dim, layer=self.index, kind=what)

    def forward(self, x: torch.Tensor, rope: Rope, start_pos: int = 0, cache_update: CacheUpdate | None = None,
                recompute_core: bool = False) -> torch.Tensor:
        cap = self.capture.active
        if cap:
            x = self._point("in", x)
        n = self.norm1(x)
        a = self.attn(n, rope, start_pos, cache_update, recompute_core)
        if cap:
            a = self._point("attn.out", a)
        if self.parallel_block:
            m = self.mlp(n)
            if cap:
                m = self._point("mlp.out", m)
            out = x + a + m
        else:
            h = x + a
            m = self.mlp(self.norm2(h))
            if cap:
                m = self._point("mlp.out", m)
            out = h + m
        return self._point("out", out) if cap else out


class TransformerChunk(nn.Module):
    """Global layers [layer_start, layer_end), with the embedding if pre_process and the head if post_process."""

    def __init__(self, cfg: ModelConfig, layer_start: int, layer_end: int, pre_process: bool, post_process: bool,
                 tp_group: Group | None = None, sequence_parallel: bool = False, recompute: str = "none",
                 seed: int = 0, capture: Capture | None = None, device: torch.device | str | None = None,
                 tp_comm_overlap: int = 0):
        super().__init__()
        if not 0 <= layer_start <= layer_end <= cfg.num_layers:
            raise ValueError(f"layer range [{layer_start}, {layer_end}) is not inside the model's "
                             f"{cfg.num_layers} layers (model.num_layers)")
        if recompute not in RECOMPUTE:
            raise ValueError(f"recompute={recompute!r}: choose none, selective or full (train.recompute)")
        self.cfg, self.tp_group, self.recompute = cfg, tp_group, recompute
        self.layer_start, self.layer_end = layer_start, layer_end
        self.pre_process, self.post_process = pre_process, post_process
        self.sequence_parallel = sequence_parallel and tp_size(tp_group) > 1
        self.capture = capture if capture is not None else Capture()
        self.hidden_tp_dim = SEQ_DIM if self.sequence_parallel else None
        sp = self.sequence_parallel
        # The output layer has its own weight unless it is tied to an embedding living in this same chunk.
        self.tied_here = bool(cfg.tie_embeddings) and pre_process
        # Parameters are allocated once, shard-sized and uninitialised, on the device they live on (no copy of the
        # chunk from CPU); "meta" builds the shapes only, with no storage, and leaves them uninitialised.
        with torch.device(device) if device is not None else contextlib.nullcontext():
            self.embedding = Embedding(cfg, tp_group, sp) if pre_process else None
            # tp_comm_overlap: chunks of the sequence-parallel collectives overlapped with the GEMMs (0: off)
            self.layers = nn.ModuleDict({str(i): TransformerLayer(cfg, i, tp_group, sp, self.capture, tp_comm_overlap)
                                         for i in range(layer_start, layer_end)})
            self.final_norm = make_norm(cfg) if post_process else None
            self.output = OutputLayer(cfg, tp_group) if post_process and not self.tied_here else None
        # Not a buffer: model.to(bfloat16) would round the frequencies; tables are rebuilt in fp32 per forward.
        self.inv_freq = inv_frequencies(cfg.head_dim, cfg.rope_theta) if cfg.family == "llama" else None
        self._inv_freq_on: dict[torch.device, torch.Tensor] = {}  # copied to a device once, not every forward
        if sp:
            # Norms see only this rank's sequence slice: their gradients are partial sums over TP.
            for m in self.modules():
                if is_norm(m):
                    for p in m.parameters():
                        p.sequence_parallel = True
        if device is None or torch.device(device).type != "meta":
            self.reset_parameters(seed)

    def init_name(self, name: str) -> str:
        """The name whose seed initialises parameter `name` (a tied output copy starts as the embedding)."""
        if name == "output.weight" and self.cfg.tie_embeddings:
            return "embedding.word.weight"
        return name

    def reset_parameters(self, seed: int) -> None:
        """Re-initialise every parameter from (seed, name), exactly as the one-process model would."""
        reset_parameters(self, self.cfg, seed, self.tp_group, self.init_name)

    def shared_embedding_weight(self) -> nn.Parameter | None:
        """The tied word-embedding weight on first and last chunks (None when untied or in the middle)."""
        if not self.cfg.tie_embeddings:
            return None
        if self.pre_process:
            return self.embedding.word.weight
        if self.post_process:
            return self.output.weight
        return None

    def output_weight(self) -> nn.Parameter:
        """The weight of the output projection: the tied embedding here, else this chunk's own."""
        return self.embedding.word.weight if self.tied_here else self.output.weight

    @property
    def layer_indices(self) -> list[int]:
        return list(range(self.layer_start, self.layer_end))

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None, kv_cache: KVCache | None = None,
                start_pos: int = 0) -> torch.Tensor:
        """Ids [b, s] or hidden [b, s(/tp), h] in; hidden out, or logits [b, s, v], or mean loss with labels."""
        if kv_cache is not None and self.sequence_parallel:
            raise ValueError("incremental decoding with a KV cache does not support sequence parallelism; "
                             "build the chunk with sequence_parallel=False for generation")
        cap = self.capture
        if self.pre_process:
            if x.dtype not in (torch.int64, torch.int32):
                raise TypeError(f"the first chunk takes token ids (int64) [batch, seq], got {x.dtype}")
            tp = tp_size(self.tp_group)
            if self.sequence_parallel and x.shape[1] % tp:
                raise ValueError(f"sequence length {x.shape[1]} is not divisible by tp={tp}, which sequence "
                                 f"parallelism needs; pick train.seq_len as a multiple of {tp}")
            h = self.embedding(x, start_pos)
            if cap.active:
                h = cap.point("embed", h, tp_dim=self.hidden_tp_dim, layer=None, kind="embed")
        else:
            h = x
        seq = h.shape[1] * (tp_size(self.tp_group) if self.sequence_parallel else 1)
        rope = None
        if self.inv_freq is not None:
            rope = rope_tables(self._rope_frequencies(h.device), start_pos, seq)
        training = torch.is_grad_enabled() and kv_cache is None
        # Full recompute replays a layer's forward in backward: hooks would fire twice (and a random
        # perturbation would differ), so layers run plainly while an observer is attached.
        full = training and self.recompute == "full" and not cap.active
        selective = training and self.recompute == "selective"
        for key, layer in self.layers.items():
            i = int(key)
            update = kv_cache.updater(i, start_pos) if kv_cache is not None else None
            with tracing.span(f"layers.{i}", "layer"):
                if full:
                    h = checkpoint(layer, h, rope, start_pos, None, False, use_reentrant=False)
                else:
                    h = layer(h, rope, start_pos, update, selective)
        if kv_cache is not None:
            kv_cache.length = start_pos + seq
        if not self.post_process:
            return h
        return self._head(h, labels)

    def _rope_frequencies(self, device: torch.device) -> torch.Tensor:
        """The fp32 RoPE frequencies on `device`: copied there once (a pageable copy per forward would make the
        host wait for the GPU at every chunk's forward)."""
        f = self._inv_freq_on.get(device)
        if f is None:
            f = self._inv_freq_on[device] = host_copy.to_device(self.inv_freq, device)
        return f

    def _head(self, h: torch.Tensor, labels: torch.Tensor | None) -> torch.Tensor:
        cap = self.capture
        h = self.final_norm(h)
        if cap.active:
            h = cap.point("final_norm", h, tp_dim=self.hidden_tp_dim, layer=None, kind="final_norm")
        h = gather_from_sp(h, self.tp_group) if self.sequence_parallel else copy_to_tp(h, self.tp_group)
        logits = weight_grad.linear(h, self.output_weight())  # [b, s, padded vocab/tp]; W deferrable
        vocab = self.cfg.vocab_size
        if cap.active:
            tp_dim = 2 if tp_size(self.tp_group) > 1 else None
            logits = cap.point("logits", logits, tp_dim=tp_dim, layer=None, kind="logits", vocab_size=vocab)
        if labels is not None:
            if labels.shape != logits.shape[:2]:
                raise ValueError(f"labels {tuple(labels.shape)} do not match the tokens {tuple(logits.shape[:2])}")
            return vocab_parallel_cross_entropy(logits, labels, self.tp_group, vocab).mean()
        # Padding ids are not tokens: callers (generation, HF parity) see the real vocabulary only.
        return gather_from_tp(logits, self.tp_group, dim=-1)[..., :vocab]


class KVCache:
    """Keys and values of one chunk's layers for incremental decoding: each new token costs one step.

    `chunk(ids, kv_cache=cache, start_pos=cache.length)` stores the new positions and attends over all so far.
    """

    def __init__(self, chunk: TransformerChunk, batch: int, max_len: int, dtype: torch.dtype | None = None,
                 device: torch.device | None = None):
        ref = next(chunk.parameters(), None)
        dtype = dtype or (ref.dtype if ref is not None else torch.float32)
        device = device or (ref.device if ref is not None else None)
        self.max_len, self.length = max_len, 0
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}
        for key, layer in chunk.layers.items():
            shape = (batch, layer.attn.local_kv, max_len, layer.attn.head_dim)
            self.keys[int(key)] = torch.zeros(shape, dtype=dtype, device=device)
            self.values[int(key)] = torch.zeros(shape, dtype=dtype, device=device)

    def reset(self) -> None:
        """Forget every stored position (start a new sequence)."""
        self.length = 0

    def updater(self, layer: int, start_pos: int) -> Callable[[torch.Tensor, torch.Tensor],
                                                             tuple[torch.Tensor, torch.Tensor]]:
        """The function layer `layer` calls to store positions from `start_pos` on and read all so far."""
        if start_pos > self.length:
            raise ValueError(f"start_pos={start_pos} skips positions: the cache holds {self.length}")

        def update(k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            end = start_pos + k.shape[2]
            if end > self.max_len:
                raise ValueError(f"sequence length {end} exceeds the KV cache's max_len={self.max_len}")
            self.keys[layer][:, :, start_pos:end] = k
            self.values[layer][:, :, start_pos:end] = v
            return self.keys[layer][:, :, :end], self.values[layer][:, :, :end]

        return update


def build_model(cfg: ModelConfig, seed: int = 0, **kw) -> TransformerChunk:
    """The whole model as one chunk (all layers, embedding and head) for a single process."""
    return TransformerChunk(cfg, 0, cfg.num_layers, pre_process=True, post_process=True, seed=seed, **kw)


def expected_shapes(cfg: ModelConfig, held: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """Every parameter of the one-process model of `cfg` and its full shape (real vocabulary rows), to check the
    weights a file holds (`held`: name -> shape, from its headers) against before any weight is allocated. The
    model is built on the meta device, after the config's sizes are bounded by the weights (a layer holds at
    least one tensor, every size is some tensor's dimension): a claim of 10^9 layers costs nothing."""
    largest = max((d for shape in held.values() for d in shape), default=0)
    sizes = {"num_layers": cfg.num_layers, "hidden_size": cfg.hidden_size, "ffn_hidden_size": cfg.ffn_hidden_size,
             "vocab_size": cfg.vocab_size}
    if cfg.num_layers > len(held):
        raise ValueError(f"model.num_layers={cfg.num_layers}, but the weights are {len(held)} tensors")
    for name, value in sizes.items():
        if name != "num_layers" and value > largest:
            raise ValueError(f"model.{name}={value}, but no tensor of the weights has a dimension above {largest}")
    model = build_model(cfg, device="meta")
    return {n: full_shape(p, None) for n, p in model.named_parameters()}


def unpadded_state_dict(model: TransformerChunk) -> dict[str, torch.Tensor]:
    """A one-process chunk's weights as exported: vocabulary padding rows dropped (they depend on tp only)."""
    if tp_size(model.tp_group) > 1:
        raise ValueError("unpadded_state_dict needs the whole weights of a one-process chunk; consolidate a "
                         "tensor-parallel checkpoint with megatronapp.train.consolidate instead")
    return {n: p.detach()[:p.vocab_size] if getattr(p, "vocab_size", None) is not None else p.detach()
            for n, p in model.named_parameters()}


def load_unpadded_state_dict(model: TransformerChunk, state: dict[str, torch.Tensor]) -> None:
    """Copy full weights (vocabulary rows unpadded, or padded as this chunk is) into this rank's slices; the
    padding rows become zero. Names must match exactly; the message lists what differs."""
    params = dict(model.named_parameters())
    missing, unexpected = sorted(set(params) - set(state)), sorted(set(state) - set(params))
    if missing or unexpected:
        raise KeyError(f"weights do not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}")
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(shard(state[name], p, model.tp_group).to(device=p.device, dtype=p.dtype))
