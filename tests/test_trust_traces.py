"""Trace inputs are sized before memory is spent, under a 1 GB address-space cap (a container's): a 2 KB Kineto
trace claiming a world of 10^9 ranks, a 2 MB `.json.gz` expanding to 2 GB and a 50 KB rank file whose summary
block claims 2,000 iterations of a 2^20-rank world are each refused with a message naming the file, while a real
gzipped trace still reads; and bad numbers in one Kineto file (NaN, Infinity, 1e17 µs, a 30-digit step, a Seq of
2^70, nesting past the parser) skip that file or rank, named, never the directory. Timings are printed by the
capped child for the report, never asserted."""
from __future__ import annotations

import gzip
import json
import subprocess
from pathlib import Path

import numpy as np
import pytest

from megatronapp.scan.read import format as fmt
from megatronapp.scan.read import rank_summary
from megatronapp.scan.read.traces import read_traces
from tests.memcap import GIB, run_capped

READ = ("from megatronapp.scan.read.traces import read_traces\n"
        "traces, problems = read_traces({d!r})\n"
        "print(round(time.monotonic() - t0, 2), len(traces), problems)\n")


def _event(name: str, ts: float, dur: float, cat: str = "cpu_op", **args) -> dict:
    return {"ph": "X", "cat": cat, "name": name, "pid": 1, "tid": 1, "ts": ts, "dur": dur, "args": args}


def _steps(n: int, per_step: int = 1) -> list[dict]:
    """`n` profiler steps of `per_step` ops each, as a CPU trace has them."""
    ev = []
    for s in range(n):
        t = 1.7e15 + s * 1000.0 * (per_step + 1)
        ev.append(_event(f"ProfilerStep#{s}", t, 1000.0 * (per_step + 1), "user_annotation"))
        ev += [_event("aten::mm", t + 10 + 1000 * i, 900.0, **{"Input Dims": [[128, 256], [256, 512]],
                                                              "Input type": ["float", "float"]})
               for i in range(per_step)]
    return ev


def _doc(rank: int, world: int, events: list[dict]) -> dict:
    return {"distributedInfo": {"backend": "gloo", "rank": rank, "world_size": world}, "traceEvents": events}


def test_a_small_kineto_file_claiming_a_huge_world_is_refused_under_1_gb(tmp_path):
    (tmp_path / "r0.json").write_text(json.dumps(_doc(0, 10**9, _steps(6))))
    assert (tmp_path / "r0.json").stat().st_size < 3000
    r = run_capped(READ.format(d=str(tmp_path)), GIB)
    assert r.returncode == 0, r.stderr[-1500:]
    assert "r0.json" in r.stdout and "world_size 1000000000" in r.stdout, r.stdout
    print("world 1e9 refused in", r.stdout.split()[0], "s")


def _gzip_bomb(path: Path, mib: int) -> Path:
    """A gzip of a JSON prefix and `mib` MiB of spaces: ~1 KB per MiB compressed."""
    block = gzip.compress(b" " * (1 << 20), 9)
    with open(path, "wb") as f:
        f.write(gzip.compress(b'{"traceEvents": ['))
        for _ in range(mib):
            f.write(block)
    return path


def test_a_gzip_bomb_is_refused_and_a_real_gzip_trace_reads_under_1_gb(tmp_path):
    (tmp_path / "bomb").mkdir()
    bomb = _gzip_bomb(tmp_path / "bomb" / "r0.json.gz", 2048)
    assert bomb.stat().st_size < 3 << 20
    r = run_capped(READ.format(d=str(tmp_path / "bomb")), GIB)
    assert r.returncode == 0, r.stderr[-1500:]
    assert "r0.json.gz: over" in r.stdout and "decompressed" in r.stdout, r.stdout
    print("2 GB gzip bomb refused in", r.stdout.split()[0], "s")
    real = tmp_path / "real"
    real.mkdir()
    for rank in (0, 1):
        with gzip.open(real / f"r{rank}.json.gz", "wt") as f:
            json.dump(_doc(rank, 2, _steps(20, 10)), f)
    r = run_capped(READ.format(d=str(real)), GIB)
    assert r.returncode == 0, r.stderr[-1500:]
    assert r.stdout.split()[1:3] == ["2", "[]"], r.stdout


def _summary_file(d: Path, world: int = 1 << 20, iterations: int = 2000, spans: bool = False) -> Path:
    """A rank file whose header says rank 0 of `world`, ending in a valid summary block of `iterations` (or, with
    `spans`, holding that many real step spans instead)."""
    header = {"rank": 0, "world": world, "coord": [0, 0, 0], "topo": [1, 1, world]}
    rec = np.zeros(iterations if spans else 1, fmt.RECORD)
    rec["ts"], rec["dur"], rec["it"] = np.arange(len(rec)) * 1000, 900, np.arange(len(rec))
    rec["cat"], rec["gid"], rec["peer"], rec["seq"] = fmt.CAT_INDEX["step"], -1, -1, -1
    summary = None if spans else rank_summary.encode(
        {"rank": 0, "world": world, "coord": [0, 0, 0], "topo": [1, 1, world], "iters": np.arange(iterations),
         "work": np.ones(iterations), "host": np.ones(iterations), "p2p": np.zeros(4), "coll": np.zeros(3),
         "peer_up": -1, "opened": 0, "spans": 1, "dropped": 0})
    d.mkdir(parents=True, exist_ok=True)
    fmt.write_rank_file(d / "rank00000.mst", header, ["step"], [], rec, summary=summary)
    return d / "rank00000.mst"


def _scan_capped(argv: list[str]) -> subprocess.CompletedProcess:
    code = ("import sys\nfrom megatronapp.cli import main\n"
            f"try:\n    rc = main({argv!r})\nexcept SystemExit as e:\n    rc = e.code\n"
            "print('rc', rc, file=sys.stderr)\nprint('took', round(time.monotonic() - t0, 2), file=sys.stderr)\n")
    return run_capped(code, GIB)


@pytest.mark.parametrize("command", [["detect", "--two-level", "on"], ["heatmap", "--two-level", "on", "-o"]])
def test_a_summary_block_claiming_2000_iterations_of_a_huge_world_is_refused_under_1_gb(tmp_path, command):
    f = _summary_file(tmp_path / "sums")
    assert f.stat().st_size < 60_000
    assert rank_summary.read(str(f))[0] is None and "2000 iterations" in rank_summary.read(str(f))[1]
    argv = ["scan", *command] + ([str(tmp_path / "h.png")] if command[-1] == "-o" else []) + [str(f.parent)]
    r = _scan_capped(argv)
    assert "MemoryError" not in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert "rank00000.mst: a summary claims a world of 1048576 ranks over 2000 iterations" in r.stderr, r.stderr
    print(command[0], "of the summary file:", r.stderr.splitlines()[-1])


def test_a_rank_file_with_2000_iterations_of_a_huge_world_is_skipped_and_named(tmp_path):
    f = _summary_file(tmp_path / "spans", spans=True)
    traces, problems = read_traces(f.parent)
    assert traces == [] and any("rank00000.mst" in p and "2000 iterations" in p for p in problems), problems
    for argv in (["scan", "detect", "--two-level", "off", str(f.parent)],
                 ["scan", "detect", "--two-level", "on", str(f.parent)]):
        r = _scan_capped(argv)
        assert "Traceback" not in r.stderr and "2000 iterations" in r.stderr, r.stderr[-2000:]


@pytest.mark.parametrize("bad, field", [
    ({"ts": float("nan")}, "'ts' = nan"), ({"ts": float("inf")}, "'ts' = inf"), ({"ts": 1e17}, "'ts' = 1e+17"),
    ({"dur": float("inf")}, "'dur' = inf"),
    ({"name": "ProfilerStep#" + "9" * 30, "cat": "user_annotation"}, "step number"),
    ({"name": "gloo:all_reduce", "cat": "user_annotation", "args": {"Seq": 2**70}}, "'Seq'"),
    ({"name": "gloo:all_reduce", "cat": "user_annotation", "args": {"In msg nelems": 1e30}}, "'In msg nelems'"),
])
def test_bad_numbers_in_one_kineto_file_skip_that_rank_named_not_the_directory(tmp_path, bad, field):
    for rank in (0, 2):
        (tmp_path / f"r{rank}.json").write_text(json.dumps(_doc(rank, 3, _steps(3))))
    ev = _steps(3)
    ev.append({**_event("aten::mm", 1.7e15 + 50, 10.0), **bad})
    (tmp_path / "r1.json").write_text(json.dumps(_doc(1, 3, ev), allow_nan=True))
    traces, problems = read_traces(tmp_path)
    assert [t.rank for t in traces] == [0, 2], problems
    text = "\n".join(problems)
    assert "r1.json" in text and field in text, text


def test_deeply_nested_trace_events_are_a_clear_error(tmp_path):
    (tmp_path / "r0.json").write_text(json.dumps(_doc(0, 2, _steps(3))))
    (tmp_path / "r1.json").write_text('{"distributedInfo": {"rank": 1, "world_size": 2}, "traceEvents": '
                                      + "[" * 100_000 + "]" * 100_000 + "}")
    traces, problems = read_traces(tmp_path)
    assert [t.rank for t in traces] == [0] and any("r1.json" in p and "nested" in p for p in problems), problems


def test_the_capped_child_really_fails_an_unbounded_allocation():
    """The harness itself: an allocation past the cap fails in the child (else the tests above could not fail)."""
    r = run_capped("b = bytearray(2 << 30)", GIB)
    assert r.returncode != 0 and "MemoryError" in r.stderr
