"""Format 3's COLS blocks: spans by column in the narrowest width that holds them, read back exactly; a damaged or
crafted column block is named and skipped, never trusted for sizes."""
from __future__ import annotations

import json
import struct
import zlib

import numpy as np
import pytest

from megatronapp.scan.read import format as fmt
from megatronapp.scan.read.format import COLUMNS, RECORD, RankWriter, pack_columns, read_rank, write_rank_file

HEADER = {"rank": 0, "world": 2, "coord": [0, 0, 0], "topo": [1, 1, 2]}


def _records(n: int, seed: int, extreme: bool = False) -> np.ndarray:
    rng = np.random.default_rng(seed)
    rec = np.zeros(n, RECORD)
    rec["ts"] = np.sort(rng.integers(10**15, 10**15 + 5 * 10**9, n))  # 5 s: past an unsigned 32-bit offset
    rec["dur"] = rng.integers(0, 10**9, n)
    rec["seq"] = rng.integers(-1, 400, n)
    rec["nbytes"] = rng.choice([0, 4096, 1 << 28], n)
    rec["cpu_wait"] = -1
    rec["name"] = rng.integers(0, 3, n)
    rec["it"] = rng.integers(0, 10, n)
    rec["gid"] = rng.integers(-1, 2, n)
    rec["peer"] = rng.integers(-1, 100_000, n)
    rec["mb"] = rng.integers(-1, 16, n)
    rec["chunk"] = -1
    rec["cat"] = rng.integers(0, 7, n)
    if extreme:  # the whole int64 range, out of order: offsets and deltas wrap and must come back exact
        rec["ts"] = rng.integers(np.iinfo(np.int64).min, np.iinfo(np.int64).max, n, dtype=np.int64)
        rec["nbytes"][::3] = np.iinfo(np.int64).max
        rec["dur"][::2] = np.iinfo(np.int64).min
        rec["cpu_wait"] = rng.integers(-1, 2**40, n)
    return rec


def _same(t, rec: np.ndarray) -> None:
    for c in COLUMNS:
        got = getattr(t, c)
        assert got.dtype == RECORD[c] and np.array_equal(got, rec[c]), c


@pytest.mark.parametrize("n,extreme", [(64, False), (1000, False), (200, True), (64, True)])
def test_columns_round_trip(tmp_path, n, extreme):
    rec = _records(n, seed=n, extreme=extreme)
    rec = rec[rec["dur"] != fmt.OPENED]  # opened markers read into `opened`, apart: compared below
    path = tmp_path / "rank00000.mst"
    write_rank_file(path, HEADER, ["forward", "send", "recv"], [("tp", (0, 1)), ("dp", (0, 1))], rec)
    t = read_rank(path)
    assert not t.problems and t.header["footer"]["records"] == len(rec)
    _same(t, rec)
    assert b"COLS" in path.read_bytes() and (extreme or path.stat().st_size < rec.nbytes / 2)


def test_small_blocks_stay_rows_and_mix_with_column_blocks(tmp_path):
    path = tmp_path / "rank00000.mst"
    rec = _records(300, seed=1)
    with RankWriter(path, HEADER, buffer_records=10) as w:
        for r in rec[:25]:  # row by row: blocks of 10 (SPAN)
            w.write(["forward", "send", "recv"][r["name"]], int(r["cat"]), int(r["ts"]), int(r["dur"]), int(r["it"]),
                    seq=int(r["seq"]), peer=int(r["peer"]), nbytes=int(r["nbytes"]), chunk=int(r["chunk"]),
                    mb=int(r["mb"]))
        w.write_columns(["forward", "send", "recv"], [], {c: rec[c][25:] for c in COLUMNS if c != "gid"})
    data = path.read_bytes()
    assert data.count(b"SPAN") == 3 and data.count(b"COLS") == 1
    t = read_rank(path)
    expect = rec.copy()
    expect["gid"] = -1
    names = ["forward", "send", "recv"]
    assert [t.names[i] for i in t.name] == [names[i] for i in rec["name"]]  # ids in the file: order of first use
    expect["name"] = t.name
    _same(t, expect)


def test_packed_batch_rows_are_each_ranks_blocks():
    a, b = _records(100, seed=2), _records(100, seed=3)
    shared = _records(100, seed=4)  # (1, n) columns: the same for every block of the batch
    cols = {"ts": np.stack([a["ts"], b["ts"]]), "dur": np.stack([a["dur"], b["dur"]]),
            "peer": np.stack([a["peer"], b["peer"]]), "name": shared["name"][None], "it": shared["it"][None]}
    rows = pack_columns(cols)
    for i, r in enumerate((a, b)):
        got = fmt._unpack_columns(memoryview(rows[i]))
        assert np.array_equal(got["ts"], r["ts"]) and np.array_equal(got["peer"], r["peer"])
        assert np.array_equal(got["name"], shared["name"]) and set(got["seq"]) == {-1} and set(got["nbytes"]) == {0}
    with pytest.raises(ValueError, match="2-D"):
        pack_columns({"ts": a["ts"]})
    with pytest.raises(ValueError, match="blocks"):
        pack_columns({"ts": np.zeros((2, 5)), "dur": np.zeros((3, 5))})


def _file(payload: bytes) -> bytes:
    def block(tag: bytes, body: bytes) -> bytes:
        return struct.pack("<4sII", tag, len(body), zlib.crc32(body)) + body

    return (fmt.MAGIC + block(b"HEAD", json.dumps(HEADER).encode()) + block(b"STRS", b'["forward"]')
            + block(b"COLS", payload) + block(b"FOOT", b'{"records": 0}'))


def _payload(n: int = 80) -> bytearray:
    rec = _records(n, seed=5)
    rec["name"] = 0
    rec["gid"] = -1
    return bytearray(pack_columns({c: rec[c][None] for c in COLUMNS})[0])


@pytest.mark.parametrize("damage,named", [
    ("claims", "claims 4000000000 records"),
    ("code", "unknown code 9"),
    ("short", "shorter than its columns"),
    ("long", "bytes past its columns"),
    ("tiny", "shorter than its header"),
])
def test_crafted_column_blocks_are_named_and_skipped(tmp_path, damage, named):
    p = _payload()
    if damage == "claims":
        p[:4] = struct.pack("<I", 4_000_000_000)
    elif damage == "code":
        p[4 + 1] = 9  # the dur column's code
    elif damage == "short":
        p = p[:-3]
    elif damage == "long":
        p += b"\0" * 5
    else:
        p = p[:50]
    path = tmp_path / "rank00000.mst"
    path.write_bytes(_file(bytes(p)))
    t = read_rank(path)
    assert len(t) == 0 and any(named in x and "block skipped" in x for x in t.problems), t.problems


def test_truncated_column_block_is_lost_whole_and_said(tmp_path):
    good = _file(bytes(_payload()))
    path = tmp_path / "rank00000.mst"
    path.write_bytes(good[:good.index(b"FOOT") - 12 - 40])
    t = read_rank(path)
    assert len(t) == 0 and "column block cut short" in t.problems[0]


def test_earlier_formats_still_read_and_columns_need_format_3(tmp_path):
    rec = _records(70, seed=6)
    rec["name"], rec["gid"] = 0, -1
    path = tmp_path / "rank00000.mst"
    v3 = _file(bytes(pack_columns({c: rec[c][None] for c in COLUMNS})[0]))
    path.write_bytes(fmt.MAGIC_V2 + v3[len(fmt.MAGIC):])  # a format-2 file knows no COLS block
    t = read_rank(path)
    assert len(t) == 0 and any("unknown block" in x for x in t.problems)
    head = struct.pack("<4sII", b"HEAD", len(json.dumps(HEADER)), zlib.crc32(json.dumps(HEADER).encode()))
    body = rec.tobytes()
    path.write_bytes(fmt.MAGIC_V2 + head + json.dumps(HEADER).encode()
                     + struct.pack("<4sII", b"STRS", 11, zlib.crc32(b'["forward"]')) + b'["forward"]'
                     + struct.pack("<4sII", b"SPAN", len(body), zlib.crc32(body)) + body)
    _same(read_rank(path), rec)


@pytest.mark.parametrize("members", [[0, 5], [-1, 1], {"range": [0, 12, 4]}])
def test_group_tables_naming_ranks_outside_the_world_are_refused(tmp_path, members):
    def block(tag: bytes, body: bytes) -> bytes:
        return struct.pack("<4sII", tag, len(body), zlib.crc32(body)) + body

    ok = json.dumps([["tp", [0, 1]]]).encode()
    bad = json.dumps([["dp", members]]).encode()
    shared: dict = {}
    for i, tables in enumerate(([ok], [ok, bad], [ok])):
        path = tmp_path / f"rank0000{i}.mst"
        path.write_bytes(fmt.MAGIC + block(b"HEAD", json.dumps({**HEADER, "world": 4}).encode())
                         + b"".join(block(b"GRPS", t) for t in tables))
        if bad in tables:  # the bounds of a table are kept with it: the second file to carry it is refused too
            for _ in range(2):
                with pytest.raises(fmt.TraceFormatError, match="outside its world of 4"):
                    read_rank(path, shared)
        else:
            assert read_rank(path, shared).groups == [("tp", (0, 1))]
