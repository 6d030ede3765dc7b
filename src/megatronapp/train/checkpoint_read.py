"""Resume with one reader per DP group (MegaScale's recovery read path): with plain data parallelism the dp
replicas of a (pp, tp) position hold the same model and optimizer state, so only DP rank 0 reads its file from
storage (checksum-checked, weights only) and broadcasts the state to its replicas over the DP group. Storage
serves 1/dp of the bytes a resume would otherwise read, which is what matters when thousands of ranks restart at
once. ZeRO-1 checkpoints hold a different optimizer slice per DP rank: every rank reads its own file.

The broadcasts, in this order, on the DP group from its first rank (every member issues exactly these, so the
sequence is NCCL-safe; sizes come from the header, so a replica never guesses):

1. header: int64 [status, n_desc, n_data]: status 0, or 1 when the reader failed (its error follows instead);
2. the descriptor: n_desc bytes of JSON, the state's structure with plain values inline and, for each tensor, its
   dtype, shape and byte range in the data (or, with status 1, the reader's error message);
3. the data: n_data bytes, every tensor's bytes one after another, in pieces of at most PIECE_BYTES.

JSON and raw bytes, not pickle: a replica runs no code from what it receives, as with a weights-only load. The
`coord` entry is each rank's own (it is the only per-replica value of a plain-DP rank file); the RNG states are the
reader's, which equal every replica's because every rank seeds and draws alike (there is no per-rank dropout
stream), so the resumed run stays bit-identical.
"""
from __future__ import annotations

import dataclasses
import json
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch

from megatronapp.parallel import comm
from megatronapp.parallel.topology import Topology
from megatronapp.train import checkpoint as ckpt

PIECE_BYTES = 256 << 20  # bounds the bytes one collective moves (and NCCL's staging) on a large state

_DTYPES = {str(d): d for d in (torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64,
                               torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool)}


def encode(state: Any) -> tuple[bytes, list[torch.Tensor]]:
    """(JSON descriptor, tensors in data order) of a nest of dicts, lists, tuples, tensors and plain values."""
    tensors: list[torch.Tensor] = []
    offset = 0

    def enc(x: Any) -> Any:
        nonlocal offset
        if isinstance(x, torch.Tensor):
            if str(x.dtype) not in _DTYPES:
                raise ckpt.CheckpointError(f"a tensor of dtype {x.dtype} cannot be broadcast to DP replicas")
            t = x.detach().contiguous()
            n = t.numel() * t.element_size()
            tensors.append(t)
            offset += n
            return {"T": [str(t.dtype), list(t.shape), offset - n, n]}
        if isinstance(x, dict):
            if not all(isinstance(k, (str, int)) and not isinstance(k, bool) for k in x):
                raise ckpt.CheckpointError("a checkpoint dict key is neither a string nor an integer")
            return {"O" if isinstance(x, OrderedDict) else "D": [[k, enc(v)] for k, v in x.items()]}
        if isinstance(x, (list, tuple)):
            return {"L" if isinstance(x, list) else "U": [enc(v) for v in x]}
        if x is None or isinstance(x, (bool, int, float, str)):
            return {"V": x}
        raise ckpt.CheckpointError(f"a checkpoint value of type {type(x).__name__} cannot be broadcast")

    desc = json.dumps(enc(state)).encode()
    return desc, tensors


def byte_image(tensors: list[torch.Tensor], device: torch.device, prefix: bytes = b"") -> torch.Tensor:
    """`prefix`, then the bytes of each of `tensors` (`encode`'s data order), in one uint8 tensor of its own:
    nothing done to the tensors afterwards changes what is sent."""
    n = len(prefix) + sum(t.numel() * t.element_size() for t in tensors)
    out = torch.empty(n, dtype=torch.uint8, device=device)
    if prefix:
        out[:len(prefix)].copy_(torch.frombuffer(bytearray(prefix), dtype=torch.uint8))
    offset = len(prefix)
    for t in tensors:
        n = t.numel() * t.element_size()
        out[offset:offset + n].copy_(t.reshape(-1).view(torch.uint8))
        offset += n
    return out


def decode(desc: bytes, data: torch.Tensor) -> Any:
    """The state from its descriptor and the received bytes (tensors are copies, on the CPU)."""
    def dec(node: dict) -> Any:
        (kind, v), = node.items()
        if kind == "T":
            dtype, shape, start, n = v
            return data[start:start + n].cpu().clone().view(_DTYPES[dtype]).reshape(shape)  # a fresh, aligned copy
        if kind == "D":
            return {k: dec(x) for k, x in v}
        if kind == "O":  # a module's state_dict
            return OrderedDict((k, dec(x)) for k, x in v)
        if kind == "L":
            return [dec(x) for x in v]
        if kind == "U":
            return tuple(dec(x) for x in v)
        return v

    return dec(json.loads(desc))


def _bcast_bytes(buf: torch.Tensor, src: int, topo: Topology) -> None:
    for i in range(0, buf.numel(), PIECE_BYTES):
        comm.broadcast(buf[i:i + PIECE_BYTES], src, topo.dp_group)


def read_state(d: Path, topo: Topology, sharded: bool, device: torch.device) -> dict[str, Any]:
    """This rank's state of checkpoint `d`: read from its own file, or (plain DP) from its DP group's reader."""
    group = topo.dp_group
    if sharded or group.size == 1:
        return ckpt.load_rank(d, topo.rank)
    src = group.ranks[0]
    header = torch.zeros(3, dtype=torch.int64, device=device)
    if topo.rank == src:
        try:
            state = ckpt.load_rank(d, topo.rank)
            desc, tensors = encode(state)
        except Exception as e:  # noqa: BLE001 - every replica must learn of it, or they would wait forever
            desc, tensors, state = f"{type(e).__name__}: {e}".encode(), [], e
        header.copy_(torch.tensor([int(isinstance(state, Exception)), len(desc),
                                   sum(t.numel() * t.element_size() for t in tensors)]))
    comm.broadcast(header, src, group)
    status, n_desc, n_data = (int(v) for v in header.tolist())
    desc_t = torch.empty(n_desc, dtype=torch.uint8, device=device)
    if topo.rank == src:
        desc_t.copy_(torch.frombuffer(bytearray(desc), dtype=torch.uint8))
    comm.broadcast(desc_t, src, group)
    if status:
        msg = bytes(desc_t.cpu().tolist()).decode(errors="replace")
        if topo.rank == src:
            raise state
        raise ckpt.CheckpointError(f"rank {src}, the reader of this rank's DP group, could not load {d}: {msg}")
    data = byte_image(tensors, device) if topo.rank == src else torch.empty(n_data, dtype=torch.uint8, device=device)
    _bcast_bytes(data, src, topo)
    if topo.rank == src:
        return state
    received = decode(desc_t.cpu().numpy().tobytes(), data)
    if "coord" in received:
        received["coord"] = dataclasses.asdict(topo.coord)  # the one per-replica entry of a plain-DP rank file
    return received
