"""MegaScope serving the default model with tp=2 from two real gloo ranks: same tokens, probabilities and
captured states as the single-process model, through the real server and WebSocket protocol."""
from __future__ import annotations

import argparse
import json
import random

import pytest
import torch
from fastapi.testclient import TestClient

from megatronapp.launch import spawn
from megatronapp.model.transformer import KVCache
from megatronapp.scope import cli, distributed
from megatronapp.scope.default_model import load_default_model
from tests.scope_cases import CAPTURE, compare, fuzz, reference, same_as_checkpoint, write_checkpoint

FUZZ_TP = 100  # random requests on tp = 2 (1,000 run on one rank in test_scope_faults.py)

REQUESTS = [
    {"type": "generate", "prompts": ["Hello", "The quick"], "max_new_tokens": 4, "greedy": True,
     "capture": CAPTURE},
    {"type": "generate", "prompts": ["ab"], "max_new_tokens": 6, "temperature": 0.8, "top_k": 20, "seed": 7,
     "capture": CAPTURE, "perturbations": [
         {"kind": "gaussian", "place": "hidden", "layers": [1], "strength": 0.5, "seed": 3},
         {"kind": "offset", "place": "activation", "target": "mlp.out", "layers": [2], "strength": 0.2}]},
]
# sharded weights and heads under tp > 1: perturbed as one process would, each rank keeping its slice
WEIGHT_PERTURBATION = {"type": "generate", "prompts": ["x"], "max_new_tokens": 2, "capture": CAPTURE,
                       "perturbations": [
    {"kind": "zero", "place": "weight", "target": "attn.qkv.weight", "layers": [0], "heads": [3]},
    {"kind": "bitflip", "place": "weight", "target": "mlp.fc1.weight", "layers": [1], "indices": [7, 60000],
     "bit": 23},
    {"kind": "gaussian", "place": "activation", "target": "attn.k", "layers": [2], "strength": 0.3, "seed": 2}]}


def _until_done(ws) -> list[dict]:
    got: list[dict] = []
    while not got or got[-1]["type"] not in ("done", "error"):
        got.append(json.loads(ws.recv(timeout=60)))
    return got


def _tp_rank(rank: int, world: int, out: str, ckpt_tp2: str, ckpt_tp1: str) -> None:
    from websockets.sync.client import connect

    from megatronapp.parallel import topology
    from megatronapp.scope.server import ServerThread, create_app

    topo = topology.build(world, 1, 1)
    sm = distributed.load_shard(None, topo)
    # --checkpoint under tp > 1: the same slices, read straight from the matching rank's file or re-cut
    same = [same_as_checkpoint(sm, topo, ckpt_tp2), same_as_checkpoint(sm, topo, ckpt_tp1)]
    if rank != 0:
        torch.save({"worker_runs": distributed.worker_loop(sm, topo), "checkpoint": same}, f"{out}.1")
        return
    sm.runner = distributed.lockstep_runner(topo)
    server = ServerThread(create_app(sm)).start()
    weights = {n: p.detach().clone() for n, p in sm.model.named_parameters()}
    res: dict = {}
    try:
        with connect(f"ws://127.0.0.1:{server.port}/ws", open_timeout=30, max_size=None) as ws:
            res["hello"] = json.loads(ws.recv(timeout=30))
            res["runs"] = []
            for req in REQUESTS:
                ws.send(json.dumps(req))
                res["runs"].append(_until_done(ws))
            ws.send(json.dumps(WEIGHT_PERTURBATION))
            res["weights"] = _until_done(ws)
            # a stop mid-generation must end it on every rank, so that the next one still runs in lockstep
            ws.send(json.dumps({"type": "generate", "prompts": ["z"], "max_new_tokens": 100}))
            ws.send(json.dumps({"type": "stop"}))
            res["stopped"] = _until_done(ws)
            ws.send(json.dumps(REQUESTS[0]))
            res["after_stop"] = _until_done(ws)
        # random valid and invalid requests: every rank fails or succeeds at the same step, nobody hangs
        res["fuzz"] = fuzz(TestClient(create_app(sm), base_url="http://127.0.0.1"), random.Random(1), FUZZ_TP)
        with connect(f"ws://127.0.0.1:{server.port}/ws", open_timeout=30, max_size=None) as ws:
            json.loads(ws.recv(timeout=30))
            ws.send(json.dumps(REQUESTS[1]))
            res["after_fuzz"] = _until_done(ws)
    finally:
        server.stop()
        distributed.shutdown(topo)
    res["restored"] = all(torch.equal(p, weights[n]) for n, p in sm.model.named_parameters())  # bit-exact
    res["checkpoint"] = same
    torch.save(res, f"{out}.0")


def test_tp2_serving_matches_single_process(tmp_path):
    out = str(tmp_path / "res")
    spawn(_tp_rank, 2, out, write_checkpoint(str(tmp_path / "tp2"), 2), write_checkpoint(str(tmp_path / "tp1"), 1))
    res, worker = torch.load(f"{out}.0"), torch.load(f"{out}.1")
    assert res["hello"]["model"]["name"] == "embedded gpt2-tiny (tp=2)"
    for got, req in zip(res["runs"], REQUESTS):
        compare(got, reference(req))
    want = reference(WEIGHT_PERTURBATION)
    compare(res["weights"], want)
    plain = reference({**WEIGHT_PERTURBATION, "perturbations": []})
    assert want[1]["states"]["layers.3.attn.q"] != plain[1]["states"]["layers.3.attn.q"]  # they did act
    assert res["stopped"][-1]["type"] == "done", res["stopped"][-1]
    compare(res["after_stop"], reference(REQUESTS[0]))
    assert res["fuzz"].get("done", 0) > 3 and res["fuzz"].get("error:invalid", 0) > 20, res["fuzz"]
    compare(res["after_fuzz"], reference(REQUESTS[1]))
    assert res["restored"]
    assert res["checkpoint"] == worker["checkpoint"] == [True, True]
    assert worker["worker_runs"] >= 5 + res["fuzz"]["done"]


def test_load_shard_single_rank_matches_default():
    # tp=1 through load_shard is the shipped model, parameter for parameter
    from megatronapp.parallel.topology import build

    sm = distributed.load_shard(None, build(1, 1, 1))
    model, _, _ = load_default_model()
    assert all(torch.equal(p, q) for p, q in zip(sm.model.parameters(), model.parameters()))
    assert sm.lens_weight is None and isinstance(KVCache(sm.model, 1, 4), KVCache)


@pytest.mark.parametrize("argv, fragment", [
    (["--tp", "2", "--pp", "2", "--nproc", "2"], "--nproc 2 must equal --tp 2 x --pp 2 = 4"),
    (["--tp", "2", "--nproc", "1"], "--nproc 1 must equal --tp 2"),
    (["--pp", "5", "--nproc", "5"], "num_layers=4 < --pp 5"),
    (["--tp", "3", "--nproc", "3"],
     "num_heads=4, num_kv_heads=4, ffn_hidden_size=512 not divisible by --tp 3"),
    (["--tp", "2", "--nproc", "2", "--checkpoint", "no/such/dir"], "no/such/dir"),
])
def test_cli_refuses_unservable_layouts(argv, fragment, capsys):
    ap = argparse.ArgumentParser()
    cli.register(ap.add_subparsers())
    args = ap.parse_args(["scope", "serve", *argv])
    assert args.func(args) == 2
    assert fragment in capsys.readouterr().err
