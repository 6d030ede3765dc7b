"""MegaFBD vs the coupled engine (1F1B) at the same backward layout and microbatches: peak activation memory per
backward rank, step time, and the extra compute the recomputed forward costs.

Activation memory is what autograd keeps for backward, counted exactly with saved-tensor hooks (storage bytes,
each storage once, weights excluded), plus the pipeline's receive buffers are not included on either side. On
CPU this is the honest measure: the process's resident size is dominated by the Python/torch runtime.
Layouts: backward tp=2 x pp=2 (forward tp=1 x pp=1, one instance) and pp=4 (forward pp=1, one instance), 8
microbatches. The coupled run and the FBD run are separate launches (different world sizes), one after the
other on the same machine; step times are medians of the steps after the first.

With --emulated (`emulated_runs`) every rank runs on an emulated device (`--emulate-device`, one accelerator per
rank: each task computes, then its rank sleeps out the modelled device time), backward layout pp=4: the coupled
1F1B run, the coupled 1F1B run with `--recompute full` (the fair memory baseline: it too keeps only each chunk's
input), and MegaFBD with forward devices 1x, 2x and 4x slower (`speed=FORWARD_RANKS:1/k`) with one and with the
balanced number of forward instances; each FBD step is set against `fbd/simulate.fbd_step` fed the same device
costs (plus the optimizer's device time), each coupled step against `dpp.emulated.predict`.

Run: python -m benchmarks.bench_fbd             (writes benchmarks/results/fbd.json)
     python -m benchmarks.bench_fbd --quick     (fewer steps, writes nothing)
     python -m benchmarks.bench_fbd --emulated  (emulated devices; writes benchmarks/results/fbd_emulated.json)
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from megatronapp.config import RunConfig
from megatronapp.launch import spawn
from megatronapp.parallel import comm

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "fbd.json"
EMU_RESULTS = ROOT / "benchmarks" / "results" / "fbd_emulated.json"
# Device seconds of a middle virtual stage's forward of one microbatch (2 layers). 20 ms left the 8-rank run
# (4 forward instances) out of the accelerator regime under load (host share 1.17 at load average 30-50).
EMU_FORWARD_S = 0.04


class SavedBytes:
    """Peak bytes of tensors autograd holds for backward (by storage, weights excluded)."""

    def __init__(self, params: list[torch.nn.Parameter]):
        self.weights = {p.untyped_storage().data_ptr() for p in params}
        self.refs: dict[int, int] = {}
        self.live = self.peak = 0

    def pack(self, t: torch.Tensor) -> Any:
        ptr = t.untyped_storage().data_ptr()
        if ptr in self.weights:
            return t
        return _Held(self, t, ptr)

    @staticmethod
    def unpack(h: Any) -> torch.Tensor:
        return h.t if isinstance(h, _Held) else h

    def hooks(self) -> Any:
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)


class _Held:
    __slots__ = ("owner", "t", "ptr")

    def __init__(self, owner: SavedBytes, t: torch.Tensor, ptr: int):
        self.owner, self.t, self.ptr = owner, t, ptr
        n = owner.refs.get(ptr, 0)
        owner.refs[ptr] = n + 1
        if n == 0:
            owner.live += t.untyped_storage().nbytes()
            owner.peak = max(owner.peak, owner.live)

    def __del__(self) -> None:
        o = self.owner
        o.refs[self.ptr] -= 1
        if o.refs[self.ptr] == 0:
            del o.refs[self.ptr]
            o.live -= self.t.untyped_storage().nbytes()


def config(layout: str, fbd: bool, steps: int) -> dict[str, Any]:
    par = {"tp2pp2": dict(tp=2, pp=2), "pp4": dict(tp=1, pp=4)}[layout]
    d = {"model": dict(family="gpt2", vocab_size=256, hidden_size=64, num_layers=8, num_heads=4, max_seq_len=64),
         "parallel": dict(dp=1, microbatches=8, schedule="1f1b", **par),
         "train": dict(steps=steps, global_batch_size=16, seq_len=32, lr=1e-3, warmup_steps=0, grad_clip=1.0,
                       seed=3, progress=False, out="/tmp/megatronapp-bench-fbd")}
    if fbd:
        d["parallel"].update(fbd=True, fbd_forward_tp=1, fbd_forward_pp=1, fbd_forward_instances=1)
    return d


def worker(rank: int, world: int, cfg_dict: dict[str, Any], outdir: str) -> None:
    cfg = RunConfig.from_dict(copy.deepcopy(cfg_dict))
    comm.reset()
    if cfg.parallel.fbd:
        from megatronapp.fbd.run import build_rank

        r = build_rank(cfg, rank)
        role = r.role
    else:
        from megatronapp.train.trainer import Trainer

        r, role = Trainer(cfg, rank), "coupled"
    saved = SavedBytes(list(getattr(r, "params", [])))  # forward ranks run without autograd: nothing saved
    times = []
    for _ in range(cfg.train.steps):
        t0 = time.perf_counter()
        with saved.hooks():
            r.train_step()
        times.append(time.perf_counter() - t0)
    r.close()
    stage = r.topo.coord.pp if role != "forward" else None
    emulated = r.emulation.record()
    params = sum(q.numel() for q in getattr(r, "params", []))
    Path(outdir, f"rank{rank}.json").write_text(json.dumps(
        {"rank": rank, "role": role, "stage": stage, "peak_saved_bytes": saved.peak, "step_times": times,
         "emulation": emulated, "params": params}))


def measure(layout: str, fbd: bool, steps: int, cfg: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    cfg = cfg or config(layout, fbd, steps)
    world = RunConfig.from_dict(copy.deepcopy(cfg)).parallel.total_ranks
    with tempfile.TemporaryDirectory() as tmp:
        spawn(worker, world, cfg, tmp)
        return [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(world)]


def summarise(coupled: list[dict], fbd: list[dict]) -> dict[str, Any]:
    def step_time(ranks: list[dict]) -> float:  # a step ends when its slowest rank does
        per_step = list(zip(*[r["step_times"] for r in ranks]))
        return statistics.median(max(s) for s in per_step[1:] or per_step)

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
    out: dict[str, Any] = {"machine": platform.machine(), "cpus": os.cpu_count(), "steps": steps,
                           "microbatches": 8, "layouts": {}}
    for layout in ("tp2pp2", "pp4"):
        coupled = measure(layout, False, steps)
        fbd = measure(layout, True, steps)
        out["layouts"][layout] = summarise(coupled, fbd)
        print(layout, json.dumps(out["layouts"][layout], indent=1), flush=True)
    out["calibration"] = calibrate()
    out["simulation"] = simulate(out["calibration"])
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
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--emulated", action="store_true", help="emulated devices: benchmarks/results/fbd_emulated.json")
    ap.add_argument("--remeasure", default="", metavar="K:N,...",
                    help="with --emulated: measure only these MegaFBD runs again into the stored result")
    ap.add_argument("--sim-only", action="store_true", help="recalibrate and re-simulate into the saved results")
    args = ap.parse_args(argv)
    if args.emulated:
        from benchmarks import stats
        from benchmarks.bench_fbd_emulated import emulated_runs, emulated_table, remeasure

        if args.remeasure:
            which = [tuple(int(x) for x in item.split(":")) for item in args.remeasure.split(",")]
            result = remeasure(json.loads(EMU_RESULTS.read_text()), which)
        else:
            result = emulated_runs(steps=3 if args.quick else 5)
        print(emulated_table(result))
        if not args.quick:
            EMU_RESULTS.write_text(json.dumps(result, indent=1) + "\n")
            for doc in ("megafbd.md", "benchmarks.md"):
                stats.write_block(ROOT / "docs" / doc, "fbd-emulated", emulated_table(result))
        return
    if args.sim_only:
        result = json.loads(RESULTS.read_text())
        result["calibration"] = calibrate()
        result["simulation"] = simulate(result["calibration"])
    else:
        result = run(args.quick)
    print(table(result))
    if not args.quick:  # --sim-only rewrites the file with the new simulation
        RESULTS.parent.mkdir(parents=True, exist_ok=True)
        RESULTS.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
