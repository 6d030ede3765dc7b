"""What keeps a MegaScope server from being starved by connections that never finish asking for anything.

Each open TCP connection holds a file descriptor; a client that opens hundreds and sends nothing, or trickles a
request a byte at a time, would otherwise use up the process's descriptors or its connection cap, after which no
real browser gets in. So (slowloris defences, as nginx's `client_header_timeout`, `client_body_timeout` and
`worker_connections`):
  * a cap on open HTTP connections, kept below the process's descriptor limit;
  * a deadline for the whole request, not only its first byte: a connection whose request has not arrived whole
    `request_s` after it opened (or after its previous response, on a kept-alive connection) is closed, however
    steadily it trickles;
  * at the cap, the oldest connection still waiting for its request to arrive whole is closed to make room (so a
    new client gets in while slow ones are pending); when every connection has a whole request in hand the new
    one is answered 503 and closed;
  * a connection upgraded to a WebSocket leaves the gate (the server caps sessions itself, MAX_SESSIONS): it was
    counted forever before, so 256 page loads left every later request a 503;
  * errors logged once per cause per interval (`RateLimitedLog`), with the number of repeats, never per event.
"""
from __future__ import annotations

import asyncio
import logging
import resource
import time
from collections import OrderedDict
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

MAX_CONNECTIONS = 256  # open HTTP connections (WebSocket sessions are capped by the server, MAX_SESSIONS)
REQUEST_S = 10.0  # seconds a connection may take to send a whole request
BUSY = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: text/plain\r\ncontent-length: 34\r\n"
        b"connection: close\r\n\r\nMegaScope is busy: try again later")
_ARRIVING = (h11.IDLE, h11.SEND_BODY)  # the client's side of a request that has not arrived whole


def descriptor_cap(wanted: int) -> int:
    """`wanted`, lowered to leave half the process's descriptor limit for everything else (model files, logs,
    WebSockets, the training run this server may live in)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return wanted
    return max(8, min(wanted, soft // 2 - 16))


class Gate:
    """Connection bookkeeping shared by every connection of one server (all on the server's event loop)."""

    def __init__(self, max_connections: int = MAX_CONNECTIONS, request_s: float = REQUEST_S):
        self.cap = descriptor_cap(max_connections)
        self.request_s = request_s
        self.open: set[Any] = set()
        self.waiting: OrderedDict[int, Any] = OrderedDict()  # connections whose request is not whole, oldest first
        self.evicted = 0
        self.refused = 0
        self.expired = 0

    def opened(self, conn: Any) -> bool:
        """Register a new connection; False when it must be answered 503 (every slot has a request in hand)."""
        if len(self.open) >= self.cap:
            if not self.waiting:
                self.refused += 1
                return False
            _, oldest = self.waiting.popitem(last=False)
            self.evicted += 1
            oldest.close_waiting()
        self.open.add(conn)
        return True

    def wait(self, conn: Any) -> None:
        """`conn` waits for a request (a new connection, or one whose response has gone out)."""
        self.waiting[id(conn)] = conn

    def arrived(self, conn: Any) -> None:
        """`conn`'s request arrived whole (or it left HTTP): it is no longer one to evict."""
        self.waiting.pop(id(conn), None)

    def closed(self, conn: Any) -> None:
        self.open.discard(conn)
        self.waiting.pop(id(conn), None)


def protocol_class(gate: Gate) -> type:
    """uvicorn's h11 HTTP protocol, with `gate`'s cap and whole-request deadline."""

    class GatedH11(H11Protocol):
        _deadline: asyncio.TimerHandle | None = None
        _gated = False

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            if not gate.opened(self):
                transport.write(BUSY)
                transport.close()
                return
            self._gated = True
            self._await_request()

        def _await_request(self) -> None:
            self._stop_clock()
            gate.wait(self)
            self._deadline = self.loop.call_later(gate.request_s, self._expire)

        def _stop_clock(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self._deadline is not None and self.conn.their_state not in _ARRIVING:
                self._stop_clock()  # the request is whole (or broken, and answered 400 and closed)
                gate.arrived(self)

        def on_response_complete(self) -> None:
            super().on_response_complete()  # may already have read a pipelined request whole
            if self._gated and not self.transport.is_closing() and self.conn.their_state in _ARRIVING:
                self._await_request()  # a kept-alive connection: its next request has the same deadline

        def handle_websocket_upgrade(self, event: h11.Request) -> None:
            self._stop_clock()
            if self._gated:  # from here the WebSocket protocol owns the transport: this one is never told it closed
                self._gated = False
                gate.closed(self)
            super().handle_websocket_upgrade(event)

        def connection_lost(self, exc: Exception | None) -> None:
            self._stop_clock()
            if self._gated:
                gate.closed(self)
            super().connection_lost(exc)

        def _expire(self) -> None:
            self._deadline = None
            gate.expired += 1
            self.close_waiting()

        def close_waiting(self) -> None:
            """Close a connection whose request has not arrived whole (deadline passed, or evicted at the cap)."""
            self._stop_clock()
            gate.arrived(self)
            if not self.transport.is_closing():
                self.transport.close()

    return GatedH11


class RateLimitedLog(logging.Filter):
    """Pass a log record's cause (logger, message template, exception type) once per `interval_s`; the next one
    that passes says how many were suppressed in between."""

    def __init__(self, interval_s: float = 60.0):
        super().__init__()
        self.interval_s = interval_s
        self.seen: dict[tuple, list[float]] = {}  # cause -> [last time passed, suppressed since]

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[0].__name__ if record.exc_info and record.exc_info[0] else ""
        cause = (record.name, str(record.msg)[:120], exc)
        now = time.monotonic()
        last = self.seen.get(cause)
        if last is not None and now - last[0] < self.interval_s:
            last[1] += 1
            return False
        if len(self.seen) > 1000:  # bounded: causes are few; a flood of distinct ones starts over
            self.seen.clear()
        if last is not None and last[1]:
            record.msg = f"{record.msg} (and {int(last[1])} more like it in the last {self.interval_s:.0f} s)"
        self.seen[cause] = [now, 0]
        return True


_FILTER = RateLimitedLog()


def quiet_logs() -> None:
    """Install the rate limit on the loggers a starved server floods (asyncio's accept errors, uvicorn's)."""
    for name in ("asyncio", "uvicorn.error", "uvicorn"):
        logger = logging.getLogger(name)
        if _FILTER not in logger.filters:
            logger.addFilter(_FILTER)


def uvicorn_config(app: Any, gate: Gate | None = None, **kwargs: Any) -> Any:
    """The uvicorn config every MegaScope server runs with: the gated HTTP protocol, rate-limited error logs."""
    import uvicorn

    quiet_logs()
    return uvicorn.Config(app, http=protocol_class(gate or Gate()), log_level="warning", ws_max_size=4 * 1024 * 1024,
                          **kwargs)
