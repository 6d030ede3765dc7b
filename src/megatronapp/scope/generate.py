"""KV-cached generation that streams, per step, the sampled tokens, their probabilities and chosen states.

Several prompts run as the rows of one batch without padding (the Llama reference's trick): the batch is
prefilled up to the shortest prompt, then advanced one position per step; a row still inside its own prompt
takes its prompt token instead of the sample ("forced"). Every forward after the prefill is one position, so
each new token costs one step. Each forward produces one `step` message: the states of the positions it
computed (compressed on the host), and per row the token placed at the next position with its probability
under the model (softmax at temperature 1) and the top candidates.
"""
from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from megatronapp.config import ModelConfig
from megatronapp.model.transformer import KVCache, TransformerChunk
from megatronapp.scope.capture import Recorder, point_names
from megatronapp.scope.compress import Compression, compress
from megatronapp.scope.perturb import Perturber
from megatronapp.scope.protocol import Generate

Emit = Callable[[dict[str, Any]], None]


@dataclass
class ScopeModel:
    """A model being watched: the single-process model, its config and tokenizer, and a one-run-at-a-time lock."""

    model: TransformerChunk
    cfg: ModelConfig
    tokenizer: Any
    name: str = "model"
    meta: dict[str, Any] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)
    # tensor-parallel serving (scope/distributed.py): what the server calls instead of `generate`, and the
    # full (vocab-gathered) output weight the logit lens needs when this rank holds only a slice of it
    runner: Callable[..., dict[str, Any]] | None = None
    lens_weight: torch.Tensor | None = None

    def describe(self) -> dict[str, Any]:
        """What the page needs to build its selectors."""
        c = self.cfg
        return {"name": self.name, "family": c.family, "num_layers": c.num_layers, "num_heads": c.num_heads,
                "num_kv_heads": c.num_kv_heads, "head_dim": c.head_dim, "hidden_size": c.hidden_size,
                "vocab_size": c.vocab_size, "max_seq_len": c.max_seq_len,
                "weights": sorted({n.split(".", 2)[2] for n, _ in self.model.named_parameters()
                                   if n.startswith("layers.")}),
                "meta": {k: self.meta[k] for k in ("val_loss", "final_train_loss") if k in self.meta}}


class Cancelled(Exception):
    """The client asked to stop."""


def token_text(tokenizer: Any, tid: int) -> str:
    """Printable text of one token (bytes that are not UTF-8 on their own shown as <xNN>)."""
    if getattr(tokenizer, "name", "") == "byte":
        return chr(tid) if 32 <= tid < 127 or tid in (9, 10) else f"<x{tid:02x}>"
    return tokenizer.decode([tid])


def _sample(logits: torch.Tensor, req: Generate, gen: torch.Generator) -> torch.Tensor:
    """Next token per row from logits [b, v]: argmax when greedy or temperature 0, else top-k sampling."""
    if req.greedy or req.temperature == 0.0:
        return logits.argmax(dim=-1)
    scaled = logits.float() / req.temperature
    if 0 < req.top_k < scaled.shape[-1]:
        kth = scaled.topk(req.top_k, dim=-1).values[:, -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    return torch.multinomial(scaled.softmax(dim=-1), 1, generator=gen).squeeze(-1)


def pca_2d(x: torch.Tensor) -> tuple[torch.Tensor, list[float]]:
    """Project rows of x [n, h] on their first two principal components (SVD); returns coords and variance ratios."""
    x = x.double()
    centred = x - x.mean(dim=0, keepdim=True)
    if x.shape[0] < 2:
        return torch.zeros(x.shape[0], 2), [0.0, 0.0]
    _, s, vh = torch.linalg.svd(centred, full_matrices=False)
    k = min(2, vh.shape[0])
    coords = centred @ vh[:k].T
    if k < 2:
        coords = torch.cat([coords, torch.zeros(x.shape[0], 2 - k, dtype=coords.dtype)], dim=1)
    total = float((s ** 2).sum()) or 1.0
    ratios = [float(s[i] ** 2) / total if i < len(s) else 0.0 for i in range(2)]
    # fix the sign of each axis (SVD's is arbitrary): the point farthest along it lies on the positive side
    for j in range(2):
        if coords[coords[:, j].abs().argmax(), j] < 0:
            coords[:, j] = -coords[:, j]
    return coords.float(), ratios


def logit_lens(model: TransformerChunk, hidden: torch.Tensor,
               weight: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """What a layer's output would predict: final norm + unembedding (`weight`: the full one); top-1 ids, probs."""
    with torch.no_grad():
        w = model.output_weight() if weight is None else weight
        w = w[:model.cfg.vocab_size]  # rows past the vocabulary are TP padding, never a prediction
        logits = torch.nn.functional.linear(model.final_norm(hidden), w)
        p = logits.float().softmax(dim=-1).max(dim=-1)
    return p.indices, p.values


def default_compression(point: str, cfg: ModelConfig) -> Compression:
    """Sensible per-point shrinking: per-head pooling for q/k/v, 64 buckets for hidden-size states."""
    if point in ("attn.q", "attn.k", "attn.v"):
        return Compression(pool="mean", buckets=min(cfg.head_dim, 8), axis=-1, quant="fp16")
    if point == "attn.probs":
        return Compression(pool="none", quant="fp16")
    if point == "logits":
        return Compression(pool="none", topk=None, quant="fp16")
    return Compression(pool="mean", buckets=64, axis=-1, quant="fp16")


def generate(sm: ScopeModel, req: Generate, emit: Emit, cancel: threading.Event | None = None) -> dict[str, Any]:
    """Run `req` on `sm`, calling `emit` with a start message, one step message per forward, pca, done."""
    model, cfg, tok = sm.model, sm.cfg, sm.tokenizer
    spec = req.capture
    prompts = [tok.encode(p) for p in req.prompts]
    if any(len(p) == 0 for p in prompts):
        raise ValueError("a prompt encodes to zero tokens; give at least one character")
    bad = [i for p in prompts for i in p if not 0 <= i < cfg.vocab_size]
    if bad:
        raise ValueError(f"token ids {bad[:3]} are outside the model's vocabulary of {cfg.vocab_size}")
    lens = [len(p) for p in prompts]
    total = max(lens) + req.max_new_tokens
    if total > cfg.max_seq_len:
        raise ValueError(f"longest prompt ({max(lens)} tokens) + max_new_tokens ({req.max_new_tokens}) = {total} "
                         f"exceeds the model's max_seq_len={cfg.max_seq_len}; shorten the prompt or ask for fewer")
    b, start = len(prompts), min(lens)
    tokens = torch.zeros(b, total, dtype=torch.long)
    forced = torch.zeros(b, total, dtype=torch.bool)
    for r, p in enumerate(prompts):
        tokens[r, :len(p)] = torch.tensor(p)
        forced[r, :len(p)] = True
    names = point_names(spec.points, spec.layers, cfg.num_layers)
    lens_names = [f"layers.{L}.out" for L in range(cfg.num_layers)] if spec.logit_lens else []
    pca_name = None
    if spec.pca_layer is not None:
        if spec.pca_layer >= cfg.num_layers:
            raise ValueError(f"capture.pca_layer={spec.pca_layer}: the model has layers 0..{cfg.num_layers - 1}")
        pca_name = f"layers.{spec.pca_layer}.out"
    recorder = Recorder(model.capture, [*names, *lens_names, *([pca_name] if pca_name else [])],
                        tp_group=model.tp_group)
    perturber = Perturber(req.perturbations, model, model.capture, cfg)
    gen = torch.Generator().manual_seed(req.seed)
    cache = KVCache(model, b, total)
    emit({"type": "start", "rows": b, "prompt_lens": lens, "start": start, "total": total,
          "tokens": [[token_text(tok, int(t)) for t in p] for p in prompts], "points": names})
    generated = [0] * b
    pca_rows: list[torch.Tensor] = []
    t0, steps = time.perf_counter(), 0
    try:
        # perturbations attach first so the recorder sees the perturbed values
        with torch.no_grad(), perturber, recorder:
            p0, p1 = 0, start
            while True:
                if cancel is not None and cancel.is_set():
                    raise Cancelled()
                logits = model(tokens[:, p0:p1], kv_cache=cache, start_pos=p0)
                states = recorder.take()
                msg: dict[str, Any] = {"type": "step", "step": steps, "positions": [p0, p1]}
                if p1 < total:
                    probs = logits[:, -1].float().softmax(dim=-1)
                    sampled = _sample(logits[:, -1], req, gen)
                    nxt = torch.where(forced[:, p1], tokens[:, p1], sampled)
                    tokens[:, p1] = nxt
                    top = probs.topk(min(req.report_top, probs.shape[-1]), dim=-1)
                    rows = []
                    for r in range(b):
                        is_new = not bool(forced[r, p1]) and generated[r] < req.max_new_tokens
                        generated[r] += int(is_new)
                        tid = int(nxt[r])
                        rows.append({"id": tid, "text": token_text(tok, tid), "prob": finite(probs[r, tid], 5),
                                     "forced": bool(forced[r, p1]), "new": is_new,
                                     "top": [[token_text(tok, int(i)), finite(p, 5)]
                                             for p, i in zip(top.values[r], top.indices[r])]})
                    msg["next"] = rows
                msg["states"] = {n: compress(states[n], _compression_for(_short(n), spec, cfg))
                                 for n in names if n in states}
                if lens_names:
                    lens_out = []
                    for n in lens_names:
                        ids, ps = logit_lens(model, states[n], sm.lens_weight)
                        lens_out.append([[[token_text(tok, int(i)), finite(p, 4)] for i, p in zip(ri, rp)]
                                         for ri, rp in zip(ids, ps)])
                    msg["lens"] = lens_out
                if pca_name:
                    pca_rows.append(states[pca_name])
                emit(msg)
                steps += 1
                if p1 >= total:
                    break
                p0, p1 = p1, p1 + 1
    except Cancelled:
        emit({"type": "done", "cancelled": True, "steps": steps})
        return {"cancelled": True, "steps": steps}
    finally:
        perturber.reset()
    elapsed = time.perf_counter() - t0
    if pca_name:
        emit(pca_message(torch.cat(pca_rows, dim=1), spec.pca_layer, lens))
    texts = [tok.decode(tokens[r, :lens[r] + req.max_new_tokens].tolist()) for r in range(b)]
    new_tokens = sum(generated)
    done = {"type": "done", "cancelled": False, "steps": steps, "texts": texts, "new_tokens": new_tokens,
            "seconds": round(elapsed, 4), "tokens_per_s": round(new_tokens / elapsed, 2) if elapsed else None}
    emit(done)
    return done


def finite(x: Any, digits: int) -> float | None:
    """A rounded float for JSON, or None for NaN/inf (a bit flip can make them; strict JSON has no NaN)."""
    v = float(x)
    return round(v, digits) if math.isfinite(v) else None


def _compression_for(point: str, spec: Any, cfg: ModelConfig) -> Compression:
    """The client's per-point choice, else its general choice when it made one, else the default for the point."""
    if point in spec.per_point:
        return spec.per_point[point]
    if "compression" in spec.model_fields_set:
        return spec.compression
    return default_compression(point, cfg)


def _short(name: str) -> str:
    """'layers.3.attn.q' -> 'attn.q'; 'logits' -> 'logits'."""
    return name.split(".", 2)[2] if name.startswith("layers.") else name


def pca_message(hidden: torch.Tensor, layer: int, lens: list[int]) -> dict[str, Any]:
    """PCA of the hidden states [b, s, h] of all rows and positions (each row up to its own end)."""
    b, s, _ = hidden.shape
    flat = hidden.reshape(b * s, -1)
    ok = torch.isfinite(flat).all(dim=1)  # states wrecked by a perturbation (inf/NaN) are left out, and counted
    pts = [(r, p) for r in range(b) for p in range(s) if ok[r * s + p]]
    coords, ratios = pca_2d(flat[ok]) if len(pts) else (torch.zeros(0, 2), [0.0, 0.0])
    return {"type": "pca", "layer": layer, "explained": [round(x, 4) for x in ratios],
            "dropped_non_finite": int((~ok).sum()),
            "points": [[r, p, round(float(coords[i, 0]), 4), round(float(coords[i, 1]), 4)]
                       for i, (r, p) in enumerate(pts)]}
