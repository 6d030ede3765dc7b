"""MegaScan per-rank trace files (`rank{r:05d}.mst`): an append-only stream of checksummed blocks.

Layout: an 8-byte magic, then blocks `tag(4s) length(u32) crc32(u32) payload`. Tags:
  HEAD  JSON header (rank, world, coord, topo, host, pid, clock info, handshake samples)
  STRS  JSON list of new names appended to the string table
  GRPS  JSON list of new [group name, ranks] appended to the group table; ranks is a list of global ranks, or
        {"range": [start, stop, step]} for evenly spaced ones (a DP group of 384 ranks costs 30 bytes, not 2 KB)
  SPAN  packed fixed-size span records (`RECORD` dtype), read with one `np.frombuffer`
  COLS  (format 3) the same spans column by column, each column in the narrowest integer that holds it (below)
  FOOT  JSON footer (records written, records dropped), merged into the header under "footer"
  SUMS  (format 3, optional, last) the writer's summary of the rank for the triage: rank_summary.py; readers of
        spans skip it (a format-3 reader older than it stops there as at any unknown block, losing nothing)
Format 2 (magic ...\x02\x00) adds `cpu_wait` to every record: ns the span's thread spent runnable but waiting
for a CPU (Linux schedstat's run-queue delay) while the span ran, -1 where unknown (a device-timed span, another
OS, a format-1 file, which still reads). Time waiting for a core is not what the op costs: on an oversubscribed
host it is the biggest noise in a span's duration, and one rank waits more than another by chance.
Format 3 (magic ...\x03\x00) adds COLS blocks, which writers use wherever they are smaller than SPAN rows (64 records
or more). A COLS payload is `records(u32) codes(12 x u8) bases(12 x i8)` and then, in RECORD's field order, each
column that is not constant as `records` values of the width its code names: value = base + stored (offset
codes, unsigned), or base + running sum of stored (delta codes, signed: start times, written nearly in order).
A simulated span takes 22 bytes instead of 64: 100,096 ranks x 10 iterations were 8.2 GB of rank files, and
writing and reading them back was most of `scan simulate` + `scan detect` (the VM's disk and fresh page cache).
A writer never stores start times narrower than 4 bytes, so a block cannot claim more records than a quarter of
its bytes (a crafted 1 KB block cannot ask for 10^9 records).
A SPAN record with `dur` = -1 marks an op OPENED (written when a comm op starts, before it completes): a rank
that hangs leaves its in-flight ops on disk. Readers put those in `RankTrace.opened`, apart from the spans.
A string or group is always written before the first span block that refers to it, so any prefix of a file is
a valid trace: a truncated file reads up to its last complete record (of a SPAN block; a COLS block cut short is
lost whole, and the problem says so). A block whose checksum fails is skipped
and named in `problems`; reading stops at an unknown tag (the framing is lost).
"""
from __future__ import annotations

import json
import os
import re
import struct
import threading
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Self

import numpy as np

CATS = ("compute", "comm", "data", "optimizer", "layer", "step", "other")
CAT_INDEX = {c: i for i, c in enumerate(CATS)}

MAGIC = b"MSCAN\x00\x03\x00"
MAGIC_V2 = b"MSCAN\x00\x02\x00"  # format 2: SPAN rows only
MAGIC_V1 = b"MSCAN\x00\x01\x00"  # format 1: no cpu_wait (read as -1)
_BLOCK = struct.Struct("<4sII")
# Files are created one at a time. Threads creating files in one directory serialise on the directory's inode lock
# in the kernel anyway, and a waiter there spins while the holder runs: perf of `scan simulate` (12,288 ranks, two
# writer threads) put 10% of its CPU in rwsem_spin_on_owner. Waiting on this lock sleeps instead.
_CREATE = threading.Lock()
FILE_PATTERN = re.compile(r"rank(\d{5,})\.mst$")

# Widest fields first so the packed record has no holes; 64 bytes a span (format 1: 56, without cpu_wait).
RECORD = np.dtype([("ts", "<i8"), ("dur", "<i8"), ("seq", "<i8"), ("nbytes", "<i8"), ("cpu_wait", "<i8"),
                   ("name", "<i4"), ("it", "<i4"), ("gid", "<i4"), ("peer", "<i4"), ("mb", "<i4"),
                   ("chunk", "<i2"), ("cat", "i1"), ("_pad", "u1")])
RECORD_V1 = np.dtype([("ts", "<i8"), ("dur", "<i8"), ("seq", "<i8"), ("nbytes", "<i8"),
                      ("name", "<i4"), ("it", "<i4"), ("gid", "<i4"), ("peer", "<i4"), ("mb", "<i4"),
                      ("chunk", "<i2"), ("cat", "i1"), ("_pad", "u1")])
OPENED = -1  # `dur` of a record that marks an op as opened (not a finished span)
COLUMNS = ("name", "cat", "ts", "dur", "it", "gid", "seq", "peer", "nbytes", "chunk", "mb", "cpu_wait")
# COLS blocks: columns in RECORD's field order; per column a code (0 constant, 1-4 offset u1/u2/u4/u8, 5-8 delta
# i1/i2/i4/i8) and a base.
_COLS_ORDER = tuple(c for c in RECORD.names if c != "_pad")
_COLS_HEAD = np.dtype([("n", "<u4"), ("code", "u1", len(_COLS_ORDER)), ("base", "<i8", len(_COLS_ORDER))])
_COLS_WIDTHS = {k: np.dtype(v) for k, v in
                {1: "<u1", 2: "<u2", 3: "<u4", 4: "<u8", 5: "<i1", 6: "<i2", 7: "<i4", 8: "<i8"}.items()}
_FIELDS = {c: RECORD[c] for c in _COLS_ORDER}
_FIELD_RANGE = {c: (int(np.iinfo(f).min), int(np.iinfo(f).max)) for c, f in _FIELDS.items()}
_COLS_MIN = 64  # records from which a writer tries COLS: below, the 112-byte column header does not pay
_TS_MIN_WIDTH = 4  # bytes: start times are never stored narrower (bounds the records a block can claim)
# A field a writer is not given: "none" (-1); nbytes and the rest 0.
_NONE = {"seq": -1, "peer": -1, "mb": -1, "chunk": -1, "it": -1, "cpu_wait": -1, "gid": -1}


class TraceFormatError(ValueError):
    """A file that is not a MegaScan trace at all (bad magic or unreadable header)."""


# Sizes a header or group table may claim, checked before anything is allocated from them: a 120-byte file must
# not make a reader build a tuple of 1e11 ranks or a missing-file list of 1e10 names.
MAX_WORLD = 1 << 20
MAX_DIMS = 8  # entries of coord/topo
# Rank x iteration cells an analysis holds: the detectors' per-(rank, iteration) arrays and the triage's are sized by
# the world a file claims times its iterations (1 GiB for two float64 arrays at this bound). A 12 KB file claiming
# 2^20 ranks over 2,000 iterations would size them at 15.6 GiB each: it is refused instead (`cells_problem`).
MAX_CELLS = 1 << 26


def cells_problem(world: int, iterations: int) -> str | None:
    """Why a world of `world` ranks over `iterations` iterations is more than an analysis holds, or None."""
    if world * max(iterations, 1) <= MAX_CELLS:
        return None
    return (f"a world of {world} ranks over {iterations} iterations: more rank x iteration cells than an analysis "
            f"holds ({MAX_CELLS})")


def rank_file(trace_dir: str | Path, rank: int) -> Path:
    """Path of one rank's trace file in a trace directory."""
    return Path(trace_dir) / f"rank{rank:05d}.mst"


@dataclass
class RankTrace:
    """One rank's spans as columnar numpy arrays plus its header, string table and group table."""

    rank: int
    world: int
    coord: tuple[int, int, int]  # (dp, pp, tp)
    topo: tuple[int, int, int]  # (tp, pp, dp) sizes
    header: dict
    names: list[str]
    groups: list[tuple[str, tuple[int, ...]]]
    name: np.ndarray
    cat: np.ndarray
    ts: np.ndarray
    dur: np.ndarray
    it: np.ndarray
    gid: np.ndarray
    seq: np.ndarray
    peer: np.ndarray
    nbytes: np.ndarray
    chunk: np.ndarray
    mb: np.ndarray
    cpu_wait: np.ndarray  # ns waiting for a CPU during the span; -1 unknown
    problems: list[str] = field(default_factory=list)
    opened: dict[str, np.ndarray] = field(default_factory=dict)  # ops written when opened (dur = -1): COLUMNS

    def __len__(self) -> int:
        return len(self.ts)

    @property
    def end(self) -> np.ndarray:
        """Span end times (ns, own clock)."""
        return self.ts + self.dur

    def name_id(self, name: str) -> int:
        """Index of `name` in the string table, -1 if this rank never used it."""
        try:
            return self.names.index(name)
        except ValueError:
            return -1


class RankWriter:
    """Append spans to one rank's trace file; buffers records and writes them as blocks."""

    def __init__(self, path: str | Path, header: dict, buffer_records: int = 4096):
        _check_header(header)
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f: BinaryIO | None = open(self.path, "wb")  # noqa: SIM115 (lives until close())
        self._names: dict[str, int] = {}
        self._groups: dict[tuple[str, tuple[int, ...]], int] = {}
        self._new_names: list[str] = []
        self._new_groups: list[list] = []
        self._rows: list[tuple] = []
        self._buffer = buffer_records
        self.records = 0
        self.footer: dict[str, Any] = {}
        self._f.write(MAGIC)
        self._block(b"HEAD", json.dumps(header, default=_jsonable).encode())

    def _block(self, tag: bytes, payload: bytes) -> None:
        self._f.write(_BLOCK.pack(tag, len(payload), zlib.crc32(payload)))
        self._f.write(payload)

    def _name(self, name: str) -> int:
        i = self._names.get(name)
        if i is None:
            i = self._names[name] = len(self._names)
            self._new_names.append(name)
        return i

    def _gid(self, group: str | None, ranks: Any) -> int:
        if group is None:
            return -1
        members = _members(ranks)
        key = (str(group), members)
        i = self._groups.get(key)
        if i is None:
            i = self._groups[key] = len(self._groups)
            self._new_groups.append([key[0], _pack_members(ranks, members)])
        return i

    def write(self, name: str, cat: str | int, ts: int, dur: int, it: int, group: str | None = None,
              group_ranks: Any = None, seq: int = -1, peer: int | None = -1, nbytes: int = 0,
              chunk: int | None = -1, mb: int | None = -1, cpu_wait: int = -1) -> None:
        """Buffer one span (times in ns on this rank's clock); flushed every `buffer_records` spans."""
        c = cat if isinstance(cat, int) else CAT_INDEX.get(cat, CAT_INDEX["other"])
        self._rows.append((ts, dur, -1 if seq is None else seq, nbytes or 0, cpu_wait, self._name(name), it,
                           self._gid(group, group_ranks), -1 if peer is None else peer,
                           -1 if mb is None else mb, -1 if chunk is None else chunk, c, 0))
        if len(self._rows) >= self._buffer:
            self.flush()

    def write_columns(self, names: list[str], groups: list[tuple[str, Any]],
                      cols: dict[str, np.ndarray] | np.ndarray) -> None:
        """Append many spans in one block: `cols` holds the COLUMNS as arrays (or is a `RECORD` array), `name`
        indexing `names` and `gid` indexing `groups` (-1: none). One numpy conversion instead of one call per span
        (simulated, bulk or a tracer's batch); `dur` = OPENED marks opened ops as in `write`."""
        n = len(cols) if isinstance(cols, np.ndarray) else len(cols["ts"])
        if not n:
            return
        self.flush()  # row-wise spans first, so the file stays in the order spans were handed over
        nids = [self._name(x) for x in names]
        gids = [self._gid(g, r) for g, r in groups]
        if isinstance(cols, np.ndarray):
            if cols.dtype != RECORD:
                raise ValueError(f"write_columns: record array has dtype {cols.dtype}, expected format.RECORD")
            rec = cols
            # Writers that register names and groups in the same order every time (the simulator) need no remap.
            if nids != list(range(len(nids))) or gids != list(range(len(gids))):
                rec = cols.copy()
                rec["name"] = np.array(nids + [-1], np.int32)[cols["name"]]
                rec["gid"] = np.array(gids + [-1], np.int32)[cols["gid"]]
        else:
            rec = np.zeros(n, RECORD)
            for c in COLUMNS:
                if c in cols:
                    rec[c] = cols[c]
            rec["name"] = np.array(nids + [-1], np.int32)[np.asarray(cols["name"])]
            rec["gid"] = np.array(gids + [-1], np.int32)[np.asarray(cols["gid"])] if "gid" in cols else -1
            for c, default in _NONE.items():
                if c not in cols and c != "gid":
                    rec[c] = default
        self.flush()  # new names and groups must precede the block that uses them
        self._block(*_span_block(rec))
        self.records += n

    def flush(self) -> None:
        """Write buffered tables and spans to the file (one block each) and flush the OS buffer."""
        if self._f is None:
            return
        if self._new_names:
            self._block(b"STRS", json.dumps(self._new_names).encode())
            self._new_names = []
        if self._new_groups:
            self._block(b"GRPS", json.dumps(self._new_groups).encode())
            self._new_groups = []
        if self._rows:
            self._block(*_span_block(np.array(self._rows, dtype=RECORD)))
            self.records += len(self._rows)
            self._rows = []
        self._f.flush()

    def close(self, footer: dict | None = None) -> None:
        """Flush, write the footer (records written plus `footer`/`self.footer` entries) and close."""
        if self._f is None:
            return
        self.flush()
        info = {"records": self.records, **self.footer, **(footer or {})}
        self._block(b"FOOT", json.dumps(info, default=_jsonable).encode())
        self._f.close()
        self._f = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _fit_unsigned(span: int) -> int:
    """Offset code (1-4) of the narrowest unsigned width holding 0..span."""
    return 1 if span < 1 << 8 else 2 if span < 1 << 16 else 3 if span < 1 << 32 else 4


def _fit_signed(lo: int, hi: int) -> int:
    """Delta code (5-8) of the narrowest signed width holding lo..hi."""
    for code, bits in ((5, 7), (6, 15), (7, 31)):
        if -(1 << bits) <= lo and hi < 1 << bits:
            return code
    return 8


def pack_columns(cols: dict[str, np.ndarray]) -> np.ndarray:
    """COLS payloads of several blocks of equal length at once: `cols` maps RECORD fields to (blocks, records)
    arrays, or (1, records) for values every block shares (absent fields take their "none": -1, nbytes 0). Returns
    a (blocks, payload bytes) uint8 array whose rows are the blocks' payloads. Widths are chosen over all the blocks
    (one layout, so the rows are made with whole-array copies); bases are each block's own."""
    shapes = [np.shape(v) for v in cols.values()]
    if not shapes or any(len(x) != 2 for x in shapes):
        raise ValueError("pack_columns: every column must be 2-D (blocks, records)")
    rows, n = max(x[0] for x in shapes), shapes[0][1]
    if any(x[1] != n or x[0] not in (1, rows) for x in shapes):
        raise ValueError(f"pack_columns: columns of shapes {sorted(set(shapes))} do not make {rows} blocks")
    head = np.zeros(rows, _COLS_HEAD)
    head["n"] = n
    data: list[np.ndarray] = []
    for i, c in enumerate(_COLS_ORDER):
        v = cols.get(c)
        v = np.full((1, n), _NONE.get(c, 0), np.int64) if v is None else np.asarray(v).astype(np.int64)
        if n == 0:
            continue
        lo, hi = v.min(axis=1), v.max(axis=1)
        head["base"][:, i] = lo
        if c != "ts" and (lo == hi).all():
            continue  # constant in each block: the base says it all
        code = _fit_unsigned(int((hi - lo).view(np.uint64).max()))
        if c == "ts":
            d = np.diff(v, axis=1)
            if d.size and _fit_signed(int(d.min()), int(d.max())) - 4 < code:
                code = _fit_signed(int(d.min()), int(d.max()))
            if code in (1, 2, 5, 6):
                code = 3 if code < 5 else 7  # never narrower than 4 bytes
            if code >= 5:
                head["base"][:, i] = v[:, 0]
                v = np.concatenate([np.zeros((v.shape[0], 1), np.int64), d], axis=1)
                lo = 0
        stored = v - (lo[:, None] if code < 5 else 0)
        data.append(np.broadcast_to(stored.astype(_COLS_WIDTHS[code]), (rows, n)))
        head["code"][:, i] = code
    out = np.empty((rows, _COLS_HEAD.itemsize + sum(a.shape[1] * a.itemsize for a in data)), np.uint8)
    out[:, :_COLS_HEAD.itemsize] = head.view(np.uint8).reshape(rows, -1)
    pos = _COLS_HEAD.itemsize
    for a in data:
        w = a.shape[1] * a.itemsize
        out[:, pos:pos + w] = np.ascontiguousarray(a).view(np.uint8).reshape(rows, w) if a.strides[0] else \
            a[:1].view(np.uint8).reshape(1, w)
        pos += w
    return out


def _unpack_columns(payload: memoryview) -> dict[str, np.ndarray] | str:
    """A COLS payload back to RECORD-typed columns, or what is wrong with it (never an exception, never an
    allocation the payload's size does not bound)."""
    if len(payload) < _COLS_HEAD.itemsize:
        return "a column block shorter than its header"
    head = np.frombuffer(payload, _COLS_HEAD, 1)[0]
    n = int(head["n"])
    if n > max(1, len(payload) // _TS_MIN_WIDTH):
        return f"a column block claims {n} records in {len(payload)} bytes"
    cols: dict[str, np.ndarray] = {}
    pos = _COLS_HEAD.itemsize
    for c, code, base in zip(_COLS_ORDER, head["code"].tolist(), head["base"].tolist()):
        field = _FIELDS[c]
        # The field's own width from the start, wrapping as C does (value = base + stored modulo 2^bits, the same
        # as in int64 and then narrowed): a call or two a column, where int64 and back cost five (100,096 files).
        lo, hi = _FIELD_RANGE[c]
        b = base if lo <= base <= hi else np.array(base, np.int64).astype(field)
        if code == 0:
            cols[c] = np.full(n, b, field)
            continue
        width = _COLS_WIDTHS.get(code)
        if width is None:
            return f"a column block has unknown code {code} for {c}"
        end = pos + n * width.itemsize
        if end > len(payload):
            return "a column block shorter than its columns"
        raw = np.frombuffer(payload, width, n, pos)
        v = raw.cumsum(dtype=field) if code >= 5 else raw.astype(field)
        if base:
            v += b
        cols[c] = v
        pos = end
    if pos != len(payload):
        return f"a column block with {len(payload) - pos} bytes past its columns"
    return cols


def _span_block(rec: np.ndarray) -> tuple[bytes, Any]:
    """The block for a RECORD array: COLS where it is smaller (64 records or more), else SPAN rows."""
    if len(rec) >= _COLS_MIN:
        cols = pack_columns({c: rec[c][None, :] for c in _COLS_ORDER})[0]
        if len(cols) < rec.nbytes:
            return b"COLS", memoryview(cols)
    return b"SPAN", memoryview(np.ascontiguousarray(rec)).cast("B")


def write_rank_file(path: str | Path, header: dict, names: list[str], groups: list[tuple[str, Any]],
                    spans: np.ndarray, summary: bytes | None = None) -> None:
    """Write a whole rank file at once: the bytes RankWriter writes for one `write_columns(names, groups, spans)`,
    in one gathered write. `spans` is a `RECORD` array (ids already indexing names and groups) or a row of
    `pack_columns` (a COLS payload made with other ranks' in one go). For writers of many finished files (the
    simulator: 100,096 of them), where a RankWriter per file cost more than the records. The GIL is released while
    the blocks are checksummed and written, so writer threads overlap. `summary`: a whole SUMS block
    (rank_summary.encode), written last."""
    _check_header(header)
    if spans.dtype == np.uint8 and spans.ndim == 1:
        if len(spans) < _COLS_HEAD.itemsize:
            raise ValueError("write_rank_file: a COLS payload shorter than its header")
        tag, payload, n = b"COLS", memoryview(np.ascontiguousarray(spans)), int(spans[:4].view("<u4")[0])
    elif spans.dtype == RECORD:
        (tag, payload), n = _span_block(spans), len(spans)
    else:
        raise ValueError(f"write_rank_file: expected a format.RECORD array or a COLS payload (got {spans.dtype})")
    parts: list = [MAGIC]

    def block(tag: bytes, payload) -> None:
        parts.append(_BLOCK.pack(tag, len(payload), zlib.crc32(payload)))
        parts.append(payload)

    block(b"HEAD", json.dumps(header, default=_jsonable).encode())
    if n:
        if names:
            block(b"STRS", json.dumps(list(names)).encode())
        if groups:
            block(b"GRPS", json.dumps([[str(g), _pack_members(r, None)] for g, r in groups]).encode())
        block(tag, payload)
    block(b"FOOT", json.dumps({"records": n}).encode())
    if summary is not None:
        parts.append(summary)
    with _CREATE:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        todo = sum(len(p) for p in parts)
        while todo:  # a regular file takes it all at once; a short write (signal, quota) goes on where it stopped
            done = os.writev(fd, parts)
            todo -= done
            while done and parts:
                if done >= len(parts[0]):
                    done -= len(parts[0])
                    parts.pop(0)
                else:
                    parts[0] = memoryview(parts[0])[done:]
                    done = 0
    finally:
        os.close(fd)


def _check_header(header: dict) -> None:
    for key in ("rank", "world", "coord", "topo"):
        if key not in header:
            raise ValueError(f"trace header needs {key!r} (got keys {sorted(header)})")


def _members(ranks: Any) -> tuple[int, ...]:
    """A group's global ranks as a tuple of ints (from a range, numpy array, list or None)."""
    if ranks is None:
        return ()
    if isinstance(ranks, range):
        return tuple(ranks)
    if isinstance(ranks, np.ndarray):
        return tuple(ranks.astype(np.int64).tolist())
    return tuple(map(int, ranks))


def _pack_members(ranks: Any, members: tuple[int, ...] | None) -> list[int] | dict[str, list[int]]:
    """GRPS form of a group: {"range": [start, stop, step]} when evenly spaced (3 or more), else the list
    (`members`: the group as _members gives it; None to have it made here when needed)."""
    if isinstance(ranks, range) and len(ranks) >= 3:
        return {"range": [ranks.start, ranks.stop, ranks.step]}
    if members is None:
        members = _members(ranks)
    n = len(members)
    if n >= 3:
        step = members[1] - members[0]
        if step and members[-1] - members[0] == step * (n - 1) and \
                all(b - a == step for a, b in zip(members, members[1:])):
            return {"range": [members[0], members[0] + step * n, step]}
    return list(members)


def _unpack_members(ranks: Any, cache: dict) -> tuple[int, ...]:
    """The GRPS form back to a tuple; equal groups read from many files share one tuple (memory at scale)."""
    if isinstance(ranks, dict):
        start, stop, step = (int(x) for x in ranks["range"])
        if step == 0 or not 0 <= start < MAX_WORLD or len(range(start, stop, step)) > MAX_WORLD:
            raise ValueError(f"group range {[start, stop, step]} is not a group of at most {MAX_WORLD} ranks")
        key = (start, stop, step)
        got = cache.get(key)
        if got is None:
            got = cache[key] = tuple(range(start, stop, step))
        return got
    return tuple(map(int, ranks))


def _json_object(payload: bytes, name: str, what: str) -> dict:
    """A JSON object block, or TraceFormatError naming the file (never a raw traceback)."""
    try:
        obj = json.loads(payload)
    except (ValueError, RecursionError) as e:
        raise TraceFormatError(f"{name}: the {what} is not valid JSON ({str(e)[:80]})") from None
    if not isinstance(obj, dict):
        raise TraceFormatError(f"{name}: the {what} is not a JSON object")
    return obj


def _jsonable(o: Any) -> Any:
    if isinstance(o, np.generic):
        return o.item()
    if isinstance(o, (tuple, set)):
        return list(o)
    return str(o)


def read_rank(path: str | Path, shared: dict | None = None, _views: bool = False) -> RankTrace:
    """Read one rank file; a truncated or partly corrupt file yields what is intact plus `problems`.

    `shared` (one dict across the files of a directory) lets equal group tables share their tuples. `_views`
    (read_dir only, which copies the columns into its store at once): columns as strided views of the records,
    not copies of their own (one copy of every span less)."""
    shared = {} if shared is None else shared
    name = os.path.basename(path)  # (no Path: building 12,288 of them cost more than reading the files)
    try:
        with open(path, "rb") as fh:
            data = fh.read()
    except OSError as e:
        raise TraceFormatError(f"{name}: cannot read ({e.strerror})") from None
    magic = data[:len(MAGIC)]
    if magic not in (MAGIC, MAGIC_V2, MAGIC_V1):
        raise TraceFormatError(f"{name}: not a MegaScan trace (bad magic); expected a file written by RankWriter")
    dtype = RECORD_V1 if magic == MAGIC_V1 else RECORD
    tags = (b"HEAD", b"STRS", b"GRPS", b"SPAN", b"FOOT") + ((b"COLS", b"SUMS") if magic == MAGIC else ())
    header: dict | None = None
    footer: dict | None = None
    names: list[str] = []
    groups: list[tuple[str, tuple[int, ...]]] = []
    spans: list[np.ndarray | dict[str, np.ndarray]] = []  # SPAN records or COLS columns, in file order
    problems: list[str] = []
    nrec = 0
    pos, size = len(MAGIC), len(data)
    view = memoryview(data)  # blocks as views of the file's bytes: a span block is not copied before numpy sees it
    while pos < size:
        if pos + _BLOCK.size > size:
            problems.append(f"{name} truncated after {nrec} records (partial block header at byte {pos})")
            break
        tag, length, crc = _BLOCK.unpack_from(data, pos)
        body = pos + _BLOCK.size
        payload = view[body:body + length]
        if tag not in tags:
            problems.append(f"{name} corrupt at byte {pos} after {nrec} records (unknown block); rest ignored")
            break
        if len(payload) < length:
            if tag == b"SPAN":
                # Records are fixed-size: keep every complete one of the partial block.
                k = len(payload) // dtype.itemsize
                if k:
                    spans.append(np.frombuffer(payload, dtype=dtype, count=k))
                    nrec += k
            problems.append(f"{name} truncated after {nrec} records" + (
                " (a column block cut short is lost whole)" if tag == b"COLS" else ""))
            break
        pos = body + length
        if zlib.crc32(payload) != crc:
            problems.append(f"{name}: checksum mismatch in {tag.decode()} block at byte {body - _BLOCK.size}; "
                            "block skipped")
            if tag in (b"STRS", b"GRPS"):
                break  # later spans would index a table we no longer have
            continue
        if tag == b"SPAN":
            if length % dtype.itemsize:
                problems.append(f"{name}: span block at byte {body} has a partial record; block skipped")
                continue
            spans.append(np.frombuffer(payload, dtype=dtype))
            nrec += length // dtype.itemsize
        elif tag == b"COLS":
            got = _unpack_columns(payload)
            if isinstance(got, str):
                problems.append(f"{name}: {got} at byte {body - _BLOCK.size}; block skipped")
                continue
            spans.append(got)
            nrec += len(got["ts"])
        elif tag == b"SUMS":
            continue  # the writer's summary of these spans (rank_summary.py): the triage's, not the reader's
        elif tag == b"STRS":
            # Every rank of a job usually writes the same string table: parsed once per distinct block.
            key = (tag, bytes(payload))
            new = shared.get(key)
            if new is None:
                try:
                    new = json.loads(key[1])
                except ValueError:
                    new = None
                if not isinstance(new, list) or not all(isinstance(n, str) for n in new):
                    problems.append(f"{name}: malformed string table at byte {body - _BLOCK.size}; rest ignored")
                    break
                shared[key] = new
            names.extend(new)
        elif tag == b"GRPS":
            key = (tag, bytes(payload))
            got = shared.get(key)
            if got is None:
                got = []
                try:
                    for g, rs in json.loads(key[1]):
                        got.append((str(g), _unpack_members(rs, shared)))
                except (TypeError, ValueError, KeyError):
                    groups.extend(got)  # the groups before the bad entry stand (as they always did)
                    problems.append(f"{name}: malformed group table at byte {body - _BLOCK.size}; rest ignored")
                    break
                shared[key] = got
            groups.extend(got)
        elif tag == b"HEAD":
            header = _json_object(bytes(payload), name, "header")
        else:
            try:
                footer = _json_object(bytes(payload), name, "footer")
            except TraceFormatError as e:
                problems.append(str(e))
    if header is None:
        raise TraceFormatError(f"{name}: header missing or corrupt; the file cannot be attributed to a rank")
    if footer is None and not problems:
        problems.append(f"{name} has no footer (the writer did not close; {nrec} records read)")
    if footer is not None:
        header = {**header, "footer": footer}
        if footer.get("dropped"):
            problems.append(dropped_problem(name, footer["dropped"]))
    if all(isinstance(p, np.ndarray) for p in spans):
        rec = np.concatenate(spans) if len(spans) > 1 else (spans[0] if spans else np.zeros(0, dtype))
        cols = {c: (rec[c] if _views else np.ascontiguousarray(rec[c])) if c in dtype.names
                else np.full(len(rec), -1, np.int64)
                for c in COLUMNS}
    else:  # COLS blocks (and any SPAN rows beside them, RECORD's layout in format 3)
        cols = {c: np.concatenate([p[c] for p in spans]) if len(spans) > 1 else spans[0][c] for c in COLUMNS}
    bad = (cols["name"] < 0) | (cols["name"] >= len(names)) | (cols["gid"] < -1) | (cols["gid"] >= len(groups))
    if bad.any():
        problems.append(f"{name}: {int(bad.sum())} records refer to unknown names/groups; dropped")
        cols = {c: v[~bad] for c, v in cols.items()}
    try:
        rank, world = int(header["rank"]), int(header["world"])
        if len(header["coord"]) > MAX_DIMS or len(header["topo"]) > MAX_DIMS:
            raise ValueError("coord/topo too long")
        coord = tuple(int(x) for x in header["coord"])
        topo = tuple(int(x) for x in header["topo"])
    except (KeyError, TypeError, ValueError, OverflowError):
        raise TraceFormatError(f"{name}: header lacks rank/world/coord/topo") from None
    if not 0 < world <= MAX_WORLD or not 0 <= rank < world:
        raise TraceFormatError(f"{name}: header claims rank {str(header['rank'])[:20]} of world "
                               f"{str(header['world'])[:20]}; a world holds 1 to {MAX_WORLD} ranks")
    if len(coord) != 3 or len(topo) != 3 or min(coord) < 0 or min(topo) < 1:  # the analyses index (dp, pp, tp)
        raise TraceFormatError(f"{name}: header coord {list(coord)[:3]} / topo {list(topo)[:3]} is not a (dp, pp, "
                               f"tp) position and (tp, pp, dp) sizes")
    # min/max per group (C loops), not a Python test per member: 1.5 million at 12,288 ranks.
    if any(members and (min(members) < 0 or max(members) >= world) for _, members in groups):
        raise TraceFormatError(f"{name}: its group table names a rank outside its world of {world}")
    is_open = cols["dur"] == OPENED
    if is_open.any():
        opened = {c: v[is_open] for c, v in cols.items()}
        cols = {c: v[~is_open] for c, v in cols.items()}
    else:  # the common case: no copies (and no views: a view keeps the whole column alive once it is released)
        opened = {c: np.empty(0, v.dtype) for c, v in cols.items()}
    return RankTrace(rank=rank, world=world, coord=coord, topo=topo, header=header, names=names, groups=groups,
                     problems=problems, opened=opened, **cols)


def dropped_problem(name: str, dropped: int) -> str:
    """The problem a file whose tracer dropped spans reports (read in full, or through its summary block)."""
    return f"{name}: the tracer dropped {dropped} spans (queue full)"


def read_dir(path: str | Path) -> tuple[list[RankTrace], list[str]]:
    """Read every `rank*.mst` in a directory: traces sorted by rank, plus problems naming bad or missing files.

    The problems list includes each trace's own problems (truncation, drops) so one list tells the whole story."""
    d = Path(path)
    if not d.is_dir():
        raise FileNotFoundError(f"trace directory {d} does not exist")
    traces: list[RankTrace] = []
    problems: list[str] = []
    seen: dict[int, str] = {}
    shared: dict = {}
    names = [e.name for e in os.scandir(d) if FILE_PATTERN.search(e.name)]
    names.sort()  # names, not Paths: Path comparison is slow at scale
    base = os.fspath(d)
    store = _ColumnStore(sum(_size(os.path.join(base, n)) for n in names))
    for name in names:
        f = os.path.join(base, name)
        try:
            t = read_rank(f, shared, _views=True)
        except TraceFormatError as e:
            problems.append(str(e))
            continue
        if t.rank in seen:
            problems.append(f"{name} claims rank {t.rank}, already read from {seen[t.rank]}; ignored")
            continue
        seen[t.rank] = name
        problems.extend(t.problems)
        store.take(t)
        traces.append(t)
    traces.sort(key=lambda t: t.rank)
    world = max((t.world for t in traces), default=0)
    missing = [r for r in range(world) if r not in seen]
    if missing:
        shown = ", ".join(rank_file(d, r).name for r in missing[:20])
        more = f" and {len(missing) - 20} more" if len(missing) > 20 else ""
        problems.append(f"missing rank files: {shown}{more}")
    if not traces and not problems:
        problems.append(f"no rank*.mst files in {d}")
    return traces, problems


def _size(p: str) -> int:
    try:
        return os.stat(p).st_size
    except OSError:
        return 0


class _ColumnStore:
    """One array per column for every rank of a directory; each trace's columns become consecutive views into
    it. A file's own arrays are small and come from malloc's heap: 12,288 of them stayed resident after use (the
    heap fragments), and `table.join` had to copy them all into its own columns. Here they are copied once into
    big arrays, reused file after file, and `join` takes the store's columns as they are (no second copy).
    The capacity is an upper bound (the files' bytes over the smallest record); pages never written cost no
    memory."""

    def __init__(self, total_bytes: int):
        # Format 3's column blocks hold a record in 22-30 bytes as writers make them (at least 4: see the top); a
        # store that fills up leaves later traces their own arrays, which is only less compact.
        self.cap = total_bytes // 16 + 1
        self.cols = {c: np.empty(self.cap, _COLUMN_DTYPES[c]) for c in COLUMNS}
        self.pos = 0

    def take(self, t: RankTrace) -> None:
        n = len(t)
        if self.pos + n > self.cap:  # cannot happen for files read whole; keep the trace's own arrays then
            for c in COLUMNS:
                setattr(t, c, np.ascontiguousarray(getattr(t, c)))  # not views of the file's bytes
            return
        a, b = self.pos, self.pos + n
        for c in COLUMNS:
            col = self.cols[c]
            col[a:b] = getattr(t, c)
            setattr(t, c, col[a:b])
        self.pos = b


_COLUMN_DTYPES = {c: RECORD[c] for c in COLUMNS}
