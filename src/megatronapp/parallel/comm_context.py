"""Issuing and recording: every comm op passes through the process's `CommContext` before torch.distributed.

`CommContext.issue()` is the one path. It numbers the op (`CommOp.seq`: per group; a P2P op per direction and
pair, so both ends agree), refuses a CPU tensor on an NCCL group, hands the record to the interceptors (fault drills
sleep there: the caller stalls; a modelled wire returns the seconds the op's bytes take), applies the strict mode's
checks (`nccl_semantics`) and enters the op in the flight recorder, where it stays in flight until its completion
is seen (`comm_handle`).

All state of the communication layer lives here, in one object: sequence counters, interceptors, the strict mode,
each process group's backend, the wires of late sends. `reset()` starts a new run in the same process. `CONTEXT` is
the process's one instance, which `comm` and `comm_handle` work through.
"""
from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatronapp.parallel.comm_wire import Wire
from megatronapp.parallel.flight_recorder import RECORDER, FlightRecorder
from megatronapp.parallel.group import Group
from megatronapp.parallel.nccl_semantics import Strict

SEMANTICS = ("native", "nccl", "nccl-lazy", "nccl-eager")


@dataclass(frozen=True)
class CommOp:
    name: str  # all_reduce | all_gather | reduce_scatter | broadcast | send | recv | barrier
    group: str  # group name: tp, pp, dp, embd, world, pp.act.up, ...
    group_ranks: tuple[int, ...]
    seq: int  # sequence number of this op within its group on this rank (matches across the group's members)
    nbytes: int
    peer: int | None = None  # global rank of the other side for P2P
    tag: int = 0

    def meta(self) -> dict:
        return {"group": self.group, "group_ranks": list(self.group_ranks), "seq": self.seq,
                "bytes": self.nbytes, "peer": self.peer, "tag": self.tag}


# An interceptor sees every op before it is issued; it may sleep (the caller stalls: slow link, hang drill), or
# return seconds the op's bytes take on a modelled wire: a send is delivered that late while the sender goes on, a
# collective does not complete before (parallel/link_model.py).
Interceptor = Callable[[CommOp], float | None]


class CommContext:
    """The communication layer's state in one process, and the path every op is issued through."""

    def __init__(self, recorder: FlightRecorder = RECORDER) -> None:
        self.flight = recorder
        # how long the strict modes wait before naming a stall; configuration, not run state: reset() keeps it
        self.stall_timeout_s = 120.0
        self.interceptors: list[Interceptor] = []
        self.strict: Strict | None = None
        self.mode = "native"
        self.epoch = 0  # runs in this process so far (each reset() starts one); keys the strict mode's store
        self._seq: dict[tuple, itertools.count] = {}
        self._seq_lock = threading.Lock()
        self._backends: dict[int, str] = {}
        self._wires: dict[tuple[str, int], Wire] = {}

    def reset(self) -> None:
        """Start a new run: forget sequence numbers, interceptors, the strict mode, backends and wires; clear the
        flight recorder."""
        with self._seq_lock:
            self._seq.clear()
        self.interceptors.clear()
        self.flight.clear()
        self.strict, self.mode = None, "native"
        self.epoch += 1
        for w in self._wires.values():
            w.close()
        self._wires.clear()
        self._backends.clear()

    def new_generation(self, epoch: int) -> None:
        """Join a new generation of process groups in the same run (resilience's in-place recovery): forget what
        belonged to the old groups (sequence numbers, the flight recorder, wires, backends: a new group may reuse
        a dead one's id) but keep the run's interceptors and strict mode, re-made under `epoch`, which every member
        of the generation passes alike (its number), so a newcomer and the survivors key the store the same."""
        with self._seq_lock:
            self._seq.clear()
        self.flight.clear()
        for w in self._wires.values():
            w.close()
        self._wires.clear()
        self._backends.clear()
        self.epoch = epoch
        if self.strict is not None:
            self.set_semantics(self.mode)

    def add_interceptor(self, fn: Interceptor) -> None:
        self.interceptors.append(fn)

    def remove_interceptor(self, fn: Interceptor) -> None:
        if fn in self.interceptors:
            self.interceptors.remove(fn)

    def set_semantics(self, mode: str, stall_timeout_s: float | None = None) -> None:
        """"native": the backend's own rules; "nccl": enforce the NCCL rules that always hold on any backend;
        "nccl-lazy" / "nccl-eager": those plus the rules of lazy or eager communicator creation (nccl_semantics)."""
        if mode not in SEMANTICS:
            raise ValueError(f"comm semantics {mode!r}: choose one of {', '.join(SEMANTICS)}")
        timeout = self.stall_timeout_s if stall_timeout_s is None else stall_timeout_s
        self.strict = Strict(timeout, self.epoch, mode) if mode != "native" else None
        self.mode = mode

    def backend(self, group: Group) -> str:
        """The group's backend ("gloo", "nccl"), asked of torch once per process group."""
        b = self._backends.get(id(group.pg))
        if b is None:
            b = self._backends[id(group.pg)] = dist.get_backend(group.pg)
        return b

    @staticmethod
    def stream(group: Group) -> str:
        """The strict mode's name of a group: groups of one name may differ in members (a pair's link groups)."""
        return f"{group.name} {list(group.ranks)}"

    def wire(self, group: Group, peer: int) -> Wire:
        """The wire late sends to `peer` on `group` leave through (made on first use)."""
        key = (group.name, peer)
        if key not in self._wires:
            self._wires[key] = Wire()
        return self._wires[key]

    def wired(self, group: Group, peer: int) -> bool:
        """Has a send to `peer` on `group` been late this run? Once late, a stream stays on its wire, in order."""
        return (group.name, peer) in self._wires

    def _next_seq(self, key: tuple) -> int:
        with self._seq_lock:
            counter = self._seq.setdefault(key, itertools.count())
            return next(counter)

    def issue(self, name: str, group: Group, t: torch.Tensor | None, peer: int | None = None, tag: int = 0,
              label: str = "", blocking: bool = False) -> tuple[CommOp, float]:
        """Record an op about to be issued: its `CommOp`, and the monotonic time before which it may not complete
        (an interceptor's modelled wire; 0.0 when none asked for one). `label` names a collective for the strict
        mode's order check; `blocking`: the caller waits for it (under nccl-eager it must find the group's stream
        drained; an async collective queues behind it instead)."""
        if peer is not None:
            me = dist.get_rank()
            key = (group.name, "p2p", me, peer) if name == "send" else (group.name, "p2p", peer, me)
        else:
            key = (group.name, group.ranks)
        nbytes = 0 if t is None else t.numel() * t.element_size()
        op = CommOp(name, group.name, group.ranks, self._next_seq(key), nbytes, peer, tag)
        if t is not None and t.device.type != "cuda" and self.backend(group) == "nccl":
            raise ValueError(f"{name} on group {group.name}: the tensor is on {t.device}, NCCL takes CUDA tensors "
                             f"only; create it on the rank's device")
        delay = 0.0
        for fn in self.interceptors:
            d = fn(op)
            if d:
                delay = max(delay, float(d))
        if self.strict is not None and peer is None:
            dtype = "" if t is None else str(t.dtype).removeprefix("torch.")
            signature = f"{name}[{label}]({nbytes} B {dtype})"
            self.strict.first_use(group.name, group.ranks, None, f"{signature} on group {group.name}")
            self.strict.check_collective(group.name, group.ranks, op.seq, signature)
            if blocking:
                self.strict.gate(self.stream(group), f"{signature} on group {group.name}")
        self.flight.issue(op)  # in flight until its completion is seen
        return op, (time.monotonic() + delay) if delay > 0 else 0.0


CONTEXT = CommContext()
