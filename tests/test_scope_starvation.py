"""MegaScope cannot be starved: 500 idle TCP connections to a server whose process may hold only 256 file
descriptors (the issue's repro) and a real client still gets its page within 5 s; the error log stays short.
300 connections trickling their requests a byte at a time do not keep a real client from its page either (they
are the ones evicted at the cap), a trickled request is closed at its whole-request deadline however steadily it
trickles, and WebSocket sessions that have come and gone no longer fill the connection cap."""
from __future__ import annotations

import base64
import os
import resource
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import uvicorn

from megatronapp.scope.gate import Gate, uvicorn_config
from megatronapp.scope.server import bind_socket, create_app

SRC = str(Path(__file__).resolve().parents[1] / "src")
SERVER = """
import resource, sys, time
resource.setrlimit(resource.RLIMIT_NOFILE, (256, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
from megatronapp.scope.server import ServerThread, create_app
s = ServerThread(create_app(None, read_only=True)).start()
print(s.port, flush=True)
time.sleep(120)
"""


def test_idle_connections_do_not_lock_out_a_real_client():
    _more_descriptors(700)
    proc = subprocess.Popen([sys.executable, "-c", SERVER], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONPATH": SRC})
    idle: list[socket.socket] = []
    try:
        port = int(proc.stdout.readline())
        for _ in range(500):
            s = socket.socket()
            s.settimeout(0.5)
            try:
                s.connect(("127.0.0.1", port))
            except OSError:  # a full backlog refuses or times out: that is the attacker's problem
                s.close()
                continue
            idle.append(s)
        time.sleep(1.0)  # let the server accept what it will
        t0 = time.monotonic()
        page = urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=5).read()
        assert b"<html" in page.lower() and time.monotonic() - t0 < 5
    finally:
        for s in idle:
            s.close()
        proc.kill()
        err = proc.communicate(timeout=10)[1]
    assert len(err.splitlines()) < 60, f"the server's log grew by {len(err.splitlines())} lines:\n{err[-2000:]}"


def _more_descriptors(n: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < n:  # this process holds the attacking sockets
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 2048), hard))


def test_trickling_requests_do_not_lock_out_a_real_client():
    _more_descriptors(700)
    proc = subprocess.Popen([sys.executable, "-c", SERVER], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONPATH": SRC})
    slow: list[socket.socket] = []
    stop = threading.Event()
    try:
        port = int(proc.stdout.readline())
        for _ in range(300):
            s = socket.socket()
            s.settimeout(0.5)
            try:
                s.connect(("127.0.0.1", port))
                s.sendall(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")  # a header that never ends
            except OSError:
                s.close()
                continue
            slow.append(s)

        def trickle() -> None:  # one more byte on every socket, round after round
            while not stop.is_set():
                for s in slow:
                    try:
                        s.send(b"a")
                    except OSError:
                        pass
                stop.wait(0.5)

        threading.Thread(target=trickle, daemon=True).start()
        time.sleep(1.0)  # let the server take in what it will
        t0 = time.monotonic()
        page = urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=60).read()
        took = time.monotonic() - t0
        assert b"<html" in page.lower()
        assert not stop.is_set() and len(slow) > 200  # the page came while they were still trickling
        print(f"page in {took:.2f} s beside {len(slow)} trickling connections")
    finally:
        stop.set()
        for s in slow:
            s.close()
        proc.kill()
        err = proc.communicate(timeout=10)[1]
    assert len(err.splitlines()) < 60, f"the server's log grew by {len(err.splitlines())} lines:\n{err[-2000:]}"


def _server(gate: Gate) -> tuple[uvicorn.Server, int]:
    sock = bind_socket()
    server = uvicorn.Server(uvicorn_config(create_app(None, read_only=True), gate=gate))
    threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True).start()
    while not server.started:
        time.sleep(0.02)
    return server, sock.getsockname()[1]


def test_a_trickled_request_is_closed_at_its_whole_request_deadline():
    gate = Gate(request_s=1.0)
    server, port = _server(gate)
    request = b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n" + b"X-Pad: " + b"a" * 200 + b"\r\n\r\n"
    try:
        s = socket.create_connection(("127.0.0.1", port))
        s.settimeout(0.2)
        sent, closed = 0, False
        while sent < len(request) and not closed:  # one byte per 0.2 s: 48 s for the whole request
            try:
                s.send(request[sent:sent + 1])
                sent += 1
                closed = s.recv(100) == b""
            except TimeoutError:
                continue
            except OSError:  # reset by the server
                closed = True
        assert closed and sent < len(request), f"the server read {sent} trickled bytes without closing"
        assert gate.expired >= 1 and not gate.open
        s.close()
        # a request that arrives whole in time is served, and its kept-alive connection is not waiting
        assert urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=30).status == 200
    finally:
        server.should_exit = True


def test_websocket_sessions_that_came_and_went_do_not_fill_the_cap():
    gate = Gate(max_connections=8)
    server, port = _server(gate)
    try:
        for _ in range(20):
            with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
                key = base64.b64encode(os.urandom(16)).decode()
                s.sendall(f"GET /ws HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nUpgrade: websocket\r\n"
                          f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n"
                          .encode())
                assert s.recv(12) == b"HTTP/1.1 101"
        assert urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=30).status == 200
    finally:
        server.should_exit = True
