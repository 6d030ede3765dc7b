"""Hosts on one machine: network namespaces on a private switch, for multi-host tests and benchmarks.

A `Cluster` of N hosts is N network namespaces (each its own network stack, loopback and one interface `eth0`
with its own address) plus one switch namespace holding a bridge, with one veth pair from each host to the
switch. Nothing is added to the machine's own namespace: the switch has no address and no route out, so traffic
only flows between the namespaces the cluster made, on the addresses it assigned. The file system is shared (as
a cluster's shared file system would be), the network is not.

- `run(host, argv)` starts a command inside a host (`ip netns exec`);
- `kill_host(host)` SIGKILLs every process in the host's namespace (a machine that lost power, when the link is
  cut first: `lose_host`);
- `cut(host)` / `restore(host)` take the host's switch port down and up: its packets are dropped, its TCP
  connections stay open and retransmit, as on a pulled cable;
- `close()` (also at exit, and by `sweep_stale()` for a run that was killed) kills every process of every
  namespace and deletes them.

Names carry a per-run prefix `mah<pid>x<token>-` so that parallel runs never meet, and the owner's pid, so that
`sweep_stale()` removes only namespaces whose owner is gone. `missing_capability()` says why namespaces cannot be
made here (not root, no `ip`, namespaces not permitted), for a test to skip naming it.

Root is needed; the machine needs `ip` (iproute2) with netns, veth and bridge support. `tc netem` is not used.
"""
from __future__ import annotations

import atexit
import contextlib
import os
import secrets
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PREFIX = "mah"  # every namespace this module makes starts with it (the sweep touches nothing else)
SUBNET = "10.213.0"  # a private /24; each cluster has its own switch, so clusters never share an address space


@dataclass(frozen=True)
class Host:
    index: int
    netns: str
    addr: str
    port: str  # the switch-side end of its link, in the switch namespace
    ifname: str = "eth0"  # its interface, inside its namespace


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def missing_capability() -> str | None:
    """Why network namespaces cannot be made here, or None if they can (a probe namespace is made and removed)."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "not root: network namespaces (ip netns add) need root"
    if shutil.which("ip") is None:
        return "no `ip` command (iproute2) on PATH"
    probe = f"{PREFIX}{os.getpid()}xprobe{secrets.token_hex(2)}"
    try:
        made = _ip("netns", "add", probe, check=False)
        if made.returncode != 0:
            return f"network namespaces not permitted here: `ip netns add` said {made.stderr.strip()!r}"
        for kind in ("bridge", "veth"):
            extra = ["peer", "name", "p1"] if kind == "veth" else []
            r = _ip("-n", probe, "link", "add", "p0", "type", kind, *extra, check=False)
            if r.returncode != 0:
                return f"no {kind} devices in a network namespace: {r.stderr.strip()!r}"
            _ip("-n", probe, "link", "del", "p0", check=False)
        return None
    finally:
        _ip("netns", "del", probe, check=False)


def _pids(netns: str) -> list[int]:
    r = _ip("netns", "pids", netns, check=False)
    return [int(p) for p in r.stdout.split() if p.isdigit()] if r.returncode == 0 else []


def _kill_all(netns: str, timeout_s: float = 10.0) -> list[int]:
    """SIGKILL every process of the namespace until none is left; the pids killed."""
    killed: list[int] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        pids = [p for p in _pids(netns) if p != os.getpid()]
        if not pids:
            break
        for p in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGKILL)
                killed.append(p)
        time.sleep(0.05)
    return killed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _ours(name: str) -> bool:
    return name.startswith(PREFIX) and name[len(PREFIX):].split("x", 1)[0].isdigit()


def _netns_names() -> list[str]:
    r = _ip("netns", "list", check=False)
    return [line.split()[0] for line in r.stdout.splitlines() if line.strip()]


def sweep_stale() -> list[str]:
    """Delete the namespaces of clusters whose owner process is gone (a run killed before its cleanup)."""
    removed = []
    for name in _netns_names():
        if _ours(name) and not _alive(int(name[len(PREFIX):].split("x", 1)[0])):
            _kill_all(name)
            if _ip("netns", "del", name, check=False).returncode == 0:
                removed.append(name)
    return removed


class Cluster:
    """N hosts on one switch. Use as a context manager (or call `close()`); also closed at interpreter exit."""

    def __init__(self, n_hosts: int, log_dir: Path | None = None):
        if not 1 <= n_hosts <= 200:
            raise ValueError(f"n_hosts={n_hosts}: 1 to 200 hosts fit the cluster's /24")
        self.tag = f"{PREFIX}{os.getpid()}x{secrets.token_hex(3)}"
        self.switch = f"{self.tag}-sw"
        self.hosts = [Host(i, f"{self.tag}-h{i}", f"{SUBNET}.{i + 1}", f"p{i}") for i in range(n_hosts)]
        self.log_dir = log_dir
        self._made: list[str] = []
        self._procs: list[subprocess.Popen] = []
        self._closed = False
        atexit.register(self.close)
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    def _build(self) -> None:
        sweep_stale()
        self._add_netns(self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        for h in self.hosts:
            self._attach(h)

    def _attach(self, h: Host) -> None:
        """Make host `h`'s namespace and link it to the switch."""
        self._add_netns(h.netns)
        _ip("-n", h.netns, "link", "set", "lo", "up")
        # both ends made inside their namespaces: the machine's own namespace never holds one
        _ip("-n", self.switch, "link", "add", h.port, "type", "veth", "peer", "name", h.ifname, "netns", h.netns)
        _ip("-n", self.switch, "link", "set", h.port, "master", "br0")
        _ip("-n", self.switch, "link", "set", h.port, "up")
        _ip("-n", h.netns, "addr", "add", f"{h.addr}/24", "dev", h.ifname)
        _ip("-n", h.netns, "link", "set", h.ifname, "up")

    def _add_netns(self, name: str) -> None:
        _ip("netns", "add", name)
        self._made.append(name)

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def run(self, host: int, argv: list[str], env: dict[str, str] | None = None, log: str | None = None,
            **kw: Any) -> subprocess.Popen:
        """Start `argv` inside host `host`; its output goes to `<log_dir>/<log>` when given."""
        if self._closed:
            raise RuntimeError("the cluster is closed")
        h = self.hosts[host]
        if log is not None and self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            f = (self.log_dir / log).open("w")
            kw.setdefault("stdout", f)
            kw.setdefault("stderr", subprocess.STDOUT)
        p = subprocess.Popen(["ip", "netns", "exec", h.netns, *argv], env=env, **kw)
        self._procs.append(p)
        return p

    def pids(self, host: int) -> list[int]:
        """Every process running in host `host`."""
        return _pids(self.hosts[host].netns)

    def kill_host(self, host: int) -> list[int]:
        """SIGKILL every process of host `host` (what a crashed machine leaves: nothing)."""
        return _kill_all(self.hosts[host].netns)

    def lose_host(self, host: int) -> list[int]:
        """A machine that lost power: its link goes first (no FIN or RST reaches its peers), then its processes."""
        self.cut(host)
        return self.kill_host(host)

    def cut(self, host: int) -> None:
        """Take host `host`'s switch port down: its packets are dropped both ways, its connections stay open."""
        _ip("-n", self.switch, "link", "set", self.hosts[host].port, "down")

    def restore(self, host: int) -> None:
        _ip("-n", self.switch, "link", "set", self.hosts[host].port, "up")

    def close(self) -> None:
        """Kill every process of every host and delete every namespace this cluster made (idempotent)."""
        if self._closed:
            return
        self._closed = True
        for name in self._made:
            _kill_all(name)
        for p in self._procs:
            with contextlib.suppress(Exception):
                p.wait(timeout=5)
        for name in reversed(self._made):
            _ip("netns", "del", name, check=False)
        atexit.unregister(self.close)

    def leftovers(self) -> list[str]:
        """Namespaces of this cluster that still exist (none after `close()`)."""
        return [n for n in _netns_names() if n.startswith(self.tag)]
