"""A rank's summary block (SUMS): the triage's numbers for one rank, written by its writer at the end of its file.

Two-level detection (triage.py) reduces every rank file to a few numbers per rank and iteration before choosing
what to read in full. At 100,096 ranks that meant reading and decoding 128 million spans (about 16 s of CPU, and
as long again reducing them) to keep ~400 bytes a rank. A writer has the spans at hand when it finishes (the
simulator its arrays, the tracer its file), so it works the numbers out once and writes them beside the spans, as
MegaScale aggregates on the host; the triage then reads a file's last page instead of the file.

The SUMS block is a file's last block (after FOOT), framed as every block (tag, length, crc32). Its payload, little
endian: b"RS01", W (u32: iterations), then int64 rank, world, coord[3], topo[3], peer_up, opened, spans, dropped,
iters[W], then float64 (ms; NaN where none) work[W], host[W], p2p[4], coll[3], and a trailer: the payload's length
(u32) and b"SUMS". A reader finds it from the end: the trailer says where the block starts, and the block's tag,
length and checksum must agree. Without one (an older file, a rank that never closed, a block written after it) or
with one that fails a check, the file is read in full as before: a summary saves reading and is never needed.

Trust: it is data. Sizes are bounded before anything is read (the block against its file's real size; its world
times its iterations against format.MAX_CELLS, what the triage's per-rank, per-iteration arrays may hold), every value
is range-checked, floats are NaN or finite and not negative, and its rank, world, coord and topo must be those of
its file's header (the first page).
It decides what the full detector reads, never what it finds (findings come from the spans of the ranks read); a
summary that lies could keep a rank out of the triage, so `scan detect --no-summaries` works the numbers out from
the spans instead. Damage to a span block after the summary was written is seen only in the ranks read in full (the
report's note says how many ranks were taken from summaries).
"""
from __future__ import annotations

import json
import os
import struct
import zlib

import numpy as np

from megatronapp.scan.read.format import _BLOCK, MAGIC, MAX_WORLD, cells_problem

TAG = b"SUMS"
_HEAD = struct.Struct("<4sI")
_VERSION = b"RS01"
_N_INTS = 12  # rank, world, coord x3, topo x3, peer_up, opened, spans, dropped
_TRAILER = struct.Struct("<I4s")
MAX_ITERS = 1 << 16  # iterations a summary may hold (a payload of at most 1.6 MB)
_TAIL = 4096  # bytes read from a file's end first: a summary of up to ~160 iterations is in them


def payload_size(iterations: int) -> int:
    return _HEAD.size + 8 * (_N_INTS + iterations) + 8 * (2 * iterations + 7) + _TRAILER.size


def encode(s: dict) -> bytes:
    """The whole SUMS block (header and payload) for one rank's numbers: keys rank, world, coord, topo, iters,
    work, host (ms per iteration), p2p (4), coll (3), peer_up, opened, spans, dropped."""
    ints = [[s["rank"], s["world"], *s["coord"][:3], *s["topo"][:3], s["peer_up"], s["opened"], s["spans"],
             s.get("dropped", 0)]]
    floats = np.concatenate([np.asarray(s[k], np.float64).reshape(-1) for k in ("work", "host", "p2p", "coll")])
    return encode_batch(np.array(ints, np.int64), np.asarray(s["iters"], np.int64), floats[None, :])[0]


def encode_batch(ints: np.ndarray, iters: np.ndarray, floats: np.ndarray) -> list[bytes]:
    """SUMS blocks of ranks with the same iterations at once: `ints` (ranks, 12) as the layout above has them,
    `floats` (ranks, 2W + 7): work, host, p2p, coll. (A block a rank: 100,096 of them in a simulated job.)"""
    W, B = len(iters), len(ints)
    if ints.shape != (B, _N_INTS) or floats.shape != (B, 2 * W + 7):
        raise ValueError(f"rank summary: {W} iterations need ints of (ranks, {_N_INTS}) and floats of (ranks, "
                         f"{2 * W + 7}) (got {ints.shape}, {floats.shape})")
    size = payload_size(W)
    layout = np.dtype([("head", "S8"), ("ints", "<i8", _N_INTS), ("iters", "<i8", W), ("floats", "<f8", 2 * W + 7),
                       ("trailer", "S8")])
    rows = np.zeros(B, layout)
    rows["head"] = _HEAD.pack(_VERSION, W)
    rows["ints"] = ints
    rows["iters"] = iters
    rows["floats"] = floats
    rows["trailer"] = _TRAILER.pack(size, TAG)
    raw = rows.view(np.uint8).reshape(B, size)
    out = []
    for k in range(B):
        payload = raw[k].tobytes()
        out.append(_BLOCK.pack(TAG, size, zlib.crc32(payload)) + payload)
    return out


def decode(payload: bytes) -> dict | str:
    """A SUMS payload back to its numbers, or a string saying what is wrong with it."""
    if len(payload) < payload_size(0):
        return "a summary block shorter than its fixed part"
    version, W = _HEAD.unpack_from(payload)
    if version != _VERSION:
        return f"a summary block of unknown version {version[:4]!r}"
    if W > MAX_ITERS or len(payload) != payload_size(W):
        return f"a summary block of {len(payload)} bytes for {W} iterations"
    ints = np.frombuffer(payload, "<i8", _N_INTS + W, _HEAD.size)
    floats = np.frombuffer(payload, "<f8", 2 * W + 7, _HEAD.size + 8 * (_N_INTS + W))
    rank, world = int(ints[0]), int(ints[1])
    coord, topo, (peer_up, opened, spans, dropped) = ints[2:5], ints[5:8], (int(x) for x in ints[8:12])
    iters = ints[_N_INTS:]
    if not 0 < world <= MAX_WORLD or not 0 <= rank < world:
        return f"a summary claims rank {rank} of world {world}"
    too_big = cells_problem(world, W)
    if too_big:
        return f"a summary claims {too_big}"
    if (topo < 1).any() or (topo > MAX_WORLD).any() or (coord < 0).any() or (coord >= topo[::-1]).any():
        return f"a summary claims coord {coord.tolist()} in topo {topo.tolist()}"
    if not -1 <= peer_up < world or opened < 0 or spans < 0 or dropped < 0:
        return "a summary with counts out of range"
    if W > 1 and (np.diff(iters) <= 0).any():
        return "a summary whose iterations are not in increasing order"
    if np.isinf(floats).any() or (floats < 0).any():
        return "a summary with an infinite or negative time"
    return {"rank": rank, "world": world, "coord": coord.copy(), "topo": tuple(int(x) for x in topo),
            "peer_up": peer_up, "opened": opened, "spans": spans, "dropped": dropped, "iters": iters.copy(),
            "work": floats[:W].copy(), "host": floats[W:2 * W].copy(), "p2p": floats[2 * W:2 * W + 4].copy(),
            "coll": floats[2 * W + 4:].copy()}


def read(path: str) -> tuple[dict | None, str | None]:
    """The summary at the end of a rank file: (numbers, None); (None, None) where it has none; (None, why) where
    the one it has fails a check (the caller reads the file in full then, and says so)."""
    name = os.path.basename(path)
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as e:
        return None, f"{name}: cannot read ({e.strerror})"
    try:
        size = os.fstat(fd).st_size
        tail = os.pread(fd, min(size, _TAIL), max(size - _TAIL, 0))
        if len(tail) < _TRAILER.size or tail[-4:] != TAG:
            return None, None
        head = tail if size <= _TAIL else os.pread(fd, _TAIL, 0)  # a small file: the same bytes
        if head[:len(MAGIC)] != MAGIC:
            return None, None  # not format 3: whatever it ends with, the full reader judges the file
        length = _TRAILER.unpack_from(tail, len(tail) - _TRAILER.size)[0]
        start = size - length - _BLOCK.size
        if length > payload_size(MAX_ITERS) or start < len(MAGIC):
            return None, f"{name}: a summary trailer claiming {length} bytes; read in full"
        if size - start > len(tail):
            tail = os.pread(fd, size - start, start)
        block = tail[len(tail) - (size - start):]
    finally:
        os.close(fd)
    tag, n, crc = _BLOCK.unpack_from(block)
    payload = block[_BLOCK.size:]
    if tag != TAG or n != length or zlib.crc32(payload) != crc:
        return None, f"{name}: its summary block fails its checksum or framing; read in full"
    got = decode(payload)
    if isinstance(got, str):
        return None, f"{name}: {got}; read in full"
    mismatch = _against_header(head, got)
    if mismatch:
        return None, f"{name}: its summary {mismatch}; read in full"
    return got, None


def _against_header(head: bytes, s: dict) -> str | None:
    """What the summary says that its file's HEAD block (the first page) does not: rank, world, coord, topo. A
    summary is its file's; one that claims another rank would put numbers on the wrong rank."""
    pos = len(MAGIC)
    if len(head) < pos + _BLOCK.size:
        return "sits in a file without a readable header"
    tag, n, crc = _BLOCK.unpack_from(head, pos)
    body = head[pos + _BLOCK.size:pos + _BLOCK.size + n]
    if tag != b"HEAD" or len(body) != n or zlib.crc32(body) != crc:
        return "sits in a file whose header does not fit its first page or fails its checksum"
    try:
        h = json.loads(body)
        claims = (int(h["rank"]), int(h["world"]), [int(x) for x in h["coord"]][:3], [int(x) for x in h["topo"]][:3])
    except (ValueError, TypeError, KeyError, RecursionError):
        return "sits in a file whose header cannot be read"
    mine = (s["rank"], s["world"], [int(x) for x in s["coord"]], list(s["topo"]))
    return None if claims == mine else f"claims rank {mine[0]} of {mine[1]}, the header rank {claims[0]} of {claims[1]}"
