"""MegaScope against the browser it runs in: foreign origins, DNS rebinding, tokens, non-loopback binds."""
from __future__ import annotations

import argparse
import json

import pytest
from fastapi.testclient import TestClient
from starlette.websockets import WebSocketDisconnect
from websockets.sync.client import connect

from megatronapp.config import ModelConfig
from megatronapp.data.tokenizer import ByteTokenizer
from megatronapp.model.transformer import build_model
from megatronapp.scope import cli
from megatronapp.scope.generate import ScopeModel
from megatronapp.scope.security import Guard, check_bind, page_url, resolve_token
from megatronapp.scope.server import ServerThread, create_app, serve


@pytest.fixture(scope="module")
def sm() -> ScopeModel:
    cfg = ModelConfig(family="gpt2", vocab_size=256, hidden_size=32, num_layers=2, num_heads=2, max_seq_len=64)
    return ScopeModel(build_model(cfg, seed=1).eval(), cfg, ByteTokenizer(), name="test")


@pytest.fixture(scope="module")
def server(sm):
    st = ServerThread(create_app(sm, guard=Guard(allowed_origins=["https://notebook.example:8888"]))).start()
    yield st
    st.stop()


def _closed_with(url: str, **headers: str) -> tuple[int | None, str]:
    """Open a WebSocket with these headers; the close code and reason the server answers with."""
    from websockets.exceptions import ConnectionClosed

    with connect(url, additional_headers=headers, open_timeout=30) as ws:
        try:
            ws.recv(timeout=30)
        except ConnectionClosed as e:
            return (e.rcvd.code, e.rcvd.reason) if e.rcvd else (None, "")
    return None, "the server sent a message instead of closing"


def test_foreign_origin_is_refused_with_a_reason(server):
    code, reason = _closed_with(f"ws://127.0.0.1:{server.port}/ws", Origin="http://evil.example")
    assert code == 1008 and "origin http://evil.example refused: only this server" in reason
    # a page on the same host but another port is another origin, too
    code, reason = _closed_with(f"ws://127.0.0.1:{server.port}/ws", Origin="http://127.0.0.1:1")
    assert code == 1008 and "origin http://127.0.0.1:1" in reason


def test_own_and_allowed_origins_and_plain_clients_connect(server):
    for origin in (f"http://127.0.0.1:{server.port}", "https://notebook.example:8888", None):
        headers = {"Origin": origin} if origin else {}
        with connect(f"ws://127.0.0.1:{server.port}/ws", additional_headers=headers, open_timeout=30) as ws:
            assert json.loads(ws.recv(timeout=30))["type"] == "hello", origin


def test_rebinding_host_is_refused_over_http_and_websocket(sm):
    client = TestClient(create_app(sm), base_url="http://evil.example:8765")
    page = client.get("/")
    assert page.status_code == 403 and "Host 'evil.example:8765' refused" in page.text
    assert TestClient(create_app(sm), base_url="http://localhost:8765").get("/").status_code == 200
    with pytest.raises(WebSocketDisconnect) as e, \
            client.websocket_connect("ws://evil.example:8765/ws", headers={"origin": "http://evil.example:8765"}) \
            as ws:
        ws.receive_json()
    assert e.value.code == 1008 and "Host 'evil.example:8765'" in e.value.reason


def test_non_loopback_bind_without_token_refuses_to_start(sm, capsys):
    with pytest.raises(ValueError, match="refusing to serve on 0.0.0.0 without a token"):
        serve(sm, host="0.0.0.0", port=0, token=None)  # refused before any socket is bound
    check_bind("0.0.0.0", None, insecure=True)  # --insecure says the network is trusted
    check_bind("127.0.0.1", None, insecure=False)
    ap = argparse.ArgumentParser()
    cli.register(ap.add_subparsers())
    args = ap.parse_args(["scope", "serve", "--host", "0.0.0.0", "--no-token"])
    assert args.func(args) == 2
    assert "--insecure" in capsys.readouterr().err


def test_token_defaults_env_and_url_encoding():
    generated = resolve_token(None, "0.0.0.0", env={})
    assert generated and len(generated) >= 24 and generated != resolve_token(None, "0.0.0.0", env={})
    assert resolve_token(None, "127.0.0.1", env={}) is None  # loopback: Host and Origin checks suffice
    assert resolve_token(None, "127.0.0.1", env={"MEGASCOPE_TOKEN": "from env"}) == "from env"
    assert resolve_token("flag", "0.0.0.0", env={"MEGASCOPE_TOKEN": "from env"}) == "flag"
    assert page_url("0.0.0.0", 8765, "a b&c=d/é") == "http://127.0.0.1:8765/?token=a%20b%26c%3Dd%2F%C3%A9"


def test_training_page_takes_the_token_from_the_environment(monkeypatch):
    from megatronapp.scope.training import TrainingScope

    monkeypatch.setenv("MEGASCOPE_TOKEN", "tr&in")
    lines: list[str] = []
    scope = TrainingScope(0, announce=lines.append)
    try:
        assert lines[0].endswith("/?token=tr%26in")
        url = f"ws://127.0.0.1:{scope.server.port}/ws"
        with connect(url, open_timeout=30) as ws:
            scope.on_step(1, [], {"loss": 1.0})  # published to authenticated pages only
            ws.send(json.dumps({"type": "control", "action": "pause"}))
            assert json.loads(ws.recv(timeout=30))["code"] == "unauthorized"  # not the step's metrics
            assert not scope.paused
        with connect(url + "?token=tr%26in", open_timeout=30) as ws:
            assert json.loads(ws.recv(timeout=30))["type"] == "hello"
    finally:
        scope.close()


def test_is_loopback_parses_the_address():
    from megatronapp.scope.security import is_loopback

    for host in ("127.0.0.1", "127.1.2.3", "::1", "localhost", "::ffff:127.0.0.1"):
        assert is_loopback(host), host
    for host in ("127.evil.example", "127.0.0.1.nip.io", "0.0.0.0", "10.0.0.1", "", "::", "localhost.evil"):
        assert not is_loopback(host), host
    assert resolve_token(None, "127.evil.example", env={}) is not None  # a name off loopback gets a token
