"""Stability of MegaScan's verdicts on REAL runs: each real-run scenario of tests/test_scan_real.py, repeated.

Each repeat is one fresh process that trains a tiny GPT-2 on gloo ranks with a fault drill from
`megatronapp.faults`, traces every step and runs `analyse` on the traces. Repeats of all scenarios are
interleaved (round-robin), so a burst of machine load hits every scenario alike rather than one. Per scenario:
the detection rate (the top finding has the injected kind and ranks) with a 95% Wilson interval, the number of
repeats with a false alarm (any finding that matches no injected fault) and the load average of each repeat; per
scenario, per group of scenarios and pooled: precision over ALL findings (kind and ranks match an injected fault;
a consequence folded into its cause's evidence is no finding) and recall, each with a Wilson interval.
Before/after on identical runs: record with --keep DIR, then `--reanalyse --as-before LABEL` with the old
detector on the path (stored as the before), then `--reanalyse --detector LABEL` with the new one.
Peer: the same detector on the same scenario; the question is run-to-run stability, not a ratio.
Each run's trace files are kept (--keep, default /tmp/megascan_real_runs), so `--reanalyse` judges the same
runs again with the current detector (a detector change is then compared on identical runs, not new noise).
Run: python -m benchmarks.bench_scan_real [--repeats 5] [--only NAME,...] [--steps 8] [--reanalyse]
(--only re-measures those scenarios and keeps the stored rows of the others; --quick: one repeat of QUICK, 4 steps,
writes nothing.) Two scenarios are a pure pipeline
(pp = 4, one rank per stage) traced per layer, judged by measured stage work and layer floors; four are no engine
run but a plain FSDP2 or DDP job on 2 ranks traced through `scan.instrument()` (benchmarks/anyjob.py, the job of
tests/test_scan_anyjob.py), healthy or with rank 1 slowed 3x. Nine are pure pipelines (pp 4) under the
interleaved (vpp 2), zb-h1 and dpp-zb (vpp 2) schedules, healthy, with a slow P2P link or a slow rank; two run
beside SPINNERS CPU-spinning processes (an oversubscribed host), healthy and with a slow rank.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import harness, stats

RESULTS = harness.results_path("scan_real")
TITLE = "## MegaScan on real runs: verdict stability over repeats"
LAYOUTS = {4: (1, 2, 2), 8: (2, 2, 2)}  # world -> (tp, pp, dp); rank = tp + tp_size * (dp + dp_size * pp)
# name -> (world, faults, expected (kind, ranks) or None for a healthy run)
SCENARIOS: dict[str, tuple[int, tuple[str, ...], tuple[str, tuple[int, ...]] | None]] = {
    "healthy 4": (4, (), None),
    "healthy 8": (8, (), None),
    "slow compute 2.0x, 1 peer/stage": (4, ("slow-compute=3:2.0",), ("slow-compute", (3,))),
    "slow P2P link +20 ms": (4, ("slow-link=0-2:20",), ("slow-link", (0, 2))),
    "transient pause 100 ms": (4, ("pause=1:100:2",), ("transient-pause", (1,))),
    "8 ranks slow compute 2.0x": (8, ("slow-compute=5:2.0",), ("slow-compute", (5,))),
    "8 ranks slow compute 1.10x": (8, ("slow-compute=5:1.1",), ("slow-compute", (5,))),
    "8 ranks DP-peer link +20 ms": (8, ("slow-link=1-3:20",), ("slow-link", (1, 3))),
    "pure pp4 healthy (per layer)": (4, (), None),
    "pure pp4 last stage 1.3x (per layer)": (4, ("slow-compute=3:1.3",), ("slow-compute", (3,))),
    "FSDP2 healthy (instrument)": (2, (), None),
    "FSDP2 slow rank 3x (instrument)": (2, ("slow-compute=1:3",), ("slow-compute", (1,))),
    "DDP healthy (instrument)": (2, (), None),
    "DDP slow rank 3x (instrument)": (2, ("slow-compute=1:3",), ("slow-compute", (1,))),
}
# The schedules of pure pipelines (pp 4, one rank per stage, traced coarse as `--trace` does): interleaved (vpp 2),
# zero bubble (zb-h1) and the dynamic scheduler with its zero-bubble policy (dpp, vpp 2: the last stage sends
# chunk boundaries back to the first). Healthy, one slow P2P link, one slow rank each; ranks vary by schedule.
SCHEDULES = {"interleaved": dict(schedule="interleaved-1f1b", vpp=2), "zb-h1": dict(schedule="zb-h1", vpp=1),
             "dpp-zb": dict(schedule="dpp", vpp=2, dpp_policy="zb")}
_SCHED_FAULTS = {"interleaved": ("1-2", 3), "zb-h1": ("2-3", 1), "dpp-zb": ("0-1", 2)}
for _s, (_link, _rank) in _SCHED_FAULTS.items():
    SCENARIOS[f"pp4 {_s} healthy"] = (4, (), None)
    SCENARIOS[f"pp4 {_s} link {_link} +20 ms"] = (4, (f"slow-link={_link}:20",),
                                                   ("slow-link", tuple(int(x) for x in _link.split("-"))))
    SCENARIOS[f"pp4 {_s} rank {_rank} 1.5x"] = (4, (f"slow-compute={_rank}:1.5",), ("slow-compute", (_rank,)))
# An oversubscribed host: CPU-spinning processes beside the ranks (tp 1, pp 2, dp 2), healthy and one slow rank.
SPINNERS = 4
SCENARIOS["oversubscribed healthy 4"] = (4, (), None)
SCENARIOS["oversubscribed slow compute 2.0x"] = (4, ("slow-compute=3:2.0",), ("slow-compute", (3,)))
OVERSUB = {name for name in SCENARIOS if name.startswith("oversubscribed")}
QUICK = ("healthy 4", "slow compute 2.0x, 1 peer/stage")  # --quick: one repeat of these
# Scenarios of another shape: a pure pipeline (one rank per stage) traced per layer (scan/detect/layercost.py), and the
# schedules above: (tp, pp, dp), granularity, ParallelConfig overrides, layers.
SHAPE: dict[str, tuple[tuple[int, int, int], str, dict, int]] = {
    name: ((1, 4, 1), "full", {}, 4) for name in SCENARIOS if name.startswith("pure pp4")}
SHAPE.update({name: ((1, 4, 1), "coarse", {**kw, "microbatches": 8}, 8)
              for s, kw in SCHEDULES.items() for name in SCENARIOS if name.startswith(f"pp4 {s} ")})


def group_of(name: str) -> str:
    """The scenario group a result is pooled in (layouts and schedules the held-out scenarios span)."""
    if name in PLAIN:
        return "plain FSDP2/DDP (instrument)"
    if name.startswith("pp4 "):
        return "pp4 " + name.split()[1]
    if name in OVERSUB:
        return "oversubscribed host"
    if name.startswith("pure pp4"):
        return "pure pp4 1f1b (per layer)"
    return "8 ranks tp2pp2dp2 1f1b" if SCENARIOS[name][0] == 8 else "4 ranks pp2dp2 1f1b"
KIND_OF = {"slow-compute": "slow-compute", "slow-link": "slow-link", "pause": "transient-pause"}
# Scenarios that are no engine run: a plain PyTorch job traced through scan.instrument() (benchmarks/anyjob.py).
PLAIN = {name: ("fsdp" if name.startswith("FSDP2") else "ddp") for name in SCENARIOS if "(instrument)" in name}


def one_run(name: str, steps: int, out: Path) -> dict:
    """Train, trace and analyse one scenario in THIS process; returns the findings as plain values."""
    load0 = os.getloadavg()[0]
    t0 = time.perf_counter()
    (_plain_run if name in PLAIN else _engine_run)(name, steps, out)
    return {**analysed(out / "trace"), "wall_s": round(time.perf_counter() - t0, 1),
            "load_avg": [round(load0, 2), round(os.getloadavg()[0], 2)]}


def _engine_run(name: str, steps: int, out: Path) -> None:
    """One traced training of the engine (a tiny GPT-2) with the scenario's drills; traces in out/trace."""
    from megatronapp.config import ModelConfig, ParallelConfig, RunConfig, TraceConfig, TrainConfig
    from megatronapp.train.trainer import train

    world, inject, _ = SCENARIOS[name]
    (tp, pp, dp), granularity, kw, layers = SHAPE.get(name, (LAYOUTS[world], "coarse", {}, 4))
    cfg = RunConfig(model=ModelConfig(family="gpt2", hidden_size=64, num_layers=layers, num_heads=4, max_seq_len=32),
                    parallel=ParallelConfig(tp=tp, pp=pp, dp=dp, **{"microbatches": 4, "schedule": "1f1b", **kw}),
                    train=TrainConfig(steps=steps, global_batch_size=8, seq_len=32, warmup_steps=1, out=str(out),
                                      progress=False),
                    trace=TraceConfig(enabled=True, dir=str(out / "trace"), interval=steps, iterations=steps,
                                      granularity=granularity),
                    inject=list(inject))
    train(cfg)


def _plain_run(name: str, steps: int, out: Path) -> None:
    """One traced training of benchmarks/anyjob.py (FSDP2 or DDP, 2 ranks, its own 8 steps); traces in out/trace."""
    from benchmarks.anyjob import job
    from megatronapp.launch import spawn

    run = "slow" if SCENARIOS[name][2] else "healthy"
    spawn(job, SCENARIOS[name][0], str(out), PLAIN[name], (run,))
    (out / run).rename(out / "trace")


def analysed(trace_dir: Path) -> dict:
    from megatronapp.scan.detect.analysis import analyse
    from megatronapp.scan.read.format import read_dir

    traces, problems = read_dir(trace_dir)
    report = analyse(traces).report
    return {"findings": [{"kind": f.kind, "ranks": list(f.ranks), "confidence": f.confidence,
                          "describe": f.describe()} for f in report.findings], "problems": problems}


def _matches(f: dict, fault: str) -> bool:
    kind, spec = fault.split("=", 1)
    ranks = {int(x) for x in spec.split(":")[0].split("-")}
    return f["kind"] == KIND_OF[kind] and set(f["ranks"]) == ranks


def judge(name: str, run: dict) -> dict:
    """Detected: the TOP finding is the injected fault; false alarm: any finding matching no injected fault.
    Over ALL findings: `correct` of `findings_n` match an injected fault (kind and ranks; a consequence folded into
    its cause's evidence is no finding), and `faults_found` of the injected faults are among the findings."""
    _, faults, expected = SCENARIOS[name]
    found = run["findings"]
    detected = bool(expected and found and found[0]["kind"] == expected[0]
                    and set(found[0]["ranks"]) == set(expected[1]))
    false = [f["describe"] for f in found if not any(_matches(f, x) for x in faults)]
    return {"detected": detected, "false_alarms": false, "findings_n": len(found),
            "correct": sum(any(_matches(f, x) for x in faults) for f in found),
            "faults_found": sum(any(_matches(f, x) for f in found) for x in faults), "faults_n": len(faults),
            "false_high": sum(f["confidence"] >= 0.5 for f in found if not any(_matches(f, x) for x in faults))}


def _rates(runs: list[dict]) -> dict:
    """Precision over all findings and recall of the injected faults, each with its Wilson interval."""
    out: dict = {"repeats": len(runs)}
    for key, num, den in (("precision", "correct", "findings_n"), ("recall", "faults_found", "faults_n")):
        k, n = sum(r[num] for r in runs), sum(r[den] for r in runs)
        lo, hi = stats.wilson_ci(k, n) if n else (float("nan"), float("nan"))
        out[key] = {"k": k, "n": n, "value": round(k / n, 3) if n else None,
                    "ci95": [round(lo, 3), round(hi, 3)] if n else None}
    out["false_findings"] = sum(r["findings_n"] - r["correct"] for r in runs)
    out["false_at_c05"] = sum(r["false_high"] for r in runs)
    return out


def summarise(rows: list[dict]) -> list[dict]:
    out = []
    for name, (world, faults, expected) in SCENARIOS.items():
        runs = [r for r in rows if r["scenario"] == name and "error" not in r]
        if not runs:
            continue
        n = len(runs)
        det = sum(r["detected"] for r in runs)
        fa = sum(1 for r in runs if r["false_alarms"])
        lo, hi = stats.wilson_ci(det if expected else n - fa, n)
        out.append({"scenario": name, "group": group_of(name), "world": world, "faults": list(faults), "repeats": n,
                    "detected": det if expected else None, "repeats_with_false_alarm": fa,
                    "rate": (det if expected else n - fa) / n, "ci95": [round(lo, 3), round(hi, 3)],
                    **{k: v for k, v in _rates(runs).items() if k != "repeats"},
                    "load_avg": [min(r["load_avg"][0] for r in runs), max(r["load_avg"][1] for r in runs)],
                    "wall_s_median": sorted(r["wall_s"] for r in runs)[n // 2]})
    return out


def pooled(rows: list[dict]) -> dict:
    """Precision and recall per scenario group and over every run."""
    ok = [r for r in rows if "error" not in r and r["scenario"] in SCENARIOS]
    groups = {}
    for g in dict.fromkeys(group_of(r["scenario"]) for r in ok):
        runs = [r for r in ok if group_of(r["scenario"]) == g]
        groups[g] = {**_rates(runs), "load_avg": [min(r["load_avg"][0] for r in runs),
                                                  max(r["load_avg"][1] for r in runs)]}
    load = [min((r["load_avg"][0] for r in ok), default=0.0), max((r["load_avg"][1] for r in ok), default=0.0)]
    return {"groups": groups, "all": {**_rates(ok), "load_avg": load}}


def _cell(x: dict) -> str:
    if not x["n"]:
        return "-"
    return f"{x['k']}/{x['n']} = {x['value']:.2f} [{x['ci95'][0]:.2f}, {x['ci95'][1]:.2f}]"


def docs_body(res: dict) -> str:
    lines = ["`python -m benchmarks.bench_scan_real` (the real-run scenarios of tests/test_scan_real.py and "
             "tests/test_scan_anyjob.py, each repeated in fresh processes, interleaved; engine runs: "
             f"{res['steps']} traced steps of a tiny GPT-2, 4 microbatches (the pp4 schedule scenarios: 8 layers, 8 "
             "microbatches, one rank per stage, traced coarse); `(instrument)` runs: a 3-layer MLP "
             "under FSDP2 or DDP traced by `scan.instrument()`, 8 steps of 4 microbatches; `oversubscribed`: "
             f"{SPINNERS} CPU-spinning processes beside the 4 ranks; gloo on the shared 2-core machine). "
             "Precision is over ALL findings of every repeat (a finding is correct when its kind and ranks match "
             "an injected fault; a consequence folded into its cause's evidence is no finding), recall over the "
             "injected faults (found anywhere in the list), each with a 95% Wilson interval. Detected: the top "
             "finding is the injected fault; for a healthy run the rate is the share of repeats with no finding. "
             "Load average: 1-minute, at start and end of the repeats (other engineers' jobs: realistic noise).", ""]
    if res.get("before"):
        b = res["before"]
        lines += [f"Before (`{b['detector']}`) and after (`{res.get('detector', 'this branch')}`), judged on the "
                  "identical kept runs (`--reanalyse`):", "",
                  "| group | repeats | precision before | precision after | recall before | recall after | "
                  "false findings at c >= 0.5 before / after | load average |", "|---|---:|---|---|---|---|---|---|"]
        after = res["pooled"]
        for g, a in list(after["groups"].items()) + [("**all**", after["all"])]:
            bb = b["pooled"]["groups"].get(g) if g != "**all**" else b["pooled"]["all"]
            if bb is None:
                continue
            load = a.get("load_avg")
            lines.append(f"| {g} | {a['repeats']} | {_cell(bb['precision'])} | {_cell(a['precision'])} | "
                         f"{_cell(bb['recall'])} | {_cell(a['recall'])} | {bb['false_at_c05']} / "
                         f"{a['false_at_c05']} | {f'{load[0]:.1f}-{load[1]:.1f}' if load else '-'} |")
        lines.append("")
    lines += ["| scenario | ranks | detected (or quiet) [95% CI] | precision over all findings | recall | "
              "repeats with a false alarm | load average | median s per repeat |",
              "|---|---:|---|---|---|---:|---|---:|"]
    for s in res["summary"]:
        k = s["detected"] if s["detected"] is not None else s["repeats"] - s["repeats_with_false_alarm"]
        lines.append(f"| {s['scenario']} | {s['world']} | {k}/{s['repeats']} = {s['rate']:.2f} "
                     f"[{s['ci95'][0]:.2f}, {s['ci95'][1]:.2f}] | {_cell(s['precision'])} | {_cell(s['recall'])} | "
                     f"{s['repeats_with_false_alarm']}/{s['repeats']} | "
                     f"{s['load_avg'][0]:.1f}-{s['load_avg'][1]:.1f} | {s['wall_s_median']:.0f} |")
    lines += ["", f"Measured {res['date']}; {res['note']}" if res.get("note") else f"Measured {res['date']}."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    ap = harness.parser(__doc__, f"one repeat of {', '.join(QUICK)}, 4 steps; writes nothing", from_json=True)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--only", default="", help="comma-separated scenario names (default: all)")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # internal: run one scenario in this process
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--note", default="")
    ap.add_argument("--keep", default="/tmp/megascan_real_runs", help="where each run's trace files are kept")
    ap.add_argument("--reanalyse", action="store_true", help="judge the kept runs again with the current detector")
    ap.add_argument("--as-before", metavar="LABEL", help="with --reanalyse: store this judgement as the BEFORE of "
                    "the kept runs (LABEL names the detector, e.g. main@abc123); the rows keep the last AFTER")
    ap.add_argument("--detector", default="", help="with --reanalyse: a label for the judging detector")
    args = ap.parse_args(argv)
    if args.reanalyse:
        partial = RESULTS.with_suffix(".partial.json")
        if partial.exists():  # a run stopped early (or still going): judge what it has
            rows = json.loads(partial.read_text())
            res = {"steps": args.steps, "repeats": 1 + max((r["repeat"] for r in rows), default=-1),
                   "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "note": args.note, "rows": rows}
        else:
            res = harness.read_result(RESULTS)
        rows = [dict(r) for r in res["rows"]]
        for row in rows:
            if "error" not in row and Path(row.get("trace_dir", "")).is_dir():
                row.update(analysed(Path(row["trace_dir"])))
                row.update(judge(row["scenario"], row))
        if args.as_before:
            res["before"] = {"detector": args.as_before, "summary": summarise(rows), "pooled": pooled(rows),
                             "judged": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                             "findings": [r.get("findings") for r in rows]}
        else:
            res["rows"] = rows
            res["detector"] = args.detector or res.get("detector", "")
        res["summary"] = summarise(res["rows"])
        res["pooled"] = pooled(res["rows"])
        res["reanalysed"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
        res["note"] = args.note or res.get("note", "")
        harness.save(res, RESULTS, docs_body(res), section=TITLE)
        for s in res["summary"]:
            print(s)
        return res
    if args.one:
        print("RESULT " + json.dumps(one_run(args.one, args.steps, Path(args.out))))
        return {}
    if args.from_json:
        return harness.rerender(RESULTS, docs_body, section=TITLE,
                                refresh=lambda r: r.update(summary=summarise(r["rows"]), pooled=pooled(r["rows"])))
    names = [n for n in SCENARIOS if not args.only or n in args.only.split(",")]
    if args.quick:
        names, args.repeats, args.steps = list(QUICK), 1, 4
    clock = harness.Clock()
    rows: list[dict] = []
    for rep in range(args.repeats):
        for name in names:
            keep = Path(args.keep) / f"{name.replace(' ', '_').replace(',', '').replace('/', '-')}" / str(rep)
            spin = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
                    for _ in range(SPINNERS if name in OVERSUB else 0)]
            with tempfile.TemporaryDirectory() as tmp:
                try:
                    proc = subprocess.run([sys.executable, "-m", "benchmarks.bench_scan_real", "--one", name,
                                           "--steps", str(args.steps), "--out", tmp],
                                          capture_output=True, text=True, cwd=harness.ROOT)
                finally:
                    for p in spin:
                        p.kill()
                        p.wait()
                if (Path(tmp) / "trace").is_dir() and not args.quick:  # quick runs leave the kept runs alone
                    shutil.rmtree(keep, ignore_errors=True)
                    shutil.copytree(Path(tmp) / "trace", keep)
            line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
            if line is None:
                rows.append({"scenario": name, "repeat": rep, "error": proc.stderr[-2000:]})
                print(f"ERROR {name}: {proc.stderr[-300:]}", flush=True)
                continue
            run = json.loads(line[7:])
            row = {"scenario": name, "repeat": rep, "trace_dir": str(keep), "spinners": len(spin), **run,
                   **judge(name, run)}
            rows.append(row)
            top = run["findings"][0]["describe"] if run["findings"] else "no finding"
            print(f"{rep} {name:<34} {'DET' if row['detected'] else '   '} fa={len(row['false_alarms'])} "
                  f"load={run['load_avg']} {run['wall_s']}s | {top}", flush=True)
            if not args.quick:
                RESULTS.with_suffix(".partial.json").write_text(json.dumps(rows, indent=1))
    if args.only and RESULTS.exists():  # re-measured some scenarios: keep the stored rows of the others
        rows = [r for r in harness.read_result(RESULTS)["rows"] if r["scenario"] not in names] + rows
    res = {"steps": args.steps, "repeats": args.repeats, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "note": args.note, "machine": harness.machine(clock), "rows": rows}
    res["summary"] = summarise(rows)
    res["pooled"] = pooled(rows)
    for s in res["summary"]:
        print(s)
    if not args.quick:
        harness.save(res, RESULTS, docs_body(res), section=TITLE)
        RESULTS.with_suffix(".partial.json").unlink(missing_ok=True)
    return res


if __name__ == "__main__":
    main()
