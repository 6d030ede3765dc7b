"""MegaScan's LARGE simulator sub-family: several faults of different kinds at once on 4,096 and 8,192 ranks.

Used by `python -m benchmarks.bench_scan_detect --family large` (results apart in
benchmarks/results/scan_detect_large.json). The main simulator family runs 64 ranks; at thousands of ranks every
per-(rank, iteration) comparison is made millions of times and the noise floor, a victim's delay and one fault's
shadow on another's peers all have more chances to pass for a fault. Scenarios: healthy runs, and 2-3 faults of
different kinds (slow compute, a pause every other iteration, a late arrival, a slow P2P link between pipeline
neighbours) on random ranks, seeds varied; tp 8, pp 8 (4,096 ranks) and pp 16 (8,192 ranks), 5 iterations, the
simulator's default costs. A finding counts as in the main family (bench_scan_detect.matches); every finding that
matches no injected fault is a false positive. About 20-40 s a scenario on the shared 2-core machine.
"""
from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks import harness, stats
from megatronapp.scan.detect.analysis import analyse
from megatronapp.scan.read.format import read_dir
from megatronapp.scan.synth.simulate import Fault, simulate

RESULTS = harness.results_path("scan_detect_large")
TITLE = "## MegaScan detection at 4,096 and 8,192 simulated ranks (several faults at once)"
TP = 8
GRIDS = {4096: 8, 8192: 16}  # ranks -> pp (tp 8)


def _rank(tp: int, dp: int, d: int, p: int, t: int) -> int:
    return t + tp * (d + dp * p)


def scenarios() -> list[tuple[str, int, int, int, list[Fault]]]:
    """(name, ranks, pp, seed, faults) per scenario."""
    out: list[tuple[str, int, int, int, list[Fault]]] = []
    for ranks, pp in GRIDS.items():
        out.append((f"{ranks} healthy", ranks, pp, 7, []))
    # Which kinds meet (slow compute, pause, late arrival, slow link): every pair at least once, triples too.
    combos = [(0, 1), (0, 2, 3), (1, 2), (0, 1, 3), (2, 3), (0, 1, 2), (1, 3), (0, 3)]
    for k, combo in enumerate(combos):
        ranks = 4096 if k % 2 == 0 else 8192
        pp = GRIDS[ranks]
        dp = ranks // (TP * pp)
        rng = np.random.default_rng(1000 + k)
        a, b, c = (int(x) for x in rng.choice(ranks, 3, replace=False))
        self_ms = 13.0 * max(pp, 2)  # a rank's own work per iteration: ~13 ms a micro-batch, pp micro-batches
        d, p, t = int(rng.integers(0, dp)), int(rng.integers(0, pp - 1)), int(rng.integers(0, TP))
        link = Fault("slow-link", (_rank(TP, dp, d, p, t), _rank(TP, dp, d, p + 1, t)), factor=1.3)
        pool = [Fault("slow-compute", (a,), factor=1.2 + 0.1 * (k % 3)),
                Fault("pause", (b,), ms=round(0.15 * self_ms, 1), every=2),
                Fault("late-arrival", (c,), ms=round(0.1 * self_ms, 1)), link]
        faults = [pool[i] for i in combo]
        out.append((f"{ranks} multi {k}: " + ", ".join(f.label() for f in faults), ranks, pp, 100 + k, faults))
    return out


def run(matches, quick: bool = False) -> dict:
    """Every scenario judged with `matches` (bench_scan_detect's rule); `quick`: the first two, nothing written."""
    rows, tp_, fp, fn, healthy_alarms = [], 0, 0, 0, 0
    t0 = time.perf_counter()
    for name, ranks, pp, seed, faults in scenarios()[:2] if quick else scenarios():
        with tempfile.TemporaryDirectory() as tmp:
            simulate(tmp, ranks, TP, pp, iterations=5, faults=faults, seed=seed)
            traces, _ = read_dir(Path(tmp))
            found = analyse(traces, release_traces=True).report.findings
        grid = (TP, pp, ranks)
        hit = [any(matches(f, x, grid) for x in faults) for f in found]
        caught = [any(matches(f, x, grid) for f in found) for x in faults]
        tp_ += sum(caught)
        fn += len(caught) - sum(caught)
        fp += hit.count(False)
        healthy_alarms += 0 if faults else len(found)
        rows.append({"scenario": name, "faults": [x.label() for x in faults], "found": [f.describe() for f in found],
                     "missed": [x.label() for x, c in zip(faults, caught) if not c],
                     "false": [f.describe() for f, h in zip(found, hit) if not h]})
        status = "ok" if all(caught) and all(hit) else "MISS" if not all(caught) else "FALSE"
        print(f"{status:>5}  {name:<90} found {len(found)}", flush=True)
    res = {"scenarios": len(rows), "healthy_runs": sum(1 for r in rows if not r["faults"]),
           "injected_faults": tp_ + fn, "precision": round(tp_ / max(tp_ + fp, 1), 4),
           "recall": round(tp_ / max(tp_ + fn, 1), 4), "true_positives": tp_, "false_positives": fp,
           "missed": fn, "false_alarms_on_healthy_runs": healthy_alarms,
           "wall_s": round(time.perf_counter() - t0, 1),
           "date": time.strftime("%Y-%m-%d", time.gmtime()), "machine": harness.machine(), "rows": rows}
    print(json.dumps({k: v for k, v in res.items() if k not in ("rows", "machine")}))
    if not quick:
        harness.save(res, RESULTS, docs_body(res), section=TITLE)
    return res


def docs_body(res: dict) -> str:
    return "\n".join(["`python -m benchmarks.bench_scan_detect --family large`: "
                      f"{res['scenarios'] - res['healthy_runs']} scenarios with 2-3 faults of different kinds and "
                      f"{res['healthy_runs']} healthy ones, simulated on 4,096 (tp 8, pp 8) and 8,192 ranks (tp 8, "
                      f"pp 16), 5 iterations ({res['injected_faults']} injected faults; {res['wall_s']:.0f} s in all). "
                      "Every finding counts: one that matches no injected fault is a false positive. Deterministic "
                      "per seed.", ""] + stats.detection_table(res))
