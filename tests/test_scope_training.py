"""MegaScope's training hook: metrics every step, a probe generation every N steps, streamed to a live page."""
from __future__ import annotations

import json

import torch
from websockets.sync.client import connect

from megatronapp.config import ModelConfig
from megatronapp.model.transformer import build_model
from megatronapp.scope.training import TrainingScope


def test_training_scope_publishes_metrics_and_probe_generations():
    cfg = ModelConfig(family="gpt2", vocab_size=256, hidden_size=32, num_layers=2, num_heads=2, max_seq_len=64)
    model = build_model(cfg, seed=0)
    model.train()
    lines: list[str] = []
    scope = TrainingScope(0, every=2, probe="ab", probe_tokens=3, announce=lines.append)
    try:
        assert lines[0].startswith("MegaScope (training) at http://127.0.0.1:")
        with connect(scope.ws_url, open_timeout=30) as ws:
            hello = json.loads(ws.recv(timeout=30))
            assert hello["type"] == "hello" and hello["read_only"] is True
            ws.send(json.dumps({"type": "generate", "prompts": ["x"]}))
            assert json.loads(ws.recv(timeout=30))["code"] == "read_only"
            before = {k: v.clone() for k, v in model.state_dict().items()}
            scope.on_step(1, [model], {"loss": 2.5, "lr": 1e-3, "grad_norm": 0.7})
            scope.on_step(2, [model], {"loss": 2.25, "lr": 1e-3})
            got = []
            while not got or got[-1]["type"] != "done":
                got.append(json.loads(ws.recv(timeout=30)))
            kinds = [m["type"] for m in got]
            assert kinds[:4] == ["train", "train", "info", "start"] and kinds.count("step") == 4 and "pca" in kinds
            assert got[0] == {"type": "train", "step": 1, "loss": 2.5, "lr": 1e-3, "grad_norm": 0.7}
            steps = [m for m in got if m["type"] == "step"]
            assert "layers.1.attn.probs" in steps[0]["states"] and "lens" in steps[0]
        assert model.training  # put back in train mode
        assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())
        assert not model.capture.active  # no hooks left on the training model
        assert [h["step"] for h in scope.history] == [1, 2]
    finally:
        scope.close()


def test_console_pauses_steps_once_and_resumes():
    import threading

    cfg = ModelConfig(family="gpt2", vocab_size=256, hidden_size=32, num_layers=2, num_heads=2, max_seq_len=64)
    model = build_model(cfg, seed=0)
    scope = TrainingScope(0, every=1000, announce=lambda s: None)
    done: list[int] = []
    stop = threading.Event()

    def trainer() -> None:  # what the trainer's step-end hook does, as fast as it can
        step = 0
        while not stop.is_set() and step < 10_000:
            step += 1
            scope.on_step(step, [model], {"loss": 1.0})
            done.append(step)

    def state(ws) -> dict:
        while True:
            m = json.loads(ws.recv(timeout=30))
            if m["type"] == "train_state":
                return m

    try:
        with connect(scope.ws_url, open_timeout=30) as ws:
            hello = json.loads(ws.recv(timeout=30))
            assert hello["training"] == {"type": "train_state", "step": 0, "paused": False, "waiting": False,
                                         "every": 1000}
            ws.send(json.dumps({"type": "control", "action": "pause"}))
            assert state(ws)["paused"] is True
            runner = threading.Thread(target=trainer, daemon=True)
            runner.start()
            waiting = state(ws)  # the trainer stopped after the step it was in
            while not waiting["waiting"]:
                waiting = state(ws)
            held = waiting["step"]
            assert done == list(range(1, held))  # on_step(held) has not returned: step held+1 never began
            ws.send(json.dumps({"type": "control", "action": "step"}))
            m = state(ws)
            while not (m["waiting"] and m["step"] == held + 1):
                m = state(ws)
            assert done == list(range(1, held + 1))  # exactly one more step ran
            ws.send(json.dumps({"type": "control", "action": "every", "every": 7}))
            assert state(ws)["every"] == 7 and scope.every == 7
            ws.send(json.dumps({"type": "control", "action": "resume"}))
            m = state(ws)
            while m["paused"] or m["waiting"]:
                m = state(ws)
            stop.set()
            runner.join(timeout=60)
            assert len(done) > held + 1
    finally:
        stop.set()
        scope.close()


def test_probe_is_skipped_while_no_page_watches():
    cfg = ModelConfig(family="gpt2", vocab_size=256, hidden_size=32, num_layers=2, num_heads=2, max_seq_len=64)
    model = build_model(cfg, seed=0)
    scope = TrainingScope(0, every=1, probe="ab", probe_tokens=2, announce=lambda s: None)
    try:
        scope.on_step(1, [model], {"loss": 1.0})
        assert scope.app.state.scope_model is None  # nobody connected: no probe ran
        scope.always = True
        scope.on_step(2, [model], {"loss": 1.0})
        assert scope.app.state.scope_model is not None
    finally:
        scope.close()


def test_console_on_loopback_needs_the_token():
    """Any local user could pause a run (and under --supervise a pause becomes a restart): no token, no control."""
    lines: list[str] = []
    scope = TrainingScope(0, every=1000, announce=lines.append)
    try:
        assert "?token=" in lines[0]
        with connect(f"ws://127.0.0.1:{scope.server.port}/ws", open_timeout=30) as ws:
            ws.send(json.dumps({"type": "control", "action": "pause"}))
            assert json.loads(ws.recv(timeout=30))["code"] == "unauthorized"
        assert not scope.paused
    finally:
        scope.close()
