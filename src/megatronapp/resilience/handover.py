"""A newcomer's state from memory: the survivor at its (pp, tp) in another DP replica sends it, point to point.

With plain data parallelism every DP replica of a (pp, tp) position holds the same parameters, optimizer moments
and RNG states after each committed step (they reduce the same gradients and draw alike: the checkpoint's
one-reader-per-DP-group resume relies on the same fact, `train/checkpoint_read.py`), and the data position is the
step number. So the lowest surviving DP rank of the position sends its state, and the newcomer takes it as it
would take its own checkpoint file. Nothing touches the disk.

The messages, on the DP group from the source to the newcomer (only the two of them take part; transfers run
one after another in rank order of the newcomers, the same on every rank): int64 header [n_desc, n_data], then
n_desc bytes of JSON (the state's structure, `checkpoint_read.encode`: plain values inline, tensors by dtype,
shape and byte range; a newcomer builds tensors from raw bytes and runs no code from what it receives), then the
n_data bytes in pieces of at most `checkpoint_read.PIECE_BYTES`. The state carries where the source stands after
its last committed step (`loop.AfterStep`), so the newcomer resumes the same work.

With ZeRO-1 the DP peers' optimizer slices differ: the peer sends everything but its slice, and the newcomer's
own slice comes from its buddy's in-memory copy of the last committed step (`buddy.py`), in the same form.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch

from megatronapp.parallel import comm
from megatronapp.parallel.topology import Topology
from megatronapp.resilience.buddy import MAX_DESC_BYTES, BuddyCopy, buddy_of
from megatronapp.train.checkpoint_read import PIECE_BYTES, byte_image, decode, encode
from megatronapp.train.loop import AfterStep


def sources(topo: Topology, newcomers: list[int]) -> dict[int, int] | None:
    """For each newcomer, the survivor that sends its state: the lowest-ranked DP peer that is not itself new.
    None when some newcomer has no surviving DP peer (memory holds no copy of its state)."""
    new = set(newcomers)
    out = {}
    for r in sorted(new):
        peers = [p for p in topo.dp_ranks(r) if p not in new]
        if not peers:
            return None
        out[r] = peers[0]
    return out


def _bytes(buf: torch.Tensor, peer: int, group: Any, send: bool) -> None:
    for i in range(0, buf.numel(), PIECE_BYTES):
        (comm.send if send else comm.recv)(buf[i:i + PIECE_BYTES], peer, group)


def send_encoded(desc: bytes, data: torch.Tensor, dst: int, topo: Topology, device: torch.device) -> None:
    """Send an encoded state (descriptor, data bytes) to the newcomer `dst` (a DP peer)."""
    comm.send(torch.tensor([len(desc), data.numel()], dtype=torch.int64, device=device), dst, topo.dp_group)
    comm.send(torch.frombuffer(bytearray(desc), dtype=torch.uint8).to(device), dst, topo.dp_group)
    _bytes(data, dst, topo.dp_group, send=True)


def send_state(state: dict[str, Any], dst: int, topo: Topology, device: torch.device) -> None:
    """Send `state` to the newcomer `dst` (a DP peer)."""
    desc, tensors = encode(state)
    send_encoded(desc, byte_image(tensors, device), dst, topo, device)


def recv_encoded(src: int, topo: Topology, device: torch.device, max_bytes: int | None = None) -> Any:
    """Receive an encoded state from `src` (a DP peer) and decode it as data; `max_bytes` bounds its data."""
    header = comm.recv(torch.zeros(2, dtype=torch.int64, device=device), src, topo.dp_group)
    n_desc, n_data = (int(v) for v in header.tolist())
    if not 0 < n_desc <= MAX_DESC_BYTES or n_data < 0 or (max_bytes is not None and n_data > max_bytes):
        raise ValueError(f"state from rank {src}: {n_desc} descriptor and {n_data} data bytes, beyond the bounds "
                         f"({MAX_DESC_BYTES}, {max_bytes})")
    desc = comm.recv(torch.empty(n_desc, dtype=torch.uint8, device=device), src, topo.dp_group)
    data = torch.empty(n_data, dtype=torch.uint8, device=device)
    _bytes(data, src, topo.dp_group, send=False)
    return decode(desc.cpu().numpy().tobytes(), data)


def recv_state(src: int, topo: Topology, device: torch.device) -> dict[str, Any]:
    """Receive a state from `src` (a DP peer); its `coord` is this rank's own."""
    state = recv_encoded(src, topo, device)
    state["coord"] = dataclasses.asdict(topo.coord)
    return state


def holders(topo: Topology, newcomers: list[int]) -> dict[int, int] | None:
    """For each newcomer (ZeRO-1), the buddy that keeps its optimizer slice; None when a buddy is new too."""
    out = {r: buddy_of(topo, r) for r in sorted(newcomers)}
    return None if set(out.values()) & set(newcomers) else out


def hand_over(trainer: Any, newcomers: list[int], after: AfterStep | None,
              buddy: BuddyCopy | None = None) -> AfterStep | None:
    """Every rank of the new generation calls this in the same order: sources send, newcomers receive and take
    the state. With `buddy` (ZeRO-1, plan source "peer+buddy") the DP peer sends the replicated state without its
    optimizer slice, then each newcomer's buddy sends the slice it holds of the newcomer's. Returns, on a
    newcomer, where its source stood (`after`'s elsewhere)."""
    pairs = sources(trainer.topo, newcomers)
    if pairs is None:
        raise ValueError("a newcomer has no surviving DP peer to take its state from")
    keepers = holders(trainer.topo, newcomers) if buddy is not None else {}
    if keepers is None:
        raise ValueError("a newcomer's buddy is a newcomer too: no copy of its optimizer slice survived")
    me = trainer.rank
    for dst, src in pairs.items():
        if me == src:
            state = trainer.state()
            if dst in keepers:
                del state["optimizer"]  # the newcomer's own slice comes from its buddy
            state["after"] = dataclasses.asdict(after) if after is not None else None
            send_state(state, dst, trainer.topo, trainer.device)
        elif me == dst:
            state = recv_state(src, trainer.topo, trainer.device)
            got = state.pop("after")
        if dst in keepers:
            if me == keepers[dst]:
                held = buddy.buffer.of(trainer.step)  # refuses a copy of another step than the committed one
                send_encoded(held.desc, held.data, dst, trainer.topo, trainer.device)
            elif me == dst:
                bound = trainer.optimizer.slice_bytes_bound()
                state["optimizer"] = recv_encoded(keepers[dst], trainer.topo, trainer.device, bound)
        if me == dst:
            trainer.load_state(state)
            after = AfterStep(**{**got, "ran_here": False}) if got is not None else AfterStep(trainer.step)
    return after
