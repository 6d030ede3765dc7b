"""Hidden-state messages of MegaFBD: forward stage -> backward stage inputs, and forward stage -> forward stage.

Each (sender, receiver) stream travels on its own 2-rank group (`fbd.groups.PairLinks`): the outbox and
inbox ask their links for the group of each peer. Every message is a 16-byte header (step, dp replica,
microbatch, virtual stage) and the hidden state. Both ends derive the order of the messages on each stream from
the layout, so the receiver posts its receives in exactly the sender's issue order (NCCL matches point-to-point
by order, not tag); the header only checks that, turning a mismatch into an error instead of silently mixed
microbatches. A receiver keeps a small window of receives posted per stream and files arrivals under their key
until their consumer takes them.
"""
from __future__ import annotations

from collections import deque

import torch

from megatronapp.fbd.groups import PairLinks
from megatronapp.parallel import comm, host_copy

HEADER_BYTES = 16
Key = tuple[int, int, int]  # (dp replica, microbatch, virtual stage)


def _buffer(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    payload = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    return torch.empty(HEADER_BYTES + payload, dtype=torch.uint8, device=device)


class Outbox:
    """Asynchronous sends of one rank on its links; payloads are dropped as soon as their send completes."""

    def __init__(self, links: PairLinks, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device):
        self.links, self.shape, self.dtype, self.device = links, shape, dtype, device
        self.sends: deque[comm.Handle] = deque()
        self.peak = 0  # payloads held at once (memory the forward side spends on running ahead)

    def send(self, dst: int, step: int, key: Key, t: torch.Tensor) -> None:
        buf = _buffer(self.shape, self.dtype, self.device)
        host_copy.write_ints(buf[:HEADER_BYTES].view(torch.int32), [step % 2**31, *key])
        buf[HEADER_BYTES:].view(self.dtype).view(self.shape).copy_(t.detach())
        h = comm.isend(buf, dst, self.links(dst))
        h.is_completed()  # gloo: start watching now, so the payload can go as soon as it is sent
        self.sends.append(h)
        self.peak = max(self.peak, len(self.sends))
        while self.sends and self.sends[0].is_completed():
            self.sends.popleft().wait()

    def finish(self) -> None:
        while self.sends:
            self.sends.popleft().wait()


class _Stream:
    def __init__(self, src: int, keys: list[Key]):
        self.src, self.keys = src, deque(keys)  # keys still to post, in the sender's order
        self.posted: deque[tuple[Key, torch.Tensor, comm.Handle]] = deque()


class Inbox:
    """Receives of one rank on its links for one step, in the order each sender issues them."""

    def __init__(self, links: PairLinks, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
                 window: int = 2):
        self.links, self.shape, self.dtype, self.device = links, shape, dtype, device
        self.window = max(1, window)
        self.streams: dict[int, _Stream] = {}
        self.source: dict[Key, int] = {}
        self.arrived: dict[Key, torch.Tensor] = {}
        self.unchecked: list[tuple[int, Key, torch.Tensor]] = []  # GPU: headers kept on the device until finish
        self.step = 0

    def start(self, step: int, expected: dict[int, list[Key]]) -> None:
        """Begin a step: `expected[src]` lists the keys `src` sends, in its order."""
        if self.arrived or any(s.posted or s.keys for s in self.streams.values()):
            raise RuntimeError(f"FBD step {self.step} left messages unconsumed: {sorted(self.arrived)}")
        self.step = step
        self.streams = {src: _Stream(src, keys) for src, keys in expected.items() if keys}
        self.source = {k: src for src, keys in expected.items() for k in keys}
        for s in self.streams.values():
            self._post(s)

    def _post(self, s: _Stream) -> None:
        while s.keys and len(s.posted) < self.window:
            key = s.keys.popleft()
            buf = _buffer(self.shape, self.dtype, self.device)
            s.posted.append((key, buf, comm.irecv(buf, s.src, self.links(s.src))))

    def take(self, key: Key) -> torch.Tensor:
        """The payload of message `key` (waiting for it, and filing the ones ahead of it on its stream)."""
        if key not in self.source:
            raise RuntimeError(f"FBD: message {key} is not expected this step (step {self.step})")
        s = self.streams[self.source[key]]
        while key not in self.arrived:
            want, buf, h = s.posted.popleft()
            h.wait()
            if buf.device.type == "cuda":  # checked once per step (finish): no host sync per message
                self.unchecked.append((s.src, want, buf[:HEADER_BYTES].view(torch.int32).clone()))
            else:
                self._check(s.src, want, tuple(buf[:HEADER_BYTES].view(torch.int32).tolist()))
            self.arrived[want] = buf[HEADER_BYTES:].view(self.dtype).view(self.shape)
            self._post(s)
        del self.source[key]
        return self.arrived.pop(key)

    def _check(self, src: int, want: Key, header: tuple[int, ...]) -> None:
        if header != (self.step % 2**31, *want):
            raise RuntimeError(f"FBD message out of order from rank {src}: got header (step, dp, microbatch, "
                               f"virtual stage) {header}, expected {(self.step, *want)}")

    def finish(self) -> None:
        if self.unchecked:  # GPU: every header of the step, read with one copy
            headers = torch.stack([h for _, _, h in self.unchecked]).tolist()
            for (src, want, _), header in zip(self.unchecked, headers):
                self._check(src, want, tuple(header))
            self.unchecked = []
        left = sorted(self.source)
        if left or self.arrived:
            raise RuntimeError(f"FBD step {self.step} ended with messages not taken: {left[:8]}")
