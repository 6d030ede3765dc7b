"""MegaScope WebSocket conversations through FastAPI's TestClient: good, malformed, oversized, hostile, busy."""
from __future__ import annotations

import asyncio
import json
import threading

import pytest
from fastapi.testclient import TestClient
from starlette.websockets import WebSocketDisconnect

from megatronapp.config import ModelConfig
from megatronapp.data.tokenizer import ByteTokenizer
from megatronapp.model.transformer import build_model
from megatronapp.scope import protocol
from megatronapp.scope.generate import ScopeModel
from megatronapp.scope.server import create_app

LOCAL = "http://127.0.0.1"  # the Host the server accepts (TestClient's default "testserver" is refused)
LOCAL_WS = "ws://127.0.0.1/ws"


@pytest.fixture(scope="module")
def sm() -> ScopeModel:
    cfg = ModelConfig(family="gpt2", vocab_size=256, hidden_size=32, num_layers=2, num_heads=2, max_seq_len=64)
    return ScopeModel(build_model(cfg, seed=1).eval(), cfg, ByteTokenizer(), name="test")


def gen(**kw) -> dict:
    msg = {"type": "generate", "prompts": ["ab"], "max_new_tokens": 3, "greedy": True}
    msg.update(kw)
    return msg


def until(ws, kind: str, limit: int = 200) -> list[dict]:
    out = []
    for _ in range(limit):
        m = ws.receive_json()
        out.append(m)
        if m["type"] == kind:
            return out
        if m["type"] in ("busy", "error"):
            raise AssertionError(f"waiting for {kind}, got {m}")
    raise AssertionError(f"no {kind} message in {limit}")


def test_page_and_static_served(sm):
    client = TestClient(create_app(sm), base_url=LOCAL)
    page = client.get("/")
    assert page.status_code == 200 and "MegaScope" in page.text and "/static/app.js" in page.text
    js = client.get("/static/app.js")
    assert js.status_code == 200 and "new WebSocket" in js.text
    assert "http://" not in page.text and "https://" not in page.text  # nothing from a CDN
    assert client.get("/static/../server.py").status_code == 404


def test_conversation_hello_generate_done(sm):
    client = TestClient(create_app(sm), base_url=LOCAL)
    with client.websocket_connect(LOCAL_WS) as ws:
        hello = ws.receive_json()
        assert hello["type"] == "hello" and hello["model"]["num_layers"] == 2
        ws.send_json({"type": "ping"})
        assert ws.receive_json() == {"type": "pong"}
        ws.send_json(gen(capture={"points": ["attn.probs", "mlp.out"], "logit_lens": True}))
        msgs = until(ws, "done")
        steps = [m for m in msgs if m["type"] == "step"]
        assert msgs[0]["type"] == "start" and len(steps) == 4
        assert set(steps[0]["states"]) == {"layers.0.attn.probs", "layers.1.attn.probs", "layers.0.mlp.out",
                                           "layers.1.mlp.out"}
        assert msgs[-1]["new_tokens"] == 3


def test_malformed_oversized_unknown_and_hostile_messages(sm):
    client = TestClient(create_app(sm), base_url=LOCAL)
    with client.websocket_connect(LOCAL_WS) as ws:
        ws.receive_json()
        cases = [
            ("{not json", "bad_json"),
            ("[1, 2]", "bad_message"),
            (json.dumps({"type": "exec", "code": "__import__('os').system('touch /tmp/pwned')"}), "unknown_type"),
            (json.dumps({"kind": "generate"}), "unknown_type"),
            (json.dumps({"type": "generate", "prompts": []}), "invalid"),
            (json.dumps(gen(max_new_tokens=10**9)), "invalid"),
            ('{"type": "generate", "prompts": ["a"], "temperature": NaN}', "invalid"),
            (json.dumps(gen(capture={"points": ["__class__.__subclasses__"]})), "invalid"),
            (json.dumps(gen(capture={"compression": {"pool": "eval('1')"}})), "invalid"),
            (json.dumps(gen(perturbations=[{"kind": "bitflip", "target": "__import__('os')", "rate": 1}])), "invalid"),
            (json.dumps(gen(extra_field=1)), "invalid"),
            (json.dumps({"type": "generate", "prompts": ["x" * (protocol.MAX_MESSAGE_BYTES + 10)]}), "too_large"),
            ("[" * 5000 + "]" * 5000, "bad_json"),
        ]
        for raw, code in cases:
            ws.send_text(raw)
            reply = ws.receive_json()
            assert reply["type"] == "error" and reply["code"] == code, (raw[:60], reply)
            assert len(reply["message"]) < 2000  # never echoes a huge input back
        ws.send_bytes(b"\xff\xfe")
        assert ws.receive_json()["code"] == "bad_json"
        # still serving after all that
        ws.send_json(gen())
        assert until(ws, "done")[-1]["cancelled"] is False


def test_request_errors_are_reported_not_fatal(sm):
    client = TestClient(create_app(sm), base_url=LOCAL)
    with client.websocket_connect(LOCAL_WS) as ws:
        ws.receive_json()
        ws.send_json(gen(prompts=["x" * 63], max_new_tokens=5))
        reply = until(ws, "error")[-1]
        assert reply["code"] == "bad_request" and "max_seq_len" in reply["message"]
        ws.send_json(gen(capture={"layers": [7], "points": ["out"]}))
        assert "layers [7]" in until(ws, "error")[-1]["message"]
        ws.send_json(gen(perturbations=[{"kind": "gaussian", "place": "weight", "target": "nope.weight",
                                         "strength": 1}]))
        assert "not found" in until(ws, "error")[-1]["message"]
        assert not sm.lock.locked()


def test_too_many_errors_disconnects(sm):
    client = TestClient(create_app(sm), base_url=LOCAL)
    with client.websocket_connect(LOCAL_WS) as ws:
        ws.receive_json()
        with pytest.raises(WebSocketDisconnect):
            for _ in range(30):
                ws.send_text("nope")
                ws.receive_json()


def test_token_query_first_message_and_bad_token(sm):
    client = TestClient(create_app(sm, token="s3cret"), base_url=LOCAL)
    with client.websocket_connect(LOCAL_WS + "?token=s3cret") as ws:
        assert ws.receive_json()["type"] == "hello"
    with client.websocket_connect(LOCAL_WS) as ws:
        ws.send_json({"type": "auth", "token": "s3cret"})
        assert ws.receive_json()["type"] == "hello"
    with client.websocket_connect(LOCAL_WS + "?token=wrong") as ws:
        ws.send_json({"type": "auth", "token": "also wrong"})
        assert ws.receive_json()["code"] == "unauthorized"
        with pytest.raises(WebSocketDisconnect) as e:
            ws.receive_json()
        assert e.value.code == 1008
    with client.websocket_connect(LOCAL_WS) as ws:
        ws.send_json(gen())  # no auth first: refused, nothing generated
        assert ws.receive_json()["code"] == "unauthorized"


def test_busy_while_generating_and_stop(sm):
    app = create_app(sm)
    client = TestClient(app, base_url=LOCAL)
    release = threading.Event()
    entered = threading.Event()
    original = sm.model.forward

    def slow_forward(*a, **kw):
        entered.set()
        release.wait(10)
        return original(*a, **kw)

    sm.model.forward = slow_forward
    try:
        with client.websocket_connect(LOCAL_WS) as a, client.websocket_connect(LOCAL_WS) as b:
            a.receive_json()
            b.receive_json()
            a.send_json(gen(max_new_tokens=20))
            assert entered.wait(10)
            b.send_json(gen())
            busy = b.receive_json()
            assert busy["type"] == "busy" and "already running" in busy["message"]
            a.send_json({"type": "stop"})
            release.set()
            done = until(a, "done")[-1]
            assert done["cancelled"] is True
    finally:
        del sm.model.forward
        release.set()
    assert not sm.lock.locked()


def test_slow_reader_is_bounded(sm):
    """A browser that never reads: the queue stays at its bound and the producer gives up after the timeout."""
    from megatronapp.scope.server import SlowClient, _Session

    class StuckSocket:
        async def send_text(self, text):
            await asyncio.Event().wait()  # never completes

    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    session = asyncio.run_coroutine_threadsafe(_make_session(_Session, StuckSocket(), sm), loop).result()
    session.loop = loop
    asyncio.run_coroutine_threadsafe(_start_writer(session), loop).result()
    sent = 0
    with pytest.raises(SlowClient):
        for _ in range(100):
            session._emit({"type": "step", "n": sent})
            sent += 1
    # one message is stuck in send_json, `queue_size` wait in the queue; nothing else was accepted
    assert sent == 1 + 3 and session.out.qsize() == 3 and session.cancel.is_set()
    loop.call_soon_threadsafe(loop.stop)


async def _make_session(cls, ws, sm):
    return cls(ws, sm, None, queue_size=3, send_timeout_s=0.5, max_bytes=1000)


async def _start_writer(session):
    session.writer = asyncio.create_task(session._writer())


def test_console_actions_need_a_training_run(sm):
    client = TestClient(create_app(sm), base_url=LOCAL)
    with client.websocket_connect(LOCAL_WS) as ws:
        assert ws.receive_json()["training"] is None
        ws.send_json({"type": "control", "action": "pause"})
        assert ws.receive_json()["code"] == "not_training"
        ws.send_json({"type": "control", "action": "every", "every": 0})
        m = ws.receive_json()
        assert m["code"] == "invalid" and "every" in m["message"]
