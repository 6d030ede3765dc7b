"""The flight recorder: every rank's recent and in-flight communication ops, for naming who a hung job waits for.

`comm` calls `issue(op)` before it hands an op to torch.distributed and `done(op)` when the op is seen to
complete (a blocking op returned, an async op's handle completed). On NCCL a returned `wait()` only means the
op is queued on its stream, so `comm` hands over a probe instead (`done_when(op, work.is_completed)`): the op
stays in flight until the probe, checked whenever an op is issued or a snapshot taken, says its CUDA event fired.
The ops of one stream (a group's collectives, one direction of a P2P channel) run in order on one CUDA stream, so
their events fire in order: only the oldest unconfirmed op of each stream is probed, and the probes per issued op
are bounded by the number of streams, not by the ops in flight (a host running far ahead of the GPU would
otherwise spend its time probing). It is always on and costs a dict insert and delete and a deque append per op.
Readers (the resilience heartbeat, a hang dump) call `snapshot()`, which is JSON-ready and safe from any thread.

Record format (one dict per op; shared with MegaScan's hang analysis, documented in docs/resilience.md):
    {"id": 17, "op": "recv", "group": "pp.act.up", "ranks": [0, 2], "seq": 5, "peer": 0, "bytes": 4096,
     "key": "pp.act.up 0->2", "t_issue": 1764620000.12, "t_done": null}
`key` names the ordered stream the op belongs to: a collective's group and members ("tp[2, 3]"), or a P2P
channel and direction ("pp.act.up 0->2", sender first). `seq` counts the ops of that stream from 0 and is the same
number on every member (both ends of a P2P pair), so "member M issued up to seq S of stream K" is comparable
across ranks. The snapshot adds `issued` and `completed`: per stream key, the highest seq issued / completed.
"""
from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

CAPACITY = 128  # completed ops kept; in-flight ops are all kept (they are bounded by the pipeline's windows)


class _Entry:
    __slots__ = ("id", "op", "key", "t_issue", "t_done")

    def __init__(self, ident: int, op: Any, key: str):
        self.id, self.op, self.key, self.t_issue, self.t_done = ident, op, key, time.time(), None

    def record(self) -> dict[str, Any]:
        op = self.op
        return {"id": self.id, "op": op.name, "group": op.group, "ranks": list(op.group_ranks), "seq": op.seq,
                "peer": op.peer, "bytes": op.nbytes, "key": self.key, "t_issue": self.t_issue,
                "t_done": self.t_done}


def stream_key(name: str, group: str, ranks: tuple[int, ...], peer: int | None, me: int) -> str:
    """The stream an op is numbered in: a collective's group, or a P2P channel in one direction."""
    if peer is None:
        return f"{group}{list(ranks)}"
    src, dst = (me, peer) if name == "send" else (peer, me)
    return f"{group} {src}->{dst}"


class FlightRecorder:
    def __init__(self, capacity: int = CAPACITY):
        self.recent: deque[_Entry] = deque(maxlen=capacity)
        self.open: dict[int, _Entry] = {}
        self.issued: dict[str, int] = {}
        self.completed: dict[str, int] = {}
        self._ids = itertools.count()
        self._keys: dict[tuple, str] = {}
        self._rank: int | None = None
        # NCCL ops waited on, maybe still running: per stream key, oldest first (they complete in this order)
        self.unconfirmed: dict[str, deque[tuple[Any, Callable[[], bool]]]] = {}
        self._sweep_lock = threading.Lock()

    def clear(self) -> None:
        self.__init__(self.recent.maxlen or CAPACITY)  # type: ignore[misc]

    def _me(self) -> int:
        if self._rank is None:
            import torch.distributed as dist  # here, not at import: `scan detect` reads this module without torch

            self._rank = dist.get_rank() if dist.is_initialized() else 0
        return self._rank

    def issue(self, op: Any) -> None:
        cache = (op.name == "send", op.group, op.group_ranks, op.peer)
        key = self._keys.get(cache)
        if key is None:  # formatting a key costs more than the rest of the bookkeeping: once per stream
            key = self._keys[cache] = stream_key(op.name, op.group, op.group_ranks, op.peer, self._me())
        self.open[id(op)] = _Entry(next(self._ids), op, key)
        self.issued[key] = op.seq
        if self.unconfirmed:
            self._sweep()

    def done_when(self, op: Any, probe: Callable[[], bool]) -> None:
        """`op` completes when `probe()` says so (a CUDA work's `is_completed`); checked now and later."""
        e = self.open.get(id(op))
        if e is None:
            return
        with self._sweep_lock:
            if e.key not in self.unconfirmed and probe():  # an op behind an unconfirmed one waits its turn
                self.done(op)
                return
            self.unconfirmed.setdefault(e.key, deque()).append((op, probe))

    def _sweep(self) -> None:
        """Confirm what has completed: per stream, probe from the oldest op and stop at the first still running."""
        with self._sweep_lock:
            for key in list(self.unconfirmed):
                queue = self.unconfirmed[key]
                while queue and queue[0][1]():
                    self.done(queue.popleft()[0])
                if not queue:
                    del self.unconfirmed[key]

    def done(self, op: Any) -> None:
        e = self.open.pop(id(op), None)
        if e is None:
            return
        e.t_done = time.time()
        self.recent.append(e)
        if self.completed.get(e.key, -1) < op.seq:
            self.completed[e.key] = op.seq

    def snapshot(self, recent: int = 16) -> dict[str, Any]:
        """In-flight ops (oldest first), the last `recent` completed ones, and per-stream issued/completed seq."""
        if self.unconfirmed:
            self._sweep()
        for _ in range(5):  # another thread may add an op while we copy; copies are atomic under the GIL
            try:
                open_ops = sorted(list(self.open.values()), key=lambda e: e.id)
                done = list(self.recent)[-recent:]
                return {"open": [e.record() for e in open_ops], "recent": [e.record() for e in done],
                        "issued": dict(self.issued), "completed": dict(self.completed)}
            except RuntimeError:
                continue
        return {"open": [], "recent": [], "issued": {}, "completed": {}}


RECORDER = FlightRecorder()
