"""Leaving a generation's collectives: every way of failing must end in an end of stream, never in a failed write.

Gloo collectives cannot be aborted from outside (pytorch/pytorch#130345; `ProcessGroupGloo` does not override
`Backend::abort()`, which is a no-op: torch/csrc/distributed/c10d/Backend.hpp). What releases a rank blocked in a
gloo op is an end of stream on its pair: gloo's TCP pair reads it and fails every pending operation on it
("Connection closed by peer", gloo/transport/tcp/pair.cc). A SIGKILLed peer's sockets are closed by the kernel.
Otherwise every live member releases itself when the supervisor ends the generation (its watcher, `member.py`)
or when it leaves on its own: it shuts down the receiving side (`shutdown(SHUT_RD)`) of every connected socket
it opened while joining the generation, the generation's store connection and gloo's pairs. That wakes its own
blocked operations (the store's `get`, a collective's `recv`: each reads the end of stream), and leaves the
connections themselves open for its peers until the next generation formed (the two sections below say why).
Listening sockets are left alone (gloo's listener thread terminates the process if its socket is shut:
`accept: Invalid argument`, seen on torch 2.13).

Why only the receiving side. Shutting the sending side too (`SHUT_RDWR`, as this module did) strands a gloo send:
gloo's device thread reads what is already in the socket before the end of stream, and a peer's "receive ready"
notice read there makes it write the matching send (`Pair::handleRemotePendingRecv`). With the sending side shut
that write fails with EPIPE, which gloo's asynchronous path treats as "try again later" (`Pair::write` returns
false without an error) and queues; the end of stream read next fails the pair's pending operations, but of its
queued writes only those of bound buffers (`Pair::signalException` loops over `tx_` for `op.buf`, never
`op.ubuf`), and every collective and point-to-point op of `ProcessGroupGloo` sends from an unbound buffer. So the
send waits in `UnboundBuffer::waitSend` for the operation timeout (300 s) while its peer, released, goes on:
the survivor that never began the next generation (docs/resilience.md, "What we learned"). The same happens when
the rank's own thread posts a send between the release and the device thread reading the end. With the sending
side open every such write succeeds, the send completes, and the next operation fails on the closed pair.

Why the connections stay open until every member has left the generation. Gloo closes a pair once it has read the
end of stream, and a closed socket ends its peer's stream: a FIN, and a reset for whatever the peer writes after.
The peer was usually released at the same moment (the generation's end reaches every watcher) and its device
thread can be as far behind: a "receive ready" notice read before the FIN makes it write, the first write draws
the reset, and the next fails with EPIPE and is stranded as above (the drills caught this too, once the sending
side stayed open). So the release keeps a duplicate of each socket it shuts down (`GenerationSockets.held`): gloo's
close then ends nothing, every write of a peer into the generation succeeds, and each member is released by the
end of stream of its own sockets, which its own watcher (the generation's end) or its own thread (leaving) brings.
The duplicates are closed once the rank's groups of the next generation exist (`Member.formed`): every member
has joined that one, so nobody operates on the old connections any more. A peer that dies still ends its
connections at once, and a survivor writing to it can still be stranded in gloo the same way (not seen in the
drills: a survivor reads a dead peer's end of stream within microseconds, unless it was already mid-write).

A pair still connecting is not released by any socket closing. Gloo connects a pair from one side only: the side
with the higher listening address connects to the other's listener and writes the pair's sequence number
(`Device::connectAsInitiator`, gloo/transport/tcp/device.cc); the other side registers a callback for that number
with its device's listener and waits (`Device::connectAsListener`, which ignores its timeout: "TODO(pietern): Use
timeout"). `Pair::connect` waits under the pair's mutex for a state change bounded by five times the group's
timeout ("Use a longer timeout when waiting for initial connect", `Pair::waitUntil`, gloo/transport/tcp/pair.h),
and only a connection for that number or an error of the pair's own changes it. So a peer that dies after
publishing its address and before connecting leaves the listening side waiting 5 x the timeout (150 s under a
30 s forming timeout, measured: docs/resilience.md), and no socket exists to shut. What releases it is what it
waits for: a connection to its listener that says its number. While a generation's groups form, leaving it
therefore also answers every listener the rank opened for the generation (one device, one listener and sequence
numbers 0..size-1 per group: `tcp::Context::createAndConnectAllPairs`, `Listener::nextAddress`) with a connection
per number that is shut at once: the waiting pair is connected to a closed stream and fails on its first read
("Connection closed by peer"), so the group's construction fails and the rank goes on to the next generation. A
number nobody waits for parks the connection in the listener until the device is destroyed with the group.

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
import struct
from collections.abc import Iterable

SEQUENCE_NUMBER = struct.Struct("=q")  # gloo's `sequence_number_t` (ssize_t), as its listener reads it: native order


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


def shut_down(fds: Iterable[int], keep: dict[int, socket.socket] | None = None) -> int:
    """Shut down the receiving side of every connected socket among `fds` (listeners are skipped); returns how many.
    The descriptors stay open (their owners close them): a duplicate is shut down, which acts on the socket they
    share. Only the receiving side (module docstring, "Why only the receiving side"): its owner reads the end of
    stream and fails its operations; its writes keep working. With `keep` ({inode: socket}) the duplicate of each
    socket shut down is kept open there, so that its owner closing it ends nothing for its peer (module docstring,
    "Why the connections stay open")."""
    n = 0
    for fd in fds:
        try:
            s = socket.socket(fileno=os.dup(fd))
        except OSError:  # closed meanwhile, or not a socket any more
            continue
        kept = False
        try:
            if s.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                continue
            s.shutdown(socket.SHUT_RD)
            n += 1
            inode = os.fstat(s.fileno()).st_ino
            if keep is not None and inode not in keep:
                keep[inode], kept = s, True
        except OSError:  # not connected (any more)
            pass
        finally:
            if not kept:
                s.close()
    return n


def listening(fds: Iterable[int]) -> list[tuple]:
    """The local addresses of the listening sockets among `fds`."""
    out = []
    for fd in fds:
        try:
            s = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        try:
            if s.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                out.append((s.family, s.getsockname()))
        except OSError:
            pass
        finally:
            s.close()
    return out


def answer_connects(listeners: Iterable[tuple], numbers: int, timeout_s: float = 1.0) -> int:
    """Release the pairs of gloo listeners `listeners` ((family, address) pairs) that wait for a peer to connect:
    for each sequence number below `numbers`, connect, write the number and shut the connection down. Returns how
    many connections were made (a listener already closed refuses them, which is as good)."""
    n = 0
    for family, addr in listeners:
        host = addr[0]
        if host in ("0.0.0.0", "::"):  # noqa: S104 - bound to every interface: its loopback address reaches it
            host = "127.0.0.1" if family == socket.AF_INET else "::1"
        for seq in range(numbers):
            try:
                with socket.socket(family, socket.SOCK_STREAM) as s:
                    s.settimeout(timeout_s)
                    s.connect((host, *addr[1:]))
                    s.sendall(SEQUENCE_NUMBER.pack(seq))
                    s.shutdown(socket.SHUT_RDWR)
                    n += 1
            except OSError:  # the listener is gone (its group was destroyed): nothing waits on it
                break
    return n


class GenerationSockets:
    """The sockets this process opens while joining one generation, and how to close them all at once."""

    def __init__(self, size: int) -> None:
        self.size = size  # the most members a group of the generation has: its pairs' sequence numbers are below it
        self.before = set(socket_inodes().values())  # taken before the generation's first connection
        self.store: set[int] | None = None  # while the groups form: the inodes of the store connection alone
        self.whole_left = False  # every socket of the generation was shut down (not only its store connection)
        self.held: dict[int, socket.socket] = {}  # {inode: duplicate} of the sockets shut down, kept open (`close`)

    def forming(self) -> None:
        """The generation's store connection is made and its groups are about to form: until `formed()`, leaving
        shuts down the store connection and answers the generation's gloo listeners (above). A rank blocked in the
        rendezvous waits on the store, which the first releases; one blocked in `Pair::connect` waits on its
        listener, which the second releases. The pairs of the groups it made or half made before are not torn down
        by the failed construction (torch keeps the groups made before it, and the failure's traceback holds the
        frames that hold them): the rank's own `Member.leave` releases them too once it is out of the formation,
        and keeps them open with the rest until the next generation formed (a live peer whose groups formed over
        them is released by its own watcher, the generation having ended)."""
        self.store = set(socket_inodes().values()) - self.before

    def formed(self) -> None:
        """The generation's groups exist: leaving shuts down every socket opened since joining."""
        self.store = None

    def new(self) -> list[int]:
        """Descriptors of the sockets opened since (the generation's); while its groups form, the store's only."""
        held = {s.fileno() for s in self.held.values()}
        return [fd for fd, inode in socket_inodes().items()
                if inode not in self.before and fd not in held and (self.store is None or inode in self.store)]

    def leave(self) -> int:
        """Release every operation of this generation, here and at its peers: abort NCCL communicators, shut down
        the generation's sockets and, while its groups form, answer its listeners. Returns how many sockets were
        shut down."""
        _abort_nccl()
        forming = self.store is not None
        self.whole_left = self.whole_left or not forming
        n = shut_down(self.new(), self.held)
        if forming:
            answer_connects(listening(fd for fd, inode in socket_inodes().items() if inode not in self.before),
                            self.size)
        return n


    def close(self) -> None:
        """End the connections of this generation for its peers: call once every member has left it (the next
        generation formed), never before (module docstring, "Why the connections stay open")."""
        for s in self.held.values():
            s.close()
        self.held.clear()


def _abort_nccl() -> None:
    """On NCCL, abort every communicator of the process (`_abort_process_group`): gloo has no such call."""
    import torch.distributed as dist

    try:
        if dist.is_initialized() and dist.get_backend() == "nccl":
            dist.distributed_c10d._abort_process_group()
    except Exception:  # noqa: BLE001, S110 - the groups may be half torn down already; sockets come next anyway
        pass
