"""Step time of our engine against PyTorch-native peers on the same model, batch and microbatches.

Cases (2 ranks each, gloo on CPU; see benchmarks/engine_peers.py for the peers):
  pp=2 1F1B                 vs torch.distributed.pipelining Schedule1F1B
  pp=2 vpp=2 interleaved    vs torch.distributed.pipelining ScheduleInterleaved1F1B
  tp=2                      vs DTensor parallelize_module (ColwiseParallel / RowwiseParallel, loss_parallel)
  dp=2                      vs DistributedDataParallel
Both sides live in the same rank processes and alternate step by step (ours first on even repetitions, the
peer first on odd ones), each step fenced by barriers, so machine noise falls on both alike. The first steps'
losses of both sides are compared: equal losses on steps 1 and 2 show that forward, backward, clipping and
the optimizer compute the same thing. Reported: median step time after warm-up and the ratio ours/peer, and the
paired ratios (wall and CPU) with 95% intervals: bootstrap over repetitions, or with --blocks K over K independent
launches of fresh rank processes, pooled by the two-level bootstrap (benchmarks/stats.py).

Run: python -m benchmarks.bench_engine            (writes benchmarks/results/engine.json, docs/benchmarks.md)
     python -m benchmarks.bench_engine --blocks 3 (3 independent launches, pooled)
     python -m benchmarks.bench_engine --from-json (re-render the docs section from the stored result)
     python -m benchmarks.bench_engine --quick    (tiny model, 2 steps, writes nothing)
     python -m benchmarks.bench_engine --profile  (cProfile of both sides on rank 0, writes nothing)
"""
from __future__ import annotations

import copy
import cProfile
import gc
import io
import math
import pstats
import statistics
import tempfile
from pathlib import Path
from typing import Any

import torch

from benchmarks import harness, stats
from benchmarks.engine_peers import PEERS
from megatronapp.config import RunConfig

RESULTS = harness.results_path("engine")
SECTION = "## Engine vs PyTorch peers"
TARGET = 1.05  # the bar: ours/peer <= 1.05

# (name, peer kind, peer label, parallel settings)
CASES: list[tuple[str, str, str, dict[str, Any]]] = [
    ("pp=2 1f1b", "pipeline", "pipelining Schedule1F1B", {"pp": 2, "schedule": "1f1b"}),
    ("pp=2 vpp=2 interleaved-1f1b", "pipeline", "pipelining ScheduleInterleaved1F1B",
     {"pp": 2, "vpp": 2, "schedule": "interleaved-1f1b"}),
    ("tp=2", "tensor", "DTensor parallelize_module", {"tp": 2}),
    ("dp=2", "data", "DistributedDataParallel", {"dp": 2}),
]
# Schedule1F1B needs at least as many microbatches as stages.
PP4_CASE = ("pp=4 1f1b", "pipeline", "pipelining Schedule1F1B", {"pp": 4, "schedule": "1f1b", "microbatches": 4})

FULL = {"hidden": 256, "layers": 4, "heads": 8, "seq": 128, "global_batch": 8, "microbatches": 4,
        "warmup": 2, "steps": 16}
QUICK = {"hidden": 32, "layers": 4, "heads": 4, "seq": 16, "global_batch": 8, "microbatches": 2,
         "warmup": 1, "steps": 2}


def case_config(parallel: dict[str, Any], size: dict[str, int]) -> dict[str, Any]:
    """The run config of one case: an untied GPT-2 (the peers cannot tie weights across stages or meshes)."""
    base = {"tp": 1, "pp": 1, "dp": 1, "vpp": 1, "microbatches": size["microbatches"], "schedule": "1f1b"}
    return {
        "model": {"family": "gpt2", "vocab_size": 256, "hidden_size": size["hidden"], "num_layers": size["layers"],
                  "num_heads": size["heads"], "max_seq_len": size["seq"], "tie_embeddings": False},
        "parallel": {**base, **parallel},
        "train": {"steps": size["warmup"] + size["steps"], "global_batch_size": size["global_batch"],
                  "seq_len": size["seq"], "lr": 1e-3, "warmup_steps": 0, "grad_clip": 1.0, "seed": 11,
                  "progress": False, "peak_tflops": 1.0,
                  "out": str(Path(tempfile.gettempdir()) / "megatronapp-bench-engine")},
    }


def _timed(fn, profiler: cProfile.Profile | None) -> tuple[float, float, float]:
    """(wall seconds, CPU seconds of all ranks, loss) of one step, fenced by barriers to span the slowest rank.

    CPU time (every thread of every rank) is the work done; unlike wall time it hardly grows when other jobs
    take the cores, so it shows overheads that the noise of a shared machine hides."""
    if profiler is None:
        return harness.fenced_cpu(fn)

    def profiled() -> float:
        profiler.enable()
        try:
            return fn()
        finally:
            profiler.disable()

    return harness.fenced_cpu(profiled)


def run_case(cfg_dict: dict[str, Any], kind: str, rank: int, warmup: int, steps: int,
             profile: bool) -> dict[str, Any]:
    """Build both sides on this rank and alternate their steps; rank 0's record of times and losses."""
    from megatronapp.parallel import comm
    from megatronapp.train.trainer import Trainer

    cfg = RunConfig.from_dict(copy.deepcopy(cfg_dict))
    comm.reset()
    torch.manual_seed(cfg.train.seed)
    ours = Trainer(cfg, rank)
    peer = PEERS[kind](cfg, rank, ours.data)
    recv_peaks: list[int] = []

    def ours_step() -> float:
        rec = ours.train_step()
        recv_peaks.append(rec.get("peak_recv_buffers", 0))
        return rec["loss"]

    sides = {"ours": ours_step, "peer": lambda: peer.step(peer_step[0])}
    peer_step = [0]
    prof = {s: cProfile.Profile() for s in sides} if profile and rank == 0 else {}
    times: dict[str, list[float]] = {"ours": [], "peer": []}
    cpu: dict[str, list[float]] = {"ours": [], "peer": []}
    losses: dict[str, list[float]] = {"ours": [], "peer": []}
    for rep in range(warmup + steps):
        for side in (("ours", "peer") if rep % 2 == 0 else ("peer", "ours")):
            dt, dc, loss = _timed(sides[side], prof.get(side) if rep >= warmup else None)
            if rep >= warmup:
                times[side].append(dt)
                cpu[side].append(dc)
            losses[side].append(loss)
        peer_step[0] += 1
    p = cfg.parallel
    # Receive buffers this rank (stage 0) held at once: measured, and what the old executor posted up front
    # (every receive of the step: activations of chunks 1.., gradients of every chunk).
    before = p.microbatches * (2 * p.vpp - 1) if p.pp > 1 else 0
    out = {"times": times, "cpu": cpu, "losses": losses,
           "recv_buffers": {"before": before, "after": max(recv_peaks, default=0)}}
    if prof:
        out["profile"] = {s: _profile_text(p) for s, p in prof.items()}
    return out


def _profile_text(p: cProfile.Profile, top: int = 30) -> str:
    buf = io.StringIO()
    pstats.Stats(p, stream=buf).strip_dirs().sort_stats("tottime").print_stats(top)
    return buf.getvalue()


def worker(rank: int, world: int, cases: list[tuple], size: dict[str, int], profile: bool, outdir: str) -> None:
    """Spawned entry: run every case; rank 0 reports one record per case."""
    recs = []
    for _name, kind, _label, parallel in cases:
        recs.append(run_case(case_config(parallel, size), kind, rank, size["warmup"], size["steps"], profile))
        gc.collect()
    if rank == 0:
        harness.report(outdir, rank, recs)


def _world(parallel: dict[str, Any]) -> int:
    return parallel.get("tp", 1) * parallel.get("pp", 1) * parallel.get("dp", 1)


def summarise(name: str, label: str, parallel: dict[str, Any], rec: dict[str, Any],
              blocks: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """Medians, ratio and loss agreement of one case; `blocks` are the per-launch records when rec pools several."""
    med = {s: statistics.median(rec["times"][s]) for s in ("ours", "peer")}
    # Steps of one repetition ran back to back, so their ratio sees nearly the same machine load.
    paired = statistics.median(a / b for a, b in zip(rec["times"]["ours"], rec["times"]["peer"]))
    cpu = {s: statistics.median(rec["cpu"][s]) for s in ("ours", "peer")}
    loss_diff = max(abs(a - b) for a, b in zip(rec["losses"]["ours"][:2], rec["losses"]["peer"][:2]))
    return {"case": name, "peer": label, "parallel": parallel, "median_s": med,
            "ratio": med["ours"] / med["peer"], "paired_ratio": paired,
            "cpu_median_s": cpu, "cpu_ratio": cpu["ours"] / cpu["peer"], "times_s": rec["times"], "cpu_s": rec["cpu"],
            "losses": rec["losses"], "recv_buffers_stage0": rec.get("recv_buffers"),
            "first_losses_max_abs_diff": loss_diff, "losses_match": loss_diff < 1e-4,
            **({"blocks": [{"times_s": b["times"], "cpu_s": b["cpu"]} for b in blocks]} if blocks else {})}


def ratio_intervals(row: dict[str, Any]) -> dict[str, Any]:
    """Paired ours/peer ratios of wall and CPU time: pooled median, 95% interval, verdict (one block if the row
    was recorded in one launch)."""
    blocks = row.get("blocks") or [{"times_s": row["times_s"], "cpu_s": row["cpu_s"]}]
    out = {}
    for key, field in (("paired", "times_s"), ("cpu", "cpu_s")):
        out[key] = stats.summarize_blocks([stats.paired_ratios(b[field]["ours"], b[field]["peer"]) for b in blocks])
        out[key].pop("ratios")  # the samples are in the row already
        lo, hi = out[key]["ci95"]
        out[key]["claim"] = stats.claim(lo, hi, TARGET)
    return out


def _with_intervals(result: dict[str, Any]) -> None:
    for r in result["cases"]:
        r["intervals"] = ratio_intervals(r)


def _pool(recs: list[dict[str, Any]]) -> dict[str, Any]:
    """One record of several launches: times and CPU concatenated, losses and buffers of the first launch."""
    if len(recs) == 1:
        return recs[0]
    return {**recs[0], **{f: {s: [x for r in recs for x in r[f][s]] for s in ("ours", "peer")}
                          for f in ("times", "cpu")}}


def run(quick: bool = False, pp4: bool = False, profile: bool = False,
        steps: int | None = None, blocks: int = 1) -> dict[str, Any]:
    """Run every case (world 2, plus pp=4 on 4 ranks if asked) in `blocks` independent launches; the summary
    with per-case ratios and their intervals."""
    size = dict(QUICK if quick else FULL)
    if steps is not None:
        size["steps"] = steps
    groups: dict[int, list[tuple]] = {}
    for case in CASES + ([PP4_CASE] if pp4 else []):
        groups.setdefault(_world(case[3]), []).append(case)
    rows, profiles = [], {}
    clock = harness.Clock()
    for world, cases in groups.items():
        recs: list[list[dict[str, Any]]] = [[] for _ in cases]
        for _ in range(blocks):  # every block a fresh launch of the rank processes
            (launch,) = harness.launch(worker, world, cases, size, profile)
            for i, rec in enumerate(launch):
                recs[i].append(rec)
        for i, (name, _kind, label, parallel) in enumerate(cases):
            rec = _pool(recs[i])
            rows.append(summarise(name, label, parallel, rec, recs[i] if blocks > 1 else None))
            rows[-1]["intervals"] = ratio_intervals(rows[-1])
            if "profile" in recs[i][0]:
                profiles[name] = recs[i][0]["profile"]
    cfg = RunConfig.from_dict(case_config({}, size))
    return {
        "benchmark": "engine step time vs PyTorch-native peers",
        "timestamp": clock.timestamp,
        "wall_s": clock.wall_s(),
        "machine": harness.machine(clock, threads_per_rank=1, backend="gloo"),
        "config": {"size": size, "model": cfg.to_dict()["model"], "train": cfg.to_dict()["train"],
                   "params": cfg.model.num_params(), "protocol": "both sides in the same rank processes, "
                   "alternating step by step, barrier-fenced; medians over the measured steps after warm-up"},
        "target_ratio": TARGET, "blocks": blocks,
        "cases": rows,
        **({"profiles": profiles} if profiles else {}),
    }


def table(result: dict[str, Any]) -> str:
    """A Markdown table of medians and ratios."""
    lines = ["| case | peer | ours (s/step) | peer (s/step) | ours/peer | paired [95% CI] | CPU paired [95% CI] "
             "| target <= 1.05 (paired / CPU) | losses equal | recv buffers stage 0 (before -> after) |",
             "|---|---|---:|---:|---:|---|---|---|---|---|"]
    for r in result["cases"]:
        iv = r.get("intervals") or ratio_intervals(r)
        eq = "yes" if r["losses_match"] else f"no (diff {r['first_losses_max_abs_diff']:.2e})"
        lines.append(f"| {r['case']} | {r['peer']} | {r['median_s']['ours']:.4f} | {r['median_s']['peer']:.4f} "
                     f"| {r['ratio']:.3f} | {stats.fmt(iv['paired'])} | {stats.fmt(iv['cpu'])} "
                     f"| {iv['paired']['claim']} / {iv['cpu']['claim']} | {eq} "
                     f"| {_buffers(r.get('recv_buffers_stage0'))} |")
    return "\n".join(lines)


def _buffers(b: dict[str, int] | None) -> str:
    return "-" if not b or not b["before"] else f"{b['before']} -> {b['after']}"


def docs_body(result: dict[str, Any]) -> str:
    """This benchmark's section of docs/benchmarks.md, below its title."""
    s, m = result["config"]["size"], result["machine"]
    return "\n".join([
        ("`python -m benchmarks.bench_engine` trains the same untied GPT-2 "
        f"(hidden {s['hidden']}, {s['layers']} layers, {s['heads']} heads, seq {s['seq']}, global batch "
        f"{s['global_batch']}, {s['microbatches']} microbatches per replica, AdamW, global-norm clipping 1.0) with "
        "our engine and with a PyTorch-native peer, side by side in the same 2 rank processes (gloo, CPU, one "
        "thread per rank), alternating step by step. Times are medians of "
        f"{s['steps']} steps after {s['warmup']} warm-up steps; target ours/peer <= {TARGET}. Both sides compute "
        "the same losses on the first two steps (checked), so they do the same work. \"paired\" is the median of "
         "the per-repetition ratios (the two steps of a repetition run back to back, so they share the machine's "
         "load): on a shared, noisy machine it is the steadier estimate. \"CPU\" compares the CPU seconds of both "
         "ranks per step (medians): the work done, which other jobs on the machine barely change. Intervals: 95%, "
         f"{stats.blocks_label(result.get('blocks', 1))} (bootstrap over repetitions"
         f"{'' if result.get('blocks', 1) == 1 else ', blocks resampled first'}); \"within noise\" when the "
         "interval holds 1.0; the target is met only when the whole interval is at or below 1.05, \"unresolved\" "
         "when it crosses 1.05."), "",
        table(result), "",
        ("`--profile` prints a cProfile of both sides on rank 0 (nothing written); `--pp4` adds pp=4 1F1B on 4 "
         "ranks, which oversubscribes 2 cores; `--quick` is the smoke run."), "",
        (f"Recorded {result['timestamp']} on {m['cpus']} CPUs ({m['processor']}), torch {m['torch']}; load average "
        f"at the end {tuple(round(x, 2) for x in m['load_avg_at_end'])}. Raw times: `benchmarks/results/engine.json`."),
    ])


def write_docs(result: dict[str, Any], path: Path = harness.DOCS) -> None:
    """Replace (or append) this benchmark's section of docs/benchmarks.md, leaving other sections alone."""
    harness.write_section(path, SECTION, docs_body(result))


def main(argv: list[str] | None = None) -> None:
    ap = harness.parser(__doc__, "tiny model, 2 measured steps; writes nothing", from_json=True, blocks=1)
    ap.add_argument("--pp4", action="store_true", help="also pp=4 1F1B on 4 ranks (oversubscribes 2 cores)")
    ap.add_argument("--profile", action="store_true", help="cProfile both sides on rank 0; writes nothing")
    ap.add_argument("--steps", type=int, default=None, help="measured steps per side (after warm-up)")
    args = ap.parse_args(argv)
    if args.from_json:
        stored = harness.rerender(RESULTS, docs_body, section=SECTION, refresh=_with_intervals)
        print(table(stored))
        return
    result = run(quick=args.quick, pp4=args.pp4, profile=args.profile, steps=args.steps, blocks=args.blocks)
    for r in result["cases"]:
        print(f"{r['case']:<30} first losses ours {r['losses']['ours'][:2]} peer {r['losses']['peer'][:2]}")
    print(table(result))
    print(f"wall {result['wall_s']} s")
    for name, prof in result.get("profiles", {}).items():
        for side, text in prof.items():
            print(f"\n===== {name}: {side} =====\n{text}")
    if args.quick or args.profile:
        return
    if any(not math.isfinite(r["ratio"]) for r in result["cases"]):
        raise SystemExit("a case produced no valid timing; nothing written")
    harness.save(result, RESULTS, docs_body(result), section=SECTION)


if __name__ == "__main__":
    main()
