"""Columnar reading at scale: read_dir's column store, join without a second copy, release of the traces' columns.

The table must be the same whichever path built it (store views, separate arrays, ranks out of file order)."""
import dataclasses
import shutil

import numpy as np

from megatronapp.scan.detect.analysis import detect
from megatronapp.scan.detect.table import join, phases, rank_chunks
from megatronapp.scan.read.format import COLUMNS, rank_file, read_dir, read_rank
from megatronapp.scan.synth.simulate import simulate

TABLE_COLUMNS = ("rank", "name", "cat", "ts", "dur", "it", "gkey", "seq", "peer", "nbytes", "mb", "chunk")


def _same_table(a, b):
    assert a.world == b.world and a.names == b.names and a.groups == b.groups
    for k in TABLE_COLUMNS:
        assert np.array_equal(getattr(a, k), getattr(b, k)), k


def test_read_dir_traces_share_one_store_and_join_takes_it_without_a_copy(tmp_path):
    simulate(tmp_path, 32, 2, 4, iterations=3, faults=["slow-compute=13:1.3"], seed=1)
    traces, problems = read_dir(tmp_path)
    assert problems == []
    # Each trace's columns are consecutive views of one array per column, in rank order.
    assert all(t.ts.base is traces[0].ts.base for t in traces)
    apart = [read_rank(rank_file(tmp_path, t.rank)) for t in traces]  # the same files, each its own arrays
    for t, u in zip(traces, apart):
        for c in COLUMNS:
            assert np.array_equal(getattr(t, c), getattr(u, c)) and getattr(t, c).dtype == getattr(u, c).dtype, c
    tb = join(traces)
    assert np.shares_memory(tb.ts, traces[0].ts) and np.shares_memory(tb.dur, traces[-1].dur)
    _same_table(tb, join(apart))
    assert tb.cat.dtype == np.int8 and tb.ts.dtype == np.int64 and tb.peer.dtype == np.int64


def test_release_empties_the_traces_columns_and_changes_no_verdict(tmp_path):
    simulate(tmp_path, 32, 2, 4, iterations=5, faults=["slow-link=10-18:1.5", "slow-compute=3:1.3"], seed=2)
    kept, _ = read_dir(tmp_path)
    released, _ = read_dir(tmp_path)
    want = detect(kept).to_json()
    assert detect(released, release_traces=True).to_json() == want
    assert all(len(t) == 0 and len(t.cpu_wait) == 0 for t in released)
    assert all(t.header and t.names for t in released)  # headers and tables stay: only the spans go
    assert detect(kept).to_json() == want  # without release the traces are untouched and reusable


def test_ranks_out_of_file_order_and_a_duplicate_file_join_the_same_table(tmp_path):
    src, mixed = tmp_path / "a", tmp_path / "b"
    simulate(src, 16, 2, 2, iterations=3, faults=[], seed=3)
    mixed.mkdir()
    for f in src.iterdir():
        shutil.copy(f, mixed / f.name)
    # Rank 5's file under the name of rank 99 (sorted after every other), and a second copy of rank 2.
    (mixed / "rank00005.mst").rename(mixed / "rank00099.mst")
    shutil.copy(src / "rank00002.mst", mixed / "rank00098.mst")
    a, _ = read_dir(src)
    b, problems = read_dir(mixed)
    assert any("claims rank 2" in p for p in problems)
    assert [t.rank for t in b] == list(range(16))
    _same_table(join(a), join(b))


def test_per_rank_ranges_hold_whole_ranks_and_give_the_same_phases(tmp_path):
    simulate(tmp_path, 32, 2, 4, iterations=3, faults=["pause=9:20:2"], seed=4)
    traces, _ = read_dir(tmp_path)
    tb = join(traces)
    chunks = rank_chunks(tb, rows=500)
    assert len(chunks) > 4 and chunks[0][0] == 0 and chunks[-1][1] == len(tb.ts)
    assert all(b == c for (_, b), (c, _) in zip(chunks, chunks[1:]))
    assert all(tb.rank[a] != tb.rank[a - 1] for a, _ in chunks[1:])  # no rank split between two ranges
    whole = phases(tb)
    import megatronapp.scan.detect.table as table
    old = table._CHUNK_ROWS
    try:
        table._CHUNK_ROWS = 500
        small = phases(dataclasses.replace(tb))
    finally:
        table._CHUNK_ROWS = old
    for k in ("compute", "data", "gap", "comm", "window", "excl"):
        assert np.array_equal(getattr(whole, k), getattr(small, k), equal_nan=True), k


def test_waits_summed_range_by_range_equal_one_pass(tmp_path, monkeypatch):
    import megatronapp.scan.detect.table as table
    simulate(tmp_path, 32, 2, 4, iterations=4, faults=["late-arrival=22:8", "slow-link=10-18:1.5"], seed=5)
    traces, _ = read_dir(tmp_path)
    want = detect(traces).to_json()
    monkeypatch.setattr(table, "_CHUNK_ROWS", 300)
    assert len(rank_chunks(join(traces))) > 8
    assert detect(traces).to_json() == want
