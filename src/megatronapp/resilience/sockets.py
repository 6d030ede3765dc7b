"""Leaving a generation's collectives: every way of failing must end in closed connections.

Gloo collectives cannot be aborted from outside (pytorch/pytorch#130345; `ProcessGroupGloo` does not override
`Backend::abort()`, which is a no-op: torch/csrc/distributed/c10d/Backend.hpp). What releases a rank blocked in a
gloo op is its peer's connection closing: gloo's TCP pair sees the end of stream and fails every pending
operation on it ("Connection closed by peer", gloo/transport/tcp/pair.cc). A SIGKILLed peer closes its sockets
through the kernel. A peer that is alive but left the generation for another reason (its own peer died, the
supervisor ended the generation) must close them itself, or a rank blocked on it would wait for gloo's timeout.
So a rank leaving a generation shuts down (`shutdown(SHUT_RDWR)`) every connected socket it opened while joining
it: the generation's store connection and gloo's pairs. That wakes its own blocked operations (the store's
`get`, a collective's `recv`) and, through the end of stream, its peers'. Listening sockets are left alone (gloo's
listener thread terminates the process if its socket is shut: `accept: Invalid argument`, seen on torch 2.13).

The sockets of a generation are the ones that did not exist before the rank began to join it (`/proc/self/fd`,
compared by inode): the store connection, the listeners and the pairs torch makes while building the
generation's process groups (gloo connects every pair when a group is made, `connectFullMesh`). A socket another
thread opened in that window would be shut down too; in the engine nothing else opens sockets then.

On NCCL the analogue is aborting the communicators (`ProcessGroupNCCL::abort()`, `ncclCommAbort`: kernels
waiting on a dead peer return and the communicator's resources are freed), which torch exposes as
`torch.distributed.distributed_c10d._abort_process_group()`; `leave()` calls it when the default group is NCCL.
"""
from __future__ import annotations

import os
import socket
from collections.abc import Iterable


def socket_inodes() -> dict[int, int]:
    """This process's open sockets: {fd: inode}."""
    out = {}
    try:
        fds = os.listdir("/proc/self/fd")
    except OSError:
        return out
    for fd in fds:
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # closed meanwhile (listdir's own fd, a socket another thread closed)
            continue
        if target.startswith("socket:["):
            out[int(fd)] = int(target[8:-1])
    return out


def shut_down(fds: Iterable[int]) -> int:
    """Shut down every connected socket among `fds` (listeners are skipped); returns how many. The descriptors stay
    open (their owners close them): a duplicate is shut down, which acts on the socket they share."""
    n = 0
    for fd in fds:
        try:
            s = socket.socket(fileno=os.dup(fd))
        except OSError:  # closed meanwhile, or not a socket any more
            continue
        try:
            if s.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                continue
            s.shutdown(socket.SHUT_RDWR)
            n += 1
        except OSError:  # not connected (any more)
            pass
        finally:
            s.close()
    return n


class GenerationSockets:
    """The sockets this process opens while joining one generation, and how to close them all at once."""

    def __init__(self) -> None:
        self.before = set(socket_inodes().values())  # taken before the generation's first connection
        self.store: set[int] | None = None  # while the groups form: the inodes of the store connection alone

    def forming(self) -> None:
        """The generation's store connection is made and its groups are about to form: until `formed()`, leaving
        shuts down the store connection only. A rank blocked in the rendezvous waits on the store, which that
        releases; its half-made gloo pairs are torn down by torch as the group's construction fails (a pair
        socket shut in the middle of gloo's connect handshake was seen to leave the pair waiting for gloo's whole
        timeout, with the rendezvous of the next generation waiting on it)."""
        self.store = set(socket_inodes().values()) - self.before

    def formed(self) -> None:
        """The generation's groups exist: leaving shuts down every socket opened since joining."""
        self.store = None

    def new(self) -> list[int]:
        """Descriptors of the sockets opened since (the generation's); while its groups form, the store's only."""
        return [fd for fd, inode in socket_inodes().items()
                if inode not in self.before and (self.store is None or inode in self.store)]

    def leave(self) -> int:
        """Release every operation of this generation, here and at its peers: abort NCCL communicators, shut down
        the generation's sockets. Returns how many sockets were shut down."""
        _abort_nccl()
        return shut_down(self.new())


def _abort_nccl() -> None:
    """On NCCL, abort every communicator of the process (`_abort_process_group`): gloo has no such call."""
    import torch.distributed as dist

    try:
        if dist.is_initialized() and dist.get_backend() == "nccl":
            dist.distributed_c10d._abort_process_group()
    except Exception:  # noqa: BLE001, S110 - the groups may be half torn down already; sockets come next anyway
        pass
