"""PyTorch profiler (Kineto) traces in: `scan detect`, `aggregate`, `heatmap` and `summary` read a directory of
torch.profiler Chrome traces. Real traces are recorded here, in one launch of 3 gloo ranks (benchmarks/kinetojob.py)
running six jobs in turn: DDP and FSDP2, each healthy, with a rank that computes slowly, and with a rank that stalls
before every micro-batch (sleeping on I/O or spinning on CPU-bound input preparation); the faulty rank differs
from job to job. Assertions are about WHO and WHAT, never timings. The reader's edges (gzip,
several files per rank, bad files, the size limit, a GPU trace's NCCL kernels as in the public HTA samples) are
checked on small files written here."""
from __future__ import annotations

import argparse
import functools
import gzip
import json
import tempfile
from pathlib import Path

import numpy as np
from benchmarks.kinetojob import REPEAT, job

from megatronapp.launch import spawn
from megatronapp.scan import cli
from megatronapp.scan.detect.analysis import detect
from megatronapp.scan.detect.table import join, phases
from megatronapp.scan.read.kineto import read_kineto_dir
from megatronapp.scan.read.traces import read_traces
from tests.tmpdirs import session_dir

# 3 ranks: each judged against two peers. Every size has its failure under a load of 20-30 on the 2-core machine
# (docs/megascan.md, Kineto): 2 ranks judge a stall against its own jitter, 4 share the cores two to one.
WORLD = 3
RUNS = [("healthy-fsdp", "fsdp", None, -1), ("slow-fsdp", "fsdp", "slow", 2), ("stall-fsdp", "fsdp", "stall", 1),
        ("healthy-ddp", "ddp", None, -1), ("slow-ddp", "ddp", "slow", 0), ("decode-ddp", "ddp", "decode", 2)]
KIND = {"slow": "slow-compute", "stall": "late-arrival", "decode": "late-arrival"}


@functools.lru_cache(maxsize=1)
def _recorded() -> Path:
    out = session_dir("megascan-kineto-")
    spawn(job, WORLD, str(out), RUNS)
    return out


def _waits(out: Path, run: str) -> list[float]:
    """Each rank's wait for a core in `run`, ms per step (benchmarks/kinetojob.py)."""
    return [json.loads((out / f"{run}.rank{r}.cpuwait.json").read_text())["run_queue_ms_per_step"]
            for r in range(WORLD)]


def _starved(out: Path, run: str, f) -> bool:  # noqa: ANN001
    """Whether a slow-compute finding of a healthy run is the host's doing: its one rank waited for a core longer
    than every peer by at least half the compute it is said to have lost per iteration."""
    if f.kind != "slow-compute" or len(f.ranks) != 1:
        return False
    lost = f.evidence.get("floor_ms_per_iteration", 0.0) - f.evidence.get("peer_floor_ms_per_iteration", 0.0)
    waits = _waits(out, run)
    (r,) = f.ranks
    return lost > 0 and all(waits[r] - w >= lost / 2 for i, w in enumerate(waits) if i != r)


def _main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    cli.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(argv)
    return args.func(args)


def test_real_profiler_traces_name_the_faulty_rank_first_and_nothing_persistent_on_healthy_jobs():
    out = _recorded()
    for run, kind, fault, bad in RUNS:
        traces, problems = read_traces(out / run)
        assert problems == [] and [t.rank for t in traces] == list(range(WORLD)), (run, problems)
        for t in traces:  # two profiling windows per rank, merged; steps and both kinds of spans mapped
            assert len(t.header["files"]) == REPEAT and t.header["source"] == "kineto"
            names = set(np.array(t.names)[t.name].tolist())
            # DDP's loop marks forward and backward; FSDP2's marks nothing: FSDP's own annotations and aten ops
            want = {"ddp": {"all_reduce", "forward", "backward"},
                    "fsdp": {"all_gather", "all_reduce", "FSDP::pre_forward (1)", "aten::linear"}}[kind]
            assert want | {"step"} <= names, (run, names)
        rep = detect(traces)
        if fault is None:
            # Nothing persistent. A process descheduled for 8-40 ms between the DDP loop's `forward` and `backward`
            # (nothing else runs there) reads as a one-iteration pause at c 0.70 on a loaded host: a profiler trace
            # records no CPU wait to tell it from a real pause (docs/megascan.md, Kineto). Only that may stand.
            odd = [f for f in rep.findings if f.kind != "transient-pause" or len(f.evidence.get("iterations", [])) != 1
                   or f.confidence > 0.7]
            # A rank the host starved for the whole run computes slower on a CPU, and is slower: a slow-compute
            # finding is then true, and excused only where the rank's measured wait for a core explains it (seen once
            # at load 24: rank 0 at 1.43x). A finding the waits do not explain stays a false alarm.
            odd = [f for f in odd if not _starved(out, run, f)]
            assert odd == [], (run, rep.to_text(), _waits(out, run))
            continue
        assert rep.findings, (run, rep.to_text())
        top = rep.findings[0]
        assert top.ranks == (bad,) and top.kind == KIND[fault], (run, rep.to_text())


def test_collectives_match_across_ranks_with_group_size_and_instance_number():
    traces, _ = read_traces(_recorded() / "slow-ddp")
    inst = []
    for t in traces:
        comm = (t.gid >= 0) & (t.seq >= 0)
        assert comm.any()
        assert t.groups[int(t.gid[comm][0])] == ("pg0", tuple(range(WORLD)))
        assert (t.nbytes[comm] > 0).all()  # from the annotation's input dims
        inst.append(sorted(zip(t.seq[comm].tolist(), np.array(t.names)[t.name[comm]].tolist())))
    assert all(i == inst[0] for i in inst)


def test_cli_views_accept_a_profiler_trace_directory(tmp_path, capsys):
    d = str(_recorded() / "slow-ddp")  # DDP's traces are the smaller: each view reads them again
    assert _main(["scan", "detect", d, "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["world"] == WORLD and rep["findings"][0]["ranks"] == [0]
    assert _main(["scan", "summary", d]) == 0
    assert "slow-compute" in capsys.readouterr().out
    assert _main(["scan", "heatmap", d, "-o", str(tmp_path / "heat.html")]) == 0
    assert (tmp_path / "heat.html").stat().st_size > 0
    capsys.readouterr()
    assert _main(["scan", "aggregate", d, "-o", str(tmp_path / "all.json"), "--only-flagged", "--json"]) == 0
    agg = json.loads(capsys.readouterr().out)
    assert 0 in agg["written_ranks"], agg
    assert json.loads((tmp_path / "all.json").read_text())["traceEvents"]


def _trace(rank: int, world: int, events: list[dict], **info) -> dict:
    return {"schemaVersion": 1, "distributedInfo": {"backend": "nccl", "rank": rank, "world_size": world, **info},
            "traceEvents": events}


def _gpu_events(rank: int, slow: float) -> list[dict]:
    """Two steps of a GPU trace in the layout of the public HTA samples: ProfilerStep on the CPU, a compute kernel
    and an NCCL all-reduce kernel whose args carry the collective name, size, dtype and process group."""
    ev, t = [], 1000.0
    for step in (1, 2):
        ev.append({"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{step}", "pid": 1, "tid": 1,
                   "ts": t, "dur": 900.0})
        ev.append({"ph": "X", "cat": "kernel", "name": "sm90_xmma_gemm_bf16(int)", "pid": 0, "tid": 7,
                   "ts": t + 10, "dur": 300.0 * slow})
        ev.append({"ph": "X", "cat": "kernel", "name": "ncclKernel_AllReduce_RING_LL_Sum_float(ncclDevComm*)",
                   "pid": 0, "tid": 40, "ts": t + 20 + 300 * slow, "dur": 50.0,
                   "args": {"Collective name": "allreduce", "In msg nelems": 1024, "Out msg nelems": 1024,
                            "Group size": 2, "dtype": "Float", "Process Group Name": "0",
                            "Process Group Description": "default_pg", "Process Group Ranks": "[0, 1]"}})
        ev.append({"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 1, "tid": 1, "ts": t + 5, "dur": 5.0})
        t += 1000.0
    return ev


def test_gpu_trace_maps_nccl_kernels_and_bad_files_are_named_and_skipped(tmp_path):
    (tmp_path / "rank-0.json").write_text(json.dumps(_trace(0, 3, _gpu_events(0, 1.0))))
    with gzip.open(tmp_path / "rank-1.json.gz", "wt") as f:
        json.dump(_trace(1, 3, _gpu_events(1, 1.0)), f)
    (tmp_path / "notes.json").write_text("{not json")
    (tmp_path / "single.json").write_text(json.dumps({"traceEvents": []}))  # profiled outside torch.distributed
    (tmp_path / "big.json").write_text(json.dumps(_trace(2, 3, _gpu_events(2, 1.0))) + " " * 4096)
    traces, problems = read_kineto_dir(tmp_path, max_bytes=3000)
    assert [t.rank for t in traces] == [0, 1]
    text = "\n".join(problems)
    for name in ("notes.json: not JSON", "single.json: no distributedInfo", "big.json:", "ranks [2]"):
        assert name in text, text
    t = traces[0]
    names = np.array(t.names)[t.name]
    comm = names == "allreduce"
    assert comm.sum() == 2 and (t.nbytes[comm] == 4096).all() and t.groups == [("pg0", (0, 1))]
    assert sorted(t.seq[comm].tolist()) == [1_000_000, 2_000_000]  # step 1 and 2, first of each
    assert "aten::mm" not in names  # a GPU job's time is on the device; CPU ops are launches
    assert t.header["device"] and sorted(set(t.it[t.cat == 5].tolist())) == [1, 2]


def test_a_file_without_profiler_steps_is_named():
    with tempfile.TemporaryDirectory() as d:
        ev = [e for e in _gpu_events(0, 1.0) if not e["name"].startswith("ProfilerStep")]
        (Path(d) / "r0.json").write_text(json.dumps(_trace(0, 1, ev)))
        traces, problems = read_traces(d)
        assert traces == [] and "no ProfilerStep#N" in problems[0], problems


def test_a_missing_directory_is_a_clear_error_not_a_traceback(tmp_path):
    import pytest

    with pytest.raises(SystemExit, match="does not exist"):
        _main(["scan", "detect", str(tmp_path / "nowhere")])


def _cpu_events() -> list[dict]:
    """One step of a CPU (gloo) FSDP trace, in µs: the main thread (tid 1) waits in `FSDP::all_gather` for the
    all-gather gloo runs on its worker thread (tid 9), computes an `aten::mm` while an all-reduce runs on the
    worker, then waits in `FSDP::post_backward_reduce` for that all-reduce's last 100 µs."""
    def x(name: str, cat: str, tid: int, ts: float, dur: float, **args) -> dict:
        return {"ph": "X", "cat": cat, "name": name, "pid": 5, "tid": tid, "ts": ts, "dur": dur, "args": args}

    return [x("ProfilerStep#1", "user_annotation", 1, 0, 1000),
            x("FSDP::all_gather (0)", "user_annotation", 1, 10, 390),
            x("c10d::_allgather_base_", "cpu_op", 1, 20, 10),
            x("gloo:all_gather", "user_annotation", 9, 25, 365, **{"Input Dims": [[1024]]}),
            x("aten::select", "cpu_op", 9, 385, 3),  # the collective's own copy, on its worker thread
            x("aten::mm", "cpu_op", 1, 400, 300),
            x("gloo:all_reduce", "user_annotation", 9, 450, 350, **{"Input Dims": [[2048]]}),
            x("FSDP::post_backward_reduce (0)", "user_annotation", 1, 700, 200)]


def test_cpu_trace_waits_are_stretches_with_no_op_while_a_collective_runs(tmp_path):
    """Waiting is where the thread runs no op while a collective is in flight; an op overlapping a collective
    (compute overlapped with an async all-reduce) stays compute, and the worker thread's ops are not the rank's."""
    pgs = [{"pg_name": "0", "ranks": [0, 1]}]
    for r in (0, 1):
        (tmp_path / f"r{r}.json").write_text(json.dumps(_trace(r, 2, _cpu_events(), backend="gloo", pg_config=pgs)))
    traces, problems = read_traces(tmp_path)
    assert problems == [], problems
    t = traces[0]
    names = np.array(t.names)[t.name]
    assert "aten::select" not in names
    flight = names == "in flight"
    got = sorted(zip((t.ts[flight] - t.ts[names == "step"][0]).tolist(), t.dur[flight].tolist()))
    # ns: [25, 30) in the all-gather's launch once it runs, [30, 390) blocked after it, [700, 800) in the reduce
    assert got == [(25_000, 5_000), (30_000, 360_000), (700_000, 100_000)], got
    ph = phases(join(traces))
    # work spans 390 + 300 + 200 µs, less the 465 µs waited: 0.425 ms of compute on each rank
    assert np.allclose(ph.compute, 0.425), ph.compute
