"""A ZeRO-1 slice kept in a buddy's memory: after each committed step, each DP rank copies its optimizer slice to
the next DP rank, so a lost rank's slice survives in memory (in-place recovery, `--zero 1 --spares K`).

With the distributed optimizer no DP peer holds another rank's optimizer state (`distributed_optimizer.py`), so a
newcomer could otherwise only be given the slice of the newest checkpoint. Here DP rank d of a (pp, tp) position
sends its slice (`DistributedOptimizer.slice_state`: moments and step counters of the owned segments; the
parameters are their own fp32 masters and are replicated) to its *buddy*, DP rank d+1 (mod dp), and keeps its
*ward*'s, DP rank d-1. The copy of step s runs at `step_start` of s+1 (`copy`), before any work of that step, so
a kill in any phase of it (forward, backward, reduction, its commit) finds the copy whole. It is a hook every rank
fires once per step it runs, in the same order after a new generation agreed where to resume; a copy sent at
`step_end` instead could leave a rank waiting in it for a peer whose `step_end` did not fire (a newcomer handed a
position without its step's record) while that peer waits in the checkpoint's collective.

Double buffer: the receive lands in a slot of its own and becomes the held copy only once it completed whole; a
copy cut off by a failure is dropped, and the held one (an older step) stays. The buddy then tells the supervisor
which step of its ward it holds (`held_key`: step and its own pid), which is how the supervisor chooses between
this copy and the disk: a held copy serves a newcomer only if it is of the last committed step (`DoubleBuffer.of`);
one of an older step (a failure hit the window between the update and the end of the next step_start's copy:
the update after its commit point, evaluation, logging, the checkpoint) is refused.

Messages (DP group, grouped send to the buddy and receive from the ward, NCCL-safe: `comm.batch_isend_irecv`):
int64 header [step, n_desc, n_data], then n_desc + n_data bytes (`checkpoint_read.encode`'s JSON descriptor and
data) in pieces of at most `PIECE_BYTES`. Sizes are checked against the bound of any DP rank's slice
(`DistributedOptimizer.slice_bytes_bound`) before anything else is received; the bytes are decoded as data only
when a newcomer takes them (`handover.py`).
"""
from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from megatronapp.parallel import comm
from megatronapp.parallel.topology import Topology
from megatronapp.train.checkpoint_read import PIECE_BYTES, byte_image, encode

BUDDY_ENV = "MEGATRONAPP_BUDDY_COPY"  # "0" (the supervisor's `--no-buddy-copy`): no per-step copies
MAX_DESC_BYTES = 64 << 20  # a descriptor lists a slice's tensors: far below this for any model we build


def held_key(owner: int) -> str:
    """Store key: the copy of rank `owner`'s slice its buddy holds, "<step> <buddy pid>" (the buddy's)."""
    return f"ctl/buddy/{owner}"


def parse_held(value: bytes) -> tuple[int, int] | None:
    """(step, pid) of a `held_key` value, None when it is not two bounded integers."""
    parts = value.decode(errors="replace").split()
    if len(value) > 64 or len(parts) != 2 or not all(p.isdigit() for p in parts):
        return None
    return int(parts[0]), int(parts[1])


def buddy_of(topo: Topology, rank: int) -> int:
    """The DP peer that keeps `rank`'s slice: the next DP index at the same (pp, tp)."""
    peers = topo.dp_ranks(rank)
    return peers[(peers.index(rank) + 1) % len(peers)]


def ward_of(topo: Topology, rank: int) -> int:
    """The DP peer whose slice `rank` keeps: the previous DP index at the same (pp, tp)."""
    peers = topo.dp_ranks(rank)
    return peers[(peers.index(rank) - 1) % len(peers)]


@dataclass
class HeldCopy:
    """A whole copy of the ward's slice after its step `step`: descriptor and data bytes, as received."""

    step: int
    desc: bytes
    data: torch.Tensor  # uint8


class DoubleBuffer:
    """The copy being received and the last whole one; only the whole one is ever handed out."""

    def __init__(self) -> None:
        self.held: HeldCopy | None = None
        self.receiving: HeldCopy | None = None

    def begin(self, step: int, desc_bytes: int, data_bytes: int, device: torch.device) -> torch.Tensor:
        """A slot for the copy of `step` (desc and data in one buffer); the held copy is untouched."""
        self.receiving = HeldCopy(step, b"", torch.empty(desc_bytes + data_bytes, dtype=torch.uint8, device=device))
        self._split = desc_bytes
        return self.receiving.data

    def complete(self) -> HeldCopy:
        """The copy being received arrived whole: it becomes the held one."""
        r = self.receiving
        if r is None:
            raise RuntimeError("no buddy copy is being received")
        buf = r.data
        self.held = HeldCopy(r.step, buf[:self._split].cpu().numpy().tobytes(), buf[self._split:])
        self.receiving = None
        return self.held

    def drop(self) -> None:
        """A copy cut off (its generation ended): never used; the held copy stays."""
        self.receiving = None

    def of(self, step: int) -> HeldCopy:
        """The held copy if it is of `step`; an older (or newer) one, or none, is refused."""
        h = self.held
        if h is None:
            raise LookupError(f"no copy of the ward's optimizer slice is held (wanted step {step})")
        if h.step != step:
            raise LookupError(f"the held copy of the ward's optimizer slice is of step {h.step}, not of the last "
                              f"committed step {step}")
        return h


class BuddyCopy:
    """This rank's side of the per-step copies: send its slice to its buddy, keep its ward's."""

    def __init__(self, trainer: Any, report: Callable[[str, str], None]):
        self.trainer, self.report = trainer, report  # report(key, value): a write to the supervisor's store
        self.buffer = DoubleBuffer()
        self._pending: list[comm.Handle] = []
        self.pid = os.getpid()

    # -- the per-step copy ----------------------------------------------------------------------------------
    def _limits(self) -> tuple[int, int]:
        """Bounds on the ward's message: every DP rank's slice has the same size."""
        return MAX_DESC_BYTES, self.trainer.optimizer.slice_bytes_bound()

    def copy(self, step: int) -> None:
        """`step_start` hook of step `step`+1: copy the slice after step `step` to the buddy, receive the ward's;
        the whole copy becomes the held one, and the supervisor learns which step of the ward this rank holds."""
        if step >= self.trainer.cfg.train.steps:  # after the last step no step needs it
            return
        self.send(step)
        self.finish()

    def send(self, step: int) -> None:
        """Issue the copy of the slice after step `step` (the header exchange waited, the bytes not)."""
        tr = self.trainer
        topo, device = tr.topo, tr.device
        desc, tensors = encode(tr.optimizer.slice_state())
        out = byte_image(tensors, device, prefix=desc)  # its own buffer: the next update cannot change it in flight
        n_data = out.numel() - len(desc)
        buddy, ward = buddy_of(topo, tr.rank), ward_of(topo, tr.rank)
        header = torch.tensor([step, len(desc), n_data], dtype=torch.int64, device=device)
        theirs = torch.zeros(3, dtype=torch.int64, device=device)
        for h in comm.batch_isend_irecv([comm.P2P("send", header, buddy, topo.dp_group),
                                         comm.P2P("recv", theirs, ward, topo.dp_group)]):
            h.wait()
        w_step, n_desc, w_data = (int(v) for v in theirs.tolist())
        max_desc, max_data = self._limits()
        if w_step != step or not 0 < n_desc <= max_desc or not 0 <= w_data <= max_data:
            raise ValueError(f"buddy copy from rank {ward}: header step {w_step}, {n_desc} descriptor and {w_data} "
                             f"data bytes; expected step {step}, at most {max_desc} and {max_data}")
        into = self.buffer.begin(step, n_desc, w_data, device)
        ops = []
        for i in range(0, max(out.numel(), into.numel()), PIECE_BYTES):  # in order, send and receive side by side
            if i < out.numel():
                ops.append(comm.P2P("send", out[i:i + PIECE_BYTES], buddy, topo.dp_group))
            if i < into.numel():
                ops.append(comm.P2P("recv", into[i:i + PIECE_BYTES], ward, topo.dp_group))
        self._pending = comm.batch_isend_irecv(ops)

    def finish(self) -> None:
        """Wait for the copy in flight; once whole it is the held one, and the supervisor is told."""
        if not self._pending:
            return
        for h in self._pending:
            h.wait()
        self._pending = []
        held = self.buffer.complete()
        self.report(held_key(ward_of(self.trainer.topo, self.trainer.rank)), f"{held.step} {self.pid}")

    def drop(self) -> None:
        """The generation ended: forget the copy in flight (its groups are gone); the held copy stays."""
        self._pending = []
        self.buffer.drop()

    def forget(self) -> None:
        """Nothing held is of this state any more (everyone loaded a checkpoint or built again)."""
        self.drop()
        self.buffer.held = None
