"""MegaFBD on emulated devices (run through `python -m benchmarks.bench_fbd --emulated`; see its docstring).

Backward layout pp=4 (8 layers, 8 microbatches), every rank on an emulated device of the same nominal rate; the
forward instances' devices run at 1/k of it. Per run: median step time after the first (a step ends when its
slowest rank's does), each backward stage's peak activation bytes (saved-tensor hooks), every rank's host share.
"""
from __future__ import annotations

import math
import os
import statistics
import time
from typing import Any

from benchmarks import harness
from benchmarks.fbd_runs import EMU_FORWARD_S, config, measure, step_time
from megatronapp.config import RunConfig
from megatronapp.dpp import emulated as dpp_emulated
from megatronapp.fbd import simulate as fbd_sim
from megatronapp.parallel import device_emulation as emu

LAYOUT = "pp4"
FACTORS = (1, 2, 4)


def _tflops() -> float:
    cfg = RunConfig.from_dict(config(LAYOUT, False, 1))
    return emu.virtual_flops(cfg)[1][0] / EMU_FORWARD_S / 1e12


def costs(tflops: float) -> tuple[list[float], list[float]]:
    """Per virtual stage: a forward instance's forward and a backward rank's recompute + backward, in device s."""
    cfg = RunConfig.from_dict(config(LAYOUT, False, 1))
    rate = tflops * 1e12
    virtual = emu.virtual_flops(cfg)
    return [f / rate for f, _, _ in virtual], [(f + b + w) / rate for f, b, w in virtual]


def balanced(t_fwd: list[float], t_bwd: list[float], k: float) -> int:
    """Instances that keep up: an instance makes a microbatch every k * (forward of stages 0..V-2); the slowest
    backward stage takes one every max(t_bwd)."""
    return max(1, math.ceil(k * sum(t_fwd[:-1]) / max(t_bwd) - 1e-9))


def run_dict(kind: str, steps: int, tflops: float, k: float = 1.0, n: int = 1) -> dict[str, Any]:
    d = config(LAYOUT, kind == "fbd", steps)
    spec = f"tflops={tflops:.6g}"
    if kind == "fbd":
        d["parallel"]["fbd_forward_instances"] = n
        wb = RunConfig.from_dict(config(LAYOUT, False, 1)).parallel.world_size
        if k != 1:
            spec += f",speed={wb}-{wb + n - 1}:{1 / k:.6g}"
    if kind == "coupled-recompute":
        d["train"]["recompute"] = "full"
    d["emulate_device"] = spec
    return d


def _host_share(ranks: list[dict]) -> float:
    return emu.summarize("tflops=1", [r["emulation"] for r in ranks if r["emulation"]])["host_share"]


def emulated_runs(steps: int = 5) -> dict[str, Any]:
    """Coupled, coupled --recompute full, and MegaFBD for k in FACTORS with 1 and the balanced instances."""
    clock = harness.Clock()
    tflops = _tflops()
    t_fwd, t_bwd = costs(tflops)
    out: dict[str, Any] = {"layout": LAYOUT, "tflops": tflops, "forward_s": EMU_FORWARD_S, "steps": steps,
                           "t_fwd_s": t_fwd, "t_bwd_s": t_bwd, "runs": []}
    coupled = measure(LAYOUT, False, steps, run_dict("coupled", steps, tflops))
    recompute = measure(LAYOUT, False, steps, run_dict("coupled-recompute", steps, tflops))
    coupled_cfg = RunConfig.from_dict(run_dict("coupled", steps, tflops))
    params = [next(r["params"] for r in coupled if r["stage"] == s) for s in range(4)]
    opt = dpp_emulated.optimizer_seconds(coupled_cfg, params)
    t_c = step_time(coupled)
    sim_c = statistics.median(dpp_emulated.predict(coupled_cfg, s).step_time for s in range(1, steps)) + opt
    out["coupled"] = {"step_s": t_c, "simulated_s": sim_c, "sim_error": sim_c / t_c - 1,
                      "host_share": _host_share(coupled),
                      "stage_bytes": {r["stage"]: r["peak_saved_bytes"] for r in coupled}}
    out["coupled_recompute_full"] = {"step_s": step_time(recompute), "host_share": _host_share(recompute),
                                     "stage_bytes": {r["stage"]: r["peak_saved_bytes"] for r in recompute}}
    for k in FACTORS:
        n_bal = balanced(t_fwd, t_bwd, k)
        for n in sorted({1, n_bal}):
            ranks = measure(LAYOUT, True, steps, run_dict("fbd", steps, tflops, k, n))
            back = [r for r in ranks if r["role"] == "backward"]
            t = step_time(ranks)
            sim = fbd_sim.fbd_step(4, 8, n, t_fwd, t_bwd, k) + opt
            out["runs"].append({"k": k, "instances": n, "balanced": n == n_bal, "step_s": t,
                                "vs_coupled": t / t_c, "simulated_s": sim, "sim_error": sim / t - 1,
                                "host_share": _host_share(ranks),
                                "stage_bytes": {r["stage"]: r["peak_saved_bytes"] for r in back}})
            print(f"k={k} n={n}: {t:.3f} s ({t / t_c:.3f} of coupled), sim {sim:.3f} s", flush=True)
    out["wall_s"] = clock.wall_s()
    worst = max(r["host_share"] for r in [out["coupled"], out["coupled_recompute_full"], *out["runs"]])
    out["machine"] = harness.machine(clock, emulated=True, host_share=worst)
    return out


def remeasure(result: dict[str, Any], which: list[tuple[int, int]], steps: int = 5) -> dict[str, Any]:
    """Measure the MegaFBD runs (k, instances) in `which` again, in place (a run a crowded host pushed out of the
    accelerator regime); the coupled reference stays."""
    t_c = result["coupled"]["step_s"]
    for row in result["runs"]:
        if (row["k"], row["instances"]) not in which:
            continue
        ranks = measure(LAYOUT, True, steps, run_dict("fbd", steps, result["tflops"], row["k"], row["instances"]))
        t = step_time(ranks)
        row.update(step_s=t, vs_coupled=t / t_c, sim_error=row["simulated_s"] / t - 1, host_share=_host_share(ranks),
                   remeasured=time.strftime("%Y-%m-%dT%H:%M:%S%z"), load_avg_after=os.getloadavg())
        print(f"k={row['k']} n={row['instances']}: {t:.3f} s, host share {row['host_share']:.2f}", flush=True)
    return result


def emulated_table(result: dict[str, Any]) -> str:
    """Markdown: step times vs coupled and the simulator; activation bytes per stage for the three designs."""
    c, m = result["coupled"], harness.machine_of(result)
    fwd = f", a middle virtual stage's forward {1e3 * result['forward_s']:.0f} ms" if "forward_s" in result else ""
    lines = [f"Coupled 1F1B (pp 4, emulated{fwd}): {c['step_s']:.3f} s/step, simulated {c['simulated_s']:.3f} s "
             f"({c['sim_error']:+.1%}), host share {c['host_share']:.2f}.", "",
             "| forward devices | forward instances | MegaFBD step | vs coupled | simulated | sim error | host share |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for r in result["runs"]:
        limit = emu.parse_spec("tflops=1").host_share
        out = " (out of the accelerator regime: not a figure)" if r["host_share"] > limit else ""
        lines.append(f"| {r['k']}x slower | {r['instances']}{' (balanced)' if r['balanced'] else ''} "
                     f"| {r['step_s']:.3f} s | {r['vs_coupled']:.3f} | {r['simulated_s']:.3f} s "
                     f"| {r['sim_error']:+.1%} | {r['host_share']:.2f}{out} |")
    fbd = next(r for r in result["runs"] if r["k"] == 1)
    rc = result["coupled_recompute_full"]
    lines += ["", "| stage | coupled 1F1B | coupled 1F1B `--recompute full` | MegaFBD (backward rank) |",
              "|---|---:|---:|---:|"]
    for s in sorted(c["stage_bytes"], key=int):
        lines.append(f"| {s} | {c['stage_bytes'][s] / 1024:.0f} KiB | {rc['stage_bytes'][s] / 1024:.0f} KiB "
                     f"| {fbd['stage_bytes'][s] / 1024:.0f} KiB |")
    lines.append(f"\n`--recompute full` coupled step: {rc['step_s']:.3f} s ({rc['step_s'] / c['step_s']:.3f} of "
                 f"plain coupled), host share {rc['host_share']:.2f}; load average "
                 + (f"at the start {tuple(round(x, 1) for x in m['load_avg_at_start'])}, "
                    if m.get("load_avg_at_start") else "")
                 + f"at the end {tuple(round(x, 1) for x in m['load_avg_at_end'])} (2 cores shared with other "
                 f"jobs). "
                 f"Activations: bytes autograd keeps for backward, per backward stage (saved-tensor hooks). "
                 f"Raw: `benchmarks/results/fbd_emulated.json`.")
    return "\n".join(lines)
