"""MegaScope unit tests: capture names and shapes, compression math, perturbation semantics, generation."""
from __future__ import annotations

import math

import pytest
import torch

from megatronapp.config import ModelConfig
from megatronapp.data.tokenizer import ByteTokenizer
from megatronapp.model.capture import Capture
from megatronapp.model.transformer import KVCache, build_model
from megatronapp.scope.capture import Recorder, point_names
from megatronapp.scope.compress import Compression, bucket_bounds, compress, decode, encode, pool
from megatronapp.scope.generate import ScopeModel, generate, pca_2d
from megatronapp.scope.perturb import (
    Perturbation,
    Perturber,
    apply,
    flip_bits,
    generator_for,
    load_perturbations,
)
from megatronapp.scope.protocol import Generate


def small_cfg(**kw) -> ModelConfig:
    base = {"family": "llama", "vocab_size": 256, "hidden_size": 32, "num_layers": 2, "num_heads": 4,
            "num_kv_heads": 2, "max_seq_len": 64}
    base.update(kw)
    return ModelConfig(**base)


@pytest.fixture(scope="module")
def sm() -> ScopeModel:
    cfg = small_cfg()
    return ScopeModel(build_model(cfg, seed=3).eval(), cfg, ByteTokenizer())


def gen_req(**kw) -> Generate:
    base = {"type": "generate", "prompts": ["Hello", "Hi there"], "max_new_tokens": 5, "greedy": True}
    base.update(kw)
    return Generate(**base)


def run(sm: ScopeModel, req: Generate) -> list[dict]:
    msgs: list[dict] = []
    generate(sm, req, msgs.append)
    return msgs


# ---------------------------------------------------------------- capture
def test_point_names_and_errors():
    assert point_names(["attn.q", "logits"], [1], 2) == ["layers.1.attn.q", "logits"]
    assert point_names(["out"], None, 2) == ["layers.0.out", "layers.1.out"]
    with pytest.raises(ValueError, match="layers \\[5\\]"):
        point_names(["out"], [5], 2)
    with pytest.raises(ValueError, match="unknown capture point"):
        point_names(["attn.qq"], None, 2)


def test_recorder_shapes_gqa(sm):
    cfg = sm.cfg
    ids = torch.randint(0, 256, (2, 7))
    names = point_names(["attn.q", "attn.k", "attn.v", "attn.probs", "mlp.out", "out", "logits"], None, 2)
    with torch.no_grad(), Recorder(sm.model.capture, names) as rec:
        logits = sm.model(ids)
    got = rec.take()
    d = cfg.head_dim
    assert got["layers.1.attn.q"].shape == (2, 4, 7, d)
    assert got["layers.1.attn.k"].shape == (2, 2, 7, d)  # grouped-query: 2 kv heads, not 4
    assert got["layers.0.attn.v"].shape == (2, 2, 7, d)
    assert got["layers.0.attn.probs"].shape == (2, 4, 7, 7)
    torch.testing.assert_close(got["layers.0.attn.probs"].sum(-1), torch.ones(2, 4, 7))
    assert got["layers.1.mlp.out"].shape == (2, 7, 32)
    torch.testing.assert_close(got["logits"], logits)
    assert not sm.model.capture.active  # detached


def test_recorder_kv_cached_step_matches_full_pass(sm):
    ids = torch.randint(0, 256, (1, 6))
    with torch.no_grad(), Recorder(sm.model.capture, ["layers.1.out"]) as rec:
        sm.model(ids)
        full = rec.take()["layers.1.out"]
        cache = KVCache(sm.model, 1, 6)
        sm.model(ids[:, :5], kv_cache=cache, start_pos=0)
        rec.take()
        sm.model(ids[:, 5:], kv_cache=cache, start_pos=5)
        last = rec.take()["layers.1.out"]
    assert last.shape == (1, 1, 32)
    torch.testing.assert_close(last[0, 0], full[0, 5], atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------- compression
def test_bucket_bounds_spread_remainder_evenly():
    b = bucket_bounds(10, 4)
    assert b.tolist() == [0, 2, 5, 7, 10]
    sizes = (b[1:] - b[:-1]).tolist()
    assert max(sizes) - min(sizes) <= 1 and sum(sizes) == 10
    for n in range(1, 40):
        for k in range(1, n + 1):
            s = (bucket_bounds(n, k)[1:] - bucket_bounds(n, k)[:-1])
            assert s.sum() == n and s.max() - s.min() <= 1


def test_pool_matches_reference_loops():
    x = torch.randn(3, 11, 5)
    for kind in ("mean", "max", "absmax"):
        got = pool(x, kind, 4, axis=1)
        bounds = bucket_bounds(11, 4).tolist()
        for i in range(4):
            seg = x[:, bounds[i]:bounds[i + 1]]
            if kind == "mean":
                want = seg.mean(1)
            elif kind == "max":
                want = seg.amax(1)
            else:
                want = seg.gather(1, seg.abs().argmax(1, keepdim=True)).squeeze(1)
            torch.testing.assert_close(got[:, i], want)
    assert pool(x, "mean", 64, axis=1) is x  # fewer items than buckets: unchanged


def test_last_bucket_not_biased():
    # a ramp pooled into 3 buckets: the means must be the centres of near-equal segments
    x = torch.arange(10.0)
    got = pool(x, "mean", 3, axis=0)
    assert got.tolist() == [1.0, 4.0, 7.5]  # [0..2], [3..5], [6..9]; torch.chunk would give 4, 4, 2 items


def test_int8_and_fp16_roundtrip():
    x = torch.randn(4, 50) * 3
    q = encode(x, "int8")
    back = decode(q)
    assert q["dtype"] == "int8" and math.isclose(q["scale"], float(x.abs().max()) / 127, rel_tol=1e-6)
    assert (back - x).abs().max() <= q["scale"] / 2 + 1e-6
    torch.testing.assert_close(decode(encode(x, "fp16")), x.half().float())
    assert decode(encode(torch.zeros(3), "int8")).tolist() == [0.0, 0.0, 0.0]


def test_compress_topk_keeps_largest():
    x = torch.tensor([[0.1, -5.0, 0.2], [3.0, 0.0, -0.3]])
    c = compress(x, Compression(topk=2, quant="fp32"))
    assert c["topk"]["indices"] == [1, 3]
    assert decode(c).tolist() == [-5.0, 3.0]


def test_compression_refuses_unknown_kinds():
    with pytest.raises(ValueError):
        Compression(pool="median")
    with pytest.raises(ValueError):
        Compression(quant="__import__('os')")


# ---------------------------------------------------------------- perturbations
def test_bitflip_changes_exactly_the_chosen_bit_of_the_chosen_elements():
    for dtype, view, nbits in ((torch.float32, torch.int32, 32), (torch.bfloat16, torch.int16, 16),
                               (torch.float16, torch.int16, 16)):
        x = torch.randn(3, 7).to(dtype)
        for bit in (0, nbits - 2, nbits - 1):
            spec = Perturbation(kind="bitflip", indices=[2, 9, 20], bit=bit,
                                storage="native" if dtype == torch.float32 else
                                {torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype])
            y = apply(x, spec, generator_for(0, "t", 0))
            diff = torch.bitwise_xor(x.view(view), y.view(view)).reshape(-1)
            changed = diff.nonzero().reshape(-1).tolist()
            assert changed == [2, 9, 20]
            expected = torch.tensor(1, dtype=view) << bit
            assert all(int(diff[i]) == int(expected) for i in changed)


def test_bitflip_random_bit_flips_one_bit_per_chosen_element():
    x = torch.randn(1000)
    y = apply(x, Perturbation(kind="bitflip", rate=0.1, seed=5), generator_for(5, "p", 0))
    diff = torch.bitwise_xor(x.view(torch.int32), y.view(torch.int32))
    touched = diff != 0
    assert 50 < int(touched.sum()) < 150
    pops = [(int(d) & 0xFFFFFFFF).bit_count() for d in diff[touched]]
    assert set(pops) == {1}


def test_bitflip_storage_bf16_of_fp32_tensor_keeps_untouched_elements():
    x = torch.randn(20, generator=torch.Generator().manual_seed(0))
    # bit 14 is bf16's top exponent bit: for |x| in [1, 2) the flip gives inf/NaN, whose bits are not preserved
    # through fp32; 0.3 (exponent 125) flips to a large finite value, so the bit comparison below is exact.
    x[4] = 0.3
    y = apply(x, Perturbation(kind="bitflip", indices=[4], bit=14, storage="bf16"), generator_for(0, "n", 0))
    same = torch.ones(20, dtype=torch.bool)
    same[4] = False
    assert torch.equal(x[same], y[same])
    flipped = torch.bitwise_xor(x[4:5].bfloat16().view(torch.int16), y[4:5].bfloat16().view(torch.int16))
    assert int(flipped) == 1 << 14


def test_flip_bits_sign_of_negative_zero():
    x = torch.tensor([0.0, -0.0])
    y = flip_bits(x, 31, None)
    assert torch.signbit(y).tolist() == [True, False]


def test_zero_strength_is_bit_identical_and_gaussian_statistics():
    x = torch.randn(200_000)
    x[0] = -0.0
    for kind in ("gaussian", "uniform", "offset"):
        assert torch.equal(apply(x, Perturbation(kind=kind, strength=0.0), generator_for(0, "z", 0)).view(torch.int32),
                           x.view(torch.int32))
    noise = apply(x, Perturbation(kind="gaussian", strength=0.5, seed=1), generator_for(1, "g", 0)) - x
    assert abs(float(noise.mean())) < 0.005
    assert abs(float(noise.std()) - 0.5) < 0.005
    assert abs(float(((noise / 0.5) ** 4).mean()) - 3.0) < 0.1  # Gaussian kurtosis
    u = apply(torch.ones(100_000), Perturbation(kind="uniform", strength=0.2), generator_for(0, "u", 0))
    assert 0.8 <= float(u.min()) and float(u.max()) <= 1.2 and abs(float(u.mean()) - 1.0) < 0.003


def test_offset_zero_and_heads():
    x = torch.randn(2, 4, 3, 5)
    y = apply(x, Perturbation(kind="offset", strength=2.0, place="activation", target="attn.q", heads=[1]),
              generator_for(0, "o", 0), head_dim=1)
    d = y - x
    assert torch.allclose(d[:, 1], torch.full_like(d[:, 1], 2.0))
    assert torch.equal(d[:, [0, 2, 3]], torch.zeros_like(d[:, [0, 2, 3]]))
    z = apply(x, Perturbation(kind="zero", place="activation", target="attn.q", heads=[3]),
              generator_for(0, "o", 0), head_dim=1)
    assert torch.equal(z[:, 3], torch.zeros_like(z[:, 3])) and torch.equal(z[:, :3], x[:, :3])


def test_gradients_flow_as_documented():
    x = torch.randn(50, requires_grad=True)
    for spec, want in ((Perturbation(kind="gaussian", strength=1.0), torch.ones(50)),
                       (Perturbation(kind="bitflip", rate=0.5, bit=30), torch.ones(50))):
        (g,) = torch.autograd.grad(apply(x, spec, generator_for(0, "g", 0)).sum(), x)
        assert torch.equal(g, want)
    spec = Perturbation(kind="zero", indices=[3, 4])
    (g,) = torch.autograd.grad(apply(x, spec, generator_for(0, "g", 0)).sum(), x)
    assert g[3] == 0 and g[4] == 0 and g[5] == 1
    spec = Perturbation(kind="uniform", strength=0.3)
    y = apply(x, spec, generator_for(0, "g", 0))
    (g,) = torch.autograd.grad(y.sum(), x)
    torch.testing.assert_close(g, (y / x).detach())


def test_seeds_reproduce_and_differ():
    x = torch.randn(1000)
    spec = Perturbation(kind="gaussian", strength=1.0, seed=7)
    a = apply(x, spec, generator_for(7, "layers.0.out", 0))
    b = apply(x, spec, generator_for(7, "layers.0.out", 0))
    c = apply(x, spec, generator_for(8, "layers.0.out", 0))
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_weight_perturbation_restores_originals_exactly(sm):
    before = {k: v.clone() for k, v in sm.model.state_dict().items()}
    specs = [Perturbation(kind="bitflip", place="weight", target="attn.qkv.weight", rate=0.2, layers=[0]),
             Perturbation(kind="gaussian", place="weight", target="mlp.down.weight", strength=0.3),
             Perturbation(kind="offset", place="weight", target="attn.proj.weight", heads=[2], strength=1.0)]
    with Perturber(specs, sm.model, sm.model.capture, sm.cfg):
        now = sm.model.state_dict()
        assert not torch.equal(now["layers.0.attn.qkv.weight"], before["layers.0.attn.qkv.weight"])
        assert torch.equal(now["layers.1.attn.qkv.weight"], before["layers.1.attn.qkv.weight"])
        proj = now["layers.0.attn.proj.weight"] - before["layers.0.attn.proj.weight"]
        d = sm.cfg.head_dim
        assert torch.allclose(proj[:, 2 * d:3 * d], torch.ones(32, d)) and proj[:, :2 * d].abs().sum() == 0
    for k, v in sm.model.state_dict().items():
        assert torch.equal(v.view(torch.int32) if v.is_floating_point() else v,
                           before[k].view(torch.int32) if v.is_floating_point() else before[k]), k


def test_weight_head_mask_selects_query_rows_in_grouped_layout(sm):
    spec = Perturbation(kind="offset", place="weight", target="attn.qkv.weight", heads=[3], strength=1.0, layers=[1])
    before = sm.model.state_dict()["layers.1.attn.qkv.weight"].clone()
    with Perturber([spec], sm.model, sm.model.capture, sm.cfg):
        diff = sm.model.state_dict()["layers.1.attn.qkv.weight"] - before
    q, k, v = sm.model.layers["1"].attn.split_qkv(diff.T.unsqueeze(0))  # [1, in, out] -> heads
    assert q[0, 3].abs().sum() > 0 and q[0, :3].abs().sum() == 0
    assert k.abs().sum() == 0 and v.abs().sum() == 0


def test_spec_validation_messages(tmp_path):
    with pytest.raises(ValueError, match="needs `rate`"):
        Perturbation(kind="bitflip")
    with pytest.raises(ValueError, match="not an activation point"):
        Perturbation(kind="zero", target="os.system")
    with pytest.raises(ValueError, match="heads"):
        Perturbation(kind="zero", target="mlp.out", heads=[0])
    with pytest.raises(ValueError, match="outside a 16-bit"):
        Perturbation(kind="bitflip", rate=0.1, bit=20, storage="bf16")
    f = tmp_path / "p.yaml"
    f.write_text("perturbations:\n  - {kind: bitflip, place: hidden, rate: 0.01, bit: 30, layers: [1]}\n"
                 "  - {kind: gaussian, strength: 0.1, target: mlp.out}\n")
    specs = load_perturbations(f)
    assert [s.kind for s in specs] == ["bitflip", "gaussian"] and specs[0].point(1) == "layers.1.out"
    f.write_text("- {kind: nope}\n")
    with pytest.raises(ValueError, match="item 0"):
        load_perturbations(f)


# ---------------------------------------------------------------- generation
def test_generation_streams_tokens_probs_and_states(sm):
    req = gen_req(capture={"points": ["attn.q", "attn.k", "attn.probs", "mlp.out"], "layers": [1],
                           "logit_lens": True, "pca_layer": 0})
    msgs = run(sm, req)
    kinds = [m["type"] for m in msgs]
    assert kinds[0] == "start" and kinds[-2:] == ["pca", "done"]
    steps = [m for m in msgs if m["type"] == "step"]
    # prefill up to the shortest prompt (5), then one position per step up to 8 + 5 = 13
    assert steps[0]["positions"] == [0, 5] and all(s["positions"][1] - s["positions"][0] == 1 for s in steps[1:])
    assert steps[-1]["positions"][1] == 13 and "next" not in steps[-1]
    row0 = [s["next"][0] for s in steps if "next" in s]
    assert sum(r["new"] for r in row0) == 5 and all(0 < r["prob"] <= 1 for r in row0)
    row1 = [s["next"][1] for s in steps if "next" in s]
    assert [r["forced"] for r in row1[:3]] == [True, True, True]  # "Hi there" still in its prompt
    st = steps[1]["states"]
    assert st["layers.1.attn.q"]["orig_shape"] == [2, 4, 1, 8] and st["layers.1.attn.k"]["orig_shape"] == [2, 2, 1, 8]
    assert st["layers.1.attn.probs"]["shape"] == [2, 4, 1, 6]
    assert len(steps[0]["lens"]) == 2 and len(steps[0]["lens"][0][0]) == 5
    done = msgs[-1]
    assert done["new_tokens"] == 10 and done["texts"][0].startswith("Hello")


def test_generation_matches_uncached_greedy(sm):
    msgs = run(sm, gen_req(prompts=["abc"], max_new_tokens=6))
    ids = torch.tensor([list(b"abc")])
    with torch.no_grad():
        for _ in range(6):
            ids = torch.cat([ids, sm.model(ids)[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert msgs[-1]["texts"][0] == ByteTokenizer().decode(ids[0].tolist())


def test_zero_strength_perturbation_is_identical_to_none_and_bitflip_changes_output(sm):
    base = run(sm, gen_req(capture={"points": ["out"]}))
    zero = run(sm, gen_req(capture={"points": ["out"]}, perturbations=[
        {"kind": "gaussian", "place": "hidden", "strength": 0.0},
        {"kind": "uniform", "place": "weight", "target": "mlp.up.weight", "strength": 0.0}]))
    sb = [m for m in base if m["type"] == "step"]
    sz = [m for m in zero if m["type"] == "step"]
    assert [m.get("next") for m in sb] == [m.get("next") for m in sz]
    assert [m["states"] for m in sb] == [m["states"] for m in sz]  # compressed bytes identical
    flip = run(sm, gen_req(perturbations=[{"kind": "bitflip", "place": "hidden", "rate": 0.3, "bit": 30,
                                           "layers": [0]}]))
    assert flip[-1]["texts"] != base[-1]["texts"]
    again = run(sm, gen_req(perturbations=[{"kind": "bitflip", "place": "hidden", "rate": 0.3, "bit": 30,
                                            "layers": [0]}]))
    assert again[-1]["texts"] == flip[-1]["texts"]  # seeded: reproducible


def test_sampling_seeded_and_length_errors(sm):
    a = run(sm, gen_req(greedy=False, temperature=1.0, top_k=20, seed=4))[-1]["texts"]
    b = run(sm, gen_req(greedy=False, temperature=1.0, top_k=20, seed=4))[-1]["texts"]
    assert a == b
    with pytest.raises(ValueError, match="max_seq_len=64"):
        run(sm, gen_req(prompts=["x" * 60], max_new_tokens=10))


def test_pca_2d_recovers_dominant_direction():
    g = torch.Generator().manual_seed(0)
    t = torch.randn(100, 1, generator=g)
    x = t * torch.tensor([[3.0, 0, 0, 0]]) + 0.01 * torch.randn(100, 4, generator=g)
    coords, ratios = pca_2d(x)
    assert ratios[0] > 0.99
    assert abs(float(torch.corrcoef(torch.stack([coords[:, 0], t[:, 0]]))[0, 1])) > 0.999


def test_capture_hook_sees_perturbed_value():
    cap = Capture()
    seen = []
    p = Perturber([Perturbation(kind="offset", place="hidden", strength=1.0, layers=[0])], torch.nn.Linear(1, 1),
                  cap, small_cfg())
    with p, Recorder(cap, ["layers.0.out"]) as rec:
        seen.append(cap.point("layers.0.out", torch.zeros(2)))
    assert seen[0].tolist() == [1.0, 1.0] and rec.take()["layers.0.out"].tolist() == [1.0, 1.0]


def test_destructive_bitflips_still_give_strict_json(sm):
    import json

    msgs = run(sm, gen_req(capture={"points": ["out"], "logit_lens": True, "pca_layer": 1}, perturbations=[
        {"kind": "bitflip", "place": "hidden", "rate": 0.5, "bit": 30, "layers": [0]}]))
    for m in msgs:
        json.dumps(m, allow_nan=False)  # raises on NaN/inf
    pca = next(m for m in msgs if m["type"] == "pca")
    assert pca["dropped_non_finite"] + len(pca["points"]) == 2 * 13
