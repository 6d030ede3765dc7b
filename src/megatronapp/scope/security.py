"""What keeps a MegaScope server safe from the browser it runs in: Host and Origin checks, and the token.

A page on any site the user visits can open `ws://127.0.0.1:PORT/ws` (browsers do not apply the same-origin
policy to WebSockets) and a DNS-rebinding page can even read HTTP answers under its own name. So:
  * Host: every HTTP and WebSocket request must name this server by a loopback name, the address it is bound
    to, this machine's name or addresses, or an entry of `allowed_hosts`. A rebinding page's requests carry
    the attacker's host name and are refused (HTTP 403; WebSocket closed with 1008 and the reason).
  * Origin: a request that carries an Origin (every browser request does) must come from the server's own
    origin (scheme://the Host header) or an entry of `allowed_origins`. Clients without an Origin (curl,
    Python) pass this check and still need the token when one is set.
  * Token: generated at random whenever the server binds anything but loopback, unless one is given (flag or
    the MEGASCOPE_TOKEN environment variable). Binding elsewhere without any token is refused unless the caller
    says `insecure=True` (`--insecure`).
"""
from __future__ import annotations

import hmac
import ipaddress
import os
import secrets
import socket
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote, urlsplit

TOKEN_ENV = "MEGASCOPE_TOKEN"
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
WILDCARD_HOSTS = ("0.0.0.0", "::", "")


def is_loopback(host: str) -> bool:
    """True when binding `host` is reachable from this machine only: `localhost`, or an address that parses as a
    loopback one (`127.evil.example` is a name, resolved by DNS to anything, not a loopback address)."""
    if host == "localhost":
        return True
    try:
        addr = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return False
    mapped = getattr(addr, "ipv4_mapped", None)  # ::ffff:127.0.0.1
    return addr.is_loopback or (mapped is not None and mapped.is_loopback)


def resolve_token(given: str | None, host: str, insecure: bool = False, env: dict[str, str] | None = None,
                  no_token: bool = False) -> str | None:
    """The token a server on `host` requires: the given one, else $MEGASCOPE_TOKEN, else a random one when the
    bind is not loopback. `no_token` asks for none; on a non-loopback bind that needs `insecure`."""
    env = os.environ if env is None else env
    if no_token:
        check_bind(host, None, insecure)
        return None
    token = given or env.get(TOKEN_ENV) or None
    if token is None and not is_loopback(host):
        token = secrets.token_urlsafe(24)
    return token


def check_bind(host: str, token: str | None, insecure: bool) -> None:
    """Refuse to serve a non-loopback address without a token, unless `insecure`."""
    if token is None and not is_loopback(host) and not insecure:
        raise ValueError(f"refusing to serve on {host} without a token: anyone who can reach the port could "
                         f"drive the model; drop --no-token (a random token is then printed), give --token or "
                         f"${TOKEN_ENV}, or pass --insecure if this network is trusted")


def page_url(host: str, port: int, token: str | None) -> str:
    """The URL to open, with the token URL-encoded (a token may hold any character)."""
    shown = "127.0.0.1" if host in WILDCARD_HOSTS else host
    if ":" in shown:
        shown = f"[{shown}]"
    return f"http://{shown}:{port}/" + (f"?token={quote(token, safe='')}" if token else "")


def token_ok(given: object, expected: str) -> bool:
    """Constant-time comparison of a client's token."""
    return isinstance(given, str) and hmac.compare_digest(given.encode(), expected.encode())


def _machine_names() -> set[str]:
    # names and addresses a user on the network may type to reach a wildcard bind
    names = {socket.gethostname(), socket.getfqdn()}
    for name in list(names):
        try:
            names.update(info[4][0] for info in socket.getaddrinfo(name, None))
        except OSError:
            pass
    return {n.lower() for n in names if n}


def _hostname(host_header: str) -> str:
    """'example.com:8080' -> 'example.com'; '[::1]:80' -> '::1'."""
    try:
        return (urlsplit(f"//{host_header}").hostname or "").lower()
    except ValueError:
        return ""


@dataclass
class Guard:
    """The Host and Origin rules of one server (see the module docstring)."""

    bind_host: str = "127.0.0.1"
    allowed_hosts: Iterable[str] = ()
    allowed_origins: Iterable[str] = ()
    hosts: set[str] = field(init=False)
    origins: set[str] = field(init=False)

    def __post_init__(self) -> None:
        self.hosts = {*LOOPBACK_HOSTS, *(h.lower() for h in self.allowed_hosts)}
        if self.bind_host in WILDCARD_HOSTS:
            self.hosts |= _machine_names()
        elif self.bind_host:
            self.hosts.add(self.bind_host.lower())
        self.origins = {o.rstrip("/").lower() for o in self.allowed_origins}

    def refusal(self, headers: dict[str, str], scheme: str) -> str | None:
        """Why a request with these (lower-case) headers is refused, or None when it may proceed."""
        host = headers.get("host", "")
        name = _hostname(host)
        if name not in self.hosts:
            shown = host[:64] if host.isprintable() else "(unprintable)"
            return f"Host {shown!r} refused: not a name of this server (DNS rebinding?); see --allow-host"
        origin = headers.get("origin")
        if origin is None:
            return None
        origin = origin.rstrip("/").lower()
        own = {f"http://{host}".lower(), f"https://{host}".lower()}
        if origin in own or origin in self.origins:
            return None
        shown = origin[:64] if origin.isprintable() else "(unprintable)"
        return f"origin {shown} refused: only this server's own page may connect; see --allow-origin"


class GuardMiddleware:
    """ASGI middleware applying `Guard` to every HTTP request and WebSocket handshake."""

    def __init__(self, app: Any, guard: Guard):
        self.app, self.guard = app, guard

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        why = self.guard.refusal(headers, scope.get("scheme", "http"))
        if why is None:
            return await self.app(scope, receive, send)
        if scope["type"] == "http":
            body = why.encode()
            await send({"type": "http.response.start", "status": 403,
                        "headers": [(b"content-type", b"text/plain; charset=utf-8"),
                                    (b"content-length", str(len(body)).encode())]})
            await send({"type": "http.response.body", "body": body})
            return None
        # Accept, then close with 1008 and the reason: a refused handshake would show the page only "1006",
        # while the close frame tells a user (or a test) exactly why. Nothing else is sent or read.
        await receive()  # websocket.connect
        await send({"type": "websocket.accept"})
        reason = why.encode()[:120].decode("utf-8", errors="ignore")  # a close reason holds <= 123 bytes
        await send({"type": "websocket.close", "code": 1008, "reason": reason})
        return None
