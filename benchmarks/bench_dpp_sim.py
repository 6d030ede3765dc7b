"""MegaDPP in simulation: dpp-adaptive against interleaved 1F1B (Megatron) and ZB-H1 (Zero Bubble).

`python -m benchmarks.bench_dpp_sim` simulates one step for pp in {4, 8, 16}, microbatches in {16, 64} and three
jitter levels on compute and links, averaging step times over seeds (every schedule sees the same jitter draws
for a seed). dpp-adaptive runs with its memory cap set to interleaved 1F1B's peak (the fair comparison) and
uncapped. Prints ratios (< 1: dpp-adaptive is faster), the peak activation memory of the busiest stage, and
writes benchmarks/results/dpp_sim.json.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from statistics import mean

from megatronapp.dpp.simulator import SimConfig, simulate

JITTER = {  # (compute, link)
    "none": ("none", "none"),
    "low": ("lognormal:0.1", "lognormal:0.3"),
    "high": ("lognormal:0.3", "lognormal:1.0"),
}
# A model cut in pp * vpp chunks; per-chunk forward 1, backward 2 (time units). A message between stages
# costs 0.25 latency + 0.25 on the wire (one message at a time per direction): inter-node pipeline links.
BASE = {"vpp": 2, "fwd": 1.0, "bwd": 2.0, "latency": 0.25, "act_bytes": 1.0, "bandwidth": 4.0}
TARGETS = {"no_jitter_max_slowdown": 1.02, "high_jitter_min_speedup": 0.90}


def run_case(pp: int, m: int, level: str, seeds: list[int]) -> dict:
    """Mean step time and peak memory of each schedule over `seeds` for one configuration."""
    cj, lj = JITTER[level]
    steps: dict[str, list[float]] = {}
    peaks: dict[str, float] = {}
    for seed in seeds:
        cfg = SimConfig(pp=pp, microbatches=m, compute_jitter=cj, link_jitter=lj, seed=seed, **BASE)
        inter = simulate("interleaved-1f1b", cfg, timeline=False)
        cap = max(inter.peak_inflight)  # interleaved 1F1B's busiest stage, in chunk activations
        runs = {"interleaved-1f1b": inter, "zb-h1": simulate("zb-h1", cfg, timeline=False),
                "dpp-adaptive": simulate("dpp-adaptive", SimConfig(**{**cfg.__dict__, "max_inflight": cap}),
                                         timeline=False),
                "dpp-adaptive-uncapped": simulate("dpp-adaptive", cfg, timeline=False)}
        for name, r in runs.items():
            steps.setdefault(name, []).append(r.step_time)
            peaks[name] = max(peaks.get(name, 0.0), max(r.peak_activation))
    step = {k: mean(v) for k, v in steps.items()}
    return {"pp": pp, "microbatches": m, "jitter": level, "compute_jitter": cj, "link_jitter": lj,
            "step": step, "peak_activation": peaks,
            "ratio_vs_interleaved": {k: step[k] / step["interleaved-1f1b"] for k in step},
            "ratio_vs_zb_h1": {k: step[k] / step["zb-h1"] for k in step}}


def scale_check() -> dict:
    """CPU seconds to simulate pp=64 with 512 microbatches (the simulator's stated scale)."""
    cfg = SimConfig(pp=64, microbatches=512, compute_jitter="lognormal:0.3", link_jitter="lognormal:1.0",
                    latency=0.25)
    out = {}
    for name in ("1f1b", "zb-h1", "dpp-adaptive"):
        t0 = time.process_time()
        simulate(name, cfg, timeline=False)
        out[name] = round(time.process_time() - t0, 2)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--out", default="benchmarks/results/dpp_sim.json")
    args = ap.parse_args(argv)
    seeds = list(range(args.seeds))
    rows = [run_case(pp, m, level, seeds) for pp in (4, 8, 16) for m in (16, 64) for level in JITTER]
    print(f"step-time ratios (< 1: faster), mean of {len(seeds)} seeds; peak = activations on the busiest stage "
          f"in whole-stage units; dpp = dpp-adaptive capped at interleaved's peak, dpp-u = uncapped")
    head = (f"{'pp':>3} {'m':>4} {'jitter':>6} | {'zb/int':>7} {'dpp/int':>8} {'dpp/zb':>7} {'dpp-u/int':>9} | "
            f"{'peak int':>8} {'zb':>5} {'dpp':>5} {'dpp-u':>6}")
    print(head)
    print("-" * len(head))
    for r in rows:
        ri, rz, pk = r["ratio_vs_interleaved"], r["ratio_vs_zb_h1"], r["peak_activation"]
        print(f"{r['pp']:>3} {r['microbatches']:>4} {r['jitter']:>6} | {ri['zb-h1']:>7.3f} {ri['dpp-adaptive']:>8.3f} "
              f"{rz['dpp-adaptive']:>7.3f} {ri['dpp-adaptive-uncapped']:>9.3f} | {pk['interleaved-1f1b']:>8.2f} "
              f"{pk['zb-h1']:>5.2f} {pk['dpp-adaptive']:>5.2f} {pk['dpp-adaptive-uncapped']:>6.2f}")
    quiet = [r["ratio_vs_interleaved"]["dpp-adaptive"] for r in rows if r["jitter"] == "none"]
    loud = [r["ratio_vs_interleaved"]["dpp-adaptive"] for r in rows if r["jitter"] == "high"]
    loud_u = [r["ratio_vs_interleaved"]["dpp-adaptive-uncapped"] for r in rows if r["jitter"] == "high"]
    mem_ok = all(r["peak_activation"]["dpp-adaptive"] <= r["peak_activation"]["interleaved-1f1b"] + 1e-9
                 for r in rows)
    verdict = {
        "no_jitter_worst_ratio": max(quiet),
        "no_jitter_target_met": max(quiet) <= TARGETS["no_jitter_max_slowdown"],
        "high_jitter_best_ratio": min(loud), "high_jitter_worst_ratio": max(loud),
        "high_jitter_target_met_all": max(loud) <= TARGETS["high_jitter_min_speedup"],
        "high_jitter_uncapped_worst_ratio": max(loud_u),
        "capped_memory_never_above_interleaved": mem_ok,
    }
    scale = scale_check()
    print(f"\nno jitter: worst dpp/int {verdict['no_jitter_worst_ratio']:.3f} (target <= 1.02: "
          f"{'met' if verdict['no_jitter_target_met'] else 'MISSED'})")
    print(f"high jitter: dpp/int from {verdict['high_jitter_best_ratio']:.3f} to "
          f"{verdict['high_jitter_worst_ratio']:.3f} (target <= 0.90 everywhere: "
          f"{'met' if verdict['high_jitter_target_met_all'] else 'MISSED'}); uncapped worst "
          f"{verdict['high_jitter_uncapped_worst_ratio']:.3f}")
    print(f"capped dpp memory never above interleaved 1F1B: {mem_ok}")
    print(f"pp=64, 512 microbatches, CPU seconds per simulated step: {scale}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"base": BASE, "jitter": JITTER, "seeds": seeds, "targets": TARGETS,
                               "verdict": verdict, "scale_cpu_s": scale, "rows": rows}, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
