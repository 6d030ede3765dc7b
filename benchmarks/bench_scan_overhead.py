"""MegaScan overhead: step time of the demo model untraced vs traced (coarse and full), side by side.

The same rank processes run every mode and rotate step by step (off, coarse, full, off, ...), each step fenced
by a barrier, so machine noise falls on all modes alike. Traced steps record every iteration (interval 1: the
worst case; the default window traces 3 in 10). "Untraced" means no span sink installed at all, as in a run
without --trace. Reported: median step time after warm-up per mode and the ratio traced/untraced; the target
is <= 1.03. Step i of every mode ran in the same rotation, so traced_i / off_i is a paired ratio; its median and
95% interval (bootstrap over pairs; with --blocks K, K independent process trees pooled by the two-level bootstrap)
go to the JSON and the interval block of docs/benchmarks.md.

Run: python -m benchmarks.bench_scan_overhead            (writes benchmarks/results/scan_overhead.json, docs block)
     python -m benchmarks.bench_scan_overhead --blocks 3 (3 blocks of fresh processes, pooled)
     python -m benchmarks.bench_scan_overhead --from-json (re-render the intervals from the stored result)
     python -m benchmarks.bench_scan_overhead --quick    (a few steps, writes nothing)
"""
from __future__ import annotations

import os
import statistics
import tempfile
from pathlib import Path
from typing import Any

from benchmarks import harness, stats
from megatronapp.config import RunConfig

RESULTS = harness.results_path("scan_overhead")
BLOCK = "intervals:bench_scan_overhead"
MODES = ("off", "coarse", "full")
TARGET = 1.03
CASES = {"pp=2 1f1b": {"pp": 2, "schedule": "1f1b", "microbatches": 4}, "dp=2": {"dp": 2, "microbatches": 2}}


def _rank(rank: int, world: int, cfg_dict: dict, steps_per_mode: int, warmup: int, out: str) -> None:
    from megatronapp import tracing
    from megatronapp.config import validate
    from megatronapp.parallel import comm
    from megatronapp.scan.record.tracer import attach
    from megatronapp.train.trainer import Trainer

    cfg = RunConfig.from_dict(cfg_dict)
    validate(cfg, world)
    comm.reset()
    tr = Trainer(cfg, rank)
    tracers = {}
    for mode in MODES[1:]:
        cfg.trace.granularity = mode
        tracers[mode] = attach(cfg, tr.topo, Path(out) / f"trace-{mode}")
        tracing.uninstall(tracers[mode])  # installed only for its own steps
    world_group = tr.topo.groups["world"]
    times: dict[str, list[float]] = {m: [] for m in MODES}
    for i in range((warmup + steps_per_mode) * len(MODES)):
        mode = MODES[i % len(MODES)]
        comm.barrier(world_group)
        if mode != "off":
            tracing.install(tracers[mode])
        with tracing.step(tr.step):
            rec = tr.train_step()
        if mode != "off":
            tracing.uninstall(tracers[mode])
        if i >= warmup * len(MODES):
            times[mode].append(rec["step_time"])
    for t in tracers.values():
        t.close()
    if rank == 0:
        harness.report(out, rank, times)


def run_case(name: str, parallel: dict[str, Any], steps: int, warmup: int) -> dict[str, Any]:
    """Run one case in one process tree; return median step times per mode and the traced/untraced ratios."""
    cfg = RunConfig()
    for k, v in parallel.items():
        setattr(cfg.parallel, k, v)
    cfg.trace.enabled, cfg.trace.interval, cfg.trace.iterations = True, 1, 1
    cfg.train.progress = False
    with tempfile.TemporaryDirectory() as out:
        cfg.train.out = out
        (times,) = harness.launch(_rank, cfg.parallel.world_size, cfg.to_dict(), steps, warmup, outdir=out,
                                  threads=max(1, (os.cpu_count() or 1) // cfg.parallel.world_size))
        spans = sum(1 for _ in (Path(out) / "trace-full").glob("rank*.mst"))
    med = {m: statistics.median(times[m]) for m in MODES}
    return {"case": name, "median_step_s": med, "steps_per_mode": steps, "rank_files": spans,
            "ratio_coarse": med["coarse"] / med["off"], "ratio_full": med["full"] / med["off"], "raw_s": times}


def intervals(result: dict[str, Any]) -> list[dict[str, Any]]:
    """traced/untraced paired ratios of every case and granularity, median with its 95% interval."""
    out = []
    for c in result["cases"]:
        blocks = c.get("blocks") or [c["raw_s"]]  # results recorded before --blocks hold one block
        for mode in MODES[1:]:
            per_block = [stats.paired_ratios(b[mode], b["off"]) for b in blocks]
            sm = stats.summarize_blocks(per_block)
            lo, hi = sm["ci95"]
            c[f"ratio_{mode}_ci95"] = sm["ci95"]
            out.append({"figure": f"whole steps, {c['case']}, {mode} every iteration / untraced", "value": sm["ratio"],
                        "ci95": sm["ci95"], "n": sm["n"], "basis": stats.blocks_label(len(blocks)),
                        "target": f"<= {result.get('target_ratio', TARGET)}",
                        "claim": stats.claim(lo, hi, result.get("target_ratio", TARGET))
                        + (" (within noise of 1)" if sm["verdict"] == "within noise" else "")})
    return out


def docs_block(result: dict[str, Any]) -> str:
    load = harness.machine_of(result).get("load_avg_at_end")
    return (stats.interval_table(intervals(result)) + "\n\n`bench_scan_overhead`: "
            f"{result['cases'][0]['steps_per_mode']} steps per mode and block, load average at the end "
            f"{tuple(round(x, 1) for x in load) if load else '?'}. The per-span figure (`bench_tracing_cost`) "
            "resolves the overhead far more finely; this whole-step cross-check cannot tell traced from untraced.")


def main(argv: list[str] | None = None) -> None:
    ap = harness.parser(__doc__, "3 steps per mode; writes nothing", from_json=True, blocks=1)
    ap.add_argument("--steps", type=int, default=12, help="measured steps per mode")
    args = ap.parse_args(argv)
    if args.from_json:
        stored = harness.rerender(RESULTS, docs_block, block=BLOCK, refresh=lambda r: r.update(intervals=intervals(r)))
        print(stats.interval_table(stored["intervals"]))
        return
    clock = harness.Clock()
    steps, warmup = (3, 1) if args.quick else (args.steps, 2)
    results = []
    for name, par in CASES.items():
        runs = [run_case(name, par, steps, warmup) for _ in range(args.blocks)]
        pooled = {m: [t for r in runs for t in r["raw_s"][m]] for m in MODES}
        med = {m: statistics.median(pooled[m]) for m in MODES}
        results.append({**runs[0], "median_step_s": med, "ratio_coarse": med["coarse"] / med["off"],
                        "ratio_full": med["full"] / med["off"], "raw_s": pooled,
                        "blocks": [r["raw_s"] for r in runs]})
    print(f"{'case':<14} {'untraced ms':>12} {'coarse ms':>10} {'full ms':>9} {'coarse/off':>11} {'full/off':>9}")
    for r in results:
        m = r["median_step_s"]
        print(f"{r['case']:<14} {m['off'] * 1e3:>12.1f} {m['coarse'] * 1e3:>10.1f} {m['full'] * 1e3:>9.1f} "
              f"{r['ratio_coarse']:>11.3f} {r['ratio_full']:>9.3f}")
    result = {"target_ratio": TARGET, "cases": results, "machine": harness.machine(clock, backend="gloo")}
    result["intervals"] = intervals(result)
    print(stats.interval_table(result["intervals"]))
    if not args.quick:
        harness.save(result, RESULTS, docs_block(result), block=BLOCK)


if __name__ == "__main__":
    main()
