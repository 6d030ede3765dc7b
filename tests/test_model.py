"""The transformer in one process: shapes, capture points, GQA, sliding window, recompute, KV cache, chunks."""
from __future__ import annotations

import math

import pytest
import torch

from megatronapp.config import ModelConfig
from megatronapp.model.attention import attention_core, fuse_qkv
from megatronapp.model.capture import Capture
from megatronapp.model.transformer import KVCache, TransformerChunk, build_model


def gpt2(**kw) -> ModelConfig:
    base = {"family": "gpt2", "vocab_size": 64, "hidden_size": 32, "num_layers": 3, "num_heads": 4, "max_seq_len": 32}
    return ModelConfig(**{**base, **kw})


def llama(**kw) -> ModelConfig:
    base = {"family": "llama", "vocab_size": 64, "hidden_size": 32, "num_layers": 3, "num_heads": 4,
            "num_kv_heads": 2, "ffn_hidden_size": 48, "max_seq_len": 32}
    return ModelConfig(**{**base, **kw})


FAMILIES = {"gpt2": gpt2, "llama": llama}



def batch(b: int = 2, s: int = 12, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 64, (b, s), generator=g), torch.randint(0, 64, (b, s), generator=g)


def grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("family", FAMILIES)
def test_shapes(family):
    cfg = FAMILIES[family]()
    ids, labels = batch()
    model = build_model(cfg)
    assert model(ids).shape == (2, 12, 64)
    loss = model(ids, labels=labels)
    assert loss.dim() == 0 and math.isfinite(loss.item())
    # Untrained: the loss is close to uniform over the vocabulary.
    assert abs(loss.item() - math.log(64)) < 0.5
    first = TransformerChunk(cfg, 0, 2, pre_process=True, post_process=False)
    assert first(ids).shape == (2, 12, 32)
    middle = TransformerChunk(cfg, 2, 3, pre_process=False, post_process=False)
    assert middle(torch.randn(2, 12, 32)).shape == (2, 12, 32)
    assert middle.shared_embedding_weight() is None


@pytest.mark.parametrize("family", FAMILIES)
def test_capture_points(family):
    cfg = FAMILIES[family]()
    cap = Capture()
    seen: dict[str, tuple] = {}
    cap.add("*", lambda name, t, info: seen.setdefault(name, (tuple(t.shape), info)) and None)
    build_model(cfg, capture=cap)(batch()[0])
    expected = {"embed", "final_norm", "logits"}
    for i in range(cfg.num_layers):
        expected |= {f"layers.{i}.{p}" for p in ("in", "attn.q", "attn.k", "attn.v", "attn.probs", "attn.out",
                                                 "mlp.out", "out")}
    assert set(seen) == expected
    kv = cfg.num_kv_heads
    assert seen["layers.1.attn.q"][0] == (2, 4, 12, 8)
    assert seen["layers.1.attn.k"][0] == (2, kv, 12, 8) and seen["layers.1.attn.v"][0] == (2, kv, 12, 8)
    assert seen["layers.1.attn.probs"][0] == (2, 4, 12, 12)
    assert seen["layers.2.out"][0] == (2, 12, 32)
    # the raw logits point has the padded vocabulary (64 -> 128); info says which columns are real
    assert seen["logits"][0] == (2, 12, 128) and seen["logits"][1]["vocab_size"] == 64
    assert seen["layers.1.attn.k"][1] == {"tp_dim": None, "layer": 1, "kind": "k"}


def test_probs_only_computed_when_wanted_and_perturbation_flows(monkeypatch):
    from megatronapp.model import attention

    calls = []
    real = attention.attention_probs
    monkeypatch.setattr(attention, "attention_probs", lambda *a: calls.append(1) or real(*a))
    ids = batch()[0]
    cap = Capture()
    model = build_model(gpt2(), capture=cap)
    clean = model(ids)
    seen = []
    cap.add("layers.?.out", lambda n, t, i: seen.append(n) and None)
    model(ids)
    assert seen == ["layers.0.out", "layers.1.out", "layers.2.out"] and not calls
    probs = []
    cap.add("layers.0.attn.probs", lambda n, t, i: probs.append(t) and None)
    torch.testing.assert_close(model(ids), clean, atol=1e-5, rtol=0)  # explicit path equals SDPA
    assert len(calls) == 1  # only the layer whose probs are watched
    torch.testing.assert_close(probs[0].sum(-1), torch.ones(2, 4, 12))
    assert torch.all(probs[0].triu(1) == 0)  # causal
    cap.clear()
    cap.add("layers.1.mlp.out", lambda n, t, i: t * 3.0)  # (a constant shift would vanish in LayerNorm)
    assert (model(ids) - clean).abs().max() > 1e-3


def test_grouped_query_attention_equals_repeated_kv_heads():
    # A GQA model equals a full multi-head model whose kv heads repeat each group's kv head.
    gqa_cfg = llama(num_kv_heads=2)
    mha_cfg = llama(num_kv_heads=4)
    gqa, mha = build_model(gqa_cfg, seed=1), build_model(mha_cfg, seed=1)
    d, h = gqa_cfg.head_dim, gqa_cfg.hidden_size
    with torch.no_grad():
        for name, p in mha.named_parameters():
            src = dict(gqa.named_parameters())[name]
            if name.endswith("attn.qkv.weight"):
                w = src.view(2, 4, d, h)  # [kv group, (2 q heads, k, v), d, h]
                q = w[:, :2].reshape(4 * d, h)
                k = w[:, 2].repeat_interleave(2, dim=0).reshape(4 * d, h)
                v = w[:, 3].repeat_interleave(2, dim=0).reshape(4 * d, h)
                p.copy_(fuse_qkv(q, k, v, 4, 4))
            else:
                p.copy_(src)
        ids = batch()[0]
        torch.testing.assert_close(gqa(ids), mha(ids), atol=1e-5, rtol=0)


def naive_window_attention(q, k, v, window):
    """Per-query loop: softmax over keys j with i - window < j <= i (the reference, no masks shared)."""
    _, nh, s, d = q.shape
    group = nh // k.shape[1]
    out = torch.zeros_like(q)
    for head in range(nh):
        kh, vh = k[:, head // group], v[:, head // group]
        for i in range(s):
            lo = 0 if window is None else max(0, i - window + 1)
            scores = torch.einsum("bd,bjd->bj", q[:, head, i], kh[:, lo:i + 1]) / math.sqrt(d)
            out[:, head, i] = torch.einsum("bj,bjd->bd", scores.softmax(-1), vh[:, lo:i + 1])
    return out


@pytest.mark.parametrize("window", [None, 1, 3])
def test_sliding_window_equals_explicit_reference(window):
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(2, 4, 9, 8, generator=g), torch.randn(2, 2, 9, 8, generator=g), torch.randn(2, 2, 9, 8,
                                                                                                     generator=g)
    torch.testing.assert_close(attention_core(q, k, v, 0, window), naive_window_attention(q, k, v, window),
                               atol=1e-5, rtol=0)


def test_sliding_window_in_the_model():
    ids = batch()[0]
    plain = build_model(llama(), seed=2)(ids)
    wide = build_model(llama(sliding_window=12), seed=2)(ids)
    cap = Capture()
    narrow_model = build_model(llama(sliding_window=3), seed=2, capture=cap)
    narrow = narrow_model(ids)
    torch.testing.assert_close(wide, plain)  # a window covering the sequence changes nothing
    assert (narrow - plain).abs().max() > 1e-3
    torch.testing.assert_close(narrow[:, :3], plain[:, :3], atol=1e-5, rtol=0)  # first 3 rows see the same keys
    probs = []
    cap.add("layers.0.attn.probs", lambda n, t, i: probs.append(t) and None)
    narrow_model(ids)
    i, j = torch.meshgrid(torch.arange(12), torch.arange(12), indexing="ij")
    assert torch.all(probs[0][..., (i - j >= 3) | (j > i)] == 0)


def test_parallel_block_runs_and_differs():
    ids, labels = batch()
    model = build_model(gpt2(parallel_block=True))
    assert all(layer.norm2 is None for layer in model.layers.values())
    loss = model(ids, labels=labels)
    loss.backward()
    assert math.isfinite(loss.item())
    assert all(p.grad is not None for p in model.parameters())
    sequential = build_model(gpt2())
    assert abs(sequential(ids, labels=labels).item() - loss.item()) > 1e-6


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("mode", ["selective", "full"])
def test_recompute_gives_identical_loss_and_grads(family, mode):
    cfg = FAMILIES[family](sliding_window=5)
    ids, labels = batch()
    ref = build_model(cfg, seed=4)
    ref_loss = ref(ids, labels=labels)
    ref_loss.backward()
    model = build_model(cfg, seed=4, recompute=mode)
    loss = model(ids, labels=labels)
    loss.backward()
    assert loss.item() == ref_loss.item()
    for name, g in grads(model).items():
        torch.testing.assert_close(g, ref.get_parameter(name).grad, atol=1e-6, rtol=0, msg=name)


@pytest.mark.parametrize("cfg", [gpt2(), llama(), llama(sliding_window=4), gpt2(parallel_block=True)],
                         ids=["gpt2", "llama-gqa", "llama-window", "gpt2-parallel"])
def test_kv_cached_generation_matches_full_forward(cfg):
    model = build_model(cfg, seed=6)
    ids = batch(s=10)[0]
    with torch.no_grad():
        full = model(ids)
        cache = KVCache(model, batch=2, max_len=16)
        steps = [model(ids[:, :4], kv_cache=cache, start_pos=0)]
        for pos in range(4, 10):  # one token per step
            steps.append(model(ids[:, pos:pos + 1], kv_cache=cache, start_pos=cache.length))
        assert cache.length == 10
        torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=0)
        # Greedy decoding through the cache agrees with re-running the whole prefix each step.
        cache.reset()
        seq, logits = ids[:, :3], model(ids[:, :3], kv_cache=cache)
        for _ in range(5):
            nxt = logits[:, -1].argmax(-1, keepdim=True)
            seq = torch.cat([seq, nxt], dim=1)
            logits = model(nxt, kv_cache=cache, start_pos=cache.length)
            torch.testing.assert_close(logits[:, -1], model(seq)[:, -1], atol=1e-5, rtol=0)
        with pytest.raises(ValueError, match="max_len"):
            model(ids, kv_cache=cache, start_pos=cache.length)
        with pytest.raises(ValueError, match="skips"):
            model(ids[:, :1], kv_cache=KVCache(model, 2, 16), start_pos=3)


@pytest.mark.parametrize("family,cuts", [("gpt2", (0, 1, 2, 3)), ("llama", (0, 2, 3)), ("gpt2", (0, 3, 3))])
def test_chunks_chained_equal_whole_model(family, cuts):
    cfg = FAMILIES[family]()
    ids, labels = batch()
    whole = build_model(cfg, seed=8)
    ref_loss = whole(ids, labels=labels)
    ref_loss.backward()
    n = len(cuts) - 1
    chunks = [TransformerChunk(cfg, cuts[c], cuts[c + 1], pre_process=c == 0, post_process=c == n - 1, seed=8)
              for c in range(n)]
    x = ids
    for c in chunks[:-1]:
        x = c(x)
    loss = chunks[-1](x, labels=labels)
    torch.testing.assert_close(loss, ref_loss, atol=1e-6, rtol=0)
    loss.backward()
    whole_params = dict(whole.named_parameters())
    for c in chunks:
        for name, p in c.named_parameters():
            if name == "output.weight" and cfg.tie_embeddings:
                continue
            assert torch.equal(p, whole_params[name]), name  # split-independent initialisation
            if p is c.shared_embedding_weight() and n > 1:
                continue  # partial on each end; their sum is checked below
            torch.testing.assert_close(p.grad, whole_params[name].grad, atol=1e-6, rtol=0, msg=name)
    first, last = chunks[0].shared_embedding_weight(), chunks[-1].shared_embedding_weight()
    if cfg.tie_embeddings:
        assert first is not None and last is not None
        if n > 1:
            assert first is not last and torch.equal(first, last)  # the last stage's copy starts identical
            # The engine all-reduces the two copies' gradients: their sum is the whole model's gradient.
            torch.testing.assert_close(first.grad + last.grad, whole.embedding.word.weight.grad, atol=1e-6, rtol=0)
    else:
        assert first is None and last is None


def test_user_errors_are_named():
    cfg = gpt2()
    with pytest.raises(ValueError, match="model.num_layers"):
        TransformerChunk(cfg, 2, 5, False, False)
    with pytest.raises(ValueError, match="recompute"):
        build_model(cfg, recompute="some")
    with pytest.raises(ValueError, match="max_seq_len"):
        build_model(cfg)(torch.zeros(1, 40, dtype=torch.long))
    with pytest.raises(TypeError, match="token ids"):
        build_model(cfg)(torch.randn(1, 4, 32))


@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_compute_stays_close_to_fp32(family):
    cfg = FAMILIES[family]()
    ids, labels = batch()
    ref = build_model(cfg, seed=9)(ids, labels=labels)
    model = build_model(cfg, seed=9).to(torch.bfloat16)
    loss = model(ids, labels=labels)
    loss.backward()
    assert loss.dtype == torch.float32  # the loss is reduced in fp32 whatever the compute dtype
    assert abs(loss.item() - ref.item()) < 2e-2
    assert all(p.grad.dtype == torch.bfloat16 and torch.isfinite(p.grad).all() for p in model.parameters())
    with torch.no_grad():
        cache = KVCache(model, 2, 16)
        assert model(ids[:, :3], kv_cache=cache).dtype == torch.bfloat16
        assert cache.keys[0].dtype == torch.bfloat16
