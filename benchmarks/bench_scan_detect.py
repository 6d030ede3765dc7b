"""Detection quality of MegaScan on simulated jobs: root-cause precision/recall and false alarms on healthy runs.

Scenarios: fault kinds x positions (first/middle/last stage, different DP/TP slots) x severities (10-50% for
compute and links, pauses and late arrivals of 10-50% of a rank's own iteration work), single and multiple
faults. A finding is a true positive when its kind and ranks match an injected fault (a link finding must name
both ends; a collective-group finding must contain both, except for a link between DP ring neighbours, which
must be named as that pair: the group is no answer an operator can act on). Peer compared: the reference
MegatronApp rule (DP peers only, fixed 0.9/1.1 thresholds on mean compute, exactly one culprit) run on the same traces.
Intervals: precision, recall and the false-alarm rate are proportions over injected faults, findings and healthy
runs; each gets a 95% Wilson interval (the simulation is deterministic per scenario seed, so the uncertainty is which
scenarios were drawn, not timing). Faults of one scenario are not fully independent trials: read the intervals as
slightly narrow.
Second family (`--family real`, results apart in benchmarks/results/scan_detect_real.json): faults injected into
REAL traces by causal re-timing (`scan/synth/perturb.py`): four healthy traced engine runs stored in
benchmarks/data/scan_real/ (pp4: tp1 pp4 dp1, 8 microbatches; tp2pp2dp2; dp4; pp2dp2; 10 traced steps each,
a tiny GPT-2 on gloo ranks of the shared 2-core machine; regenerate with `--record`), each perturbed with known
ground truth (scenarios_real()). The detector was not built from these traces.
Run: python -m benchmarks.bench_scan_detect              (writes benchmarks/results/scan_detect.json, docs block)
     python -m benchmarks.bench_scan_detect --from-json  (re-render the intervals from the stored result)
     python -m benchmarks.bench_scan_detect --family real  (perturbed real traces -> scan_detect_real.json)
     python -m benchmarks.bench_scan_detect --family large (2-3 faults at once on 4,096 / 8,192 simulated ranks)
     python -m benchmarks.bench_scan_detect [--family F] --quick  (a few scenarios of the family; writes nothing)
"""
from __future__ import annotations

import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks import harness, scan_large_family, scan_real_family, stats
from megatronapp.scan.detect.analysis import analyse
from megatronapp.scan.read.format import read_dir
from megatronapp.scan.synth.simulate import Fault, simulate

TP, PP, RANKS = 2, 4, 64  # dp = 8
KIND = {"slow-compute": "slow-compute", "slow-link": "slow-link", "pause": "transient-pause",
        "late-arrival": "late-arrival"}
RESULTS = harness.results_path("scan_detect")
BLOCK = "intervals:bench_scan_detect"
SELF_MS = 53.0  # a rank's own work per iteration in the simulator's default costs (4 microbatches)


def rank(dp: int, pp: int, tp: int) -> int:
    return tp + TP * (dp + (RANKS // (TP * PP)) * pp)


def scenarios() -> list[tuple[str, list[Fault]]]:
    """(name, faults) for every scenario; healthy ones have no faults."""
    out: list[tuple[str, list[Fault]]] = [(f"healthy seed {s}", []) for s in range(10)]
    positions = [(0, 0, 0), (3, 1, 1), (5, 2, 0), (7, 3, 1)]
    for sev in (0.1, 0.2, 0.3, 0.5):
        for d, p, t in positions:
            r = rank(d, p, t)
            out.append((f"slow-compute r{r} x{1 + sev:g}", [Fault("slow-compute", (r,), factor=1 + sev)]))
            nxt = rank(d, p + 1, t) if p < PP - 1 else rank(d, p - 1, t)
            out.append((f"slow-link p2p {r}-{nxt} x{1 + sev:g}", [Fault("slow-link", (r, nxt), factor=1 + sev)]))
            out.append((f"slow-link tp {rank(d, p, 0)}-{rank(d, p, 1)} x{1 + sev:g}",
                        [Fault("slow-link", (rank(d, p, 0), rank(d, p, 1)), factor=1 + sev)]))
            out.append((f"pause r{r} {sev * SELF_MS:.0f}ms", [Fault("pause", (r,), ms=sev * SELF_MS, every=2)]))
            out.append((f"late-arrival r{r} {sev * SELF_MS:.0f}ms", [Fault("late-arrival", (r,), ms=sev * SELF_MS)]))
    for k in range(6):
        rng = np.random.default_rng(k)
        a, b, c = (int(x) for x in rng.choice(RANKS, 3, replace=False))
        d, p = int(rng.integers(0, 8)), int(rng.integers(0, PP - 1))
        out.append((f"multi {k}", [Fault("slow-compute", (a,), factor=1.2), Fault("pause", (b,), ms=20, every=2),
                                   Fault("slow-link", (rank(d, p, 1), rank(d, p + 1, 1)), factor=1.3)]
                    + ([Fault("late-arrival", (c,), ms=10)] if c not in (a, b) else [])))
    # A slow link between two DP ring neighbours (8-rank DP groups), to be named as the pair, not the group.
    # Added last, so the earlier scenarios keep their seeds.
    for sev in (0.1, 0.2, 0.3, 0.5):
        for d, p, t in ((0, 0, 0), (3, 1, 1), (5, 2, 0), (7, 3, 1)):  # (7 -> 0: the ring's closing link)
            a, b = rank(d, p, t), rank((d + 1) % 8, p, t)
            out.append((f"slow-link dp {a}-{b} x{1 + sev:g}", [Fault("slow-link", (a, b), factor=1 + sev)]))
    return out


def matches(finding, fault: Fault, grid: tuple[int, int, int] = (TP, PP, RANKS)) -> bool:
    if finding.kind != KIND[fault.kind]:
        return False
    if fault.kind == "slow-link" and _dp_neighbours(*fault.ranks, grid=grid):
        return set(fault.ranks) == set(finding.ranks)  # the pair inside the DP group, not the group
    return set(fault.ranks) <= set(finding.ranks) if fault.kind == "slow-link" else finding.ranks == fault.ranks


def _dp_neighbours(a: int, b: int, grid: tuple[int, int, int] = (TP, PP, RANKS)) -> bool:
    """Same stage and TP slot, different DP replica: a link inside a DP group (of more than two ranks)."""
    tp, pp, ranks = grid
    dp = ranks // (tp * pp)
    return a % tp == b % tp and a // (tp * dp) == b // (tp * dp) and a != b and dp > 2


def reference_rule(an) -> set[int]:
    """MegatronApp's reference: mean compute per DP peer set, flag one rank outside 0.9/1.1 of the DP mean."""
    tb, ph = an.table, an.phases
    comp = np.nanmean(ph.compute + ph.data, axis=1)
    worst, flagged = 0.0, set()
    for key in {(int(p), int(t)) for _, p, t in tb.coords}:
        ranks = np.flatnonzero((tb.coords[:, 1] == key[0]) & (tb.coords[:, 2] == key[1]))
        ratio = comp[ranks] / comp[ranks].mean()
        i = int(np.argmax(np.abs(ratio - 1)))
        if (ratio[i] > 1.1 or ratio[i] < 0.9) and abs(ratio[i] - 1) > worst:
            worst, flagged = abs(ratio[i] - 1), {int(ranks[i])}
    return flagged


def _proportion(figure: str, k: int, n: int, target: float | None = None, higher_is_better: bool = True) -> dict:
    lo, hi = stats.wilson_ci(k, n)
    row = {"figure": figure, "value": k / n, "ci95": [lo, hi], "n": n, "basis": "Wilson, over scenarios"}
    if target is not None:
        row.update(target=f"{'>=' if higher_is_better else '<='} {target}",
                   claim=stats.claim(lo, hi, target, lower_is_better=not higher_is_better))
    return row


def intervals(res: dict) -> list[dict]:
    """Precision, recall, false-alarm rate on healthy runs and the reference rule's recall, with Wilson intervals."""
    tp, fp, fn = res["true_positives"], res["false_positives"], res["missed"]
    healthy = [r for r in res["rows"] if not r["faults"]]
    alarmed = sum(1 for r in healthy if r["found"])
    ref_n = round(tp + fn)  # the reference rule is scored on the same injected faults
    ref_k = round(res["reference_recall"] * ref_n)
    rate = _proportion(f"healthy runs with a false alarm ({alarmed}/{len(healthy)})", alarmed, len(healthy))
    rate.update(target="0", claim="unresolved: none seen, but a rate up to the upper end is not excluded"
                if alarmed == 0 else "missed")
    return [_proportion(f"precision ({tp}/{tp + fp} findings)", tp, tp + fp, 0.95),
            _proportion(f"recall ({tp}/{tp + fn} injected faults)", tp, tp + fn, 0.95),
            rate,
            _proportion(f"reference rule's recall ({ref_k}/{ref_n})", ref_k, ref_n)]


def docs_block(res: dict) -> str:
    return (stats.interval_table(intervals(res)) + f"\n\n`bench_scan_detect`: {res['scenarios']} simulated "
            f"scenarios on {res['grid']['ranks']} ranks (deterministic: rerunning gives the same counts).")


def main(argv: list[str] | None = None) -> dict:
    ap = harness.parser(__doc__, "a few scenarios of the family; writes nothing", from_json=True)
    ap.add_argument("--family", choices=["sim", "real", "large"], default="sim",
                    help="sim: the simulator's scenarios; real: faults injected into recorded real traces; "
                    "large: several faults at once on 4,096 and 8,192 simulated ranks (a few minutes)")
    ap.add_argument("--recordings", choices=sorted(scan_real_family.RECORDINGS), default="busy",
                    help="which stored recordings --family real perturbs (and --record rewrites)")
    ap.add_argument("--record", action="store_true", help="re-record the healthy real traces of --family real")
    args = ap.parse_args(argv)
    if args.record:
        scan_real_family.record_all(scan_real_family.RECORDINGS[args.recordings][0],
                                    scan_real_family.GRANULARITY.get(args.recordings, "coarse"))
        return {}
    if args.family == "real":
        return scan_real_family.run(args.recordings, quick=args.quick)
    if args.family == "large":
        return scan_large_family.run(matches, quick=args.quick)
    if args.from_json:
        res = harness.rerender(RESULTS, docs_block, block=BLOCK, refresh=lambda r: r.update(intervals=intervals(r)))
        print(stats.interval_table(res["intervals"]))
        return res
    rows, tp, fp, fn, healthy_alarms, ref_tp, ref_fp, ref_fn = [], 0, 0, 0, 0, 0, 0, 0
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for i, (name, faults) in enumerate(scenarios()):
            if args.quick and i % 11:
                continue  # every eleventh scenario (every kind of fault), each with its seed of a full run
            d = Path(tmp) / f"s{i}"
            simulate(d, RANKS, TP, PP, iterations=5, faults=faults, seed=100 + i)
            traces, _ = read_dir(d)
            an = analyse(traces)
            found = an.report.findings
            hit = [any(matches(f, x) for x in faults) for f in found]
            caught = [any(matches(f, x) for f in found) for x in faults]
            tp += sum(caught)
            fn += len(caught) - sum(caught)
            fp += hit.count(False)
            if not faults:
                healthy_alarms += len(found)
            ref = reference_rule(an)
            ref_truth = {x.ranks[0] for x in faults if x.kind in ("slow-compute", "pause", "late-arrival")}
            ref_tp += len(ref & ref_truth)
            ref_fp += len(ref - ref_truth)
            ref_fn += len(ref_truth - ref) + sum(1 for x in faults if x.kind == "slow-link")
            rows.append({"scenario": name, "faults": [x.label() for x in faults],
                         "found": [f.describe() for f in found], "missed": [x.label() for x, c in
                                                                            zip(faults, caught) if not c],
                         "false": [f.describe() for f, h in zip(found, hit) if not h],
                         "reference_flagged": sorted(ref)})
            status = "ok" if all(caught) and all(hit) else "MISS" if not all(caught) else "FALSE"
            print(f"{status:>5}  {name:<34} found {len(found)}")
    res = {"scenarios": len(rows), "faulty_scenarios": sum(1 for r in rows if r["faults"]),
           "healthy_runs": sum(1 for r in rows if not r["faults"]),
           "precision": round(tp / max(tp + fp, 1), 4), "recall": round(tp / max(tp + fn, 1), 4),
           "false_alarms_on_healthy_runs": healthy_alarms, "true_positives": tp, "false_positives": fp,
           "missed": fn, "reference_precision": round(ref_tp / max(ref_tp + ref_fp, 1), 4),
           "reference_recall": round(ref_tp / max(ref_tp + ref_fn, 1), 4),
           "grid": {"ranks": RANKS, "tp": TP, "pp": PP, "dp": RANKS // (TP * PP), "iterations": 5},
           "wall_s": round(time.perf_counter() - t0, 1), "machine": harness.machine(), "rows": rows}
    res["intervals"] = intervals(res)
    print(stats.interval_table(res["intervals"]))
    print(f"MegaScan: precision {res['precision']}, recall {res['recall']}, healthy false alarms "
          f"{healthy_alarms} over {res['healthy_runs']} runs | reference rule: precision "
          f"{res['reference_precision']}, recall {res['reference_recall']}")
    if not args.quick:
        harness.save(res, RESULTS, docs_block(res), block=BLOCK)
    return res


if __name__ == "__main__":
    main()
