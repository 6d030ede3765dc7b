"""A gloo send written after its generation's sockets were released completes, instead of waiting for the operation
timeout while its peer goes on: the race that kept a healthy survivor in an ended generation (docs/resilience.md,
"What we learned"; `resilience/sockets.py`, "Why only the receiving side"), with its order forced by stopping gloo's
device thread with ptrace."""
from __future__ import annotations

import datetime
import fcntl
import os
import socket
import struct
import subprocess
import sys
import termios
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from megatronapp.resilience.sockets import shut_down, socket_inodes


@pytest.fixture
def store():
    server = dist.TCPStore("127.0.0.1", 0, None, True, use_libuv=True, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=30))
    yield lambda: dist.TCPStore("127.0.0.1", server.port, None, False, timeout=datetime.timedelta(seconds=30))


_PTRACE_STOP = """
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
tid = int(sys.argv[1])
if libc.ptrace(0x4206, tid, None, None) != 0:  # PTRACE_SEIZE
    print("refused", ctypes.get_errno(), flush=True)
    sys.exit(1)
libc.ptrace(0x4207, tid, None, None)  # PTRACE_INTERRUPT: this thread alone stops
os.waitpid(tid, 0x40000000)  # __WALL
print("stopped", flush=True)
sys.stdin.readline()
libc.ptrace(17, tid, None, None)  # PTRACE_DETACH: it runs on
"""


def _gloo_loops() -> set[str]:
    return {t for t in os.listdir("/proc/self/task")
            if Path(f"/proc/self/task/{t}/comm").read_text().strip() == "gloo_tcp_loop"}


def _listening_ports() -> dict[int, int]:
    """{inode: port} of this process's listening sockets."""
    out = {}
    for fd, inode in socket_inodes().items():
        try:
            s = socket.socket(fileno=os.dup(fd))
        except OSError:  # closed since it was listed (a thread of an earlier test's group or store)
            continue
        with s:
            if s.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                out[inode] = s.getsockname()[1]
    return out


def _until(what: str, pred) -> None:
    deadline = time.monotonic() + 300  # a guard against a broken setup, not the subject of the test
    while not pred():
        assert time.monotonic() < deadline, what
        time.sleep(0.001)


class _Pair:
    """A two-member gloo group in this process, with what the tests need to force an order: member 0's device
    thread (to stop it) and each member's end of the pair."""

    def __init__(self, store) -> None:
        # A stranded send fails after this with "Timed out waiting"; a sent one completes in milliseconds, and the
        # margin is for a loaded host, where a device thread may wait seconds for a core.
        timeout = datetime.timedelta(seconds=60)
        self.pgs: dict[int, dist.ProcessGroupGloo] = {}

        def make(rank: int) -> None:
            self.pgs[rank] = dist.ProcessGroupGloo(dist.PrefixStore("strand/", store()), rank, 2, timeout)

        loops, ports = _gloo_loops(), _listening_ports()
        one = threading.Thread(target=make, args=(1,), daemon=True)
        one.start()  # member 1's device (its listener and loop thread) first, so the two can be told apart
        _until("member 1's device", lambda: len(_listening_ports()) > len(ports) and len(_gloo_loops()) > len(loops))
        port1 = next(p for i, p in _listening_ports().items() if i not in ports)
        loops1 = _gloo_loops() - loops
        zero = threading.Thread(target=make, args=(0,), daemon=True)
        zero.start()
        zero.join(300)
        one.join(300)
        assert set(self.pgs) == {0, 1}
        (self.loop0,) = _gloo_loops() - loops - loops1
        port0 = next(p for i, p in _listening_ports().items() if i not in ports and p != port1)
        ends: dict[int, list[int]] = {0: [], 1: []}  # each member's end: accepted on its listener, or connected
        for fd in socket_inodes():
            try:
                dup = os.dup(fd)
            except OSError:  # closed since it was listed
                continue
            with socket.socket(fileno=dup) as s:
                try:
                    local, peer = s.getsockname()[1], s.getpeername()[1]
                except OSError:  # a listener, or not an internet socket
                    continue
                if local == port0 or peer == port1:
                    ends[0].append(fd)
                elif local == port1 or peer == port0:
                    ends[1].append(fd)
        assert len(ends[0]) == len(ends[1]) == 1, ends
        self.end = {m: fds[0] for m, fds in ends.items()}

    def stopped(self) -> subprocess.Popen:
        """Member 0's device thread, stopped (its `communicate("\\n")` lets it run on)."""
        stop = subprocess.Popen([sys.executable, "-c", _PTRACE_STOP, self.loop0], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True)
        line = stop.stdout.readline().strip()
        if line != "stopped":
            stop.communicate("\n", timeout=300)
            pytest.skip(f"cannot stop gloo's device thread with ptrace here ({line})")
        return stop


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc and ptrace")
def test_a_gloo_send_written_after_its_generation_was_released_is_not_stranded(store):
    """The race that kept a healthy survivor in its ended generation (docs/resilience.md, "What we learned"), with
    its order forced: member 0 of a two-member gloo group has a send posted; its peer's "receive ready" notice is
    in member 0's socket, not yet read, when the generation's end releases the socket. Gloo's device thread then
    reads the notice and writes the send before it reads the end of stream. Had the release shut the writing side
    too, that write would fail with EPIPE, which gloo's asynchronous path queues without an error, and the pair's
    end of stream fails every pending operation but an unbound buffer's queued send: the send would wait for the
    operation timeout while its peer went on (`sockets.py`). The device thread is held still (ptrace stops that
    thread alone) so the notice is queued before the release and read after it."""
    pair = _Pair(store)
    sent, got = torch.ones(4), torch.zeros(4)
    send = pair.pgs[0].send([sent], 1, 3)  # posted: it waits for member 1's notice that its receive is ready
    stop = pair.stopped()
    try:
        recv = pair.pgs[1].recv([got], 0, 3)  # member 1's notice goes out and waits, unread, in member 0's socket
        _until("member 1's notice in member 0's socket", lambda: _unread(pair.end[0]) > 0)
        assert shut_down([pair.end[0]]) == 1  # the generation's end releases member 0's socket
    finally:
        stop.communicate("\n", timeout=300)  # the device thread runs on: the notice, then the end of stream
    send.wait()  # written before the end was read: it completed (a stranded one raises "Timed out waiting")
    recv.wait()
    assert torch.equal(got, sent)
    with pytest.raises(RuntimeError, match="Connection closed"):
        pair.pgs[0].send([sent], 1, 4).wait()  # and the pair is closed now: the next operation fails at once


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc and ptrace")
def test_a_peer_released_first_does_not_strand_a_send_written_to_it(store):
    """The other order of the same race, which the drills showed once the sending side stayed open: both members
    are released by the generation's end, member 1 first. Gloo reads member 1's end of stream and closes its pair;
    member 0's device thread, behind, then reads two "receive ready" notices queued before that and writes two
    sends. Had member 1's socket really closed, the first write would draw a reset and the second fail with EPIPE
    (on loopback the reset arrives within the first write), queued and stranded as in the test above. The release
    keeps a duplicate of each socket it shuts down (`GenerationSockets.held`), so gloo's close ends nothing: both
    writes succeed, and the connection ends once the duplicates are closed (`GenerationSockets.close`)."""
    pair = _Pair(store)
    sent, got = [torch.full((4,), 1.0), torch.full((4,), 2.0)], [torch.zeros(4), torch.zeros(4)]
    sends = [pair.pgs[0].send([t], 1, tag) for tag, t in zip((3, 4), sent)]  # both wait for member 1's notices
    held: dict[int, socket.socket] = {}
    stop = pair.stopped()
    try:
        recvs = []
        for tag, t in zip((3, 4), got):  # two notices, one after the other, unread by member 0
            queued = _unread(pair.end[0])
            recvs.append(pair.pgs[1].recv([t], 0, tag))
            _until("member 1's notice in member 0's socket", lambda q=queued: _unread(pair.end[0]) > q)
        inode1 = socket_inodes()[pair.end[1]]
        assert shut_down([pair.end[1]], held) == 1  # the generation's end releases member 1 first, as GenerationSockets
        for r in recvs:  # member 1's device thread read the end of stream: its receives fail, its pair is closed
            with pytest.raises(RuntimeError, match="Connection closed"):
                r.wait()
        _until("gloo closed member 1's end", lambda: socket_inodes().get(pair.end[1]) != inode1)
    finally:
        stop.communicate("\n", timeout=300)  # member 0 reads the notices and writes the sends to member 1
    for s in sends:
        s.wait()  # written into a connection still open (a stranded send raises "Timed out waiting")
    for s in held.values():
        s.close()


def _unread(fd: int) -> int:
    """Bytes waiting to be read on socket `fd` (FIONREAD)."""
    return struct.unpack("i", fcntl.ioctl(fd, termios.FIONREAD, b"\0\0\0\0"))[0]
