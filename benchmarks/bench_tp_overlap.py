"""TP communication overlap (`--tp-comm-overlap`) and the fused SwiGLU GEMM, tp=2 with sequence parallelism on CPU.

Part 1, training steps: three trainers of one Llama model live in the same two rank processes (gloo) and take
turns step by step, in a rotating order, each step fenced by barriers: plain collectives, and the overlapped
ones in 2 and in 4 chunks. Reported: the median paired ratio of step times, overlap / plain, with its bootstrap
interval; and that the losses agree.

Part 2, the SwiGLU block alone (forward + backward of one MLP at the same sizes): gate and up as one
column-parallel GEMM behind one sequence all-gather (the engine's path) against the same two layers run apart
(two all-gathers, two GEMMs), and the fused block with its collectives in 2 overlapped chunks, in rotating
order; paired ratios fused / separate and overlapped / fused.

Run: python -m benchmarks.bench_tp_overlap          (writes benchmarks/results/tp_overlap.json, docs section)
     python -m benchmarks.bench_tp_overlap --quick  (tiny model, 2 steps, writes nothing)
"""
from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import torch

from benchmarks import harness, stats
from megatronapp.config import ModelConfig, RunConfig

RESULTS = harness.results_path("tp_overlap")
TITLE = "## TP communication overlap and fused SwiGLU (tp=2, sequence parallel, CPU gloo)"

FULL = {"hidden": 256, "ffn": 768, "layers": 4, "heads": 8, "kv_heads": 4, "seq": 256, "global_batch": 4,
        "microbatches": 2, "warmup": 2, "steps": 18, "mlp_reps": 40}
QUICK = {"hidden": 32, "ffn": 64, "layers": 2, "heads": 4, "kv_heads": 2, "seq": 16, "global_batch": 2,
         "microbatches": 1, "warmup": 1, "steps": 2, "mlp_reps": 2}
SIDES = {"plain": 0, "overlap 2 chunks": 2, "overlap 4 chunks": 4}


def model_config(size: dict[str, int]) -> dict[str, Any]:
    return {"family": "llama", "vocab_size": 256, "hidden_size": size["hidden"], "ffn_hidden_size": size["ffn"],
            "num_layers": size["layers"], "num_heads": size["heads"], "num_kv_heads": size["kv_heads"],
            "max_seq_len": size["seq"]}


def case_config(chunks: int, size: dict[str, int]) -> dict[str, Any]:
    return {
        "model": model_config(size),
        "parallel": {"tp": 2, "sequence_parallel": True, "microbatches": size["microbatches"],
                     "tp_comm_overlap": chunks > 0, "tp_comm_overlap_chunks": max(chunks, 1)},
        "train": {"steps": size["warmup"] + size["steps"], "global_batch_size": size["global_batch"],
                  "seq_len": size["seq"], "lr": 1e-3, "warmup_steps": 0, "seed": 11, "progress": False,
                  "peak_tflops": 1.0, "data_prefetch": 0,
                  "out": str(Path(tempfile.gettempdir()) / f"megatronapp-bench-tp-overlap{chunks}")},
    }


def _steps(rank: int, size: dict[str, int]) -> tuple[dict[str, Any], Any]:
    from megatronapp.train.trainer import Trainer

    trainers = {name: Trainer(RunConfig.from_dict(case_config(c, size)), rank) for name, c in SIDES.items()}
    names = list(SIDES)
    times: dict[str, list[float]] = {n: [] for n in names}
    losses: dict[str, list[float]] = {n: [] for n in names}
    for k in range(size["warmup"] + size["steps"]):
        for name in harness.rotation(names, k):  # rotate who goes first
            dt, rec = harness.fenced(trainers[name].train_step)
            if k >= size["warmup"]:
                times[name].append(dt)
            losses[name].append(rec["loss"])
    return {"times": times, "losses": losses}, trainers["plain"].topo.tp_group


def _mlp(rank: int, size: dict[str, int], group) -> dict[str, list[float]]:
    import torch.nn.functional as F

    from megatronapp.model.mlp import MLP

    cfg = ModelConfig(**model_config(size))
    mlp = MLP(cfg, group, sequence_parallel=True)
    chunked = MLP(cfg, group, sequence_parallel=True, tp_comm_overlap=2)
    g = torch.Generator().manual_seed(rank)
    with torch.no_grad():
        for p, q in zip(mlp.parameters(), chunked.parameters()):
            p.copy_(torch.randn(p.shape, generator=g) * 0.02)
            q.copy_(p)
    x = torch.randn(size["global_batch"] // size["microbatches"], size["seq"] // 2, size["hidden"], generator=g,
                    requires_grad=True)

    def separate() -> torch.Tensor:
        return mlp.down(F.silu(mlp.gate(x)) * mlp.up(x))

    sides = {"fused": lambda: mlp(x), "separate": separate, "fused, overlap 2 chunks": lambda: chunked(x)}
    names = list(sides)
    times: dict[str, list[float]] = {n: [] for n in sides}
    for k in range(size["mlp_reps"] + 2):
        for name in harness.rotation(names, k):
            dt, _ = harness.fenced(lambda: sides[name]().sum().backward())  # noqa: B023 (called at once)
            if k >= 2:
                times[name].append(dt)
    return times


def worker(rank: int, world: int, size: dict[str, int], outdir: str) -> None:
    """Spawned entry: the training steps, then the SwiGLU block alone; rank 0 reports both."""
    result, tp_group = _steps(rank, size)
    result["mlp"] = _mlp(rank, size, tp_group)
    if rank == 0:
        harness.report(outdir, rank, result)


def run(quick: bool = False) -> dict[str, Any]:
    size = QUICK if quick else FULL
    clock = harness.Clock()
    (raw,) = harness.launch(worker, 2, size)
    times, losses = raw["times"], raw["losses"]
    overlap = {name: stats.summarize_ratios(stats.paired_ratios(times[name], times["plain"]))
               for name in SIDES if name != "plain"}
    worst_loss = max(abs(a - b) for name in SIDES for a, b in zip(losses[name], losses["plain"]))
    mlp = stats.summarize_ratios(stats.paired_ratios(raw["mlp"]["fused"], raw["mlp"]["separate"]))
    mlp_overlap = stats.summarize_ratios(stats.paired_ratios(raw["mlp"]["fused, overlap 2 chunks"],
                                                             raw["mlp"]["fused"]))
    return {
        "case": "tp=2 sequence-parallel Llama, " + ", ".join(f"{k} {v}" for k, v in size.items()),
        "median_step_s": {name: sorted(v)[len(v) // 2] for name, v in times.items()},
        "overlap_vs_plain": overlap,
        "max_loss_difference": worst_loss,
        "mlp_median_s": {name: sorted(v)[len(v) // 2] for name, v in raw["mlp"].items()},
        "fused_vs_separate_swiglu": mlp,
        "mlp_overlap_vs_plain": mlp_overlap,
        "machine": harness.machine(clock, threads_per_rank=1, backend="gloo"),
    }


def docs_section(r: dict[str, Any]) -> str:
    load = r["machine"]["load_avg_at_end"][0]
    rows = [f"| {name} | {r['median_step_s'][name] * 1e3:.0f} | "
            f"{stats.fmt(r['overlap_vs_plain'][name]) if name != 'plain' else '1 (baseline)'} |" for name in SIDES]
    return "\n".join([
        f"Case: {r['case']}. Machine: {r['machine']['cpus']} CPUs, load {load:.1f}, "
        f"torch {r['machine']['torch']}. Run: `python -m benchmarks.bench_tp_overlap`; raw numbers in "
        "`benchmarks/results/tp_overlap.json`.",
        "",
        "| TP collectives | median step (ms) | paired ratio vs plain [95% CI] |",
        "|---|---|---|",
        *rows,
        "",
        f"Losses of the three trainers agree within {r['max_loss_difference']:.1e}. SwiGLU block alone (forward + "
        f"backward): gate and up as one GEMM behind one all-gather vs the two layers apart: "
        f"{stats.fmt(r['fused_vs_separate_swiglu'])} (median {r['mlp_median_s']['fused'] * 1e3:.1f} vs "
        f"{r['mlp_median_s']['separate'] * 1e3:.1f} ms); the same block with its collectives in 2 overlapped "
        f"chunks vs plain: {stats.fmt(r['mlp_overlap_vs_plain'])}.",
        "",
        *([f"The load average ({load:.1f}) was above the core count: other processes shared "
           "the cores during this run, which widens the intervals; rerun on a quiet machine for tighter ones.", ""]
          if load > r["machine"]["cpus"] else []),
        "Why overlap buys little or nothing here: on a 2-core machine both ranks' GEMMs already use every core, "
        "and gloo moves the chunks with those same cores (its threads copy and reduce in memory), so there is no "
        "idle link to hide work behind; each chunk adds a collective's fixed cost and its GEMM works on fewer "
        "rows. gloo also has no reduce-scatter: the engine emulates it with an all-reduce (twice the bytes), on "
        "both sides alike. On GPUs the chunked collectives run on NCCL's stream while the GEMMs run on the "
        "compute stream, which is where MegaScale's gain comes from; this row stays in the ablation as a CPU "
        "measurement, not a claim about GPUs.",
    ])


def main(argv: list[str] | None = None) -> None:
    args = harness.parser(__doc__, "tiny model, 2 steps; writes nothing").parse_args(argv)
    r = run(args.quick)
    for name, s in r["overlap_vs_plain"].items():
        print(f"{name} / plain step time: {stats.fmt(s)}")
    print(f"SwiGLU block, overlapped / plain: {stats.fmt(r['mlp_overlap_vs_plain'])}")
    print(f"fused / separate SwiGLU block: {stats.fmt(r['fused_vs_separate_swiglu'])}; "
          f"losses equal within {r['max_loss_difference']:.1e}")
    if not args.quick:
        harness.save(r, RESULTS, docs_section(r), section=TITLE)


if __name__ == "__main__":
    main()
