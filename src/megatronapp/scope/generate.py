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
from megatronapp.scope import budget
from megatronapp.scope.budget import DEFAULT_MAX_REQUEST_BYTES
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
    # the final norm for the logit lens when this rank's chunk has none (pipeline stage 0 of scope/distributed.py)
    lens_norm: torch.nn.Module | None = None
    # how the ranks serving this model run a step together (None: one process holds the whole model)
    lockstep: Any = None
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES

    def describe(self) -> dict[str, Any]:
        """What the page needs to build its selectors."""
        c = self.cfg
        return {"name": self.name, "max_request_bytes": self.max_request_bytes,
                "family": c.family, "num_layers": c.num_layers, "num_heads": c.num_heads,
                "num_kv_heads": c.num_kv_heads, "head_dim": c.head_dim, "hidden_size": c.hidden_size,
                "vocab_size": c.vocab_size, "max_seq_len": c.max_seq_len,
                "weights": sorted({n.split(".", 2)[2] for n, _ in self.model.named_parameters()
                                   if n.startswith("layers.")}),
                "meta": {k: self.meta[k] for k in ("val_loss", "final_train_loss") if k in self.meta}}


def token_text(tokenizer: Any, tid: int) -> str:
    """Printable text of one token (bytes that are not UTF-8 on their own shown as <xNN>)."""
    if getattr(tokenizer, "name", "") == "byte":
        return chr(tid) if 32 <= tid < 127 or tid in (9, 10) else f"<x{tid:02x}>"
    return tokenizer.decode([tid])


def _sample(logits: torch.Tensor, req: Generate, gen: torch.Generator) -> torch.Tensor:
    """Next token per row from finite-or-(-inf) logits [b, v]: argmax when greedy or temperature 0, else top-k
    and top-p (nucleus) sampling; a row whose scaled distribution is not finite (huge logits over a small
    temperature) takes its argmax."""
    if req.greedy or req.temperature == 0.0:
        return logits.argmax(dim=-1)
    scaled = logits.float() / req.temperature
    if 0 < req.top_k < scaled.shape[-1]:
        kth = scaled.topk(req.top_k, dim=-1).values[:, -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if req.top_p < 1.0:  # keep the most likely tokens until their mass reaches top_p (the first always stays)
        ordered, order = scaled.sort(dim=-1, descending=True)
        p = ordered.softmax(dim=-1)
        drop = (p.cumsum(dim=-1) - p) >= req.top_p
        scaled = scaled.scatter(-1, order, ordered.masked_fill(drop, float("-inf")))
    probs = scaled.softmax(dim=-1)
    ok = torch.isfinite(probs).all(dim=-1) & (probs.sum(dim=-1) > 0)
    if not bool(ok.all()):
        fallback = torch.nn.functional.one_hot(logits.argmax(dim=-1), logits.shape[-1]).to(probs.dtype)
        probs = torch.where(ok[:, None], probs, fallback)
    return torch.multinomial(probs, 1, generator=gen).squeeze(-1)


def mask_non_finite(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Logits [b, v] with NaN/inf set to -inf (a row with nothing finite: all 0, i.e. uniform), the count of
    non-finite logits per row, and which rows had nothing finite. A perturbation can make any of these."""
    x = logits.float()
    bad = ~torch.isfinite(x)
    dead = bad.all(dim=-1)
    clean = x.masked_fill(bad, float("-inf"))
    clean[dead] = 0.0
    return clean, bad.sum(dim=-1), dead


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


def logit_lens(model: TransformerChunk, hidden: torch.Tensor, weight: torch.Tensor | None = None,
               norm: torch.nn.Module | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """What a layer's output would predict: final norm + unembedding (`weight`: the full one); top-1 ids, probs."""
    with torch.no_grad():
        w = model.output_weight() if weight is None else weight
        w = w[:model.cfg.vocab_size]  # rows past the vocabulary are TP padding, never a prediction
        # captured states are on the host; the weights may be on a GPU
        logits = torch.nn.functional.linear((norm or model.final_norm)(hidden.to(w.device)), w)
        p = logits.float().softmax(dim=-1).max(dim=-1)
    return p.indices.cpu(), p.values.cpu()


def default_compression(point: str, cfg: ModelConfig, total: int = 0) -> Compression:
    """Sensible per-point shrinking: per-head pooling for q/k/v, 64 buckets for hidden-size states, attention
    pooled over keys into 64 buckets once a run is longer than budget.POOL_ATTENTION_ABOVE positions."""
    if point in ("attn.q", "attn.k", "attn.v"):
        return Compression(pool="mean", buckets=min(cfg.head_dim, 8), axis=-1, quant="fp16")
    if point == "attn.probs":
        if total > budget.POOL_ATTENTION_ABOVE:
            return Compression(pool="mean", buckets=64, axis=-1, quant="fp16")
        return Compression(pool="none", quant="fp16")
    if point == "logits":
        return Compression(pool="none", topk=None, quant="fp16")
    return Compression(pool="mean", buckets=64, axis=-1, quant="fp16")


class Local:
    """How one process holding the whole model runs a step (the lockstep interface of scope/distributed.py)."""

    emitter = True

    def sync(self, err: BaseException | None, stop: bool) -> bool:
        """Raise the step's error, else return whether to stop (in lockstep: every rank's same answer)."""
        if err is not None:
            raise err
        return stop

    def forward(self, model: TransformerChunk, ids: torch.Tensor, cache: KVCache, start_pos: int) -> torch.Tensor:
        """Logits [b, v] of the last position of `ids` (every rank gets them)."""
        # ids live on the host; the model may not (scope serve --device cuda): logits come back for sampling
        ids = ids.to(next(model.parameters()).device)
        return model(ids, kv_cache=cache, start_pos=start_pos)[:, -1].cpu()

    def collect(self, states: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Every stage's captured states, merged on the emitting rank."""
        return states

    def attach(self, perturber: Perturber) -> None:
        perturber.attach()


LOCAL = Local()


@dataclass
class _Plan:
    """A validated request: token layout, capture names and compression, ready to run."""

    prompts: list[list[int]]
    lens: list[int]
    start: int
    total: int
    tokens: torch.Tensor
    forced: torch.Tensor
    names: list[str]
    lens_names: list[str]
    pca_name: str | None
    compression: dict[str, Compression]


def plan(sm: ScopeModel, req: Generate) -> _Plan:
    """Check `req` against the model and the byte budget (ValueError naming the field and the fix); no collectives."""
    cfg, tok, spec = sm.cfg, sm.tokenizer, req.capture
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
    b = len(prompts)
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
    compression = {_short(n): _compression_for(_short(n), spec, cfg, total) for n in names}
    est = budget.estimate(cfg, b, min(lens), total, names, compression, pca=pca_name is not None)
    budget.check(est, sm.max_request_bytes)
    return _Plan(prompts, lens, min(lens), total, tokens, forced, names, lens_names, pca_name, compression)


def generate(sm: ScopeModel, req: Generate, emit: Emit | None, cancel: Any = None) -> dict[str, Any]:
    """Run `req` on `sm`, calling `emit` with a start message, one step message per forward, pca, done.

    `emit` None: a worker rank that runs in lockstep but sends nothing. With several ranks (`sm.lockstep`),
    every rank takes the same path: errors and the stop decision are exchanged once per step, so a failure on
    any rank ends the generation on all of them at the same step (and is raised on the emitting rank)."""
    ls = sm.lockstep or LOCAL
    model, tok, spec = sm.model, sm.tokenizer, req.capture
    err: BaseException | None = None
    p: _Plan | None = None
    try:
        p = plan(sm, req)
    except Exception as e:  # noqa: BLE001  (raised by sync on every rank alike)
        err = e
    ls.sync(err, False)
    assert p is not None
    b, total = len(p.prompts), p.total
    recorder = Recorder(model.capture, [*p.names, *p.lens_names, *([p.pca_name] if p.pca_name else [])],
                        tp_group=model.tp_group)
    perturber = Perturber(req.perturbations, model, model.capture, sm.cfg, tp_group=model.tp_group)
    gen = torch.Generator().manual_seed(req.seed)
    cache: KVCache | None = None
    failed_emit: list[BaseException] = []

    def send(msg: dict[str, Any]) -> None:
        # leaving mid-generation would strand other ranks in a collective: remember, stop at the next step
        if emit is None or failed_emit:
            return
        try:
            emit(msg)
        except Exception as e:  # noqa: BLE001  (re-raised once every rank has stopped)
            failed_emit.append(e)

    send({"type": "start", "rows": b, "prompt_lens": p.lens, "start": p.start, "total": total,
          "tokens": [[token_text(tok, int(t)) for t in pr] for pr in p.prompts], "points": p.names})
    generated = [0] * b
    pca_rows: list[torch.Tensor] = []
    t0, steps, cancelled = time.perf_counter(), 0, False
    try:
        err = None
        try:
            cache = KVCache(model, b, total)  # may fail on one rank (memory): exchanged at the first step
            ls.attach(perturber)  # perturbations first, so the recorder sees the perturbed values
            recorder.attach()
        except Exception as e:  # noqa: BLE001
            err = e
        with torch.no_grad():
            p0, p1 = 0, p.start
            while True:
                local_stop = bool(failed_emit) or (cancel is not None and cancel.is_set())
                if ls.sync(err, local_stop):
                    cancelled = True
                    break
                if p0 >= total:
                    break
                try:
                    logits = ls.forward(model, p.tokens[:, p0:p1], cache, p0)
                    states = ls.collect(recorder.take())
                    msg = _step(sm, req, p, logits, states, p0, p1, gen, generated, ls.emitter)
                    msg["step"] = steps
                    if p.pca_name and ls.emitter:
                        pca_rows.append(states[p.pca_name])
                    send(msg)
                except Exception as e:  # noqa: BLE001  (exchanged at the top of the next step)
                    err = e
                steps += 1
                p0, p1 = p1, p1 + 1
    finally:
        recorder.detach()
        perturber.detach()
        perturber.reset()
    if failed_emit:
        raise failed_emit[0]
    if cancelled:
        send({"type": "done", "cancelled": True, "steps": steps})
        return {"cancelled": True, "steps": steps}
    elapsed = time.perf_counter() - t0
    if p.pca_name and ls.emitter:
        send(pca_message(torch.cat(pca_rows, dim=1), spec.pca_layer, p.lens))
    texts = [tok.decode(p.tokens[r, :p.lens[r] + req.max_new_tokens].tolist()) for r in range(b)]
    new_tokens = sum(generated)
    done = {"type": "done", "cancelled": False, "steps": steps, "texts": texts, "new_tokens": new_tokens,
            "seconds": round(elapsed, 4), "tokens_per_s": round(new_tokens / elapsed, 2) if elapsed else None}
    send(done)
    if failed_emit:
        raise failed_emit[0]
    return done


def _step(sm: ScopeModel, req: Generate, p: _Plan, logits: torch.Tensor, states: dict[str, torch.Tensor],
          p0: int, p1: int, gen: torch.Generator, generated: list[int], emitter: bool) -> dict[str, Any]:
    """Place the next token of every row (all ranks alike) and build the step message (the emitter only)."""
    tok, b = sm.tokenizer, len(p.prompts)
    msg: dict[str, Any] = {"type": "step", "positions": [p0, p1]}
    if p1 < p.total:
        clean, n_bad, dead = mask_non_finite(logits)
        sampled = _sample(clean, req, gen)
        nxt = torch.where(p.forced[:, p1], p.tokens[:, p1], sampled)
        p.tokens[:, p1] = nxt
        rows = []
        probs = clean.softmax(dim=-1)
        probs[dead] = float("nan")  # nothing finite: the model gave no distribution (shown as null)
        top = probs.topk(min(req.report_top, probs.shape[-1]), dim=-1)
        for r in range(b):
            is_new = not bool(p.forced[r, p1]) and generated[r] < req.max_new_tokens
            generated[r] += int(is_new)
            if not emitter:
                continue
            tid = int(nxt[r])
            row = {"id": tid, "text": token_text(tok, tid), "prob": finite(probs[r, tid], 5),
                   "forced": bool(p.forced[r, p1]), "new": is_new,
                   "top": [] if bool(dead[r]) else [[token_text(tok, int(i)), finite(q, 5)]
                                                    for q, i in zip(top.values[r], top.indices[r])]}
            if int(n_bad[r]):
                row["non_finite"] = int(n_bad[r])  # NaN/inf logits, masked out before sampling
            rows.append(row)
        msg["next"] = rows
    if not emitter:
        return msg
    msg["states"] = {n: compress(states[n], p.compression[_short(n)]) for n in p.names if n in states}
    if p.lens_names:
        lens_out = []
        for n in p.lens_names:
            ids, ps = logit_lens(sm.model, states[n], sm.lens_weight, sm.lens_norm)
            lens_out.append([[[token_text(tok, int(i)), finite(q, 4)] for i, q in zip(ri, rp)]
                             for ri, rp in zip(ids, ps)])
        msg["lens"] = lens_out
    grid = head_grid(states, sm.cfg)
    if grid:
        msg["grid"] = grid
    return msg


def head_grid(states: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, Any]:
    """Layer x head summaries of the step's last position, per row: attention entropy (nats) from attn.probs and
    the L2 norm of each head's query from attn.q, for every layer captured (so one view shows all layers)."""
    out: dict[str, Any] = {}
    for point, key in (("attn.probs", "entropy"), ("attn.q", "q_norm")):
        layers = [L for L in range(cfg.num_layers) if f"layers.{L}.{point}" in states]
        if not layers:
            continue
        per_layer = []
        for L in layers:
            x = states[f"layers.{L}.{point}"][:, :, -1].float()  # [b, heads, keys or d]
            if key == "entropy":
                v = -(x * torch.log(x.clamp_min(1e-30))).sum(dim=-1)
            else:
                v = x.norm(dim=-1)
            per_layer.append(v)
        grid = torch.stack(per_layer, dim=1)  # [b, layers, heads]
        out[key] = {"layers": layers, "values": [[[finite(v, 4) for v in h] for h in lay] for lay in grid]}
    return out


def finite(x: Any, digits: int) -> float | None:
    """A rounded float for JSON, or None for NaN/inf (a bit flip can make them; strict JSON has no NaN)."""
    v = float(x)
    return round(v, digits) if math.isfinite(v) else None


def _compression_for(point: str, spec: Any, cfg: ModelConfig, total: int = 0) -> Compression:
    """The client's per-point choice, else its general choice when it made one, else the default for the point."""
    if point in spec.per_point:
        return spec.per_point[point]
    if "compression" in spec.model_fields_set:
        return spec.compression
    return default_compression(point, cfg, total)


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
