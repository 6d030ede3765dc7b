"""ZeRO-1 in place on emulated devices: what the per-step buddy copy of the optimizer slices costs, and what it buys.

The drills' job (recovery_emulated.flags: tp2 x pp2 x dp2, 8 ranks, a checkpoint every 2 steps) with `--zero 1`
and one warm spare, in two variants, alternating per pair so a drift of the host's load falls on both:
  buddy     each rank copies its optimizer slice to its DP buddy after every step (`resilience/buddy.py`): a lost
            rank's slice comes from memory (recovery source "peer+buddy")
  no buddy  `--no-buddy-copy`: no copy; a loss sends every rank back to the newest checkpoint (source "disk"),
            the steps since it computed again
Two measurements:
  overhead  jobs without a fault. The copy runs in the run loop's hooks, between steps (sent at `step_end`, waited
            at the next `step_start`), outside a step record's `step_time`, so the figure is the job's wall time
            per step (summary.json's tokens/s: the whole run, first step and saves included); the median
            `step_time` of the steady state is reported beside it. Paired ratio buddy / no buddy.
  copy      in-process, the same layout and model on 8 spawned ranks with the same emulated devices (no
            supervisor): the seconds each rank's training thread spends in the copy at each step's start
            (`BuddyCopy.copy`: pack, header exchange, bytes, the store report replaced by nothing), beside its
            step time: the copy's share of a step without the noise of whole jobs.
  drills    the same drawn kill -9 (rank, step, delay; seeded) in a buddy job and a no-buddy job: seconds from the
            kill to the next committed step, the source, and the steps computed again.
"""
from __future__ import annotations

import os
import random
import statistics
from typing import Any

from benchmarks import harness, recovery_emulated, recovery_inplace, stats

RESULTS = harness.results_path("recovery_zero_emulated")
TARGET = 1.03  # issue 41: the machinery's steady-state cost <= 3% of step time
STEPS = 10
SIDES = ("nobuddy", "buddy")
ZERO = ["--zero", "1"]
NO_BUDDY = ["--no-buddy-copy"]


def _extra(side: str) -> list[str]:
    return ZERO + (NO_BUDDY if side == "nobuddy" else [])


def job(side: str, timeout_s: float = 600.0) -> dict[str, Any]:
    """One supervised job with a spare and no fault: its wall time per step and steady-state step time."""
    ran, summary = recovery_inplace.quiet_job([*recovery_emulated.flags(8, STEPS), "--spares", "1", *_extra(side)],
                                              timeout_s)
    return {"side": side, **ran, "wall_per_step_s": _tokens_per_step() / float(summary["tokens_per_s"]),
            "host_share": summary.get("emulation", {}).get("host_share"), "load_avg": os.getloadavg()[0]}


def _tokens_per_step() -> float:
    """Tokens of one step of the job (summary.json's tokens/s is over the run's wall time)."""
    f = recovery_emulated.flags(8, STEPS)
    return float(f[f.index("--global-batch") + 1]) * float(f[f.index("--seq-len") + 1])


def overhead(pairs: int) -> dict[str, Any]:
    runs = harness.paired_runs(list(SIDES), pairs, job, lambda r: f"{r['wall_per_step_s']:.4f} s per step (step_time "
                               f"{r['step_time_s']:.4f} s), load {r['load_avg']:.1f}")
    ratio = stats.summarize_ratios(stats.paired_ratios([p["buddy"]["wall_per_step_s"] for p in runs],
                                                       [p["nobuddy"]["wall_per_step_s"] for p in runs]))
    diffs = [1000 * (p["buddy"]["wall_per_step_s"] - p["nobuddy"]["wall_per_step_s"]) for p in runs]
    lo, hi = stats.bootstrap_ci(diffs) if len(diffs) > 1 else (diffs[0], diffs[0])
    res = {"pairs": runs, "ratio": ratio, "difference_ms": {"median": statistics.median(diffs), "ci95": [lo, hi]},
           "nobuddy_wall_per_step_s": statistics.median(p["nobuddy"]["wall_per_step_s"] for p in runs),
           "claim": stats.claim(*ratio["ci95"], TARGET), "target": TARGET}
    print(f"buddy / no buddy wall per step: {stats.fmt(ratio)}; difference {res['difference_ms']['median']:.1f} ms "
          f"[{lo:.1f}, {hi:.1f}]; target <= {TARGET}: {res['claim']}")
    return res


def _copy_worker(rank: int, world: int, steps: int, outdir: str) -> None:
    import time

    from megatronapp.cli import build_parser, config_from_args
    from megatronapp.resilience.buddy import BuddyCopy
    from megatronapp.train.trainer import Trainer

    flags = recovery_emulated.flags(8, steps + 2)
    flags = flags[:flags.index("--supervise")] + flags[flags.index("--emulate-device"):]  # the rank's own flags
    cfg = config_from_args(build_parser().parse_args(["train", *flags, *ZERO, "--out", outdir + "/run"]))
    tr = Trainer(cfg, rank)
    buddy = BuddyCopy(tr, lambda key, value: None)
    copies, steps_s = [], []
    for _ in range(steps + 2):
        t0 = time.perf_counter()
        buddy.copy(tr.step)
        copies.append(time.perf_counter() - t0)
        steps_s.append(tr.train_step()["step_time"])
    tr.close()
    harness.report(outdir, rank, {"copy_s": copies[2:], "step_s": steps_s[2:],  # steady state: after two steps
                                  "slice_bytes": int(tr.optimizer.state_bytes())})


def copy_cost(steps: int = 6) -> dict[str, Any]:
    """Seconds in the copy per rank and step, and its share of the step (worst rank), measured in place."""
    ranks = harness.launch(_copy_worker, 8, steps)
    copy_ms = [1000 * statistics.median(r["copy_s"]) for r in ranks]
    step_s = statistics.median(s for r in ranks for s in r["step_s"])
    worst = max(ranks, key=lambda r: statistics.median(r["copy_s"]))
    shares = [c / s for c, s in zip(worst["copy_s"], worst["step_s"])]
    res = {"copy_ms_per_rank": copy_ms, "copy_ms_max": max(copy_ms), "step_s": step_s,
           "share_worst_rank": {"median": statistics.median(shares), "max": max(shares)},
           "slice_bytes": [r["slice_bytes"] for r in ranks], "steps": steps}
    print(f"copy per step: {min(copy_ms):.2f}-{max(copy_ms):.2f} ms by rank (medians) on a {step_s:.3f} s step; "
          f"worst rank's share {100 * res['share_worst_rank']['median']:.3f}% (max "
          f"{100 * res['share_worst_rank']['max']:.3f}%)", flush=True)
    return res


def drills(n: int, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    out: dict[str, list[dict[str, Any]]] = {s: [] for s in SIDES}
    for i in range(n):
        fault = recovery_emulated.draw(rng, "kill", 8)
        for side in harness.rotation(list(SIDES), i):
            flags = [*recovery_emulated.flags(8), *_extra(side)]
            try:
                d = recovery_inplace.drill(flags, 8, fault)
            except (RuntimeError, OSError, ValueError, KeyError) as e:
                d = {**fault, "error": f"{type(e).__name__}: {str(e)[-1500:]}"}
            out[side].append(d)
            print(f"drill {i + 1} {side}: rank {fault['victim']} after step {fault['step']} +{fault['delay_s']:.2f} s"
                  + (f": FAILED {d['error'][-300:]}" if "error" in d else
                     f" ({d['phase_at_fault']}): {d['total']:.2f} s from {d['source']}, {d['replayed_steps']} "
                     f"step(s) again"), flush=True)
    return refresh({"seed": seed, "drills": out})


def refresh(dr: dict[str, Any]) -> dict[str, Any]:
    """The drills' summary per side from its raw drills (kept with them; `--from-json` recomputes it)."""
    summary = {}
    for side, ds in dr["drills"].items():
        ok = [d for d in ds if recovery_emulated.valid(d)]
        totals = [d["total"] for d in ok if d.get("total") is not None]
        # back where the job stood: the first commit, plus the steps computed again (at the job's step time)
        regained = [d["total"] + d["replayed_steps"] * d["step_time_s"] for d in ok
                    if d.get("total") is not None and d.get("step_time_s") is not None]
        summary[side] = {"total": recovery_emulated.median_ci(totals) if totals else None,
                         "regained": recovery_emulated.median_ci(regained) if regained else None,
                         "sources": sorted({d["source"] for d in ok}),
                         "replayed_steps": [d["replayed_steps"] for d in ok], "valid": len(ok), "drills": len(ds)}
    dr["summary"] = summary
    return dr


def main(pairs: int, n_drills: int, seed: int = 41, write: bool = True) -> dict[str, Any]:
    """With `pairs`, the overhead; with `n_drills`, the drills; each kept in the results file beside the other."""
    clock = harness.Clock()
    result = harness.read_result(RESULTS) if RESULTS.is_file() else {}
    if pairs:
        result["copy"] = {**copy_cost(), "timestamp": clock.timestamp}
        result["overhead"] = {**overhead(pairs), "timestamp": clock.timestamp}
    if n_drills:
        result["drills"] = {**drills(n_drills, seed), "timestamp": clock.timestamp}
    elif result.get("drills"):
        refresh(result["drills"])  # stored drills: their summary as this version computes it
    result.update(flags=[*recovery_emulated.flags(8, STEPS), *ZERO], timestamp=clock.timestamp,
                  machine=harness.machine(clock, emulated=True))
    if write:
        harness.save(result, RESULTS, docs_body(result), block="recovery-zero")
    return result


def docs_body(res: dict[str, Any]) -> str:
    parts = ["**ZeRO-1 in place: the buddy copy** (`python -m benchmarks.bench_recovery --emulated --zero "
             "[--overhead]`): the drills' job (tp2 x pp2 x dp2 on emulated devices) with `--zero 1 --spares 1`, "
             "with the per-step copy of each rank's optimizer slice to its DP buddy and without it "
             "(`--no-buddy-copy`), alternating."]
    c = res.get("copy")
    if c:
        parts.append(f"In place ({c['steps']} steps on 8 spawned ranks, same layout, model and emulated devices, "
                     f"no supervisor): the copy takes **{min(c['copy_ms_per_rank']):.1f}-{c['copy_ms_max']:.1f} ms** "
                     f"of a rank's training thread per step (medians by rank; slices of "
                     f"{min(c['slice_bytes']) // 1024}-{max(c['slice_bytes']) // 1024} KiB) on a {c['step_s']:.3f} s "
                     f"step: **{100 * c['share_worst_rank']['median']:.2f}%** of the worst rank's step (max "
                     f"{100 * c['share_worst_rank']['max']:.2f}%).")
    o = res.get("overhead")
    if o:
        r, d = o["ratio"], o["difference_ms"]
        steps = [x["step_time_s"] for p in o["pairs"] for x in p.values()]
        spread = max(abs(p["buddy"]["step_time_s"] / p["nobuddy"]["step_time_s"] - 1) for p in o["pairs"])
        loads = [x["load_avg"] for p in o["pairs"] for x in p.values()]
        parts.append(
            f"Steady state ({STEPS} steps, no fault, {r['n']} pairs): wall time per step with over without the copy "
            f"**{r['ratio']:.4f}** [{r['ci95'][0]:.4f}, {r['ci95'][1]:.4f}] ({r['verdict']}), a difference of "
            f"{d['median']:.1f} ms [{d['ci95'][0]:.1f}, {d['ci95'][1]:.1f}] on {o['nobuddy_wall_per_step_s']:.3f} s "
            f"per step; target <= 3%: **{o['claim']}**. The copy runs at each step's start, before the step's work "
            f"(a kill in any phase of the step finds it whole), outside a record's `step_time` (median "
            f"{statistics.median(steps):.3f} s), so this figure is the run's wall time per step (first step and "
            f"saves included); within a pair the records' own `step_time`, which holds no copy, differed by up to "
            f"{100 * spread:.1f}% at load {min(loads):.1f}-{max(loads):.1f} on 2 shared cores: the whole-job figure "
            f"is the host's noise more than the copy, which the in-place figure above measures directly.")
    dr = res.get("drills")
    if dr:
        s = dr["summary"]

        def cell(side: str) -> str:
            x = s[side]
            if not x["total"]:
                return f"no valid drill ({x['drills']} run)"
            t, g = x["total"], x.get("regained")
            back = (f", back at the step the job had reached {g['median_s']:.2f} s [{g['ci95'][0]:.2f}, "
                    f"{g['ci95'][1]:.2f}]" if g else "")
            return (f"**{t['median_s']:.2f} s** [{t['ci95'][0]:.2f}, {t['ci95'][1]:.2f}] to the next committed step "
                    f"(from {'/'.join(x['sources'])}; steps computed again {x['replayed_steps']}){back} "
                    f"({x['valid']}/{x['drills']} valid)")
        parts.append(f"Kill -9 of a drawn rank after a drawn step (seed {dr['seed']}), the same draw in both jobs, "
                     f"seconds from the kill, median [bootstrap 95%]: with the buddy copy {cell('buddy')}; without "
                     f"it {cell('nobuddy')}. \"Back\" adds the steps computed again at the job's step time. The job "
                     f"checkpoints every 2 steps and loads in place in about 0.05 s, so the disk costs here at most "
                     f"one step computed again; with a checkpoint every N steps it costs up to N-1, the buddy copy "
                     f"none.")
    when = sorted({res[k].get("timestamp", res["timestamp"]) for k in ("copy", "overhead", "drills") if res.get(k)})
    parts.append(f"Recorded {', '.join(when)}; raw runs: `benchmarks/results/recovery_zero_emulated.json`.")
    return " ".join(parts)
