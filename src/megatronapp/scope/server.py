"""MegaScope's web server: the page, and one WebSocket per browser speaking the protocol in protocol.py.

Safety: binds 127.0.0.1 unless told otherwise; Host and Origin checked on every request (security.py); a token
(URL `?token=` or a first `auth` message, compared in constant time), random by default off loopback; every
message size-checked and validated before use and never evaluated;
one generation at a time per model (others get `busy`); outgoing messages go through a bounded queue, so a
slow browser slows the generation down (and after `send_timeout_s` stops it) instead of growing memory.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
import time
from pathlib import Path
from typing import Any

from fastapi import FastAPI, WebSocket, WebSocketDisconnect
from fastapi.responses import FileResponse, JSONResponse
from fastapi.staticfiles import StaticFiles

from megatronapp.scope import protocol
from megatronapp.scope.gate import uvicorn_config
from megatronapp.scope.generate import ScopeModel, generate
from megatronapp.scope.protocol import Generate, ProtocolError
from megatronapp.scope.security import Guard, GuardMiddleware, check_bind, page_url, token_ok

STATIC = Path(__file__).resolve().parent / "static"
MAX_ERRORS = 20  # a client that keeps sending bad messages is disconnected
MAX_SESSIONS = 64  # WebSocket sessions at once; more are closed with 1013 (try again later)


class SlowClient(Exception):
    """The browser did not read its messages in time."""


def create_app(sm: ScopeModel | None, token: str | None = None, queue_size: int = 64, send_timeout_s: float = 30.0,
               max_message_bytes: int = protocol.MAX_MESSAGE_BYTES, read_only: bool = False,
               guard: Guard | None = None) -> FastAPI:
    """The FastAPI app serving the page at / and the protocol at /ws.

    read_only: browsers may watch (messages `publish`ed by the process, e.g. during training) but not generate.
    guard: Host/Origin rules (default: loopback names and the server's own origin only)."""
    app = FastAPI(title="MegaScope", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(GuardMiddleware, guard=guard or Guard())
    app.state.scope_model = sm
    app.state.read_only = read_only
    app.state.sessions = set()
    app.state.control = None  # training console: callable(action, every) -> state dict (scope/training.py)
    app.mount("/static", StaticFiles(directory=STATIC), name="static")

    @app.get("/")
    def index() -> FileResponse:
        return FileResponse(STATIC / "index.html", headers={"Cache-Control": "no-store"})

    @app.get("/healthz")
    def health() -> JSONResponse:
        cur = app.state.scope_model
        return JSONResponse({"ok": True, "busy": cur is not None and cur.lock.locked()})

    @app.websocket("/ws")
    async def ws_endpoint(ws: WebSocket) -> None:
        if len(app.state.sessions) >= MAX_SESSIONS:
            await ws.close(code=1013, reason="MegaScope is busy: too many pages open")
            return
        session = _Session(ws, app, token, queue_size, send_timeout_s, max_message_bytes)
        app.state.sessions.add(session)
        try:
            await session.run()
        finally:
            app.state.sessions.discard(session)

    return app


class _Session:
    """One browser connection: a reader loop, a writer task draining a bounded queue, a generation thread."""

    def __init__(self, ws: WebSocket, app: FastAPI, token: str | None, queue_size: int, send_timeout_s: float,
                 max_bytes: int):
        self.ws, self.app, self.token = ws, app, token
        self.send_timeout_s, self.max_bytes = send_timeout_s, max_bytes
        self.out: asyncio.Queue = asyncio.Queue(maxsize=queue_size)
        self.cancel = threading.Event()
        self.closed = threading.Event()  # the connection is over: drop further messages
        self.worker: asyncio.Future | None = None
        self.errors = 0
        self.dropped = 0  # published messages dropped because this browser lagged
        self.authed = False  # published messages go to authenticated browsers only

    @property
    def sm(self) -> ScopeModel | None:
        return self.app.state.scope_model

    def offer(self, msg: dict[str, Any]) -> None:
        """Queue a published message without waiting; a lagging browser loses it instead of growing memory."""
        try:
            self.out.put_nowait(msg)
        except asyncio.QueueFull:
            self.dropped += 1

    async def run(self) -> None:
        await self.ws.accept()
        self.loop = asyncio.get_running_loop()
        writer = asyncio.create_task(self._writer())
        try:
            if self.token is not None and not await self._authenticate():
                return
            self.authed = True
            control = self.app.state.control
            await self.out.put({"type": "hello", "model": self.sm.describe() if self.sm else None,
                                "read_only": self.app.state.read_only,
                                "training": control("status", None) if control else None, "limits": {
                "max_message_bytes": self.max_bytes, "max_prompts": protocol.MAX_PROMPTS,
                "max_new_tokens": protocol.MAX_NEW_TOKENS}})
            await self._reader()
        except WebSocketDisconnect:
            pass
        finally:
            self.closed.set()
            self.cancel.set()
            if self.worker is not None:
                with contextlib.suppress(Exception):
                    await self.worker
            writer.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await writer

    async def _authenticate(self) -> bool:
        if token_ok(self.ws.query_params.get("token"), self.token):
            return True
        try:
            raw = await asyncio.wait_for(self.ws.receive_text(), timeout=10.0)
            msg = protocol.parse(raw, self.max_bytes)
            if isinstance(msg, protocol.Auth) and token_ok(msg.token, self.token):
                return True
        except (TimeoutError, ProtocolError, KeyError):
            pass
        await self.ws.send_json(protocol.error("unauthorized", "a valid token is required: open the URL printed "
                                                               "by `megatronapp scope serve` (it carries ?token=)"))
        await self.ws.close(code=1008)
        return False

    async def _writer(self) -> None:
        try:
            while True:
                msg = await self.out.get()
                try:
                    text = json.dumps(msg, allow_nan=False)  # browsers reject NaN in JSON
                except ValueError:
                    text = json.dumps(protocol.error("internal", f"a {msg.get('type')} message held NaN/inf"))
                await self.ws.send_text(text)
        finally:
            self.closed.set()

    async def _reader(self) -> None:
        while True:
            frame = await self.ws.receive()
            if frame["type"] == "websocket.disconnect":
                raise WebSocketDisconnect(frame.get("code", 1000))
            raw = frame.get("text") if frame.get("text") is not None else frame.get("bytes") or b""
            try:
                msg = protocol.parse(raw, self.max_bytes)
            except ProtocolError as e:
                self.errors += 1
                await self.out.put(e.reply())
                if self.errors >= MAX_ERRORS:
                    await self.ws.close(code=1008)
                    return
                continue
            await self._handle(msg)

    async def _handle(self, msg: Any) -> None:
        if isinstance(msg, protocol.Ping):
            await self.out.put({"type": "pong"})
        elif isinstance(msg, protocol.Info):
            await self.out.put({"type": "info", "model": self.sm.describe() if self.sm else None})
        elif isinstance(msg, protocol.Auth):
            await self.out.put({"type": "auth_ok"} if self.token is None or token_ok(msg.token, self.token)
                               else protocol.error("unauthorized", "wrong token"))
        elif isinstance(msg, protocol.Stop):
            self.cancel.set()
        elif isinstance(msg, protocol.Control):
            control = self.app.state.control
            if control is None:
                await self.out.put(protocol.error("not_training", "this server is not attached to a training "
                                                                  "run; start one with --scope-port"))
                return
            if msg.action == "every" and msg.every is None:
                await self.out.put(protocol.error("invalid", "control every: give `every` (steps between probes)"))
                return
            publish(self.app, control(msg.action, msg.every))  # every page sees the new state
        elif isinstance(msg, Generate) and (self.app.state.read_only or self.sm is None):
            await self.out.put(protocol.error("read_only", "this server only shows what its process publishes "
                                                           "(e.g. a training run); it does not take generations"))
        elif isinstance(msg, Generate):
            # one generation per model, whichever browser asked: the lock is the model's, not the session's
            sm = self.sm  # the model may be swapped (training probes); this run keeps the one it locked
            if not sm.lock.acquire(blocking=False):
                await self.out.put({"type": "busy", "message": "a generation is already running on this model; "
                                                               "wait for its 'done' or send 'stop'"})
                return
            self.cancel.clear()
            self.worker = self.loop.run_in_executor(None, self._generate, sm, msg)

    def _emit(self, msg: dict[str, Any]) -> None:
        # runs on the generation thread: block while the queue is full (back-pressure), give up when the
        # browser is gone or reads nothing for send_timeout_s
        if self.closed.is_set():
            raise SlowClient("the browser went away")
        fut = asyncio.run_coroutine_threadsafe(self.out.put(msg), self.loop)
        deadline = time.monotonic() + self.send_timeout_s
        while True:
            try:
                fut.result(timeout=0.1)
                return
            except TimeoutError:
                if self.closed.is_set() or time.monotonic() > deadline:
                    fut.cancel()
                    self.cancel.set()
                    raise SlowClient(f"the browser read no message for {self.send_timeout_s:.0f} s") from None

    def _generate(self, sm: ScopeModel, req: Generate) -> None:
        # the lock is released before the final message goes out, so a browser that has just read "done" or
        # "error" may start the next generation at once without being told "busy"
        held = [True]

        def release() -> None:
            if held[0]:
                held[0] = False
                sm.lock.release()

        def emit(msg: dict[str, Any]) -> None:
            if msg.get("type") == "done":
                release()
            self._emit(msg)

        try:
            (sm.runner or generate)(sm, req, emit, self.cancel)
        except SlowClient:
            pass
        except (ValueError, TypeError) as e:  # user-fixable request problems (lengths, layers, indices)
            release()
            self._try_emit(protocol.error("bad_request", str(e)))
        except Exception as e:  # noqa: BLE001  (report, never kill the server)
            release()
            self._try_emit(protocol.error("internal", f"{type(e).__name__}: {e}"))
        finally:
            release()

    def _try_emit(self, msg: dict[str, Any]) -> None:
        if self.closed.is_set():
            return
        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(self.out.put(msg), self.loop).result(timeout=5.0)


def publish(app: FastAPI, msg: dict[str, Any]) -> None:
    """Send `msg` to every connected browser (thread-safe; never blocks the caller)."""
    for session in list(app.state.sessions):
        loop = getattr(session, "loop", None)
        if loop is not None and session.authed and not session.closed.is_set():
            with contextlib.suppress(RuntimeError):  # the loop may be shutting down
                loop.call_soon_threadsafe(session.offer, msg)


def watchers(app: FastAPI) -> int:
    """How many authenticated browsers are connected (work nobody will see can be skipped)."""
    return sum(1 for s in list(app.state.sessions) if s.authed and not s.closed.is_set())


def bind_socket(host: str = "127.0.0.1", port: int = 0) -> socket.socket:
    """A listening TCP socket (port 0: a free one), so the URL can be printed before serving starts."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(128)
    sock.set_inheritable(True)
    return sock


class ServerThread:
    """Run the app with uvicorn on a background thread (tests, notebooks, the training hook)."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0):
        import uvicorn

        self.sock = bind_socket(host, port)
        self.host, self.port = host, self.sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn_config(app))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout_s: float = 20.0) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError(f"MegaScope server on {self.url} did not start")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.sock.close()


def serve(sm: ScopeModel, host: str = "127.0.0.1", port: int = 0, token: str | None = None,
          announce: Any = print, insecure: bool = False, guard: Guard | None = None) -> None:
    """Serve until interrupted; prints the URL (with the token) once the socket is bound.

    A non-loopback `host` without a token is refused unless `insecure` (see security.py)."""
    import uvicorn

    check_bind(host, token, insecure)
    sock = bind_socket(host, port)
    if token is None and insecure and host not in ("127.0.0.1", "localhost", "::1"):
        announce(f"warning: serving on {host} without a token (--insecure): anyone who can reach this port can "
                 f"drive the model")
    announce(f"MegaScope serving {sm.name} at {page_url(host, sock.getsockname()[1], token)}")
    app = create_app(sm, token, guard=guard or Guard(bind_host=host))
    server = uvicorn.Server(uvicorn_config(app))
    server.run(sockets=[sock])
