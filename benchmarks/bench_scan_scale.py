"""MegaScan at scale: simulate, read back and analyse 1,024 / 4,096 / 12,288 ranks x 5 iterations.

Each size runs in a fresh child process (so peak memory is that size's own) with one slow-compute rank and one
slow P2P link injected, and reports wall time per stage, peak RSS and whether both faults were named; then a
healthy run of the same size (other seed), which must report nothing (false alarms at scale).
Targets at 12,288 ranks: simulate + detect < 30 s, peak memory < 2 GB.
Intervals: with --blocks K every size runs K times (fresh children each time) and the median total time and peak
memory get a bootstrap 95% interval over the blocks; one block leaves a single measurement, shown as such. Healthy
runs without a finding give a Wilson interval on the false-alarm rate at scale.
Run: python -m benchmarks.bench_scan_scale [--sizes 1024,4096,12288] [--blocks 3] [--merge]
                                               (writes benchmarks/results/scan_scale.json, docs block)
     python -m benchmarks.bench_scan_scale --from-json  (re-render the intervals from the stored result)
     python -m benchmarks.bench_scan_scale --quick      (1,024 ranks, faulty and healthy once; writes nothing)
     python -m benchmarks.bench_scan_scale --cli 12288 [--blocks 3]
        the CLI as a user runs it: `scan simulate --ranks N --tp 8 --pp 16` (its defaults otherwise), then
        `scan detect DIR --json` and `scan aggregate DIR --only-flagged`, each its own process, timed with its own
        peak RSS (os.wait4); targets at 12,288: detect < 15 s and < 1.5 GB (results/scan_scale_cli.json)
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import harness, stats

TP, PP = 8, 4
RESULTS = harness.results_path("scan_scale")
BLOCK = "intervals:bench_scan_scale"


def one(ranks: int, out_dir: str, healthy: bool = False, merge: bool = False) -> dict:
    """Simulate, read and detect one size in this process; return wall and CPU times (process time: what the
    run itself used, less inflated than wall time on a shared machine), the load average and peak RSS; with
    `merge`, also `scan aggregate` of the whole job (gzip) and of the flagged ranks only."""
    from megatronapp.scan.detect.analysis import detect
    from megatronapp.scan.read.format import read_dir
    from megatronapp.scan.synth.simulate import simulate

    dp = ranks // (TP * PP)
    slow = TP * (dp // 2) + 3  # stage 0, a middle replica
    a = TP * dp * 1 + TP * 1 + 2  # stage 1, replica 1, tp 2 -> the same column on stage 2
    faults = [] if healthy else [f"slow-compute={slow}:1.2", f"slow-link={a}-{a + TP * dp}:1.5"]
    load0 = os.getloadavg()[0]
    t0, c0 = time.perf_counter(), time.process_time()
    res = simulate(out_dir, ranks, TP, PP, iterations=5, faults=faults, seed=8 if healthy else 7)
    t1, c1 = time.perf_counter(), time.process_time()
    traces, problems = read_dir(out_dir)
    t2, c2 = time.perf_counter(), time.process_time()
    report = detect(traces)
    t3, c3 = time.perf_counter(), time.process_time()
    named = {(f.kind, tuple(sorted(f.ranks))) for f in report.findings}
    row = {"ranks": ranks, "healthy": healthy, "tp": TP, "pp": PP, "dp": dp, "iterations": 5, "spans": res.spans,
           "simulate_s": round(t1 - t0, 2), "read_s": round(t2 - t1, 2), "detect_s": round(t3 - t2, 2),
           "total_s": round(t3 - t0, 2), "simulate_cpu_s": round(c1 - c0, 2), "read_cpu_s": round(c2 - c1, 2),
           "detect_cpu_s": round(c3 - c2, 2), "total_cpu_s": round(c3 - c0, 2),
           "load_avg": [round(load0, 1), round(os.getloadavg()[0], 1)],
           "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
           "bytes_on_disk": sum(p.stat().st_size for p in Path(out_dir).glob("rank*.mst")),
           "faults_named": [] if healthy else [("slow-compute", (slow,)) in named,
                                               ("slow-link", (a, a + TP * dp)) in named],
           "findings": len(report.findings), "problems": len(problems)}
    if merge:
        del traces, report
        row["aggregate"] = merge_sizes(out_dir)
    return row


def merge_sizes(trace_dir: str) -> dict:
    """`scan aggregate` of the whole job (gzip) and with --only-flagged: wall and CPU time, output size, events."""
    from megatronapp.scan.aggregate import aggregate

    out = {}
    for mode in ("only_flagged", "all"):
        path = Path(trace_dir) / ("merged.json" if mode == "only_flagged" else "merged.json.gz")
        t0, c0 = time.perf_counter(), time.process_time()
        rep = aggregate(trace_dir, path, only_flagged=mode == "only_flagged")
        out[mode] = {"wall_s": round(time.perf_counter() - t0, 1), "cpu_s": round(time.process_time() - c0, 1),
                     "bytes": path.stat().st_size, "events": rep["events"], "flows": rep["flows"],
                     "ranks_written": len(rep.get("written_ranks", rep["ranks"])),
                     "peak_rss_mb_so_far": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)}
        path.unlink()
    return out


CLI_RESULTS = harness.results_path("scan_scale_cli")
CLI_BLOCK = "bench_scan_scale:cli"
CLI_TARGETS = {"detect_s": 15.0, "detect_peak_mb": 1500.0}


def timed(cmd: list[str]) -> dict:
    """Run one command in its own process: wall and CPU seconds, its own peak RSS (MB), load average around it."""
    load0 = os.getloadavg()[0]
    t0 = time.perf_counter()
    with open(os.devnull, "w") as sink, tempfile.TemporaryFile("w+") as err:  # a file: a pipe could fill up
        proc = subprocess.Popen(cmd, stdout=sink, stderr=err, text=True)
        _, status, ru = os.wait4(proc.pid, 0)  # this child's own rusage (peak RSS), not all children's
        proc.returncode = os.waitstatus_to_exitcode(status)
        wall = time.perf_counter() - t0
        if proc.returncode:
            err.seek(0)
            raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}): {err.read()[-800:]}")
    return {"wall_s": round(wall, 2), "cpu_s": round(ru.ru_utime + ru.ru_stime, 2),
            "peak_mb": round(ru.ru_maxrss / 1024, 1), "load_avg": [round(load0, 1), round(os.getloadavg()[0], 1)]}


def _tree_pss_kb(pid: int) -> int:
    """Proportional set size of a process and all its descendants (kB): shared pages counted once, so a parent and
    its forked workers add up to what they hold together."""
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            with open(f"/proc/{p}/smaps_rollup") as f:
                total += next((int(line.split()[1]) for line in f if line.startswith("Pss:")), 0)
            with open(f"/proc/{p}/task/{p}/children") as f:
                todo += [int(c) for c in f.read().split()]
        except OSError:
            continue  # gone meanwhile
    return total


def timed_tree(cmd: list[str], stdout: str | None = None) -> dict:
    """timed() for a command that starts worker processes: also the peak of the summed PSS of its process tree,
    sampled every 0.1 s (wait4's peak RSS is the largest single process's)."""
    load0 = os.getloadavg()[0]
    t0 = time.perf_counter()
    peak = 0
    with open(stdout or os.devnull, "w") as sink, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, stdout=sink, stderr=err, text=True)
        while proc.poll() is None:
            peak = max(peak, _tree_pss_kb(proc.pid))
            time.sleep(0.1)
        wall = time.perf_counter() - t0
        if proc.returncode:
            err.seek(0)
            raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}): {err.read()[-800:]}")
    return {"wall_s": round(wall, 2), "peak_tree_pss_mb": round(peak / 1024, 1),
            "load_avg": [round(load0, 1), round(os.getloadavg()[0], 1)]}


SCALE_TP, SCALE_PP, SCALE_DP = 8, 16, 782  # 100,096 ranks: the 100,000 rounded up to whole replicas


def scale_faults(seed: int) -> list[str]:
    """Four faults of four kinds at ranks drawn from `seed` (never tuned to one placement): a slow rank, a weak DP
    ring link, a pause every third iteration and a slow P2P link."""
    import random

    rng = random.Random(seed)

    def rank(d: int, s: int, t: int) -> int:
        return t + SCALE_TP * (d + SCALE_DP * s)

    d = [rng.randrange(SCALE_DP - 1) for _ in range(4)]
    s = [rng.randrange(SCALE_PP - 1) for _ in range(4)]
    t = [rng.randrange(SCALE_TP) for _ in range(4)]
    return [f"slow-compute={rank(d[0], s[0], t[0])}:1.3",
            f"slow-link={rank(d[1], s[1], t[1])}-{rank(d[1] + 1, s[1], t[1])}:1.5",
            f"pause={rank(d[2], s[2], t[2])}:30:3",
            f"slow-link={rank(d[3], s[3], t[3])}-{rank(d[3], s[3] + 1, t[3])}:2"]


def scale_main(seeds: list[int]) -> None:
    """simulate + detect (+ aggregate --only-flagged) of 100,096 ranks x 10 iterations, healthy and with four faults
    per seed, each command its own process as a user runs it; results under scale_100k in
    results/scan_scale_cli.json.

    Every job's files are kept until all runs are done (about 3 GB a job): on ext4 without a journal (this machine's)
    a new inode skips every inode deleted in the last minutes (`recently_deleted`, fs/ext4/ialloc.c), and with a few
    100,096-file jobs deleted just before, `perf` put ~28% of a simulate's CPU in that search (45-96 s instead of
    25-35 s). Deleting each job before the next measured the benchmark's own clean-up."""
    cli = [sys.executable, "-m", "megatronapp", "scan"]
    ranks = SCALE_TP * SCALE_PP * SCALE_DP
    runs = []
    with tempfile.TemporaryDirectory(dir=os.environ.get("SCAN_SCALE_DIR")) as root:
        for seed in seeds:
            for faults in ([], scale_faults(seed)):
                tmp = Path(root) / f"seed{seed}-{'faulty' if faults else 'healthy'}"
                tmp.mkdir()
                runs.append(scale_run(cli, ranks, seed, faults, tmp))
                print(json.dumps(runs[-1]))
    before = harness.read_result(CLI_RESULTS) if CLI_RESULTS.exists() else {}
    earlier = before.get("scale_100k_earlier", [])
    if "scale_100k" in before:
        earlier.append(before["scale_100k"])
    before.update(scale_100k={"runs": runs, "seeds": seeds, "targets": {"simulate_plus_detect_s": 60,
                                                                        "peak_mb": 4096}},
                  scale_100k_earlier=earlier)
    harness.write_result(before, CLI_RESULTS)
    print(f"wrote {harness.shown(CLI_RESULTS)}")


def scale_run(cli: list[str], ranks: int, seed: int, faults: list[str], tmp: Path) -> dict:
    """One job: simulate, detect --json, and (faulty) aggregate --only-flagged, in `tmp`."""
    trace = str(tmp / "trace")
    row = {"ranks": ranks, "tp": SCALE_TP, "pp": SCALE_PP, "iterations": 10, "seed": seed, "faults": faults,
           "measured_at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    row["simulate"] = timed_tree(cli + ["simulate", "--ranks", str(ranks), "--tp", str(SCALE_TP), "--pp",
                                        str(SCALE_PP), "--iterations", "10", "-o", trace]
                                 + [x for f in faults for x in ("--fault", f)])
    row["bytes_on_disk"] = sum(p.stat().st_size for p in Path(trace).glob("rank*.mst"))
    report = str(tmp / "report.json")
    row["detect"] = timed_tree(cli + ["detect", trace, "--json"], stdout=report)
    rep = json.loads(Path(report).read_text())
    row["findings"] = [{"kind": f["kind"], "ranks": f["ranks"] if len(f["ranks"]) <= 8 else
                        f"{len(f['ranks'])} ranks from {f['ranks'][0]}", "confidence": f["confidence"]}
                       for f in rep["findings"]]
    row["notes"] = rep["notes"][:1]
    truth = json.loads((Path(trace) / "ground_truth.json").read_text())["faults"]
    named = [any(set(t["ranks"]) <= set(f["ranks"]) and f["kind"] == {"pause": "transient-pause"}.get(
        t["kind"], t["kind"]) for f in rep["findings"]) for t in truth]
    true_f = [any(set(t["ranks"]) <= set(f["ranks"]) for t in truth) for f in rep["findings"]]
    row["faults_named"] = f"{sum(named)}/{len(truth)}"
    row["findings_true"] = f"{sum(true_f)}/{len(true_f)}"
    row["simulate_plus_detect_s"] = round(row["simulate"]["wall_s"] + row["detect"]["wall_s"], 1)
    if faults:
        out = str(tmp / "flagged.json.gz")
        row["aggregate_only_flagged"] = timed_tree(cli + ["aggregate", trace, "-o", out, "--only-flagged"])
        row["aggregate_only_flagged"]["bytes"] = Path(out).stat().st_size
    return row


def cli_run(ranks: int, tmp: str) -> dict:
    """simulate (defaults but tp 8, pp 16), then detect --json and aggregate --only-flagged, as a user runs them."""
    cli = [sys.executable, "-m", "megatronapp", "scan"]
    row = {"ranks": ranks, "tp": 8, "pp": 16, "measured_at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "simulate": timed(cli + ["simulate", "--ranks", str(ranks), "--tp", "8",
                                                                       "--pp", "16", "-o", tmp])}
    row["bytes_on_disk"] = sum(p.stat().st_size for p in Path(tmp).glob("rank*.mst"))
    row["detect"] = timed(cli + ["detect", tmp, "--json"])
    out = str(Path(tmp) / "flagged.json")
    row["aggregate_only_flagged"] = timed(cli + ["aggregate", tmp, "-o", out, "--only-flagged"])
    row["aggregate_only_flagged"]["bytes"] = Path(out).stat().st_size
    return row


def cli_table(result: dict) -> str:
    lines = ["| ranks | command | wall / CPU (s) | peak RSS (MB) | load avg (1 min, before-after) |",
             "|---|---|---|---|---|"]
    for r in result["rows"]:
        for key, label in (("simulate", "`scan simulate --tp 8 --pp 16`"), ("detect", "`scan detect DIR --json`"),
                           ("aggregate_only_flagged", "`scan aggregate DIR --only-flagged`")):
            m = r[key]
            lines.append(f"| {r['ranks']:,} | {label} | {m['wall_s']} / {m['cpu_s']} | {m['peak_mb']:.0f} | "
                         f"{m['load_avg'][0]}-{m['load_avg'][1]} |")
    rows = [r for r in result["rows"] if r["ranks"] == 12288]
    if rows:
        wall = [r["detect"]["wall_s"] for r in rows]
        peak = [r["detect"]["peak_mb"] for r in rows]
        lines += ["", f"12,288 ranks, `scan detect --json` over {len(rows)} run(s): wall median "
                      f"{statistics.median(wall)} s (target < {CLI_TARGETS['detect_s']:.0f} s), peak median "
                      f"{statistics.median(peak):.0f} MB (target < {CLI_TARGETS['detect_peak_mb']:.0f} MB); wall "
                      "time on this shared 2-core machine includes waiting for the CPU: read it with the load average "
                      "and the CPU time beside it."]
    return "\n".join(lines)


def cli_main(ranks: int, blocks: int) -> None:
    rows = []
    for _ in range(blocks):
        with tempfile.TemporaryDirectory() as tmp:
            row = cli_run(ranks, tmp)
        rows.append(row)
        print(json.dumps(row))
    result = {"rows": rows, "targets": CLI_TARGETS}
    if CLI_RESULTS.exists():  # earlier measurements stay on record (the table shows this run's), as do records
        before = harness.read_result(CLI_RESULTS)  # this command does not write (scale_100k)
        result = {**{k: v for k, v in before.items() if k not in ("rows", "earlier")}, **result,
                  "earlier": before.get("earlier", []) + before.get("rows", [])}
    print(cli_table(result))
    harness.save(result, CLI_RESULTS, cli_table(result), block=CLI_BLOCK)


def intervals(result: dict) -> list[dict]:
    """Total time and peak memory of the faulty run at each size (median over blocks, bootstrap interval), and the
    false-alarm rate over every healthy run."""
    targets, out = result["targets"], []
    sizes = sorted({r["ranks"] for r in result["rows"]})
    for n in sizes:
        runs = [r for r in result["rows"] if r["ranks"] == n and not r["healthy"]]
        for key, label, unit, target in (("total_s", "simulate + read + detect", "s", targets["total_s_at_12288"]),
                                         ("peak_rss_mb", "peak memory", "MB", targets["peak_mb_at_12288"])):
            vals = [r[key] for r in runs]
            lo, hi = stats.bootstrap_ci(vals)
            row = {"figure": f"{n:,} ranks, {label} ({unit})", "value": statistics.median(vals), "ci95": [lo, hi],
                   "n": len(vals), "basis": "single run: no interval" if len(vals) == 1
                   else f"bootstrap over {len(vals)} blocks"}
            if n == 12288:
                row.update(target=f"< {target}", claim=stats.claim(lo, hi, target) if len(vals) > 1
                           else ("met" if vals[0] < target else "missed") + " (one run)")
            out.append(row)
    healthy = [r for r in result["rows"] if r["healthy"]]
    if healthy:
        alarmed = sum(1 for r in healthy if r["findings"])
        lo, hi = stats.wilson_ci(alarmed, len(healthy))
        out.append({"figure": f"healthy runs at scale with a finding ({alarmed}/{len(healthy)})",
                    "value": alarmed / len(healthy), "ci95": [lo, hi], "n": len(healthy),
                    "basis": "Wilson, over runs", "target": "0",
                    "claim": "unresolved: none seen in few runs" if alarmed == 0 else "missed"})
    return out


def cpu_table(result: dict) -> str:
    """Per run: wall and CPU seconds of each stage and the load average around it (wall time on a shared machine
    is CPU time stretched by the other work; CPU time is what the run itself costs)."""
    lines = ["| ranks | run | simulate wall / CPU (s) | read | detect | total | load avg | peak MB |",
             "|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        if "total_cpu_s" not in r:
            continue
        lines.append(f"| {r['ranks']:,} | {'healthy' if r['healthy'] else 'faulty'} | {r['simulate_s']} / "
                     f"{r['simulate_cpu_s']} | {r['read_s']} / {r['read_cpu_s']} | {r['detect_s']} / "
                     f"{r['detect_cpu_s']} | **{r['total_s']} / {r['total_cpu_s']}** | "
                     f"{r['load_avg'][0]}-{r['load_avg'][1]} | {r['peak_rss_mb']:.0f} |")
    merged = [(r["ranks"], r["aggregate"]) for r in result["rows"] if r.get("aggregate")]
    if merged:
        lines += ["", "| ranks | `scan aggregate` | wall / CPU (s) | output | events | ranks written | peak MB |",
                  "|---|---|---|---|---|---|---|"]
        for n, agg in merged:
            for mode, a in agg.items():
                lines.append(f"| {n:,} | {'--only-flagged' if mode == 'only_flagged' else 'all ranks (.json.gz)'} | "
                             f"{a['wall_s']} / {a['cpu_s']} | {a['bytes'] / 1e6:.1f} MB | {a['events']:,} | "
                             f"{a['ranks_written']:,} | {a['peak_rss_mb_so_far']:.0f} |")
    return "\n".join(lines)


def docs_block(result: dict) -> str:
    return (stats.interval_table(intervals(result), digits=1) + "\n\n" + cpu_table(result) + "\n\n"
            "`bench_scan_scale`: one process per run on a shared 2-core machine; wall time includes waiting for the "
            "CPU (see the load average), CPU time does not. A single run per size has no interval (rerun with "
            "`--blocks 3` on a quiet machine).")


def main(argv: list[str] | None = None) -> None:
    ap = harness.parser(__doc__, "1,024 ranks, faulty and healthy once; writes nothing", from_json=True, blocks=1)
    ap.add_argument("--sizes", default="1024,4096,12288")
    ap.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--dir", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--healthy", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--merge", action="store_true",
                    help="also time `scan aggregate` (all ranks, and --only-flagged) on the largest faulty run")
    ap.add_argument("--cli", type=int, default=None, metavar="RANKS",
                    help="time the CLI (simulate, detect --json, aggregate --only-flagged) at this size instead")
    ap.add_argument("--scale-100k", action="store_true",
                    help="simulate + detect (+ aggregate --only-flagged) of 100,096 ranks x 10 iterations (tp 8, "
                         "pp 16), healthy and with four faults; SCAN_SCALE_DIR picks where the files go (~3 GB a job, "
                         "all kept until the end)")
    ap.add_argument("--seed", type=int, nargs="+", default=[0],
                    help="with --scale-100k: where the four faults are placed (several: a healthy and a faulty job "
                         "each, every job's files kept until the end)")
    args = ap.parse_args(argv)
    if args.scale_100k:
        scale_main(args.seed)
        return
    if args.cli is not None:
        cli_main(args.cli, max(args.blocks, 1))
        return
    if args.child is not None:
        print(json.dumps(one(args.child, args.dir, args.healthy, args.merge)))
        return
    if args.from_json:
        stored = harness.rerender(RESULTS, docs_block, block=BLOCK, refresh=lambda r: r.update(intervals=intervals(r)))
        print(stats.interval_table(stored["intervals"], digits=1))
        return
    if args.quick:
        args.sizes, args.blocks = "1024", 1
    clock = harness.Clock()
    rows = []
    largest = max(int(x) for x in args.sizes.split(","))
    for _, n, healthy in ((b, int(x), h) for b in range(args.blocks) for x in args.sizes.split(",")
                          for h in (False, True)):
        with tempfile.TemporaryDirectory() as tmp:
            out = subprocess.run([sys.executable, "-m", "benchmarks.bench_scan_scale", "--child", str(n),
                                  "--dir", tmp, *(["--healthy"] if healthy else []),
                                  *(["--merge"] if args.merge and not healthy and n == largest else [])],
                                 capture_output=True, text=True, check=True, cwd=harness.ROOT)
        row = json.loads(out.stdout.strip().splitlines()[-1])
        rows.append(row)
        verdict = f"healthy: {row['findings']} findings" if healthy else f"faults named {row['faults_named']}"
        print(f"{n:>6} ranks: simulate {row['simulate_s']:6.1f}s  read {row['read_s']:6.1f}s  detect "
              f"{row['detect_s']:6.1f}s  total {row['total_s']:6.1f}s (CPU {row['total_cpu_s']:5.1f}s, load "
              f"{row['load_avg'][0]}-{row['load_avg'][1]})  peak {row['peak_rss_mb']:7.0f} MB  {verdict}")
        if row.get("aggregate"):
            print(f"        aggregate: {json.dumps(row['aggregate'])}")
    result = {"rows": rows, "blocks": args.blocks, "targets": {"total_s_at_12288": 30, "peak_mb_at_12288": 2048},
              "machine": harness.machine(clock)}
    result["intervals"] = intervals(result)
    print(stats.interval_table(result["intervals"], digits=1))
    if not args.quick:
        harness.save(result, RESULTS, docs_block(result), block=BLOCK)


if __name__ == "__main__":
    main()
