"""`megatronapp resilience store`: the c10d rendezvous store on a host outside the training hosts.

With torchrun's usual set-up the store lives in the agent of host 0 (`is_host`): when host 0 is lost, the other
agents lose the rendezvous with it and the job cannot form another round, whatever standby hosts wait. Started
on a machine that does not train (a Slurm job's batch host, a Kubernetes Service's pod), the store outlives any
training host; every host then runs torchrun with `--rdzv-conf is_host=0` and the same endpoint, and losing host
0 is like losing any other host. It listens on the one address it is given (never every interface) and holds
only the rendezvous state; it ends on SIGTERM or SIGINT.
"""
from __future__ import annotations

import contextlib
import datetime
import signal
import socket
import sys
import threading

from megatronapp.config import ConfigError


def serve(addr: str, port: int, stop: threading.Event | None = None) -> None:
    """Host a TCPStore on addr:port until `stop` is set (or SIGTERM/SIGINT, in the main thread)."""
    import torch.distributed as dist

    stop = stop or threading.Event()
    sock = socket.socket(socket.AF_INET6 if ":" in addr else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((addr, port))
    except OSError as e:
        sock.close()
        raise ConfigError(f"--addr {addr} --port {port}: cannot listen there ({e.strerror}); give an address of "
                          f"this host and a free port") from None
    sock.listen(1024)
    store = dist.TCPStore(addr, port, None, True, timeout=datetime.timedelta(seconds=60),
                          wait_for_workers=False, master_listen_fd=sock.fileno(), use_libuv=True, multi_tenant=True)
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
    print(f"megatronapp store: the rendezvous store listens on {addr}:{port}; torchrun on every host: "
          f"--rdzv-backend c10d --rdzv-endpoint {addr}:{port} --rdzv-conf is_host=0", file=sys.stderr, flush=True)
    while not stop.wait(1.0):
        pass
    del store  # the store closes the listening descriptor it was handed
    with contextlib.suppress(OSError):
        sock.close()
