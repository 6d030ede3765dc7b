"""Modelled wires for emulated devices: every collective and P2P send takes its bytes over a stated link speed.

On one machine gloo's loopback is far faster than any real link, so hiding communication behind compute cannot
show: there is nothing to hide. With emulated devices (`parallel/device_emulation.py`) compute has a device time;
this model gives communication a wire time, per kind of group, as a comm interceptor (`comm.add_interceptor`):

  * a collective on group G may not complete before its wire time has passed since it was issued: the caller
    of a blocking one is held, an asynchronous one's handle reports completion only then (the caller goes on);
  * a P2P send is delivered late by its wire time, in order, and the sender goes on (comm's slow-wire path);
  * the ops of one group share its wire: an op issued while the wire still carries an earlier one starts after
    it (per rank and group; P2P directions are separate groups, so a link is full duplex).

Bytes on the wire are those of a ring: an all-reduce of B bytes over n ranks moves 2(n-1)/n B per rank, a
reduce-scatter or an in-place all-gather (B: the whole buffer) (n-1)/n B, a broadcast or send B. Our
`all_gather` records the local part's bytes, so for it B is under-counted by n; only the TP sequence-parallel
gathers use it. Receives and barriers cost nothing here (a send's wire time is the transfer).

    LinkModel({"tp": 300.0, "dp": 25.0, "pp": 25.0})   # GB/s per group kind (the name before the first '.')
"""
from __future__ import annotations

import threading
import time

from megatronapp.parallel import comm


def wire_bytes(op: comm.CommOp) -> float:
    """Bytes one rank puts on its link for `op` (ring algorithms)."""
    n = max(len(op.group_ranks), 1)
    if op.name == "all_reduce":
        return 2.0 * (n - 1) / n * op.nbytes
    if op.name in ("reduce_scatter", "all_gather"):
        return (n - 1) / n * op.nbytes
    if op.name in ("broadcast", "send"):
        return float(op.nbytes)
    return 0.0


class LinkModel:
    """A comm interceptor giving each op of a listed group kind the wire time of its bytes at that kind's
    GB/s, serialised per group. `install()` hooks it, `remove()` unhooks it."""

    def __init__(self, gbps: dict[str, float], latency_s: float = 0.0):
        bad = {k: v for k, v in gbps.items() if not v > 0}
        if bad:
            raise ValueError(f"link speeds must be > 0 GB/s, got {bad}")
        self.gbps, self.latency_s = dict(gbps), latency_s
        self._free: dict[str, float] = {}  # group name -> monotonic time its wire is free again
        self._lock = threading.Lock()
        self.busy_s: dict[str, float] = {}  # modelled wire seconds per group kind (for reports)

    def __call__(self, op: comm.CommOp) -> float | None:
        kind = op.group.split(".")[0]
        rate = self.gbps.get(kind)
        if rate is None or op.name == "recv":
            return None
        wire = self.latency_s + wire_bytes(op) / (rate * 1e9)
        if wire <= 0:
            return None
        now = time.monotonic()
        with self._lock:
            start = max(now, self._free.get(op.group, 0.0))
            end = self._free[op.group] = start + wire
            self.busy_s[kind] = self.busy_s.get(kind, 0.0) + wire
        return end - now

    def install(self) -> LinkModel:
        comm.add_interceptor(self)
        return self

    def remove(self) -> None:
        comm.remove_interceptor(self)

    def describe(self) -> str:
        return ", ".join(f"{k} {v:g} GB/s" for k, v in self.gbps.items())
