"""`megatronapp torchrun ...`: torchrun, with what it cannot find by itself on hosts whose name does not resolve to
their own address (containers, network namespaces, some clouds) filled in and said.

torchrun's c10d rendezvous goes wrong there in three ways, each silent until a timeout:

- the host that owns the rendezvous endpoint does not host the store: torchrun decides `is_host` by comparing the
  endpoint with its host name and the addresses that name resolves to; when the name resolves elsewhere, every
  agent waits as a client for a store nobody hosts and fails after 60 s (`RendezvousConnectionError` with a C++
  traceback). Here: the endpoint's address is one of this host's (a socket binds to it) -> `is_host=1`;
- workers connect to the wrong master: rank 0's host is advertised under its host name (`socket.getfqdn()`),
  which on the other hosts resolves to their own address. Here: `--local-addr`, the address this host uses
  toward the endpoint;
- gloo (and NCCL's bootstrap) listen on the interface their host name resolves to. Here: `GLOO_SOCKET_IFNAME`
  (and `NCCL_SOCKET_IFNAME`) set to the interface holding that address, when unset.

A host that is not the store's waits for the store (torchrun's `read_timeout`, 60 s by default) and, if it never
answers, stops with a message naming the flag and the address instead of torchrun's traceback. With
`train --heartbeat-dir` it also sets `TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1` (see docs/resilience.md). Everything it
sets is printed; anything the user gave is kept. It then runs torchrun in this process (one torch import).
"""
from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import struct
import sys
import time
from dataclasses import dataclass, field

SIOCGIFADDR = 0x8915  # Linux: the IPv4 address of an interface


@dataclass
class Plan:
    """What the pre-flight adds to torchrun's arguments and environment, and why."""

    endpoint: tuple[str, int] | None = None
    is_host: bool = False
    local_addr: str | None = None
    conf: dict[str, str] = field(default_factory=dict)  # --rdzv-conf, merged
    env: dict[str, str] = field(default_factory=dict)  # set because they were unset
    notes: list[str] = field(default_factory=list)


def is_local(addr: str) -> bool:
    """Whether `addr` is an address of this host (its network namespace): a socket can bind to it."""
    try:
        infos = socket.getaddrinfo(addr, None, type=socket.SOCK_STREAM)
    except socket.gaierror:
        return False
    for family, _, _, _, sockaddr in infos:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            try:
                s.bind((sockaddr[0], 0))
                return True
            except OSError:
                continue
    return False


def source_address(host: str, port: int) -> str | None:
    """The address this host sends from toward host:port (a UDP 'connect' picks the route; nothing is sent)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)
    except socket.gaierror:
        return None
    for family, kind, proto, _, sockaddr in infos:
        with socket.socket(family, kind, proto) as s:
            try:
                s.connect(sockaddr)
                return s.getsockname()[0]
            except OSError:
                continue
    return None


def interface_of(addr: str) -> str | None:
    """The name of the interface that holds IPv4 address `addr` (Linux), or None."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                raw = fcntl.ioctl(s.fileno(), SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue
            if socket.inet_ntoa(raw[20:24]) == addr:
                return name
    return None


def plan(endpoint: str | None, conf_text: str, local_addr: str | None, backend: str,
         train_args: list[str], env: dict[str, str]) -> Plan:
    """What this host needs for torchrun's c10d rendezvous, from torchrun's parsed arguments and the environment."""
    from torch.distributed.elastic.rendezvous.utils import _parse_rendezvous_config, parse_rendezvous_endpoint

    p = Plan(conf=_parse_rendezvous_config(conf_text or ""))  # ValueError naming the option
    if backend != "c10d" or not endpoint:
        p.notes.append("not a c10d rendezvous with an endpoint: nothing to find")
        return p
    host, port = parse_rendezvous_endpoint(endpoint, 29400)
    p.endpoint = (host, port)
    if "is_host" in p.conf:
        p.is_host = p.conf["is_host"].lower() in ("1", "true", "yes", "y")
    elif is_local(host):
        p.is_host = True
        p.conf["is_host"] = "1"
        p.notes.append(f"{host} is an address of this host: it hosts the rendezvous store (is_host=1)")
    p.local_addr = local_addr
    if local_addr is None:
        p.local_addr = source_address(host, port)
        if p.local_addr is not None:
            p.notes.append(f"this host reaches {host} from {p.local_addr}: --local-addr {p.local_addr}")
    if p.local_addr is not None:
        ifname = interface_of(p.local_addr)
        for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
            if ifname and var not in env:
                p.env[var] = ifname
        if ifname and "GLOO_SOCKET_IFNAME" not in env:
            p.notes.append(f"{p.local_addr} is on {ifname}: GLOO_SOCKET_IFNAME={ifname} (and NCCL's)")
    if "--heartbeat-dir" in train_args and "TORCH_DISABLE_SHARE_RDZV_TCP_STORE" not in env:
        p.env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
        p.notes.append("--heartbeat-dir: TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (a fresh store each round)")
    return p


def store_answers(host: str, port: int, wait_s: float, poll_s: float = 0.5) -> bool:
    """Whether a TCP connection to host:port opens within `wait_s` (retried: the store's host may start later)."""
    deadline = time.monotonic() + wait_s
    while True:
        with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=min(2.0, max(wait_s, 0.1))):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(poll_s)


def unreachable_message(p: Plan, wait_s: float) -> str:
    """What a host whose store never answered is told: the address, the flag, and the store outside."""
    assert p.endpoint is not None
    host, port = p.endpoint
    return (f"megatronapp torchrun: the rendezvous store at {host}:{port} did not answer within {wait_s:.0f} s. "
            f"Nobody hosts it, or this host cannot reach it (from {p.local_addr or 'no route'}). The host that owns "
            f"{host} hosts it: start `megatronapp torchrun` there too (it passes --rdzv-conf is_host=1 when {host} "
            f"is one of its addresses; plain torchrun decides from the host name, which in a container or network "
            f"namespace does not resolve to {host}: pass --rdzv-conf is_host=1 there yourself), or run the store "
            f"outside the training hosts: `megatronapp resilience store --addr {host} --port {port}` with "
            f"--rdzv-conf is_host=0 on every host.")


def main(argv: list[str]) -> int:
    """Parse torchrun's arguments with torchrun's own parser, fill in what is missing, and run torchrun here."""
    from torch.distributed import run as torchrun

    args = torchrun.get_args_parser().parse_args(argv)
    try:
        p = plan(args.rdzv_endpoint, args.rdzv_conf, args.local_addr, args.rdzv_backend,
                 list(args.training_script_args), dict(os.environ))
    except ValueError as e:
        print(f"megatronapp torchrun: {e}", file=sys.stderr)
        return 2
    for note in p.notes:
        print(f"megatronapp torchrun: {note}", file=sys.stderr, flush=True)
    os.environ.update(p.env)
    args.rdzv_conf = ",".join(f"{k}={v}" for k, v in p.conf.items())
    args.local_addr = p.local_addr
    if p.endpoint is not None and not p.is_host:
        wait_s = float(p.conf.get("read_timeout", 60))
        if not store_answers(*p.endpoint, wait_s):
            print(unreachable_message(p, wait_s), file=sys.stderr, flush=True)
            return 2
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, record
    from torch.distributed.elastic.rendezvous import RendezvousError

    try:
        record(torchrun.run)(args)  # as torchrun's own main: the failed worker's error file is read and shown
    except ChildFailedError as e:
        print(e, file=sys.stderr)
        return 1
    except RendezvousError as e:
        where = f"{p.endpoint[0]}:{p.endpoint[1]}" if p.endpoint else "the rendezvous endpoint"
        print(f"megatronapp torchrun: the rendezvous failed ({type(e).__name__}: {e}). The store at {where} went "
              f"away or cannot be reached from this host: the job ended and its host closed the store, or that "
              f"host is down or cut off from this one (a store outside the training hosts survives the loss of "
              f"any of them: `megatronapp resilience store`)", file=sys.stderr, flush=True)
        return 1
    except AttributeError as e:
        if not _standby_closed(e):
            raise
        # pytorch/pytorch#194710 (open): a host in the rendezvous' redundancy list (a standby that was never
        # needed, or a host that was replaced and rejoined) leaves gracefully when the job closes the rendezvous,
        # but torch's launch_agent then reads the result it did not get and raises this
        print("megatronapp torchrun: the job ended while this host waited in the rendezvous as a standby (never "
              "needed, or replaced and then back); nothing more to do here", file=sys.stderr, flush=True)
    return 0


def _standby_closed(e: AttributeError) -> bool:
    """Whether `e` is torch's launch_agent reading the missing result of an agent whose rendezvous closed while it
    waited in the redundancy list."""
    tb = e.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return "is_failed" in str(e) and tb is not None and tb.tb_frame.f_code.co_name == "launch_agent"
