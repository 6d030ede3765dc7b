"""The simulator writes readable traces whose delays propagate along real 3D-parallel dependencies."""
import json

import numpy as np
import pytest

from megatronapp.scan.read.format import read_dir
from megatronapp.scan.synth.simulate import Fault, one_f_one_b, parse_fault, simulate, task_order


def _by_name(t, name):
    return t.name == t.name_id(name)


def test_1f1b_order_and_global_order_respect_dependencies():
    orders = one_f_one_b(4, 6)
    assert orders[3][:2] == [("F", 0), ("B", 0)]  # last stage: no warm-up
    assert [k for k, _ in orders[0][:4]] == ["F", "F", "F", "F"]  # stage 0 warms up pp-1 forwards, then 1F1B
    done = set()
    for s, kind, j in task_order(4, 6):
        if kind == "F" and s > 0:
            assert (s - 1, "F", j) in done
        if kind == "B" and s < 3:
            assert (s + 1, "B", j) in done
        done.add((s, kind, j))
    assert len(done) == 4 * 6 * 2


def test_parse_fault_forms_and_errors():
    assert parse_fault("slow-link=17-18") == Fault("slow-link", (17, 18), factor=3.0)
    assert parse_fault("slow-compute=5:1.3") == Fault("slow-compute", (5,), factor=1.3)
    assert parse_fault("pause=3:40:2") == Fault("pause", (3,), ms=40.0, every=2)
    assert parse_fault("late-arrival=2:7").ms == 7.0
    with pytest.raises(ValueError, match="KIND=ARGS"):
        parse_fault("slow=1")
    with pytest.raises(ValueError, match="RANK:FACTOR"):
        parse_fault("slow-compute=x")


def test_files_matching_and_clock_skew(tmp_path):
    res = simulate(tmp_path, 16, tp=2, pp=2, iterations=2, seed=3)
    traces, problems = read_dir(tmp_path)
    assert problems == [] and len(traces) == 16 and res.dp == 4
    truth = json.loads((tmp_path / "ground_truth.json").read_text())
    assert truth["faults"] == [] and len(truth["offsets_ns"]) == 16
    t5 = traces[5]
    assert t5.coord == (2, 0, 1) and t5.topo == (2, 2, 4)
    # Each P2P send has exactly one recv on the peer with the same sequence number.
    sends = {(t.rank, int(p), int(s)) for t in traces for p, s in zip(t.peer[_by_name(t, "send")],
                                                                        t.seq[_by_name(t, "send")])}
    recvs = {(int(p), t.rank, int(s)) for t in traces for p, s in zip(t.peer[_by_name(t, "recv")],
                                                                        t.seq[_by_name(t, "recv")])}
    assert sends == recvs and sends
    # Members of one collective leave it together in true time: end - offset agrees across the group.
    ar = [(t.ts + t.dur - truth["offsets_ns"][t.rank])[_by_name(t, "all_reduce") & (t.seq == 0)
                                                      & (t.gid == t.groups.index(("tp", (4, 5))))]
          for t in traces[4:6]]
    assert abs(int(ar[0][0]) - int(ar[1][0])) < 50_000
    # ... while the local clocks differ by far more (hosts booted at different times).
    assert abs(truth["offsets_ns"][0] - truth["offsets_ns"][8]) > 1_000_000


def test_slow_rank_delays_tp_peers_next_stage_and_dp_group(tmp_path):
    healthy, slow = tmp_path / "h", tmp_path / "s"
    # dp=2 tp=2 pp=2: rank 0 is (dp0, pp0, tp0); 1 its TP peer, 4 the next stage, 2/3 the other replica.
    simulate(healthy, 8, tp=2, pp=2, iterations=3, seed=1)
    simulate(slow, 8, tp=2, pp=2, iterations=3, seed=1, faults=["slow-compute=0:2.0"])
    h, _ = read_dir(healthy)
    s, _ = read_dir(slow)

    def comm_wait(t, name, group=None):
        m = _by_name(t, name)
        if group:
            m &= np.isin(t.gid, [i for i, g in enumerate(t.groups) if g[0] == group])
        return t.dur[m].sum()

    # TP peer waits in the all-reduce; the next stage waits in recv; the other replica waits in the DP reduce.
    assert comm_wait(s[1], "all_reduce", "tp") > 2 * comm_wait(h[1], "all_reduce", "tp")
    assert comm_wait(s[4], "recv") > 2 * comm_wait(h[4], "recv")
    assert comm_wait(s[2], "all_reduce", "dp") > 2 * comm_wait(h[2], "all_reduce", "dp")
    # The slow rank itself waits less in its TP all-reduce than its peer does.
    assert comm_wait(s[0], "all_reduce", "tp") < comm_wait(s[1], "all_reduce", "tp")


def test_bad_grid_and_link_are_user_errors(tmp_path):
    with pytest.raises(ValueError, match="multiple of tp\\*pp"):
        simulate(tmp_path, 10, tp=4, pp=2)
    with pytest.raises(ValueError, match="share no TP, DP"):
        simulate(tmp_path, 16, tp=2, pp=2, faults=["slow-link=0-15"])
    with pytest.raises(ValueError, match="outside a world"):
        simulate(tmp_path, 8, tp=2, pp=2, faults=["slow-compute=99:1.5"])


def test_resimulating_into_a_directory_overwrites_in_place_and_removes_only_stale_ranks(tmp_path):
    """A second job in the same directory: files of its ranks are rewritten (same inodes: no search past freshly
    deleted ones, which ext4 without a journal makes slow), files of ranks it does not have are removed, and a file
    with another hard link (a `cp -al` backup) or a symlink is replaced, never written through."""
    import os

    d, backup = tmp_path / "job", tmp_path / "backup"
    simulate(d, 64, 2, 2, iterations=2, seed=1)
    (d / "rank7.mst").write_bytes(b"stale")  # a name this writer never uses
    backup.mkdir()
    os.link(d / "rank00003.mst", backup / "rank00003.mst")
    saved = (backup / "rank00003.mst").read_bytes()
    (tmp_path / "elsewhere.mst").write_bytes(b"not a trace")
    (d / "rank00004.mst").unlink()
    (d / "rank00004.mst").symlink_to(tmp_path / "elsewhere.mst")
    # Held open: were the file deleted and created again, the new one could not get this inode number back.
    fd = os.open(d / "rank00002.mst", os.O_RDONLY)
    try:
        simulate(d, 32, 2, 2, iterations=3, seed=2)
        assert os.fstat(fd).st_ino == (d / "rank00002.mst").stat().st_ino
    finally:
        os.close(fd)
    assert sorted(p.name for p in d.glob("rank*.mst")) == [f"rank{r:05d}.mst" for r in range(32)]
    assert (backup / "rank00003.mst").read_bytes() == saved  # the other link kept the first job's file
    assert (tmp_path / "elsewhere.mst").read_bytes() == b"not a trace" and not (d / "rank00004.mst").is_symlink()
    traces, problems = read_dir(d)
    assert problems == [] and len(traces) == 32 and {t.world for t in traces} == {32}
