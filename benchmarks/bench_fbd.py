"""MegaFBD vs the coupled engine (1F1B) at the same backward layout and microbatches: peak activation memory per
backward rank, step time, and the extra compute the recomputed forward costs.

Activation memory is what autograd keeps for backward, counted exactly with saved-tensor hooks (storage bytes,
each storage once, weights excluded), plus the pipeline's receive buffers are not included on either side. On
CPU this is the honest measure: the process's resident size is dominated by the Python/torch runtime.
Layouts: backward tp=2 x pp=2 (forward tp=1 x pp=1, one instance) and pp=4 (forward pp=1, one instance), 8
microbatches. The coupled run and the FBD run are separate launches (different world sizes), one after the
other on the same machine; step times are medians of the steps after the first.

With --emulated (benchmarks/fbd_emulated.py) every rank runs on an emulated device (`--emulate-device`, one
accelerator per rank: each task computes, then its rank sleeps out the modelled device time), backward layout
pp=4: the coupled 1F1B run, the coupled 1F1B run with `--recompute full` (the fair memory baseline: it too keeps
only each chunk's input), and MegaFBD with forward devices 1x, 2x and 4x slower (`speed=FORWARD_RANKS:1/k`) with
one and with the balanced number of forward instances; each FBD step is set against `fbd/simulate.fbd_step` fed
the same device costs (plus the optimizer's device time), each coupled step against `dpp.emulated.predict`.

Run: python -m benchmarks.bench_fbd             (writes benchmarks/results/fbd.json)
     python -m benchmarks.bench_fbd --quick     (fewer steps, writes nothing)
     python -m benchmarks.bench_fbd --emulated  (emulated devices; writes benchmarks/results/fbd_emulated.json)
"""
from __future__ import annotations

import json
import math
import time
from typing import Any

import torch

from benchmarks import fbd_emulated, harness
from benchmarks.fbd_runs import config, measure, step_time
from megatronapp.config import RunConfig

RESULTS = harness.results_path("fbd")
EMU_RESULTS = harness.results_path("fbd_emulated")


def summarise(coupled: list[dict], fbd: list[dict]) -> dict[str, Any]:
    """Peak activation bytes per backward stage, coupled vs MegaFBD, and both step times."""
    by_stage = {}
    for c in coupled:
        f = next(r for r in fbd if r["role"] == "backward" and r["rank"] == c["rank"])
        by_stage.setdefault(c["stage"], []).append((c["peak_saved_bytes"], f["peak_saved_bytes"]))
    stages = {s: {"coupled_bytes": max(a for a, _ in v), "fbd_bytes": max(b for _, b in v),
                  "ratio": max(b for _, b in v) / max(1, max(a for a, _ in v))} for s, v in sorted(by_stage.items())}
    t_c, t_f = step_time(coupled), step_time(fbd)
    return {"stages": stages, "coupled_step_s": t_c, "fbd_step_s": t_f, "step_ratio": t_f / t_c,
            "backward_ranks": len(coupled), "forward_ranks": sum(r["role"] == "forward" for r in fbd)}


def calibrate(reps: int = 20) -> dict[str, float]:
    """Per-microbatch times of one virtual stage of the tp2pp2 bench model in this process: the forward without
    autograd (what a forward instance does), and recompute + backward (what a backward rank does)."""
    from megatronapp.model.transformer import TransformerChunk

    cfg = RunConfig.from_dict(config("tp2pp2", False, 1))
    chunk = TransformerChunk(cfg.model, 0, cfg.model.num_layers // 2, pre_process=False, post_process=False)
    x = torch.randn(cfg.train.global_batch_size // cfg.parallel.microbatches, cfg.train.seq_len,
                    cfg.model.hidden_size)

    def fwd() -> None:
        with torch.no_grad():
            chunk(x)

    def fwd_bwd() -> None:
        xi = x.clone().requires_grad_(True)
        chunk(xi).sum().backward()

    # Interleaved, and the minimum over repetitions: on a shared machine the minimum is the compute, anything
    # above it is other processes' time.
    torch.set_num_threads(1)
    fwd(), fwd_bwd()  # warm-up
    t_fwd = t_bwd = math.inf
    for _ in range(reps):
        t0 = time.perf_counter()
        fwd()
        t1 = time.perf_counter()
        fwd_bwd()
        t_fwd, t_bwd = min(t_fwd, t1 - t0), min(t_bwd, time.perf_counter() - t1)
    return {"t_fwd_s": t_fwd, "t_recompute_backward_s": t_bwd}


def simulate(cal: dict[str, float], pp: int = 2, microbatches: int = 8) -> list[dict[str, Any]]:
    """Heterogeneous forward devices, k times slower: one instance, and the balanced number of instances."""
    from megatronapp.fbd import simulate as sim

    t_f, t_b = cal["t_fwd_s"], cal["t_recompute_backward_s"]
    coupled = sim.coupled_step(pp, microbatches, t_f, t_b - t_f)
    rows = []
    for k in (1, 2, 4):
        n_bal = sim.balanced_instances(pp, t_f, t_b, k)
        for n in sorted({1, n_bal}):
            t = sim.fbd_step(pp, microbatches, n, t_f, t_b, k)
            rows.append({"k": k, "instances": n, "balanced": n == n_bal, "fbd_step_s": t, "coupled_step_s": coupled,
                         "ratio": t / coupled})
    return rows


def run(quick: bool = False) -> dict[str, Any]:
    steps = 2 if quick else 5
    clock = harness.Clock()
    out: dict[str, Any] = {"steps": steps, "microbatches": 8, "layouts": {}}
    for layout in ("tp2pp2", "pp4"):
        coupled = measure(layout, False, steps)
        fbd = measure(layout, True, steps)
        out["layouts"][layout] = summarise(coupled, fbd)
        print(layout, json.dumps(out["layouts"][layout], indent=1), flush=True)
    out["calibration"] = calibrate()
    out["simulation"] = simulate(out["calibration"])
    out["machine"] = harness.machine(clock)
    return out


def table(result: dict[str, Any]) -> str:
    lines = ["| backward layout | stage | coupled 1F1B activations | MegaFBD activations | ratio |",
             "|---|---|---|---|---|"]
    for layout, r in result["layouts"].items():
        for s, v in r["stages"].items():
            lines.append(f"| {layout} | {s} | {v['coupled_bytes'] / 1024:.0f} KiB | {v['fbd_bytes'] / 1024:.0f} KiB "
                         f"| {v['ratio']:.2f} |")
    lines += ["", "| backward layout | ranks (coupled / FBD) | coupled step | MegaFBD step | ratio |",
              "|---|---|---|---|---|"]
    for layout, r in result["layouts"].items():
        lines.append(f"| {layout} | {r['backward_ranks']} / {r['backward_ranks'] + r['forward_ranks']} | "
                     f"{r['coupled_step_s']:.2f} s | {r['fbd_step_s']:.2f} s | {r['step_ratio']:.2f} |")
    if "simulation" in result:
        c = result["calibration"]
        lines += ["", f"Simulated (pp 2, 8 microbatches; per virtual stage and microbatch: forward "
                      f"{c['t_fwd_s'] * 1e3:.1f} ms, recompute + backward {c['t_recompute_backward_s'] * 1e3:.1f} ms):",
                  "", "| forward k x slower | forward instances | MegaFBD step | coupled step | ratio |",
                  "|---|---|---|---|---|"]
        for r in result["simulation"]:
            lines.append(f"| {r['k']} | {r['instances']}{' (balanced)' if r['balanced'] else ''} | "
                         f"{r['fbd_step_s'] * 1e3:.0f} ms | {r['coupled_step_s'] * 1e3:.0f} ms | {r['ratio']:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = harness.parser(__doc__, "fewer steps; writes nothing")
    ap.add_argument("--emulated", action="store_true", help="emulated devices: benchmarks/results/fbd_emulated.json")
    ap.add_argument("--remeasure", default="", metavar="K:N,...",
                    help="with --emulated: measure only these MegaFBD runs again into the stored result")
    ap.add_argument("--sim-only", action="store_true", help="recalibrate and re-simulate into the saved results")
    args = ap.parse_args(argv)
    if args.emulated:
        if args.remeasure:
            which = [tuple(int(x) for x in item.split(":")) for item in args.remeasure.split(",")]
            result = fbd_emulated.remeasure(harness.read_result(EMU_RESULTS), which)
        else:
            result = fbd_emulated.emulated_runs(steps=3 if args.quick else 5)
        print(fbd_emulated.emulated_table(result))
        if not args.quick:
            harness.write_result(result, EMU_RESULTS)
            for doc in ("megafbd.md", "benchmarks.md"):
                harness.write_block(harness.ROOT / "docs" / doc, "fbd-emulated", fbd_emulated.emulated_table(result))
        return
    if args.sim_only:
        result = harness.read_result(RESULTS)
        result["calibration"] = calibrate()
        result["simulation"] = simulate(result["calibration"])
    else:
        result = run(args.quick)
    print(table(result))
    if not args.quick:  # --sim-only rewrites the file with the new simulation
        harness.write_result(result, RESULTS)


if __name__ == "__main__":
    main()
