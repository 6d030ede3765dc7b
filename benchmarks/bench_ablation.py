"""MegaScale's Table 3 on our engine: each efficiency technique added one at a time, with paired ratios.

Rows are cumulative, in MegaScale's order (NSDI'24, Table 3), each measured against the row before it:
  baseline                      sequential block, full attention, no overlap, batches built in the step, AdamW
  + parallel block + SWA        attention and MLP read one norm; sliding-window attention
  + communication overlap       DP buckets during backward, asynchronous pipeline sends, chunked TP collectives
  + data pipeline               batches built ahead by a worker (TP rank 0 reads, broadcasts to its peers)
  + LAMB, 4x batch              LAMB at four times the global batch (more microbatches per step)
  + ZeRO-1                      not in MegaScale's table: optimizer state sharded over DP (memory, not speed)
on two 4-rank layouts: tp=2 x dp=2 (sequence parallel) and pp=2 x dp=2 (1F1B). MegaScale's "efficient
operators" row (+1.7: FlashAttention-2, fused LayerNorm/GELU) has no CPU counterpart to switch: our one fused
operator, SwiGLU's gate and up projections as one GEMM, is always on, so it is in every row here.

Protocol: every row's trainer lives in the same 4 rank processes (gloo, one thread each); one repetition
runs one step of every row, in an order rotated each repetition, each step fenced by barriers. A row's
ratio is the median over repetitions of (its tokens/s) / (previous row's tokens/s) from the same repetition,
with a bootstrap 95% interval (benchmarks/stats.py); "within noise" when the interval holds 1.0.
MFU is tokens/s x FLOPs per token (PaLM's count, no embedding lookups) over a *measured* matmul rate, not a
vendor peak: after every repetition the 4 ranks multiply 512x512 fp32 matrices together, between barriers, and
the FLOPs of all ranks over the fenced wall time is the compute the machine gave the job at that moment (the 4
ranks share 2 cores; a load-dependent single-process measurement would over- or under-state it).

Run: python -m benchmarks.bench_ablation          (writes benchmarks/results/ablation.json, docs/benchmarks.md)
     python -m benchmarks.bench_ablation --quick  (tiny model, 2 repetitions, writes nothing)
     python -m benchmarks.bench_ablation --emulated [--quick] [--emulate-device SPEC]
                                                   (emulated devices and modelled wires: ablation_emulated.py;
                                                    --quick: pp2 x dp2, overlap none / DP / DP+PP, last line
                                                    one JSON; --overlap: the same rows, 36 repetitions, kept)
"""
from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks import ablation_emulated as emu
from benchmarks import stats
from megatronapp.config import RunConfig, validate
from megatronapp.launch import spawn

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "ablation.json"
EMU_RESULTS = ROOT / "benchmarks" / "results" / "ablation_emulated.json"
EMU_SECTION = "## Ablation on emulated devices: MegaScale's techniques where the step runs on the device"
DOCS = ROOT / "docs" / "benchmarks.md"
SECTION = "## Ablation (CPU-bound): MegaScale's techniques one at a time"

LAYOUTS = {
    "tp=2 x dp=2": {"tp": 2, "dp": 2, "sequence_parallel": True},
    "pp=2 x dp=2": {"pp": 2, "dp": 2, "schedule": "1f1b"},
}
# (row, MegaScale's gain for it in MFU points, settings added on top of the previous row)
ROWS: list[tuple[str, str, dict[str, dict[str, Any]]]] = [
    ("baseline", "-", {"model": {"parallel_block": False, "sliding_window": None},
                       "parallel": {"dp_overlap": False, "pp_overlap": False, "tp_comm_overlap": False},
                       "train": {"data_prefetch": 0, "optimizer": "adamw"}}),
    ("+ parallel block + sliding window", "+5.6", {"model": {"parallel_block": True, "sliding_window": "quarter"}}),
    ("+ communication overlap", "+6.2", {"parallel": {"dp_overlap": True, "pp_overlap": True,
                                                      "tp_comm_overlap": "if-sp"}}),
    ("+ data pipeline", "+1.1", {"train": {"data_prefetch": 2}}),
    ("+ LAMB, 4x batch", "+3.0", {"train": {"optimizer": "lamb", "batch_x": 4}}),
    ("+ ZeRO-1 (memory)", "n/a", {"parallel": {"zero": 1}}),
]
FULL = {"hidden": 256, "layers": 4, "heads": 8, "seq": 128, "global_batch": 8, "microbatches": 2,
        "warmup": 2, "reps": 12}
QUICK = {"hidden": 32, "layers": 2, "heads": 4, "seq": 16, "global_batch": 8, "microbatches": 2,
         "warmup": 1, "reps": 2}


def row_configs(layout: dict[str, Any], size: dict[str, int],
                rows: list[tuple[str, str, dict[str, dict[str, Any]]]] | None = None) -> list[dict[str, Any]]:
    """The cumulative run config of every row (default ROWS) on one layout (a Llama: SwiGLU, RMSNorm, RoPE).
    "if-sp" turns TP overlap on only with sequence parallelism and tp > 1, "if-pp" PP overlap only with pp > 1."""
    cfg: dict[str, Any] = {
        "model": {"family": "llama", "vocab_size": 256, "hidden_size": size["hidden"], "num_layers": size["layers"],
                  "num_heads": size["heads"], "num_kv_heads": size["heads"], "max_seq_len": size["seq"]},
        "parallel": {"tp": 1, "pp": 1, "dp": 1, "microbatches": size["microbatches"], **layout},
        "train": {"steps": 10**6, "global_batch_size": size["global_batch"], "seq_len": size["seq"], "lr": 1e-3,
                  "warmup_steps": 0, "grad_clip": 1.0, "seed": 5, "progress": False, "peak_tflops": 1.0,
                  "out": str(Path(tempfile.gettempdir()) / "megatronapp-bench-ablation")},
    }
    out = []
    for _name, _gain, add in ROWS if rows is None else rows:
        for section, values in add.items():
            for key, value in values.items():
                if key == "sliding_window" and value == "quarter":
                    value = size["seq"] // 4
                if key == "tp_comm_overlap" and value == "if-sp":
                    value = bool(cfg["parallel"].get("sequence_parallel")) and cfg["parallel"]["tp"] > 1
                if key == "pp_overlap" and value == "if-pp":
                    value = cfg["parallel"]["pp"] > 1
                if key == "batch_x":  # more microbatches of the same size: 4x the tokens per step
                    cfg["train"]["global_batch_size"] = size["global_batch"] * value
                    cfg["parallel"]["microbatches"] = size["microbatches"] * value
                    continue
                cfg[section][key] = value
        out.append(copy.deepcopy(cfg))
    return out


def _fenced_step(trainer) -> float:
    import torch.distributed as dist

    dist.barrier()
    t0 = time.perf_counter()
    trainer.train_step()
    dist.barrier()
    return time.perf_counter() - t0


def _matmul_probe(world: int, n: int = 512, reps: int = 8) -> float:
    """FLOP/s of all ranks multiplying matrices at once, barrier-fenced: the job's available matmul rate."""
    import torch.distributed as dist

    a, b = torch.randn(n, n), torch.randn(n, n)
    torch.mm(a, b)
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(reps):
        torch.mm(a, b)
    dist.barrier()
    return world * reps * 2.0 * n ** 3 / (time.perf_counter() - t0)


def build_trainers(configs: list[dict[str, Any]], world: int, rank: int) -> list:
    """One trainer per row config in this rank process (comm state reset first): the rows share one launch."""
    from megatronapp.parallel import comm
    from megatronapp.train.trainer import Trainer

    comm.reset()
    trainers = []
    for c in configs:
        cfg = RunConfig.from_dict(copy.deepcopy(c))
        validate(cfg, world)
        trainers.append(Trainer(cfg, rank))
    return trainers


def worker(rank: int, world: int, configs: list[dict[str, Any]], warmup: int, reps: int, outdir: str) -> None:
    """Spawned entry: build every row's trainer, then run rotated repetitions; rank 0 writes the times."""
    from megatronapp.parallel.distributed_optimizer import optimizer_state_bytes

    trainers = build_trainers(configs, world, rank)
    n = len(trainers)
    times: list[list[float]] = [[] for _ in range(n)]
    rates: list[float] = []
    try:
        for rep in range(warmup + reps):
            for k in range(n):
                i = (k + rep) % n  # rotated, so no row always follows the same neighbour
                dt = _fenced_step(trainers[i])
                if rep >= warmup:
                    times[i].append(dt)
            if rep >= warmup:
                rates.append(_matmul_probe(world))
        opt_bytes = []
        for tr in trainers:
            b = torch.tensor([float(optimizer_state_bytes(tr.optimizer))], dtype=torch.float64)
            torch.distributed.all_reduce(b, op=torch.distributed.ReduceOp.MAX)
            opt_bytes.append(int(b))
    finally:
        for tr in trainers:
            close = getattr(tr, "close", None)
            if close is not None:
                close()
    if rank == 0:
        Path(outdir, "times.json").write_text(json.dumps({"times": times, "optimizer_state_bytes": opt_bytes,
                                                          "matmul_flops": rates}))
    gc.collect()


def summarise(layout: str, configs: list[dict[str, Any]], rec: dict[str, Any]) -> dict[str, Any]:
    """Tokens/s, MFU and the paired ratio against the previous row, per row."""
    available = statistics.median(rec["matmul_flops"])
    rows = []
    for i, ((name, gain, _), c) in enumerate(zip(ROWS, configs)):
        cfg = RunConfig.from_dict(copy.deepcopy(c))
        tokens = cfg.train.global_batch_size * cfg.train.seq_len
        tps = [tokens / t for t in rec["times"][i]]
        row = {"row": name, "megascale_mfu_gain": gain, "tokens_per_step": tokens,
               "median_step_s": statistics.median(rec["times"][i]), "tokens_per_s": statistics.median(tps),
               "mfu": statistics.median(tps) * cfg.model.flops_per_token(cfg.train.seq_len) / available,
               "optimizer_state_bytes": rec["optimizer_state_bytes"][i], "step_times_s": rec["times"][i]}
        if i:
            prev_tokens = rows[-1]["tokens_per_step"]
            prev_tps = [prev_tokens / t for t in rec["times"][i - 1]]
            # tokens/s ratio: higher is better (the LAMB row does 4x the tokens per step)
            row["vs_previous"] = stats.summarize_ratios(stats.paired_ratios(tps, prev_tps), lower_is_better=False)
        rows.append(row)
    return {"layout": layout, "matmul_flops_median": available, "matmul_flops": rec["matmul_flops"], "rows": rows}


def run(quick: bool = False, reps: int | None = None) -> dict[str, Any]:
    size = dict(QUICK if quick else FULL)
    if reps is not None:
        size["reps"] = reps
    t0 = time.perf_counter()
    layouts = []
    for name, layout in LAYOUTS.items():
        configs = row_configs(layout, size)
        with tempfile.TemporaryDirectory() as tmp:
            spawn(worker, 4, configs, size["warmup"], size["reps"], tmp, backend="gloo", threads=1)
            rec = json.loads(Path(tmp, "times.json").read_text())
        layouts.append(summarise(name, configs, rec))
    return {
        "benchmark": "ablation of MegaScale's efficiency techniques (Table 3 form)",
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "wall_s": round(time.perf_counter() - t0, 1),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "load_avg_at_end": os.getloadavg(),
                    "torch": torch.__version__, "ranks": 4, "threads_per_rank": 1, "backend": "gloo"},
        "mfu_denominator": ("the matmul rate the 4 ranks achieved together (512x512 fp32, barrier-fenced) after "
                            "every repetition, median"),
        "size": size, "layouts": layouts,
    }


def table(result: dict[str, Any]) -> str:
    lines = []
    for lay in result["layouts"]:
        lines += [f"**{lay['layout']}** (available matmul rate, median: {lay['matmul_flops_median'] / 1e9:.1f} "
                  "GFLOP/s for the 4 ranks together)", "",
                  "| row | MegaScale (MFU points) | tokens/s | MFU (of measured matmul rate) "
                  "| vs previous row [95% CI] | optimizer state / rank |", "|---|---:|---:|---:|---|---:|"]
        for r in lay["rows"]:
            vs = stats.fmt(r["vs_previous"]) if "vs_previous" in r else "-"
            lines.append(f"| {r['row']} | {r['megascale_mfu_gain']} | {r['tokens_per_s']:,.0f} | "
                         f"{100 * r['mfu']:.2f}% | {vs} | {r['optimizer_state_bytes'] / 2**20:.2f} MiB |")
        lines.append("")
    return "\n".join(lines)


def docs_body(result: dict[str, Any]) -> str:
    s, m = result["size"], result["machine"]
    return "\n".join([
        ("CPU-bound: 4 ranks share 2 cores and compute on them, so communication and compute fight for the same "
         "cores; kept as what it is. The accelerator regime is the emulated section \"Ablation on emulated "
         "devices\" below."), "",
        ("`python -m benchmarks.bench_ablation` adds MegaScale's techniques one at a time (its Table 3: parallel "
         "block + sliding window +5.6 MFU points, overlap +6.2, efficient operators +1.7, data pipeline +1.1, "
         "LAMB at 4x batch +3.0, on 12,288 GPUs) to a Llama "
         f"(hidden {s['hidden']}, {s['layers']} layers, {s['heads']} heads, seq {s['seq']}, global batch "
         f"{s['global_batch']}, {s['microbatches']} microbatches per replica) on 4 CPU ranks (gloo, 1 thread each, "
         f"{m['cpus']} cores). All rows live in the same rank processes; each repetition runs one step of every "
         f"row in a rotated order; {s['reps']} repetitions after {s['warmup']} warm-up. \"vs previous row\" is the "
         "median paired ratio of tokens/s against the row above (same repetition), with a bootstrap 95% "
         "interval; above 1 is faster. MFU is against " + result["mfu_denominator"] + ", not a vendor peak."), "",
        table(result),
        ("Rows that make things slower on CPU are kept. What to expect on this machine: 4 ranks share 2 cores, so "
         "communication and computation compete for the same cores and overlap can only hide waiting, not work. "
         "TP overlap splits every sequence-parallel all-gather and reduce-scatter into chunks, so on gloo it adds "
         "collectives that run on the very cores the GEMMs need (its own benchmark above finds no gain either); "
         "PP overlap lets a stage compute while its sends complete, and DP overlap reduces buckets during "
         "backward. The 4x batch runs 4x the microbatches per step, which also shrinks the pipeline bubble's "
         "share on pp=2: part of that row's gain there is the bubble, not LAMB; "
         "the embedded corpus makes data time tiny, so the data pipeline row is near 1.0 by construction; the "
         "sliding window shortens attention only where the attention kernel skips masked blocks (on CPU SDPA "
         "computes them anyway). Rows needing more than one GPU to show their real effect: communication overlap "
         "(NCCL streams), and ZeRO-1 (memory per GPU). The single-GPU rows (operators, data pipeline, bf16) "
         "have not been run: no GPU was available. MegaScale's efficient-operators row (+1.7) has no switch here: "
         "our one fused operator, SwiGLU's gate and up projections as one GEMM, is on in every row (the TP overlap "
         "section above compares it with the two GEMMs apart)."), "",
        (f"Recorded {result['timestamp']}, torch {m['torch']}, load average at the end "
         f"{tuple(round(x, 2) for x in m['load_avg_at_end'])}, {result['wall_s']} s. Raw step times: "
         "`benchmarks/results/ablation.json`."),
    ])


def emulated_main(args: argparse.Namespace) -> None:
    """--emulated / --emulate-device: the rows on emulated devices; --quick prints one JSON line last."""
    spec = args.emulate_device or emu.SPEC
    if args.from_json:
        stats.write_section(DOCS, EMU_SECTION, emu.docs_body(json.loads(EMU_RESULTS.read_text())))
        print(f"re-rendered {DOCS.relative_to(ROOT)} from {EMU_RESULTS.relative_to(ROOT)}")
        return
    if args.overlap:  # the quick rows (pp2 x dp2: none, DP, DP + PP overlap) with many repetitions, kept
        result = emu.run(ROWS, LAYOUTS, row_configs, spec, quick=True, reps=args.reps or emu.OVERLAP_REPS)
        print(emu.table(result))
        print(json.dumps(emu.quick_line(result)))
        emu.OVERLAP.write_text(json.dumps(result, indent=1) + "\n")
        if EMU_RESULTS.is_file():
            stats.write_section(DOCS, EMU_SECTION, emu.docs_body(json.loads(EMU_RESULTS.read_text())))
        print(f"wrote {emu.OVERLAP.relative_to(ROOT)} and {DOCS.relative_to(ROOT)}")
        return
    result = emu.run(ROWS, LAYOUTS, row_configs, spec, quick=args.quick, reps=args.reps, only_layout=args.layout)
    print(emu.table(result))
    print(f"wall {result['wall_s']} s, load average {tuple(round(x, 2) for x in result['load_avg_at_end'])}")
    if args.quick:
        print(json.dumps(emu.quick_line(result)))
        return
    if args.layout is not None and EMU_RESULTS.is_file():  # re-measured one layout: keep the other's record
        old = json.loads(EMU_RESULTS.read_text())
        fresh = {lay["layout"] for lay in result["layouts"]}
        result["layouts"] = [lay if lay["layout"] not in fresh else next(x for x in result["layouts"]
                                                                          if x["layout"] == lay["layout"])
                             for lay in old["layouts"]]
    stats.save(result, EMU_RESULTS, DOCS, EMU_SECTION, emu.docs_body(result))
    print(f"wrote {EMU_RESULTS.relative_to(ROOT)} and {DOCS.relative_to(ROOT)}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny model, 2 repetitions; writes nothing")
    ap.add_argument("--reps", type=int, default=None, help="measured repetitions (after warm-up)")
    ap.add_argument("--from-json", action="store_true", help="re-render the docs section from the stored result")
    ap.add_argument("--emulated", action="store_true",
                    help=f"emulated devices and modelled wires (benchmarks/ablation_emulated.py), spec {emu.SPEC}")
    ap.add_argument("--layout", choices=("tp", "pp"), default=None,
                    help="with --emulated: only this layout (its record replaces the stored one)")
    ap.add_argument("--overlap", action="store_true",
                    help=f"with --emulated: pp2 x dp2, overlap none / DP / DP + PP only, {emu.OVERLAP_REPS} "
                         "repetitions (--reps), written to results/ablation_emulated_overlap.json")
    ap.add_argument("--emulate-device", metavar="SPEC", default=None,
                    help="as --emulated, with this device spec (see megatronapp train --emulate-device)")
    args = ap.parse_args(argv)
    if args.emulated or args.emulate_device:
        emulated_main(args)
        return
    if args.from_json:
        stats.write_section(DOCS, SECTION, docs_body(json.loads(RESULTS.read_text())))
        print(f"re-rendered {DOCS.relative_to(ROOT)} from {RESULTS.relative_to(ROOT)}")
        return
    result = run(quick=args.quick, reps=args.reps)
    print(table(result))
    print(f"wall {result['wall_s']} s")
    if args.quick:
        return
    stats.save(result, RESULTS, DOCS, SECTION, docs_body(result))
    print(f"wrote {RESULTS.relative_to(ROOT)} and {DOCS.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
