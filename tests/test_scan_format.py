"""MegaScan trace file format: round trip, truncation, corruption, directory reading."""
from __future__ import annotations

import numpy as np
import pytest

from megatronapp.scan.read.format import CATS, RECORD, RankWriter, TraceFormatError, rank_file, read_dir, read_rank


def _header(rank: int, world: int = 2) -> dict:
    return {"rank": rank, "world": world, "coord": [rank, 0, 0], "topo": [1, 1, world], "host": "h"}


def _write(path, rank=0, n=10, world=2, buffer_records=4096, close=True):
    w = RankWriter(path, _header(rank, world), buffer_records=buffer_records)
    for i in range(n):
        if i % 2:
            w.write("all_reduce", "comm", ts=1000 * i, dur=7, it=i // 4, group="dp", group_ranks=(0, 1),
                    seq=i, nbytes=4096)
        else:
            w.write(f"layers.{i % 3}", "layer", ts=1000 * i, dur=5 + i, it=i // 4, chunk=0, mb=i % 3)
    if close:
        w.close(footer={"dropped": 0})
    return w


def test_round_trip_columns_and_tables(tmp_path):
    path = rank_file(tmp_path, 0)
    _write(path, n=10, buffer_records=3)  # several blocks, tables growing between them
    t = read_rank(path)
    assert (t.rank, t.world, t.coord, t.topo) == (0, 2, (0, 0, 0), (1, 1, 2))
    assert len(t) == 10 and t.problems == []
    assert t.header["host"] == "h" and t.header["footer"]["records"] == 10
    assert t.ts.dtype == np.int64 and t.name.dtype == np.int32 and t.cat.dtype == np.int8
    assert t.chunk.dtype == np.int16 and t.gid.dtype == np.int32 and t.seq.dtype == np.int64
    assert list(t.ts) == [1000 * i for i in range(10)]
    names = [t.names[k] for k in t.name]
    assert names[1] == "all_reduce" and names[2] == "layers.2"
    assert [CATS[c] for c in t.cat[:2]] == ["layer", "comm"]
    assert t.groups == [("dp", (0, 1))]
    comm = t.gid >= 0
    assert list(t.seq[comm]) == [1, 3, 5, 7, 9] and set(t.nbytes[comm]) == {4096}
    assert set(t.seq[~comm]) == {-1} and set(t.peer) == {-1}
    assert list(t.mb[~comm]) == [0, 2, 1, 0, 2] and list(t.dur[:3]) == [5, 7, 7]


@pytest.mark.parametrize("cut", [1, 7, RECORD.itemsize + 3, 200])
def test_truncated_file_reads_complete_records(tmp_path, cut):
    path = rank_file(tmp_path, 1)
    _write(path, rank=1, n=20, buffer_records=8)
    full = read_rank(path)
    data = path.read_bytes()
    path.write_bytes(data[:-cut])
    t = read_rank(path)
    assert t.problems and "rank00001.mst" in t.problems[0]
    assert 0 < len(t) <= 20
    # What was read is an exact prefix of the full trace.
    assert np.array_equal(t.ts, full.ts[:len(t)]) and np.array_equal(t.name, full.name[:len(t)])
    if cut < 200:
        assert len(t) >= 16  # only the final block (and footer) are affected


def test_unclosed_writer_is_readable(tmp_path):
    path = rank_file(tmp_path, 0)
    w = _write(path, n=9, buffer_records=4, close=False)
    t = read_rank(path)
    assert len(t) == 8 and "no footer" in t.problems[0]
    w.close()


def test_checksum_failure_skips_block(tmp_path):
    path = rank_file(tmp_path, 0)
    _write(path, n=12, buffer_records=4)
    data = bytearray(path.read_bytes())
    # Flip a byte in the middle of the file (inside a span block payload, past the header and tables).
    i = data.index(b"SPAN") + 20
    data[i] ^= 0xFF
    path.write_bytes(bytes(data))
    t = read_rank(path)
    assert any("checksum" in p for p in t.problems)
    assert len(t) == 8


def test_bad_files_and_missing_ranks_named(tmp_path):
    _write(rank_file(tmp_path, 0), rank=0, world=4)
    (tmp_path / "rank00001.mst").write_bytes(b"garbage that is not a trace")
    _write(rank_file(tmp_path, 3), rank=3, world=4)
    data = rank_file(tmp_path, 3).read_bytes()
    rank_file(tmp_path, 3).write_bytes(data[:-30])
    (tmp_path / "notes.txt").write_text("ignored")
    traces, problems = read_dir(tmp_path)
    assert [t.rank for t in traces] == [0, 3]
    text = "\n".join(problems)
    assert "rank00001.mst: not a MegaScan trace" in text
    assert "rank00002.mst" in text and "missing" in text
    assert "rank00003.mst truncated" in text
    with pytest.raises(TraceFormatError, match="rank00001.mst"):
        read_rank(tmp_path / "rank00001.mst")


def test_header_requires_identity(tmp_path):
    with pytest.raises(ValueError, match="coord"):
        RankWriter(tmp_path / "x.mst", {"rank": 0, "world": 1, "topo": [1, 1, 1]})


def test_evenly_spaced_groups_are_stored_as_ranges_and_read_back(tmp_path):
    path = rank_file(tmp_path, 0)
    w = RankWriter(path, _header(0, 4096))
    groups = [("dp", range(3, 4096, 8)), ("pp", np.array([0, 1024, 2048, 3072])), ("odd", [0, 1, 5]),
              ("tp", (0, 1))]
    w.write_columns(["all_reduce"], groups, {"name": np.zeros(4, int), "cat": np.ones(4, int),
                                             "ts": np.arange(4) * 10, "dur": np.full(4, 5), "gid": np.arange(4)})
    w.close()
    raw = path.read_bytes()
    assert raw.count(b'"range"') == 2 and b"4091" not in raw  # 512 DP members in a few bytes
    t = read_rank(path)
    assert t.groups == [("dp", tuple(range(3, 4096, 8))), ("pp", (0, 1024, 2048, 3072)), ("odd", (0, 1, 5)),
                        ("tp", (0, 1))]
    # Files of one directory share equal member tuples (memory at 12,288 ranks).
    shared: dict = {}
    a, b = read_rank(path, shared), read_rank(path, shared)
    assert a.groups[0][1] is b.groups[0][1]


def test_write_columns_takes_record_arrays_and_remaps_ids(tmp_path):
    path = rank_file(tmp_path, 0)
    w = RankWriter(path, _header(0))
    w.write("data", "data", ts=0, dur=1, it=0)  # "data" is name 0 of this file
    rec = np.zeros(3, RECORD)
    rec["ts"], rec["dur"], rec["it"] = [10, 20, 30], [1, 2, -1], 0
    rec["name"] = [0, 1, 1]  # indexes ["send", "data"] below, not the file's table
    rec["gid"] = [0, -1, 0]
    rec["peer"], rec["seq"] = [1, -1, 1], [0, -1, 1]
    w.write_columns(["send", "data"], [("pp", (0, 1))], rec)
    w.close()
    t = read_rank(path)
    assert [t.names[k] for k in t.name] == ["data", "send", "data"]
    assert list(t.gid) == [-1, 0, -1] and list(t.ts) == [0, 10, 20]
    assert list(t.opened["ts"]) == [30] and t.names[t.opened["name"][0]] == "data"  # dur -1: opened, kept apart
    with pytest.raises(ValueError, match="format.RECORD"):
        RankWriter(rank_file(tmp_path, 1), _header(1)).write_columns(["x"], [], np.zeros(2, np.int64))


def test_cpu_wait_round_trips_and_format_1_files_still_read(tmp_path):
    from megatronapp.scan.read.format import MAGIC_V1, RECORD_V1

    w = RankWriter(rank_file(tmp_path, 0), _header(0))
    w.write("forward", "compute", ts=0, dur=100, it=0, cpu_wait=40)
    w.write("all_reduce", "comm", ts=100, dur=5, it=0, group="dp", group_ranks=(0, 1), seq=0)
    w.close()
    t = read_rank(rank_file(tmp_path, 0))
    assert list(t.cpu_wait) == [40, -1] and t.problems == []
    # A format-1 file (56-byte records, no cpu_wait), as written before format 2: read, cpu_wait unknown.
    import json
    import struct
    import zlib

    def block(tag, payload):
        return struct.pack("<4sII", tag, len(payload), zlib.crc32(payload)) + payload

    rec = np.zeros(2, RECORD_V1)
    rec["ts"], rec["dur"], rec["cat"], rec["it"], rec["gid"] = [0, 50], [50, 7], [0, 1], 0, -1
    old = MAGIC_V1 + block(b"HEAD", json.dumps(_header(1)).encode()) + \
        block(b"STRS", json.dumps(["forward"]).encode()) + block(b"SPAN", rec.tobytes()) + \
        block(b"FOOT", json.dumps({"records": 2}).encode())
    rank_file(tmp_path, 1).write_bytes(old)
    t1 = read_rank(rank_file(tmp_path, 1))
    assert t1.problems == [] and list(t1.dur) == [50, 7] and list(t1.cpu_wait) == [-1, -1]
    assert RECORD.itemsize == 64 and RECORD_V1.itemsize == 56
