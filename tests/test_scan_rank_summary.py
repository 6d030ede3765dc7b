"""Summary blocks (scan/read/rank_summary.py): the numbers a writer leaves at the end of a rank file for the triage.

The triage must get the same numbers from a summary as from the spans (simulated jobs of every fault kind, a real
traced gloo job), and a summary that is missing, damaged, out of place or lying must cost only speed: the file is
read in full, the problem is named, and `--no-summaries` ignores them all."""
from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import zlib

import numpy as np
import pytest

from megatronapp.scan.detect import features, triage
from megatronapp.scan.read import rank_summary
from megatronapp.scan.read.format import RECORD, RankWriter, read_rank, write_rank_file
from megatronapp.scan.synth.simulate import simulate
from tests.test_scan_tracer import traced_job

TP, PP, DP = 4, 4, 16  # 256 ranks


def rank(d: int, s: int, t: int) -> int:
    return t + TP * (d + DP * s)


FAULTS = [[], [f"slow-compute={rank(3, 1, 2)}:1.3", f"pause={rank(7, 2, 0)}:20:2"],
          [f"slow-link={rank(5, 0, 1)}-{rank(5, 1, 1)}:2", f"slow-link={rank(2, 3, 0)}-{rank(3, 3, 0)}:1.5"],
          [f"late-arrival={rank(9, 3, 3)}:5", f"slow-link={rank(4, 2, 0)}-{rank(4, 2, 1)}:2"]]


def assert_same(a: features.Features, b: features.Features) -> None:
    for k in ("iters", "coords", "work", "host", "p2p", "peer_up", "coll", "opened", "spans"):
        x, y = getattr(a, k), getattr(b, k)
        assert np.array_equal(x, y, equal_nan=x.dtype.kind == "f"), k
    assert a.paths == b.paths and a.topo == b.topo and a.world == b.world


@pytest.mark.parametrize("faults", FAULTS, ids=["healthy", "compute+pause", "links", "late+tp-link"])
def test_simulated_summaries_equal_the_spans_numbers(tmp_path, faults):
    simulate(tmp_path, TP * PP * DP, TP, PP, iterations=4, faults=faults, seed=len(faults))
    for r in (0, 77, 255):
        got, why = rank_summary.read(os.fspath(tmp_path / f"rank{r:05d}.mst"))
        assert why is None and got is not None and got["rank"] == r and got["spans"] > 0
        assert read_rank(tmp_path / f"rank{r:05d}.mst").problems == []  # the span reader skips the block
    a = features.features(tmp_path, workers=1)
    b = features.features(tmp_path, workers=1, use_summaries=False)
    assert_same(a, b)
    assert a.problems == b.problems == []


def test_tracer_leaves_the_summary_the_triage_would_work_out():
    out, _ = traced_job()
    for r in range(4):
        path = os.fspath(out / f"rank{r:05d}.mst")
        got, why = rank_summary.read(path)
        assert why is None and got is not None, path
        t = read_rank(path)
        assert t.problems == [] and len(t) > 0
        want = rank_summary.decode(features.summary_blocks([t])[0][12:])
        for k, v in want.items():
            assert np.array_equal(np.asarray(got[k]), np.asarray(v), equal_nan=True), (r, k)
        assert not features.write_summary(path)  # once only
    assert_same(features.features(out, workers=1), features.features(out, workers=1, use_summaries=False))


def _job(tmp_path, n: int = 8):
    simulate(tmp_path, 32, 2, 2, iterations=3, seed=4)
    return [os.fspath(tmp_path / f"rank{r:05d}.mst") for r in range(n)]


def _payload(path: str) -> tuple[int, bytes]:
    data = open(path, "rb").read()
    n = struct.unpack_from("<I", data, len(data) - 8)[0]
    return len(data) - n, data[len(data) - n:]


def _rewrite(path: str, payload: bytes) -> None:
    """Replace a file's summary with `payload`, framed and checksummed as a writer would (a well-formed lie)."""
    start, _ = _payload(path)
    data = open(path, "rb").read()[:start - 12]
    with open(path, "wb") as fh:
        fh.write(data + struct.pack("<4sII", b"SUMS", len(payload), zlib.crc32(payload)) + payload)


def test_damaged_or_misplaced_summaries_fall_back_to_the_spans(tmp_path):
    paths = _job(tmp_path)
    want = features.features(tmp_path, workers=1, use_summaries=False)
    # 0: a flipped byte (checksum); 1: a block appended after it (a writer went on); 2: a trailer claiming 2 GB;
    # 3: cut in the middle; 4: the trailer names a block that is not SUMS.
    data = bytearray(open(paths[0], "rb").read())
    data[-40] ^= 0xFF
    open(paths[0], "wb").write(bytes(data))
    with open(paths[1], "ab") as fh:
        fh.write(struct.pack("<4sII", b"FOOT", 2, zlib.crc32(b"{}")) + b"{}")
    data = open(paths[2], "rb").read()
    open(paths[2], "wb").write(data[:-8] + struct.pack("<I4s", 1 << 31, b"SUMS"))
    data = open(paths[3], "rb").read()
    open(paths[3], "wb").write(data[:-200] + data[-8:])
    data = open(paths[4], "rb").read()
    open(paths[4], "wb").write(data + struct.pack("<I4s", 40, b"SUMS"))
    got = features.features(tmp_path, workers=1)
    assert_same(got, want)
    named = " ".join(got.problems)
    for p in (paths[0], paths[2], paths[3], paths[4]):
        assert os.path.basename(p) in named
    assert "read in full" in named
    assert rank_summary.read(paths[1]) == (None, None)  # not last: simply none
    assert read_rank(paths[1]).problems == []


@pytest.mark.parametrize("field,value,message", [
    ("rank", 40, "rank 40 of world 32"),
    ("coord", 9, "coord"),
    ("work", -1.0, "negative"),
    ("host", float("inf"), "infinite"),
    ("iters", None, "increasing"),
    ("spans", -5, "counts out of range"),
])
def test_summaries_with_impossible_values_are_refused_by_name(tmp_path, field, value, message):
    paths = _job(tmp_path, 2)
    start, payload = _payload(paths[1])
    s = rank_summary.decode(payload)
    if field == "iters":
        s["iters"] = s["iters"][::-1].copy()
    elif field == "coord":
        s["coord"] = np.array([0, value, 0])
    elif field in ("work", "host"):
        s[field] = np.where(np.arange(len(s[field])) == 1, value, s[field])
    else:
        s[field] = value
    _rewrite(paths[1], rank_summary.encode(s)[12:])
    got, why = rank_summary.read(paths[1])
    assert got is None and message in why and "rank00001.mst" in why
    assert rank_summary.decode(b"RS01" + struct.pack("<I", 1 << 20)) == "a summary block shorter than its fixed part"
    big = b"RS01" + struct.pack("<I", (1 << 16) + 1) + bytes(rank_summary.payload_size(0) - 8)
    assert "for 65537 iterations" in rank_summary.decode(big)


def test_summary_reader_survives_random_damage(tmp_path):
    path = _job(tmp_path, 1)[0]
    good = open(path, "rb").read()
    orig = rank_summary.read(path)[0]
    rng = np.random.default_rng(7)
    for _ in range(300):
        data = bytearray(good)
        for _ in range(rng.integers(1, 4)):
            k = int(rng.integers(max(0, len(data) - 600), len(data)))
            data[k] = int(rng.integers(0, 256))
        cut = int(rng.integers(0, len(data))) if rng.random() < 0.2 else len(data)
        open(path, "wb").write(bytes(data[:cut]))
        got, why = rank_summary.read(path)  # never raises
        assert why is None or (got is None and why.startswith("rank00000.mst: ") and why.endswith("read in full"))
        if got is not None:  # damage before the block, or a byte rewritten as it was: what passes is the original
            assert all(np.array_equal(np.asarray(got[k]), np.asarray(v), equal_nan=True) for k, v in orig.items())
    for n in range(0, 200, 7):
        assert isinstance(rank_summary.decode(bytes(rng.integers(0, 256, n, dtype=np.uint8))), str)


def test_other_files_never_read_as_summaries(tmp_path):
    # A row-written file (RankWriter, no summary) and a file whose last bytes spell the tag by chance.
    header = {"rank": 0, "world": 1, "coord": [0, 0, 0], "topo": [1, 1, 1]}
    with RankWriter(tmp_path / "rank00000.mst", header) as w:
        w.write("forward", "compute", 10, 5, 0)
    assert rank_summary.read(os.fspath(tmp_path / "rank00000.mst")) == (None, None)
    open(tmp_path / "x.mst", "wb").write(b"MSCAN\x00\x02\x00" + bytes(100) + struct.pack("<I4s", 50, b"SUMS"))
    assert rank_summary.read(os.fspath(tmp_path / "x.mst")) == (None, None)
    assert rank_summary.read(os.fspath(tmp_path / "missing.mst"))[1].startswith("missing.mst: cannot read")
    rec = np.zeros(3, RECORD)
    rec["gid"] = -1
    write_rank_file(tmp_path / "rank00001.mst", {**header, "rank": 1, "world": 2}, ["forward"], [], rec)
    assert features.write_summary(tmp_path / "rank00001.mst")  # a closed file gets one, once
    assert not features.write_summary(tmp_path / "rank00001.mst")
    assert read_rank(tmp_path / "rank00001.mst").problems == []
    # A damaged file gets none (no block after the damage), and is left as it was.
    write_rank_file(tmp_path / "rank00002.mst", {**header, "rank": 2, "world": 3}, ["forward"], [], rec)
    data = bytearray((tmp_path / "rank00002.mst").read_bytes())
    data[-20] ^= 0xFF  # inside the footer
    (tmp_path / "rank00002.mst").write_bytes(bytes(data))
    assert not features.write_summary(tmp_path / "rank00002.mst")
    assert (tmp_path / "rank00002.mst").read_bytes() == bytes(data)


def test_a_lying_summary_hides_a_rank_until_no_summaries(tmp_path):
    """What a summary can do at worst: keep a rank out of the triage. `--no-summaries` reads the spans instead."""
    slow = rank(6, 2, 1)
    simulate(tmp_path, TP * PP * DP, TP, PP, iterations=4, faults=[f"slow-compute={slow}:1.5"], seed=2)
    path = os.fspath(tmp_path / f"rank{slow:05d}.mst")
    peer = rank_summary.read(os.fspath(tmp_path / f"rank{rank(5, 2, 1):05d}.mst"))[0]
    s = rank_summary.read(path)[0]
    _rewrite(path, rank_summary.encode({**peer, "rank": slow, "coord": s["coord"]})[12:])
    lied = triage.select(features.features(tmp_path, workers=1))
    true = triage.select(features.features(tmp_path, workers=1, use_summaries=False))
    assert slow not in [r for r, _, _ in lied.suspects]
    assert (slow, "work") in [(r, k) for r, k, _ in true.suspects]
    cli = [sys.executable, "-m", "megatronapp", "scan", "detect", os.fspath(tmp_path), "--json", "--two-level", "on",
           "--no-summaries"]
    out = subprocess.run(cli, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert out.returncode == 0, out.stderr
    first = json.loads(out.stdout)["findings"][0]
    assert (first["kind"], first["ranks"]) == ("slow-compute", [slow])


def test_a_ranks_numbers_do_not_depend_on_the_ranks_beside_it(tmp_path):
    """Rank 1 has no step for iteration 1 but a span tagged 1 that runs into iteration 2; rank 0 has all three
    steps. Read together (the triage's batch) or alone (a tracer's summary), rank 1's numbers are the same."""
    ms = 1_000_000
    for r, steps in ((0, (0, 1, 2)), (1, (0, 2))):
        header = {"rank": r, "world": 2, "coord": [r, 0, 0], "topo": [1, 1, 2]}
        with RankWriter(tmp_path / f"rank{r:05d}.mst", header) as w:
            for it in steps:
                w.write("step", "step", it * 10 * ms, 10 * ms, it)
                w.write("forward", "compute", it * 10 * ms + ms, 5 * ms, it)
            if r == 1:
                w.write("data", "data", 15 * ms, 10 * ms, 1)  # iteration 1's, ending inside iteration 2
    t0, t1 = (read_rank(tmp_path / f"rank{r:05d}.mst") for r in (0, 1))
    both, alone = features._batch([t0, t1]), features._batch([t1])
    cols = np.searchsorted(both["iters"], alone["iters"])
    for k in ("work", "host"):
        assert np.array_equal(both[k][1, cols], alone[k][0], equal_nan=True), k
    got = rank_summary.decode(features.summary_blocks([t1])[0][12:])
    assert np.array_equal(got["host"], alone["host"][0, :len(alone["iters"])], equal_nan=True)
    assert_same(features.features(tmp_path, workers=1), features.features(tmp_path, workers=1, use_summaries=False))


def test_a_summary_must_be_its_own_files(tmp_path):
    """A well-formed summary claiming another rank of the job (or another world) than its file's header is refused
    by name: it would put numbers on the wrong rank."""
    paths = _job(tmp_path, 6)
    other = rank_summary.read(paths[4])[0]
    _rewrite(paths[5], rank_summary.encode(other)[12:])
    got, why = rank_summary.read(paths[5])
    assert got is None and "rank00005.mst: its summary claims rank 4 of 32, the header rank 5 of 32" in why
    s = rank_summary.read(paths[3])[0]
    _rewrite(paths[3], rank_summary.encode({**s, "world": 64})[12:])
    assert "claims rank 3 of 64, the header rank 3 of 32" in rank_summary.read(paths[3])[1]
    got = features.features(tmp_path, workers=1)
    assert_same(got, features.features(tmp_path, workers=1, use_summaries=False))
    assert sum("its summary claims" in p for p in got.problems) == 2
