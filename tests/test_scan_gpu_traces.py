"""MegaScan on GPU jobs' own profiler traces: waits split out of NCCL kernels, the cause named, honest reports.

Generated GPU-style Kineto traces (scan/synth/gpu_kineto.py: pp x dp, 1F1B, NCCL kernels with the args of current
PyTorch, launches and flows) carry every fault kind, at varied ranks, sizes and seeds; their format is checked field
by field against the public traces of Holistic Trace Analysis, which are also read here where present
(`python -m benchmarks.hta_traces` fetches them; tests that need them skip otherwise). Assertions are about WHO
and WHAT; the generated jobs are deterministic for a seed."""
from __future__ import annotations

import argparse
import functools
import gzip
import json
import re
from pathlib import Path

import numpy as np
import pytest
from benchmarks import hta_traces

from megatronapp.scan import cli
from megatronapp.scan.detect.analysis import analyse
from megatronapp.scan.detect.gputime import gpu_breakdown
from megatronapp.scan.detect.table import join
from megatronapp.scan.read.kineto import to_rank_trace
from megatronapp.scan.read.kineto_fields import rank_list
from megatronapp.scan.read.kineto_layout import pipeline_layout
from megatronapp.scan.read.traces import read_traces
from megatronapp.scan.summary import rank_rows, summary_table
from megatronapp.scan.synth.gpu_kineto import generate

SMALL = {"iterations": 5, "layers": 1, "microbatches": 4}  # 64 ranks: what keeps a job to a few seconds


def _traces(docs: list[dict]) -> list:
    traces = [to_rank_trace(d["distributedInfo"]["rank"], d["distributedInfo"]["world_size"],
                            [(Path(f"rank{i}.json"), d)]) for i, d in enumerate(docs)]
    traces, problems = pipeline_layout(traces)
    assert problems == [], problems
    return traces


@functools.lru_cache(maxsize=16)
def _analysed(ranks: int, pp: int, faults: tuple[str, ...], seed: int):
    job = generate(ranks, pp, faults=list(faults), seed=seed, **(SMALL if ranks > 8 else {}))
    return analyse(_traces(job.docs))


# What each fault is named as: (kind, ranks).
CASES = [
    (8, 2, "slow-compute=5:1.5", 0, "slow-compute", (5,)),
    (8, 2, "slow-compute=2:2.0", 4, "slow-compute", (2,)),
    (8, 2, "late-arrival=3:8", 1, "late-arrival", (3,)),
    (8, 2, "pause=1:30:2", 2, "transient-pause", (1,)),
    (8, 2, "pause=6:25:3:device", 3, "transient-pause", (6,)),
    (8, 2, "slow-link=1-5:4", 5, "slow-link", (1, 5)),
    (8, 2, "hang=4:3", 6, "hang", (4,)),
    (64, 4, "slow-compute=37:1.3", 3, "slow-compute", (37,)),
    (64, 4, "late-arrival=12:6", 7, "late-arrival", (12,)),
    (64, 4, "pause=3:20:2", 8, "transient-pause", (3,)),
    (64, 4, "slow-link=20-36:3", 9, "slow-link", (20, 36)),
    (64, 4, "hang=50:2", 10, "hang", (50,)),
]


@pytest.mark.parametrize("ranks,pp,fault,seed,kind,who", CASES, ids=[c[2] + f"@{c[0]}" for c in CASES])
def test_each_injected_cause_is_named_first_and_nothing_else_is_sure(ranks, pp, fault, seed, kind, who):
    rep = _analysed(ranks, pp, (fault,), seed).report
    assert rep.findings, rep.to_text()
    top = rep.findings[0]
    assert (top.kind, top.ranks) == (kind, who), rep.to_text()
    others = [f for f in rep.findings[1:] if f.confidence >= 0.5]
    assert others == [], rep.to_text()
    if kind == "slow-compute":  # the size is what was injected
        assert top.factor == pytest.approx(float(fault.split(":")[1]), rel=0.15), rep.to_text()


@pytest.mark.parametrize("ranks,pp,seed", [(8, 2, 11), (8, 2, 12), (64, 4, 13)])
def test_healthy_generated_jobs_report_nothing(ranks, pp, seed):
    rep = _analysed(ranks, pp, (), seed).report
    assert rep.findings == [] and rep.ranks == ranks, rep.to_text()


def test_victims_waits_fill_the_summary_and_the_host_or_device_is_named():
    an = _analysed(8, 2, ("slow-compute=5:1.5",), 0)
    rows = {r["rank"]: r for r in rank_rows(an)}
    # Rank 5's DP peers (stage 1: ranks 4-7) wait for it in the gradient all-reduce; it waits least and caused most.
    assert all(rows[p]["waited"] > rows[5]["waited"] for p in (4, 6, 7)), rows
    assert max(rows, key=lambda r: rows[r]["others waited"]) == 5, rows
    text = summary_table(an)
    assert "GPU time" in text and "waits are inside the NCCL kernels" in text
    assert "the device" in an.report.findings[0].evidence["late"]
    late = _analysed(8, 2, ("late-arrival=3:8",), 1).report.findings[0]
    assert late.evidence["late"].startswith("the host")
    device_pause = _analysed(8, 2, ("pause=6:25:3:device",), 3).report.findings[0]
    host_pause = _analysed(8, 2, ("pause=1:30:2",), 2).report.findings[0]
    assert device_pause.evidence["late"].startswith("the device") and host_pause.evidence["late"].startswith("the host")


def test_text_report_lines_fit_and_list_at_most_five_ops():
    for case in CASES[:4]:
        rep = _analysed(case[0], case[1], (case[2],), case[3]).report
        text = rep.to_text()
        lines = text.splitlines()
        assert max(len(line) for line in lines) <= 120, text
        heads = [i for i, line in enumerate(lines) if "top ops by excess" in line]
        assert heads, text
        for i in heads:  # the op lines under each header: at most five
            ops = [x for x in lines[i + 1:i + 8] if re.match(r"^ +-?\d+\.\d+x ", x)]
            assert 1 <= len(ops) <= 5, text
        assert "Flash_fwd_kernel_traits" not in text  # template arguments elided
        assert all(len(f.evidence["ops"]) >= len(f.evidence["top_ops"]) for f in rep.findings)  # JSON keeps all
    slow = _analysed(8, 2, ("slow-compute=5:1.5",), 0).report.to_text()
    assert "5 of 7" in slow and "flash::flash_fwd_kernel<...>" in slow, slow


def test_instances_match_by_seq_or_by_order_and_disagreement_is_reported():
    job = generate(8, 2, faults=["slow-compute=2:1.5"], seed=4)
    by_seq = _traces(job.docs)
    assert {t.header["seq_source"] for t in by_seq} == {"Seq"}
    for d in job.docs:  # an older PyTorch: no sequence numbers anywhere
        for e in d["traceEvents"]:
            (e.get("args") or {}).pop("Seq", None)
    by_order = _traces(job.docs)
    assert {t.header["seq_source"] for t in by_order} == {"order"}
    a, b = analyse(by_seq), analyse(by_order)
    assert np.allclose(a.waits.waited, b.waits.waited, atol=0.01) and b.report.findings[0].ranks == (2,)
    # Rank 1 traced one all-reduce more (its window began a call earlier): the order shifts, and sizes disagree.
    doc = job.docs[1]
    ar = [e for e in doc["traceEvents"] if e.get("cat") == "kernel" and "AllReduce" in e["name"]]
    extra = json.loads(json.dumps(ar[0]))
    extra["ts"] -= 5000.0
    extra["args"]["In msg nelems"] = 7
    extra["args"]["correlation"] = -1
    doc["traceEvents"].append(extra)
    rep = analyse(_traces(job.docs)).report
    assert any("differ across ranks in op or size" in n for n in rep.notes), rep.notes


def test_truncated_group_ranks_are_rebuilt_where_evenly_spaced():
    cut = "[0, 16, 32, 48, 64, 80, 96, 112, 128, 144, 160, 176, 192, 208, 224, 240, 256, 272, 288, 304, 320, 336, " \
          "352, 368, 384, 400, 416, 432, 448, ..., 1008]"
    assert rank_list(cut, size=64, start=0, stride=16) == tuple(range(0, 1024, 16))
    assert rank_list(cut) is None and rank_list(cut, size=64, start=1, stride=16) is None
    assert rank_list("[3, 5]") == (3, 5) and rank_list("[3, -1]") is None and rank_list("not json") is None


def test_a_partial_world_and_few_iterations_are_said():
    job = generate(8, 2, faults=["pause=1:40:1"], seed=2, iterations=2)
    one = analyse(_traces(job.docs[:1]))
    assert one.report.findings == [] and one.report.nothing_judged and "1 of 8 ranks" in one.report.to_text()
    assert "within noise" not in one.report.to_text()
    two = analyse(_traces(job.docs[:2]))  # two ranks of stage 0, two iterations
    text = two.report.to_text()
    assert "2 of 8 ranks, 2 iterations judged" in text and "only 2 iterations judged" in text, text
    assert all(f.confidence <= 0.4 for f in two.report.findings), text


def _main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    cli.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(argv)
    return args.func(args)


def test_cli_reads_generated_gpu_trace_files(tmp_path, capsys):
    generate(8, 2, faults=["slow-compute=6:1.6"], seed=21).write(tmp_path, compress=True)
    assert _main(["scan", "detect", str(tmp_path), "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["findings"][0]["ranks"] == [6] and rep["ranks"] == 8
    assert rep["findings"][0]["evidence"]["top_ops"]  # full names stay in the JSON
    # Clocks of hosts seconds apart, aligned from the collectives that leave together (PyTorch's own op names)
    assert _main(["scan", "detect", str(tmp_path), "--json", "--align"]) == 0
    aligned = json.loads(capsys.readouterr().out)
    assert [(f["kind"], f["ranks"]) for f in aligned["findings"]] == [("slow-compute", [6])], aligned["findings"]
    assert _main(["scan", "summary", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "slow-compute" in out and "GPU time" in out
    empty = tmp_path / "single"
    empty.mkdir()
    doc = json.loads(gzip.decompress((tmp_path / "rank0.1000.pt.trace.json.gz").read_bytes()))
    del doc["distributedInfo"]
    (empty / "single.json").write_text(json.dumps(doc))
    with pytest.raises(SystemExit):
        _main(["scan", "detect", str(empty)])
    assert "torch.distributed job" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------- format and public traces
_KERNEL_ARGS = {"External id", "queued", "device", "context", "stream", "correlation", "registers per thread",
                "shared memory", "blocks per SM", "warps per SM", "grid", "block", "est. achieved occupancy %"}
_COLL_ARGS = {"Collective name", "In msg nelems", "Out msg nelems", "Group size", "dtype", "In split size",
              "Out split size", "Process Group Name", "Process Group Description", "Process Group Ranks"}
# Fields of the public traces (nccl_parser_config: PyTorch 2.4, NCCL 2.17; trace_filter, negative_queue: 2023):
FROZEN = {("X", "kernel"): _KERNEL_ARGS, ("X", "cuda_runtime"): {"External id", "cbid", "correlation"},
          ("X", "gpu_memcpy"): {"External id", "device", "context", "stream", "correlation", "bytes",
                                "memory bandwidth (GB/s)"},
          ("X", "user_annotation"): {"External id"}, ("X", "cpu_op"): {"External id"}}


def _fields(docs: list[dict]) -> dict[tuple, tuple[set, set]]:
    """Per (ph, cat): the event keys every event has, and the arg keys every event has."""
    keys: dict[tuple, list] = {}
    for d in docs:
        for e in d["traceEvents"]:
            k = (e.get("ph"), e.get("cat"))
            s = keys.setdefault(k, [set(e), set(e.get("args") or {})])
            s[0] &= set(e)
            s[1] &= set(e.get("args") or {})
    return {k: (a, b) for k, (a, b) in keys.items()}


def test_generated_traces_have_the_fields_of_public_gpu_traces():
    job = generate(8, 2, seed=1)
    got = _fields(job.docs)
    for (ph, cat), args in FROZEN.items():
        assert args <= got[(ph, cat)][1], (ph, cat, args - got[(ph, cat)][1])
    assert {"ph", "cat", "name", "pid", "tid", "ts", "dur", "args"} <= got[("X", "kernel")][0]
    assert {"id", "bp"} <= got[("f", "ac2g")][0] and "id" in got[("s", "ac2g")][0]
    nccl = [e for e in job.docs[0]["traceEvents"] if e.get("cat") == "kernel" and e["name"].startswith("nccl")]
    assert nccl and all(_COLL_ARGS <= set(e["args"]) for e in nccl)
    assert {e["name"] for e in nccl} == {"ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)",
                                         "ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)"}
    rpc = [e for e in job.docs[0]["traceEvents"] if e["name"] == "record_param_comms"]
    assert rpc and all(_COLL_ARGS | {"Seq", "Rank", "Global rank start"} <= set(e["args"]) for e in rpc)
    info = job.docs[0]["distributedInfo"]
    assert {"backend", "rank", "world_size", "pg_count", "pg_config", "nccl_version"} <= set(info)
    assert {"pg_name", "pg_desc", "backend_config", "pg_size", "ranks"} <= set(info["pg_config"][0])
    if hta_traces.missing():
        return  # the frozen fields above were taken from them; the live comparison needs the files
    public = [json.loads(gzip.decompress((hta_traces.data_dir() / d / f).read_bytes()))
              for d, f, _ in hta_traces.FILES if d in ("nccl_parser_config", "trace_filter")]
    theirs = _fields(public)
    for k in (("X", "kernel"), ("X", "cuda_runtime"), ("X", "gpu_memcpy"), ("s", "ac2g"), ("f", "ac2g")):
        if k in theirs:
            assert theirs[k][0] <= got[k][0] and theirs[k][1] <= got[k][1], (k, theirs[k], got[k])
    coll = [e for d in public for e in d["traceEvents"] if e.get("cat") == "kernel" and "Collective name" in e["args"]]
    assert coll and all(set(e["args"]) - _KERNEL_ARGS <= _COLL_ARGS for e in coll)


# HTA 0.5.0's get_temporal_breakdown / get_comm_comp_overlap on the same files (benchmarks/bench_scan_hta.py):
# (idle %, compute %, non-compute %, overlap %) per rank, where MegaScan's definition is HTA's exactly (every
# device event has its launch in the trace, times in whole microseconds).
HTA = {("trace_filter", 0): (53.56, 17.71, 28.74, 11.81), ("trace_filter", 1): (54.72, 22.57, 22.72, 20.05),
       ("trace_diff/control", 3): (16.2, 61.23, 22.57, 47.03)}


@pytest.mark.skipif(bool(hta_traces.missing()), reason="public HTA traces absent: python -m benchmarks.hta_traces")
def test_public_traces_are_read_and_reported_honestly_with_htas_breakdown():
    for job in ("trace_filter", "nccl_parser_config", "trace_diff/control", "cpu_only"):  # the larger two: the bench
        traces, problems = read_traces(hta_traces.data_dir() / job)
        assert traces, (job, problems)
        an = analyse(traces)
        text = an.report.to_text()
        world = traces[0].world
        assert f"{len(traces)} of {world} ranks" in text and max(map(len, text.splitlines())) <= 120, text
        if len(traces) < world:
            assert "within noise" not in text and any("were not judged" in n for n in an.report.notes), text
        for row in gpu_breakdown(join(traces)):
            want = HTA.get((job, row["rank"]))
            if want:
                got = (row["idle_pct"], row["compute_pct"], row["non_compute_pct"], row["overlap_pct"])
                assert got == pytest.approx(want, abs=0.01), (job, row)


# Out-of-range numbers of the right type are no trace's (kineto_fields' bounds, as on the CPU path): that rank is
# skipped and named (tests/test_trust_traces.py); every other malformed field is read as absent.
_SKIPS_RANK = {("Seq", "-5"), ("In msg nelems", "1e+300")}  # (field, repr of the value)


def test_malformed_collective_fields_are_read_as_absent_never_a_crash():
    job = generate(8, 2, faults=["slow-compute=3:1.5"], seed=5, iterations=3)
    junk = [None, "x", -5, 1e300, [], {"a": 1}, "[1, ..., 2]", True]
    rng = np.random.default_rng(0)
    for d in job.docs:
        for e in d["traceEvents"]:
            a = e.get("args")
            if isinstance(a, dict) and ("Collective name" in a or "correlation" in a) and rng.random() < 0.3:
                for k in ("Process Group Ranks", "Seq", "Src Rank", "Dst Rank", "In msg nelems", "Group size",
                          "Process Group Name", "correlation", "External id", "Global rank stride"):
                    if k in a and rng.random() < 0.5:
                        a[k] = junk[int(rng.integers(len(junk)))]
                        if (k, repr(a[k])) in _SKIPS_RANK:
                            a[k] = None
    rep = analyse(_traces(job.docs)).report  # read and judged: whatever it finds, it says in lines that fit
    assert max(map(len, rep.to_text().splitlines())) <= 120
