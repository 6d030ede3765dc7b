"""What the MegaScope tests share: the capture every layout is checked with, the embedded model saved as tensor-
parallel training ranks would save it, the one-process reference and the comparison with it, and the random
valid and invalid messages of the fuzz (one rank in test_scope_faults.py, tp = 2 in test_scope_tp.py)."""
from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from fastapi.testclient import TestClient

from megatronapp.data.tokenizer import ByteTokenizer
from megatronapp.scope import distributed
from megatronapp.scope.compress import decode
from megatronapp.scope.default_model import load_default_model
from megatronapp.scope.generate import ScopeModel, generate
from megatronapp.scope.protocol import Generate

FULL = {"pool": "none", "quant": "fp32"}
CAPTURE = {"points": ["attn.q", "attn.probs", "out", "logits"], "layers": [0, 3], "logit_lens": True,
           "pca_layer": 1, "per_point": {p: FULL for p in ("attn.q", "attn.probs", "out", "logits")}}


def write_checkpoint(root: str, tp: int) -> str:
    """The embedded model saved as `tp` tensor-parallel training ranks would save it (pp = dp = 1)."""
    import torch.nn.functional as F

    from megatronapp.config import ParallelConfig, RunConfig
    from megatronapp.train import checkpoint as ckpt

    model, cfg, _ = load_default_model()
    for t in range(tp):
        sd, dims = {}, {}
        for n, p in model.named_parameters():
            full = p.detach()
            if getattr(p, "vocab_size", None) is not None:  # zero padding rows up to this tp's padded vocabulary
                full = F.pad(full[:cfg.vocab_size], (0, 0, 0, cfg.padded_vocab_size(tp) - cfg.vocab_size))
            if getattr(p, "tensor_parallel", False):
                dims[n] = p.partition_dim
                full = full.chunk(tp, dim=p.partition_dim)[t]
            sd[n] = full.clone()
        ckpt.save_rank(Path(root), 1, t, {"step": 1, "chunks": [sd], "coord": {"dp": 0, "pp": 0, "tp": t},
                                           "partition_dims": [dims]})
    run = RunConfig(model=cfg, parallel=ParallelConfig(tp=tp))
    return str(ckpt.finalize(Path(root), 1, {"step": 1, "world_size": tp, "config": run.to_dict()}))


def same_as_checkpoint(sm, topo, path: str) -> bool:
    """The shard `load_shard` reads from a checkpoint equals the one it reads from the shipped weights."""
    other = distributed.load_shard(None, topo, checkpoint=path)
    return all(torch.equal(p, q) for p, q in zip(sm.model.parameters(), other.model.parameters()))


def reference(req: dict) -> list[dict]:
    """The messages one process serving the shipped model sends for `req` (as JSON would carry them)."""
    model, cfg, meta = load_default_model()
    msgs: list[dict] = []
    generate(ScopeModel(model, cfg, ByteTokenizer(), meta=meta), Generate.model_validate(req), msgs.append)
    return json.loads(json.dumps(msgs))


def compare(got: list[dict], want: list[dict]) -> None:
    """`got` served what `want` did: the same tokens, probabilities (1e-4), captured states, lens and PCA."""
    assert [m["type"] for m in got] == [m["type"] for m in want]
    for g, w in zip(got, want):
        if g["type"] == "step":
            if "next" in w:
                assert [r["id"] for r in g["next"]] == [r["id"] for r in w["next"]]
                for gr, wr in zip(g["next"], w["next"]):
                    assert gr["prob"] == pytest.approx(wr["prob"], abs=1e-4)
                    assert [t for t, _ in gr["top"]] == [t for t, _ in wr["top"]]
            assert set(g["states"]) == set(w["states"]) and len(w["states"]) == 7
            for name in w["states"]:
                a, b = decode(g["states"][name]), decode(w["states"][name])
                assert a.shape == b.shape and torch.allclose(a, b, atol=1e-4), name
            assert [[t for t, _ in row] for layer in g["lens"] for row in layer] == \
                   [[t for t, _ in row] for layer in w["lens"] for row in layer]
        elif g["type"] == "pca":
            assert torch.allclose(torch.tensor(g["points"]), torch.tensor(w["points"]), atol=1e-3)
        elif g["type"] == "done":
            assert g["texts"] == w["texts"] and g["new_tokens"] == w["new_tokens"]


def random_request(rng: random.Random) -> str:
    """A random message: junk, a wrong shape, or a generate request with random (often invalid) fields."""
    kind = rng.random()
    if kind < 0.15:
        return "".join(rng.choice("{}[]\":,ab1 \\\x00é") for _ in range(rng.randint(0, 40)))
    if kind < 0.3:
        return json.dumps(rng.choice([[1, 2], 3, "x", None, {"type": rng.choice(["ping", "info", "stop", "nope", 7])},
                                      {"type": "auth", "token": "t"}, {"type": "control", "action": "pause"}]))
    gen: dict = {"type": "generate", "prompts": [rng.choice(["a", "hello", "é€", "x" * 30])
                                                for _ in range(rng.randint(0, 3))],
                 "max_new_tokens": rng.choice([1, 2, 3, 0, 70, -1]), "greedy": rng.random() < 0.5,
                 "temperature": rng.choice([0.0, 0.5, 1.0, 1e-6, 11.0]), "top_k": rng.choice([0, 1, 5, 300]),
                 "seed": rng.randint(0, 5)}
    points = ["in", "attn.q", "attn.k", "attn.v", "attn.probs", "attn.out", "mlp.out", "out", "embed", "logits",
              "bogus"]
    gen["capture"] = {"points": rng.sample(points, rng.randint(0, 3)), "logit_lens": rng.random() < 0.3,
                      "layers": rng.choice([None, [0], [1], [5]]), "pca_layer": rng.choice([None, 0, 1, 9])}
    if rng.random() < 0.5:
        gen["perturbations"] = [{
            "kind": rng.choice(["gaussian", "uniform", "offset", "zero", "bitflip", "melt"]),
            "place": rng.choice(["weight", "activation", "hidden"]),
            "target": rng.choice(["out", "attn.q", "attn.probs", "mlp.out", "attn.qkv.weight", "mlp.fc1.weight",
                                  "final_norm.weight", "nope"]),
            "layers": rng.choice([None, [0], [1], [3]]), "rate": rng.choice([None, 0.1, 1.0]),
            "bit": rng.choice([None, 30, 31, 40]), "strength": rng.choice([0.0, 1.0, 1e6]),
            "indices": rng.choice([None, None, [0, 3], [10**9]])}]
    if rng.random() < 0.05:
        gen["surprise"] = True
    return json.dumps(gen)


def fuzz(client: TestClient, rng: random.Random, n: int) -> dict[str, int]:
    """Send n random messages one at a time; every one is answered (error, pong, info, done ...). A client is
    disconnected after 20 bad messages, so the fuzz opens a new connection every 16."""
    seen: dict[str, int] = {}
    for first in range(0, n, 16):
        with client.websocket_connect("ws://127.0.0.1/ws") as ws:
            assert ws.receive_json()["type"] == "hello"
            for _ in range(min(16, n - first)):
                raw = random_request(rng)
                ws.send_text(raw)
                if '"type": "stop"' in raw:
                    continue  # nothing runs: a stop has no answer
                while True:
                    m = ws.receive_json()
                    if m["type"] in ("done", "error", "pong", "info", "auth_ok", "busy"):
                        break
                kind = m["type"] if m["type"] != "error" else f"error:{m['code']}"
                seen[kind] = seen.get(kind, 0) + 1
                assert m.get("code") != "internal", (raw, m)  # every failure is a clear, user-fixable refusal
    return seen
