"""MegaScan on GPU profiler traces next to Holistic Trace Analysis: HTA's temporal breakdown and comm/compute
overlap on the public traces, and what each names on generated GPU jobs with injected faults.

Peer: `holistictraceanalysis` 0.5.0 (HTA), a benchmark-only peer run in its own interpreter (HTA_PYTHON, default
`.venv-hta/bin/python`; `make .venv-hta/.installed` installs it with only what its analyses import).
Part 1, on the public traces (benchmarks/hta_traces.py): per rank, idle / compute / non-compute % and comm/compute
overlap % from HTA's `get_temporal_breakdown` and `get_comm_comp_overlap`, from `scan summary`'s GPU table
(detect/gputime.py) as it is, and from it with HTA's two conventions applied to the input (device events without a
launch in the trace dropped; sub-microsecond times rounded inwards, start up and end down); plus what `scan detect`
says of each job. Part 2, generated jobs (scan/synth/gpu_kineto.py) of 8 and 64 ranks with every fault kind at
drawn ranks and seeds: whether `scan detect` names the injected cause first, false findings at confidence >= 0.5,
the headline factor against the injected one, and what HTA's `get_potential_stragglers` returns on the 8-rank jobs.
Results: benchmarks/results/scan_hta.json and the generated blocks of docs/megascan.md.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks import harness, hta_traces
from megatronapp.scan.detect.analysis import analyse
from megatronapp.scan.detect.gputime import gpu_breakdown
from megatronapp.scan.detect.table import join
from megatronapp.scan.read.kineto import read_kineto_dir
from megatronapp.scan.read.kineto_layout import pipeline_layout
from megatronapp.scan.read.traces import read_traces
from megatronapp.scan.synth.gpu_kineto import generate

RESULT = harness.results_path("scan_hta")
DOC = harness.ROOT / "docs" / "megascan.md"
HTA_PYTHON = os.environ.get("HTA_PYTHON") or str(harness.ROOT / ".venv-hta" / "bin" / "python")
_PEER = r"""
import json, logging, sys, warnings
warnings.filterwarnings("ignore"); logging.disable(logging.CRITICAL)
import hta
from hta.trace_analysis import TraceAnalysis
out = {"version": getattr(hta, "__version__", "0.5.0")}
for d in sys.argv[1:]:
    r = {}
    try:
        t = TraceAnalysis(trace_dir=d)
    except Exception as e:
        out[d] = {"error": f"{type(e).__name__}: {e}"}; continue
    for name, call in (("breakdown", lambda: t.get_temporal_breakdown(visualize=False).to_dict("records")),
                       ("overlap", lambda: t.get_comm_comp_overlap(visualize=False).to_dict("records")),
                       ("stragglers", lambda: [int(x) for x in t.get_potential_stragglers(visualize=False)])):
        try:
            r[name] = call()
        except Exception as e:
            r[name] = {"error": f"{type(e).__name__}: {str(e)[:120]}"}
    out[d] = r
print(json.dumps(out, default=float))
"""
# Part 2: (fault template, kind named) with r a rank drawn per seed (a link: r and its next stage's replica s).
FAMILY = [("slow-compute={r}:{f}", "slow-compute"), ("late-arrival={r}:{ms}", "late-arrival"),
          ("pause={r}:{ms}:2:host", "transient-pause"), ("pause={r}:{ms}:2:device", "transient-pause"),
          ("slow-link={r}-{s}:3", "slow-link"), ("hang={r}:2", "hang"), ("", None)]


def hta_peer(dirs: list[Path]) -> dict:
    """HTA's analyses of each directory, run by the peer's interpreter."""
    if not Path(HTA_PYTHON).exists():
        raise SystemExit(f"HTA peer interpreter {HTA_PYTHON} absent: `make .venv-hta/.installed` (or set HTA_PYTHON)")
    res = subprocess.run([HTA_PYTHON, "-c", _PEER, *map(str, dirs)], capture_output=True, text=True, timeout=3600)
    if res.returncode:
        raise SystemExit(f"HTA peer failed: {res.stderr[-2000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def hta_conventions(src: Path, dst: Path) -> None:
    """A copy of a job's traces as HTA reads them: device events whose launch is not in the trace left out, and
    every event's start rounded up and end rounded down to whole microseconds (HTA's round_down_time_stamps)."""
    import gzip

    dst.mkdir(parents=True, exist_ok=True)
    for f in sorted(src.iterdir()):
        doc = json.loads(gzip.decompress(f.read_bytes()) if f.name.endswith(".gz") else f.read_bytes())
        ev = doc["traceEvents"]
        launched = {(e.get("args") or {}).get("correlation") for e in ev
                    if e.get("ph") == "X" and "stream" not in (e.get("args") or {})}
        out = []
        for e in ev:
            a = e.get("args") or {}
            if e.get("ph") == "X" and "stream" in a and a.get("correlation") not in launched:
                continue
            if e.get("ph") == "X" and isinstance(e.get("ts"), float):
                end = math.floor(e["ts"] + e["dur"])
                e = {**e, "ts": math.ceil(e["ts"]), "dur": max(end - math.ceil(e["ts"]), 0)}
            out.append(e)
        doc["traceEvents"] = out
        (dst / f.name.removesuffix(".gz")).write_text(json.dumps(doc))


_KEYS = ("idle_pct", "compute_pct", "non_compute_pct", "overlap_pct")


def parity(quick: bool) -> list[dict]:
    """Part 1: per rank of each public GPU job, HTA's numbers and MegaScan's (as is, and with HTA's conventions)."""
    root = hta_traces.data_dir()
    gone = hta_traces.missing(root)
    if gone:
        raise SystemExit(f"public traces missing ({', '.join(gone)}): python -m benchmarks.hta_traces")
    jobs = hta_traces.GPU_JOBS[:2] if quick else hta_traces.GPU_JOBS
    peer = hta_peer([root / j for j in jobs])
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for j in jobs:
            traces, _ = read_traces(root / j)
            conv = Path(tmp) / j.replace("/", "_")
            hta_conventions(root / j, conv)
            same = {r["rank"]: r for r in gpu_breakdown(join(read_kineto_dir(conv)[0]))}
            rep = analyse(traces).report
            theirs = peer[str(root / j)]
            overlap = {o["rank"]: o["comp_comm_overlap_pctg"] for o in theirs["overlap"]}
            for mine in gpu_breakdown(join(traces)):
                h = next(x for x in theirs["breakdown"] if x["rank"] == mine["rank"])
                rows.append({"job": j, "rank": mine["rank"], "world": traces[0].world, "iterations": rep.iterations,
                             "findings": [f.describe() for f in rep.findings],
                             "hta": [h["idle_time_pctg"], h["compute_time_pctg"], h["non_compute_time_pctg"],
                                     overlap.get(mine["rank"])],
                             "megascan": [mine[k] for k in _KEYS],
                             "megascan_hta_conventions": [same[mine["rank"]][k] for k in _KEYS],
                             "hta_stragglers": theirs.get("stragglers")})
    return rows


def family(quick: bool) -> list[dict]:
    """Part 2: generated jobs with one fault each (and healthy ones), at 8 and 64 ranks, seeds varied."""
    sizes = [(8, 2, {})] if quick else [(8, 2, {}), (64, 4, {"iterations": 5, "layers": 1, "microbatches": 4})]
    seeds = range(1) if quick else range(3)
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        peer_dirs = []
        for ranks, pp, kw in sizes:
            dp = ranks // pp
            for seed in seeds:
                rng = np.random.default_rng(1000 * ranks + seed)
                for template, kind in FAMILY:
                    r = int(rng.integers(0, ranks - dp)) if "{s}" in template else int(rng.integers(0, ranks))
                    f = float(rng.choice([1.3, 1.5, 2.0]))
                    ms = float(rng.choice([8.0, 15.0, 30.0]))
                    spec = template.format(r=r, s=r + dp, f=f"{f:g}", ms=f"{ms:g}")
                    job = generate(ranks, pp, faults=[spec] if spec else [], seed=seed, **kw)
                    t0 = time.perf_counter()
                    traces = [read_kineto_dir_doc(r_, d) for r_, d in enumerate(job.docs)]
                    traces, _ = pipeline_layout(traces)
                    rep = analyse(traces).report
                    want = () if not kind else (r, r + dp) if kind == "slow-link" else (r,)
                    top = rep.findings[0] if rep.findings else None
                    row = {"ranks": ranks, "seed": seed, "fault": spec or "healthy", "kind": kind,
                           "named_first": (top is None) if not kind else
                           (top is not None and (top.kind, top.ranks) == (kind, want)),
                           "false_sure": sum(1 for g in rep.findings if g.confidence >= 0.5 and
                                             (g.kind, g.ranks) != (kind, want)),
                           "top": top.describe() if top else None, "factor": top.factor if top else None,
                           "injected": f if kind == "slow-compute" else None,
                           "detect_s": round(time.perf_counter() - t0, 2)}
                    if ranks == 8 and kind in ("slow-compute", "late-arrival", None):
                        d = Path(tmp) / f"{ranks}_{seed}_{len(out)}"
                        job.write(d)
                        peer_dirs.append((len(out), d))
                    out.append(row)
        if peer_dirs:
            peer = hta_peer([d for _, d in peer_dirs])
            for i, d in peer_dirs:
                out[i]["hta_stragglers"] = peer[str(d)].get("stragglers")
    return out


def read_kineto_dir_doc(rank: int, doc: dict):
    """One generated rank's trace, read as the CLI reads a file."""
    from megatronapp.scan.read.kineto import to_rank_trace

    return to_rank_trace(rank, doc["distributedInfo"]["world_size"], [(Path(f"rank{rank}.json"), doc)])


def body(result: dict) -> str:
    """The docs blocks: the parity table, then the generated family."""
    lines = ["| job (public HTA trace) | rank | HTA: idle / compute / non-compute / overlap % | MegaScan as is | "
             "MegaScan, HTA's conventions | largest difference as is (pp) | `scan detect` |",
             "|---|---|---|---|---|---|---|"]
    for r in result["parity"]:
        diff = max(abs(a - b) for a, b in zip(r["hta"], r["megascan"]) if a is not None and b is not None)
        fmt = " / ".join(f"{x:.2f}" for x in r["megascan"])
        conv = " / ".join(f"{x:.2f}" for x in r["megascan_hta_conventions"])
        hta = " / ".join("-" if x is None else f"{x:.2f}" for x in r["hta"])
        lines.append(f"| {r['job']} ({r['world']}-rank job) | {r['rank']} | {hta} | {fmt} | {conv} | {diff:.2f} | "
                     f"{'; '.join(r['findings']) or 'no finding'} |")
    fam = result["family"]
    lines += ["", "| generated jobs | runs | cause named first | healthy runs quiet | false findings at c >= 0.5 | "
              "slow-compute factor / injected (min-max) | HTA `get_potential_stragglers` (8 ranks) |",
              "|---|---|---|---|---|---|---|"]
    for ranks in sorted({r["ranks"] for r in fam}):
        rs = [r for r in fam if r["ranks"] == ranks]
        faulty = [r for r in rs if r["kind"]]
        healthy = [r for r in rs if not r["kind"]]
        ratios = [r["factor"] / r["injected"] for r in rs if r["kind"] == "slow-compute" and r["named_first"]]
        hta = sorted({json.dumps(r.get("hta_stragglers")) for r in rs if "hta_stragglers" in r})
        span = f"{min(ratios):.2f}-{max(ratios):.2f}" if ratios else "-"
        lines.append(f"| {ranks} ranks | {len(rs)} | {sum(r['named_first'] for r in faulty)} of {len(faulty)} | "
                     f"{sum(r['named_first'] for r in healthy)} of {len(healthy)} | "
                     f"{sum(r['false_sure'] for r in rs)} | {span} | {', '.join(hta) if hta else '-'} |")
    missed = [f"{r['fault']} at {r['ranks']} ranks (seed {r['seed']}): {r['top'] or 'nothing'}" for r in fam
              if not r["named_first"] or r["false_sure"]]
    if missed:
        lines += ["", "Missed or beside a false finding: " + "; ".join(missed)]
    m = result["machine"]
    load = [round(x, 1) for x in (m["load_avg_at_start"] or [])[:1] + (m["load_avg_at_end"] or [])[:1]]
    lines += ["", f"HTA {result['hta_version']}; MegaScan's GPU table (`scan summary`); generated: seeds 0-2, fault "
              f"ranks, factors (1.3/1.5/2.0) and delays (8/15/30 ms) drawn per seed; {result['timestamp']}, load "
              f"{' -> '.join(map(str, load))}, {result['wall_s']:.0f} s."]
    return "\n".join(lines)


def main() -> None:
    ap = harness.parser(__doc__, from_json=True)
    args = ap.parse_args()
    if args.from_json:
        harness.rerender(RESULT, body, block="bench_scan_hta", docs=DOC)
        return
    clock = harness.Clock()
    par = parity(args.quick)
    fam = family(args.quick)
    result = {"parity": par, "family": fam, "hta_version": "0.5.0", "timestamp": clock.timestamp,
              "machine": harness.machine(clock), "wall_s": clock.wall_s()}
    print(body(result))
    if args.quick:
        return
    harness.save(result, RESULT, body(result), block="bench_scan_hta", docs=DOC)


if __name__ == "__main__":
    sys.exit(main())
