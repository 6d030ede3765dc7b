"""What keeps a MegaScope server from being starved by connections that never ask for anything.

Each open TCP connection holds a file descriptor; a client that opens hundreds and sends nothing would otherwise
use up the process's descriptors, after which `accept()` fails (EMFILE), asyncio logs a traceback per attempt and
no real browser gets in. So (slowloris defences, as in nginx's `client_header_timeout` and `worker_connections`):
  * a cap on open HTTP connections, kept below the process's descriptor limit;
  * a deadline for the first request bytes: a connection that sends nothing for `first_request_s` is closed;
  * at the cap, the oldest connection that has not sent a byte yet is closed to make room (so a new client
    gets in while idle ones are pending); when every connection is busy the new one is answered 503 and closed;
  * errors logged once per cause per interval (`RateLimitedLog`), with the number of repeats, never per event.
"""
from __future__ import annotations

import asyncio
import logging
import resource
import time
from collections import OrderedDict
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

MAX_CONNECTIONS = 256  # open HTTP connections (WebSocket sessions are capped by the server, MAX_SESSIONS)
FIRST_REQUEST_S = 10.0  # seconds a new connection may take to send its first bytes
BUSY = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: text/plain\r\ncontent-length: 34\r\n"
        b"connection: close\r\n\r\nMegaScope is busy: try again later")


def descriptor_cap(wanted: int) -> int:
    """`wanted`, lowered to leave half the process's descriptor limit for everything else (model files, logs,
    WebSockets, the training run this server may live in)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return wanted
    return max(8, min(wanted, soft // 2 - 16))


class Gate:
    """Connection bookkeeping shared by every connection of one server (all on the server's event loop)."""

    def __init__(self, max_connections: int = MAX_CONNECTIONS, first_request_s: float = FIRST_REQUEST_S):
        self.cap = descriptor_cap(max_connections)
        self.first_request_s = first_request_s
        self.open: set[Any] = set()
        self.idle: OrderedDict[int, Any] = OrderedDict()  # connections that have sent nothing yet, oldest first
        self.evicted = 0
        self.refused = 0

    def opened(self, conn: Any) -> bool:
        """Register a new connection; False when it must be answered 503 (every slot busy)."""
        if len(self.open) >= self.cap:
            if not self.idle:
                self.refused += 1
                return False
            _, oldest = self.idle.popitem(last=False)
            self.evicted += 1
            oldest.close_idle()
        self.open.add(conn)
        self.idle[id(conn)] = conn
        return True

    def spoke(self, conn: Any) -> None:
        self.idle.pop(id(conn), None)

    def closed(self, conn: Any) -> None:
        self.open.discard(conn)
        self.idle.pop(id(conn), None)


def protocol_class(gate: Gate) -> type:
    """uvicorn's h11 HTTP protocol, with `gate`'s cap and first-request deadline."""

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
            self._deadline = self.loop.call_later(gate.first_request_s, self.close_idle)

        def data_received(self, data: bytes) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None
                gate.spoke(self)
            super().data_received(data)

        def connection_lost(self, exc: Exception | None) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None
            if self._gated:
                gate.closed(self)
            super().connection_lost(exc)

        def close_idle(self) -> None:
            """Close a connection that has sent nothing (deadline passed, or evicted at the cap)."""
            self._deadline = None
            gate.spoke(self)
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
