"""Pipeline point-to-point that is correct under NCCL's rules: one-way ordered channels, a header per message.

NCCL ignores tags (messages between two ranks match in issue order) and runs each pair's ops of one process
group in order on one stream, so a receive posted before a send to the same peer blocks the send. The pipeline
therefore never mixes directions on a (group, pair) stream: activations travel on the `pp.act.*` groups and
gradients on the `pp.grad.*` groups, and each of those is split by direction (`up`: to a higher rank, `down`:
to a lower one; they differ only when pp = 2, where both neighbours are one rank). On every stream a rank then
only sends or only receives, so a receive posted ahead can only wait for the message it matches, never block a
send, and no order of sends and receives on different streams can deadlock the streams themselves.

Within a channel messages arrive in the sender's order, which a dynamic policy decides at run time, so every
message starts with a 16-byte header (step, kind, chunk, microbatch) and the receiver files it under that key.
A static schedule fixes that order in advance (`schedules.arrival_orders`): the receiver then files each message
under the key it expects and checks the headers once, at the end of the step. On a GPU that removes the host from
the receive path: no polling of `is_completed()`, no header copied to the host per message; `wait()` on an NCCL
receive only orders the compute stream after it. A wrong order still fails the step, before the optimizer runs.
Only `window` receives per channel are outstanding at a time (sized from the schedule, not 2·vpp·microbatches);
one is re-posted as soon as one arrives, so a slot never waits for the task that consumes its message. Arrived
messages are kept until their task runs. A sent payload is dropped as soon as its send completes.

Why this cannot deadlock: sends are asynchronous and every message a stage sends is consumed by its neighbour
in the same step, so the only waits are for inputs; the receiver keeps a receive posted on every channel with
messages still to come and drains arrivals in order, so a wanted message is never stuck behind one that nobody
receives. The executor's waits are then exactly those of `schedules.check_orders` (inputs only, unbounded
buffers), which proves static orders complete; dynamic policies run any ready task.

With `overlap=False` (an ablation baseline, `--no-pp-overlap`) every send is waited before the stage computes
on. Every receive of the step is then posted at its start: a blocking send whose matching receive is not yet
posted would deadlock 1F1B (both neighbours sending at once), which Megatron avoids with combined
send-and-receive calls; posted receives make each blocking send wait only for the wire.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable

import torch

from megatronapp.parallel import comm, host_copy
from megatronapp.parallel.topology import Topology

HEADER_BYTES = 16  # int32 step, kind, chunk, microbatch
_KIND = {"F": 0, "B": 1}
Key = tuple[str, int, int]  # (kind, chunk on the receiving stage, microbatch)


def _poll_cap(heads: list[comm.Handle]) -> float:
    """How long a wait may sleep between polls: short when an NCCL receive (which signals nothing) decides it."""
    return comm.NCCL_POLL_MAX_S if any(h.orders_stream for h in heads) else comm.POLL_MAX_S


class _Inbound:
    """One incoming channel: outstanding receives in posting order (= arrival order)."""

    def __init__(self, kind: str, src: int, group) -> None:
        self.kind, self.src, self.group = kind, src, group
        self.posted: deque[tuple[torch.Tensor, comm.Handle]] = deque()
        self.to_post = 0  # receives still to post this step
        self.keys: deque[Key] | None = None  # a static schedule: the key of every message still to arrive, in order


class StageLinks:
    """This stage's pipeline channels for one step at a time: receive windows, headers, pending sends."""

    def __init__(self, topo: Topology, act_shape: tuple[int, ...], act_dtype: torch.dtype, device: torch.device,
                 overlap: bool = True):
        self.topo, self.act_shape, self.act_dtype, self.device = topo, act_shape, act_dtype, device
        self.overlap = overlap
        self.payload_bytes = torch.Size(act_shape).numel() * torch.empty((), dtype=act_dtype).element_size()
        me, prev, nxt = topo.rank, topo.prev_rank(), topo.next_rank()
        # Activations come from the previous stage, gradients from the next one.
        self.inbound = {"F": _Inbound("F", prev, topo.channel("act", prev, me)),
                        "B": _Inbound("B", nxt, topo.channel("grad", nxt, me))}
        self.outbound = {"F": (nxt, topo.channel("act", me, nxt)), "B": (prev, topo.channel("grad", me, prev))}
        self.arrived: dict[Key, torch.Tensor] = {}
        self.new: list[Key] = []  # arrivals not yet seen by the executor
        self.sends: deque[comm.Handle] = deque()
        self.step = 0
        self.window = 1
        self.peak_buffers = 0  # receive buffers held at once (posted + arrived, not yet consumed)
        self._side: torch.cuda.Stream | None = None  # GPU: header reads wait for their receive only
        self._pinned: torch.Tensor | None = None
        self.unchecked: list[tuple[_Inbound, Key, torch.Tensor]] = []  # known-order headers, checked at finish

    # -- a step ---------------------------------------------------------------------------------------------
    def start(self, step: int, expected: dict[str, int], window: int,
              order: dict[str, list[Key]] | None = None) -> None:
        """Begin a step expecting `expected[kind]` messages on each incoming channel; post the first windows.
        `order` (static schedules): the key of each of those messages, in the order the sender sends them."""
        if self.arrived or any(ch.posted for ch in self.inbound.values()):
            raise RuntimeError(f"pipeline step {self.step} left messages unconsumed: {sorted(self.arrived)}")
        if not self.overlap:  # blocking sends need their receives posted (see the module docstring)
            window = max(window, *expected.values(), 1)
        self.step, self.window = step, max(1, window)
        self.unchecked = []
        for kind, ch in self.inbound.items():
            ch.to_post = expected.get(kind, 0)
            ch.keys = None
            if order is not None:
                keys = order.get(kind, [])
                if len(keys) != ch.to_post:  # a bug in the schedule's arrival orders, not a user error
                    raise RuntimeError(f"pipeline: {len(keys)} {kind} messages in the static order, "
                                       f"{ch.to_post} expected")
                ch.keys = deque(keys)
            self._post(ch)

    def _post(self, ch: _Inbound) -> None:
        while ch.to_post > 0 and len(ch.posted) < self.window:
            buf = torch.empty(HEADER_BYTES + self.payload_bytes, dtype=torch.uint8, device=self.device)
            ch.posted.append((buf, comm.irecv(buf, ch.src, ch.group)))
            ch.to_post -= 1
        self._count()

    def _count(self) -> None:
        held = len(self.arrived) + sum(len(ch.posted) for ch in self.inbound.values())
        self.peak_buffers = max(self.peak_buffers, held)

    def _take_head(self, ch: _Inbound) -> Key:
        """File the head receive of `ch` (completed, or on NCCL ordered before the compute stream's next work) under
        its key, and post another: the key a static order expects (its header kept for `finish`), else the
        header's own."""
        buf, handle = ch.posted.popleft()
        if ch.keys is not None:
            key = ch.keys.popleft()
            handle.wait()  # gloo: it has arrived; NCCL: the compute stream waits for it, the host does not
            self.unchecked.append((ch, key, buf[:HEADER_BYTES].view(torch.int32).clone()))
        else:
            header = self._header(buf, handle)
            self._check(ch, header)
            key = (ch.kind, header[2], header[3])
        self.arrived[key] = buf[HEADER_BYTES:].view(self.act_dtype).view(self.act_shape)
        self.new.append(key)
        self._post(ch)
        return key

    def _check(self, ch: _Inbound, header: list[int], key: Key | None = None) -> None:
        """A message's header must carry this step and the channel's kind (and, in a static order, its key)."""
        step, kind, chunk, mb = header
        if step != self.step % 2**31 or kind != _KIND[ch.kind] or (key is not None and (chunk, mb) != key[1:]):
            expected = f", expected {key[0]}{key[1]}.{key[2]}" if key is not None else ""
            raise RuntimeError(f"pipeline message out of order on the {ch.kind} channel from rank {ch.src}: header "
                               f"(step {step}, kind {kind}, chunk {chunk}, microbatch {mb}) during step "
                               f"{self.step}{expected}")

    def _header(self, buf: torch.Tensor, handle: comm.Handle) -> list[int]:
        """The 16-byte header of a received message, on the host: the key decides which task can run.

        On CPU a plain read. On a GPU `.tolist()` on the compute stream would wait for every kernel queued
        there; instead a side stream waits for the receive alone, copies the header into pinned memory and the
        host waits for that copy only (the receive has completed when `poll` takes it); the compute stream is
        ordered after the receive without the host (an event), before the payload is used."""
        if buf.device.type != "cuda":
            handle.wait()
            return buf[:HEADER_BYTES].view(torch.int32).tolist()
        if self._side is None:
            self._side = torch.cuda.Stream(device=buf.device)
            self._pinned = torch.empty(HEADER_BYTES // 4, dtype=torch.int32, pin_memory=True)
        with torch.cuda.stream(self._side):
            handle.wait()  # orders the side stream (the current one here) after the receive
            self._pinned.copy_(buf[:HEADER_BYTES].view(torch.int32), non_blocking=True)
            copied = torch.cuda.Event()
            copied.record(self._side)
        torch.cuda.current_stream(buf.device).wait_event(copied)  # payload used on the compute stream after it
        copied.synchronize()
        return self._pinned.tolist()

    def poll(self) -> bool:
        """Take every message that has arrived (never blocks); True if any did. Also drops finished sends."""
        got = False
        for ch in self.inbound.values():
            while ch.posted and ch.posted[0][1].is_completed():
                self._take_head(ch)
                got = True
        self._prune_sends()
        return got

    def wait_for(self, key: Key, timeout_s: float, what: Callable[[], str]) -> None:
        """Block until the message `key` is here, taking the ones ahead of it on its channel in order."""
        ch = self.inbound[key[0]]
        while key not in self.arrived:
            if not ch.posted:
                raise RuntimeError(f"pipeline: {key[0]}{key[1]}.{key[2]} is not among the messages still expected "
                                   f"from rank {ch.src}; {what()}")
            head = ch.posted[0][1]
            if ch.keys is not None and head.orders_stream:
                pass  # NCCL, known order: `_take_head` orders the compute stream after the receive
            elif head.blocks_host:  # nothing else to do: wait in this thread, no hop through a watcher
                try:
                    head.wait()
                except RuntimeError as e:  # gloo's own timeout or a dead peer: say where the pipeline stood
                    raise RuntimeError(f"pipeline receive failed ({e}); {what()}") from e
            else:
                comm.wait_until(head.is_completed, timeout_s, what, _poll_cap([head]))
            self._take_head(ch)
        self._prune_sends()

    def wait_any(self, timeout_s: float, what: Callable[[], str]) -> None:
        """Block until at least one new message has arrived on any channel."""
        heads = [ch.posted[0][1] for ch in self.inbound.values() if ch.posted]
        if not heads:
            raise RuntimeError(f"pipeline: waiting for input but no message is expected; {what()}")
        comm.wait_until(lambda: any(h.is_completed() for h in heads), timeout_s, what, _poll_cap(heads))
        self.poll()

    def take(self, key: Key) -> torch.Tensor:
        return self.arrived.pop(key)

    def drain_new(self) -> list[Key]:
        new, self.new = self.new, []
        return new

    def pending(self) -> list[Key]:
        """Messages arrived but not consumed (for diagnostics)."""
        return sorted(self.arrived)

    def expected_from(self) -> dict[str, int]:
        return {k: len(ch.posted) + ch.to_post for k, ch in self.inbound.items()}

    # -- sending --------------------------------------------------------------------------------------------
    def send(self, kind: str, chunk: int, microbatch: int, t: torch.Tensor) -> None:
        """Send `t` (cast to the activation dtype) as message (kind, chunk of the receiver, microbatch)."""
        dst, group = self.outbound[kind]
        buf = torch.empty(HEADER_BYTES + self.payload_bytes, dtype=torch.uint8, device=self.device)
        host_copy.write_ints(buf[:HEADER_BYTES].view(torch.int32), [self.step % 2**31, _KIND[kind], chunk, microbatch])
        buf[HEADER_BYTES:].view(self.act_dtype).view(self.act_shape).copy_(t.detach())
        handle = comm.isend(buf, dst, group)
        if not self.overlap:
            handle.wait()
            return
        handle.is_completed()  # gloo: start watching now, so the payload can be dropped as soon as it is sent
        self.sends.append(handle)

    def _prune_sends(self) -> None:
        if any(h.is_completed() for h in self.sends):
            keep: deque[comm.Handle] = deque()
            for h in self.sends:
                if h.is_completed():
                    h.wait()  # closes the span and drops the payload
                else:
                    keep.append(h)
            self.sends = keep

    def finish(self) -> None:
        """Wait for every send of the step; every expected message must have been consumed, and the headers of a
        static order must be the ones it expected (read with one device-to-host copy for the whole step)."""
        while self.sends:
            self.sends.popleft().wait()
        if self.unchecked:
            headers = torch.stack([h for _, _, h in self.unchecked]).tolist()
            checks, self.unchecked = self.unchecked, []
            for (ch, key, _), header in zip(checks, headers):
                self._check(ch, header, key)
        left = {k: n for k, n in self.expected_from().items() if n}
        if left or self.arrived:
            raise RuntimeError(f"pipeline step {self.step} ended with messages unreceived {left} or unconsumed "
                               f"{sorted(self.arrived)}")
