"""MegaScope under bad luck and bad input: non-finite logits, requests over the byte budget, and a fuzz of
1,000 random valid and invalid messages that the server must answer one by one and survive."""
from __future__ import annotations

import json
import random

import pytest
import torch
from fastapi.testclient import TestClient

from megatronapp.config import ModelConfig
from megatronapp.data.tokenizer import ByteTokenizer
from megatronapp.model.transformer import build_model
from megatronapp.scope import budget
from megatronapp.scope.generate import ScopeModel, default_compression, generate, mask_non_finite, plan
from megatronapp.scope.protocol import Generate
from megatronapp.scope.server import create_app
from tests.scope_cases import fuzz

CFG = ModelConfig(family="gpt2", vocab_size=256, hidden_size=32, num_layers=2, num_heads=2, max_seq_len=64)
# the top exponent bit of every element of layer 0's output: inf and NaN reach the logits
NAN_MAKER = {"kind": "bitflip", "place": "hidden", "layers": [0], "rate": 1.0, "bit": 30}


@pytest.fixture(scope="module")
def sm() -> ScopeModel:
    return ScopeModel(build_model(CFG, seed=1).eval(), CFG, ByteTokenizer(), name="test")


def test_mask_non_finite_reports_and_masks():
    logits = torch.tensor([[1.0, float("nan"), float("inf"), 2.0], [float("nan")] * 4])
    clean, n_bad, dead = mask_non_finite(logits)
    assert n_bad.tolist() == [2, 4] and dead.tolist() == [False, True]
    assert clean[0].tolist() == [1.0, float("-inf"), float("-inf"), 2.0] and clean[1].tolist() == [0.0] * 4


@pytest.mark.parametrize("greedy", [True, False])
def test_non_finite_logits_are_masked_and_reported(sm, greedy):
    msgs: list[dict] = []
    req = Generate(type="generate", prompts=["ab", "c"], max_new_tokens=3, greedy=greedy, temperature=0.7,
                   top_k=5, perturbations=[NAN_MAKER])
    done = generate(sm, req, msgs.append)
    assert done["new_tokens"] == 6 and not done["cancelled"]
    rows = [r for m in msgs if m["type"] == "step" for r in m.get("next", [])]
    assert rows and all(r["non_finite"] > 0 for r in rows)
    json.dumps(msgs, allow_nan=False)  # strict JSON: no NaN reaches the browser


def test_budget_refuses_naming_the_capture_to_pool(sm):
    req = Generate(type="generate", prompts=["x" * 40] * 8, max_new_tokens=20,
                   capture={"points": ["attn.probs", "mlp.out"],
                            "per_point": {"attn.probs": {"pool": "none", "quant": "fp32"}}})
    small = ScopeModel(sm.model, CFG, sm.tokenizer, max_request_bytes=2**18)
    with pytest.raises(ValueError, match=r"capture 'attn.probs' alone costs .* pool it \(capture.per_point"):
        plan(small, req)
    plan(sm, req)  # the default budget allows it
    est = budget.estimate(CFG, 8, 40, 60, ["layers.0.attn.probs"],
                          {"attn.probs": default_compression("attn.probs", CFG, 60)})
    # step 0: 40 queries x 40 keys; then one query each over 41..60 keys; 2 heads, 8 rows, fp16, base64
    want = 8 * 2 * (40 * 40 + sum(range(41, 61))) * 2 * 4 / 3
    assert est.streamed["attn.probs"] == pytest.approx(want)


def test_attention_is_pooled_by_default_above_a_sequence_length():
    assert default_compression("attn.probs", CFG, budget.POOL_ATTENTION_ABOVE).pool == "none"
    long = default_compression("attn.probs", CFG, budget.POOL_ATTENTION_ABOVE + 1)
    assert long.pool == "mean" and long.axis == -1


def test_fuzz_1000_messages_one_rank(sm):
    client = TestClient(create_app(sm), base_url="http://127.0.0.1")
    seen = fuzz(client, random.Random(0), 1000)
    assert seen.get("done", 0) > 50 and seen.get("error:invalid", 0) > 100, seen
    with client.websocket_connect("ws://127.0.0.1/ws") as ws:
        ws.receive_json()
        ws.send_json({"type": "ping"})
        assert ws.receive_json() == {"type": "pong"}
    # and the model is untouched: the same text as a fresh copy
    msgs: list[dict] = []
    generate(sm, Generate(type="generate", prompts=["ab"], max_new_tokens=3, greedy=True), msgs.append)
    fresh = ScopeModel(build_model(CFG, seed=1).eval(), CFG, ByteTokenizer())
    ref: list[dict] = []
    generate(fresh, Generate(type="generate", prompts=["ab"], max_new_tokens=3, greedy=True), ref.append)
    assert msgs[-1]["texts"] == ref[-1]["texts"]
