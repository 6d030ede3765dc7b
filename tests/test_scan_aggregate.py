"""Merged Chrome trace: validated against the trace event format rules, clocks aligned, bad files named."""
from __future__ import annotations

import gzip
import json
import shutil
from collections import Counter

import pytest

from megatronapp.scan.aggregate import aggregate
from tests.test_scan_tracer import TRACED, traced_job


def _check_chrome_trace(doc: dict) -> list[dict]:
    """The rules a viewer relies on; returns the events."""
    events = doc["traceEvents"]
    assert isinstance(events, list) and events
    pids = {e["pid"] for e in events if e["ph"] == "X"}
    names = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert pids <= set(names)
    for e in events:
        assert e["ph"] in ("X", "M", "s", "f")
        if e["ph"] == "X":
            assert isinstance(e["ts"], float | int) and isinstance(e["dur"], float | int) and e["dur"] >= 0
            assert isinstance(e["name"], str) and "tid" in e
    starts = Counter(e["id"] for e in events if e["ph"] == "s")
    ends = Counter(e["id"] for e in events if e["ph"] == "f")
    assert starts == ends and set(starts.values()) == {1}
    assert all(e.get("bp") == "e" for e in events if e["ph"] == "f")
    # Each flow endpoint lies inside an X slice of its (pid, tid), so the viewer can bind it.
    slices: dict[tuple, list] = {}
    for e in events:
        if e["ph"] == "X":
            slices.setdefault((e["pid"], e["tid"]), []).append((e["ts"], e["ts"] + e["dur"]))
    for e in events:
        if e["ph"] in ("s", "f"):
            assert any(a <= e["ts"] <= b for a, b in slices[(e["pid"], e["tid"])]), e
    return events


def test_merged_trace_is_valid_and_aligned(tmp_path):
    out, _ = traced_job()
    report = aggregate(out, tmp_path / "merged.json.gz")
    assert report["problems"] == [] and report["ranks"] == [0, 1, 2, 3] and report["flows"] > 0
    with gzip.open(tmp_path / "merged.json.gz", "rt") as f:
        events = _check_chrome_trace(json.load(f))
    meta = [e for e in events if e["ph"] == "M"]
    labels = {e["pid"]: e["args"]["name"] for e in meta if e["name"] == "process_name"}
    assert labels == {0: "DP0-PP0-TP0 (rank 0)", 1: "DP0-PP0-TP1 (rank 1)", 2: "DP1-PP0-TP0 (rank 2)",
                      3: "DP1-PP0-TP1 (rank 3)"}
    sort = {e["pid"]: e["args"]["sort_index"] for e in meta if e["name"] == "process_sort_index"}
    assert sorted(sort, key=sort.get) == [0, 1, 2, 3]  # pp, then dp, then tp
    threads = {(e["pid"], e["args"]["name"]) for e in meta if e["name"] == "thread_name"}
    assert (0, "compute") in threads and (3, "comm") in threads
    xs = [e for e in events if e["ph"] == "X"]
    assert Counter(e["name"] for e in xs)["step"] == 4 * len(TRACED)
    # Aligned: the skews were +/-50 ms, but the ends of one collective instance now agree within 1 ms.
    ends: dict[tuple, list] = {}
    for e in xs:
        a = e["args"]
        if e["name"] == "all_reduce" and "peer" not in a:
            member_of = {"tp": e["pid"] // 2, "dp": e["pid"] % 2}.get(a["group"], 0)  # which tp/dp group
            ends.setdefault((a["group"], member_of, a["seq"]), []).append(e["ts"] + e["dur"])
    spread = sorted(max(v) - min(v) for v in ends.values() if len(v) > 1)
    assert spread and spread[len(spread) // 2] < 1000.0  # microseconds
    # Plain JSON output too, with given offsets (no estimate): skews stay visible.
    rep2 = aggregate(out, tmp_path / "raw.json", offsets={0: 0, 1: 0, 2: 0, 3: 0})
    assert rep2["offsets_ns"] == {0: 0, 1: 0, 2: 0, 3: 0}
    _check_chrome_trace(json.loads((tmp_path / "raw.json").read_text()))


def test_missing_and_corrupt_files_named(tmp_path):
    out, _ = traced_job()
    d = tmp_path / "trace"
    shutil.copytree(out, d)
    (d / "rank00002.mst").unlink()
    data = (d / "rank00003.mst").read_bytes()
    (d / "rank00003.mst").write_bytes(data[: len(data) // 2])
    (d / "rank00001.mst").write_bytes(b"\x00" * 100)
    report = aggregate(d, tmp_path / "m.json")
    text = "\n".join(report["problems"])
    assert "rank00002.mst" in text and "rank00001.mst" in text and "rank00003.mst truncated" in text
    assert report["ranks"] == [0, 3]
    events = _check_chrome_trace(json.loads((tmp_path / "m.json").read_text()))
    assert {e["pid"] for e in events if e["ph"] == "X"} == {0, 3}


def test_only_flagged_writes_the_culprit_and_its_peers(tmp_path):
    from megatronapp.scan.aggregate import with_peers
    from megatronapp.scan.read.format import read_dir
    from megatronapp.scan.synth.simulate import simulate

    # tp 2, pp 4, dp 8; rank = tp + 2 * (dp + 8 * pp). Rank 21 is (dp 2, pp 1, tp 1).
    simulate(tmp_path / "t", 64, 2, 4, faults=["slow-compute=21:1.3"], seed=3)
    report = aggregate(tmp_path / "t", tmp_path / "f.json", only_flagged=True)
    assert any("rank 21" in f for f in report["findings"])
    # TP peer 20, stages 0 and 2 of the column (5, 37), DP ring neighbours dp 1 and 3 (19, 23).
    assert report["written_ranks"] == [5, 19, 20, 21, 23, 37] and len(report["ranks"]) == 64
    events = _check_chrome_trace(json.loads((tmp_path / "f.json").read_text()))
    assert {e["pid"] for e in events} == set(report["written_ranks"])
    assert report["flows"] > 0  # arrows between written ranks only (checked: every flow binds to a slice)
    # The DP ring wraps: replica 0's neighbours are replicas 7 and 1.
    traces, _ = read_dir(tmp_path / "t")
    assert with_peers([0], traces) == [0, 1, 2, 14, 16]
    # An explicit selection, and a rank that has no trace.
    rep = aggregate(tmp_path / "t", tmp_path / "r.json", ranks=[0, 1])
    assert rep["written_ranks"] == [0, 1]
    _check_chrome_trace(json.loads((tmp_path / "r.json").read_text()))
    with pytest.raises(ValueError, match="no readable trace"):
        aggregate(tmp_path / "t", tmp_path / "x.json", ranks=[64])


def test_only_flagged_on_a_healthy_run_writes_no_rank(tmp_path):
    from megatronapp.scan.aggregate import parse_ranks
    from megatronapp.scan.synth.simulate import simulate

    simulate(tmp_path / "t", 16, 2, 2, seed=5)
    report = aggregate(tmp_path / "t", tmp_path / "f.json", only_flagged=True)
    assert report["findings"] == [] and report["written_ranks"] == []
    assert json.loads((tmp_path / "f.json").read_text())["traceEvents"] == []
    assert parse_ranks("3,7,10-12") == [3, 7, 10, 11, 12]
    with pytest.raises(ValueError, match="--ranks"):
        parse_ranks("3,x")
