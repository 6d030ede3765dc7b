"""Data time per step with the prefetching data pipeline on (train.data_prefetch=2) vs off (0), paired.

The `make demo` layout (gpt2-tiny, tp=2 x pp=2, 4 microbatches, global batch 16 x 64 tokens) on 4 CPU ranks.
Every rank holds two trainers, prefetch on and off, built from the same config; they take turns in blocks of
steps (on first in even repetitions, off first in odd ones), fenced by barriers, so machine noise falls on both
alike. Two readers:
  in-memory   the engine's own BatchSource (the corpus is tokenized once at start-up): data time is small
  slow reader the same source with a 20 ms sleep per batch, standing in for storage or on-the-fly tokenization
              (simulated, labelled so): what MegaScale's pipeline exists to hide
Reported per case: the reader's (rank 0's) time to get its batch (building it, or taking it from the prefetch
queue: what prefetching removes), data_s of the reader and of its TP peer (rank 1; data_s also holds the
host-to-device copy and the TP broadcast, where a rank waits for the other), median step time, and paired
ratios on/off per repetition with a bootstrap 95% interval (benchmarks/stats.py).

Run: python -m benchmarks.bench_data_pipeline          (writes benchmarks/results/data_pipeline.json, docs section)
     python -m benchmarks.bench_data_pipeline --quick  (few steps, writes nothing)
"""
from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

from benchmarks import harness, stats
from megatronapp.config import ParallelConfig, RunConfig, preset
from megatronapp.demo import demo_recipe

RESULTS = harness.results_path("data_pipeline")
SECTION = "## Data pipeline: prefetch on vs off"
SLOW_READ_S = 0.02
FULL = {"reps": 8, "block": 5, "warmup": 2}
QUICK = {"reps": 2, "block": 2, "warmup": 1}


def _config(prefetch: int, out: str) -> RunConfig:
    train = demo_recipe(steps=10_000, out=out)
    train.progress, train.peak_tflops, train.data_prefetch = False, 1.0, prefetch
    return RunConfig(model=preset("gpt2-tiny"),
                     parallel=ParallelConfig(tp=2, pp=2, dp=1, microbatches=4, schedule="1f1b"), train=train)


def _slow(get):
    def read(step):
        time.sleep(SLOW_READ_S)
        return get(step)
    return read


def _timed(read, into: list[float]):
    def timed(step):
        t0 = time.perf_counter()
        batch = read(step)
        into.append(time.perf_counter() - t0)
        return batch
    return timed


def worker(rank: int, world: int, size: dict[str, int], outdir: str) -> None:
    """Spawned entry: per reader, both trainers taking turns in blocks of steps; every rank reports its steps."""
    import torch.distributed as dist

    from megatronapp.train.trainer import Trainer

    result: dict[str, Any] = {}
    for case in ("in-memory", "slow reader"):
        trainers = {side: Trainer(_config(prefetch, str(Path(outdir) / side)), rank)
                    for side, prefetch in (("on", 2), ("off", 0))}
        if case == "slow reader":
            for tr in trainers.values():
                tr.data.get = _slow(tr.data.get)
        got: dict[str, list[float]] = {"on": [], "off": []}  # the reader's batch-get time per step
        for side, tr in trainers.items():
            tr._read = _timed(tr._read, got[side])
        for tr in trainers.values():  # warm-up (the prefetcher's first batch is built inside the first step)
            for _ in range(size["warmup"]):
                tr.train_step()
        recs: dict[str, list[list[dict[str, float]]]] = {"on": [], "off": []}
        for side in got:
            got[side].clear()
        for rep in range(size["reps"]):
            for side in harness.rotation(["on", "off"], rep):
                dist.barrier()
                block = [trainers[side].train_step() for _ in range(size["block"])]
                for r, g in zip(block, got[side][-size["block"]:] if got[side] else [0.0] * size["block"]):
                    r["get_s"] = g
                recs[side].append(block)
        for tr in trainers.values():
            tr.close()
        result[case] = {side: [[{"data_s": r["data_s"], "get_s": r["get_s"], "step_time": r["step_time"],
                                 "loss": r["loss"]}
                                for r in block] for block in blocks] for side, blocks in recs.items()}
    harness.report(outdir, rank, result)


def _median(blocks: list[list[dict[str, float]]], key: str) -> float:
    return statistics.median(r[key] for block in blocks for r in block)


def run(quick: bool = False) -> dict[str, Any]:
    size = QUICK if quick else FULL
    clock = harness.Clock()
    ranks = harness.launch(worker, 4, size)
    cases = {}
    for case in ranks[0]:
        reader, peer = ranks[0][case], ranks[1][case]
        per_rep = {key: stats.paired_ratios(
            [statistics.median(r[key] for r in b) for b in reader["on"]],
            [statistics.median(r[key] for r in b) for b in reader["off"]]) for key in ("get_s", "data_s", "step_time")}
        losses_equal = all(a["loss"] == b["loss"] for ba, bb in zip(reader["on"], reader["off"])
                           for a, b in zip(ba, bb))
        cases[case] = {
            "reader_get_s": {s: _median(reader[s], "get_s") for s in ("on", "off")},
            "reader_data_s": {s: _median(reader[s], "data_s") for s in ("on", "off")},
            "peer_data_s": {s: _median(peer[s], "data_s") for s in ("on", "off")},
            "step_time_s": {s: _median(reader[s], "step_time") for s in ("on", "off")},
            "get_s_ratio": stats.summarize_ratios(per_rep["get_s"]),
            "data_s_ratio": stats.summarize_ratios(per_rep["data_s"]),
            "step_time_ratio": stats.summarize_ratios(per_rep["step_time"]),
            "losses_equal": losses_equal,
        }
    return {"config": "gpt2-tiny, tp=2 x pp=2, 4 microbatches, global batch 16 x 64 tokens, 4 CPU ranks (gloo), "
                      "1 thread each", "size": size, "slow_read_s": SLOW_READ_S, "cases": cases,
            "machine": harness.machine(clock, ranks=4, threads_per_rank=1, backend="gloo")}


def _ms(x: float) -> str:
    return f"{1e3 * x:.2f}"


def report(result: dict[str, Any]) -> str:
    rows = ["| reader | batch get on / off (ms) | data_s reader on / off (ms) | data_s TP peer on / off (ms) | "
            "step on / off (ms) | batch get ratio on/off | data_s ratio on/off | step time ratio on/off |",
            "|---|---|---|---|---|---|---|---|"]
    for case, c in result["cases"].items():
        label = case if case == "in-memory" else f"{case} ({1e3 * result['slow_read_s']:.0f} ms/batch, simulated)"
        rows.append(f"| {label} | {_ms(c['reader_get_s']['on'])} / {_ms(c['reader_get_s']['off'])} | "
                    f"{_ms(c['reader_data_s']['on'])} / {_ms(c['reader_data_s']['off'])} | "
                    f"{_ms(c['peer_data_s']['on'])} / {_ms(c['peer_data_s']['off'])} | "
                    f"{_ms(c['step_time_s']['on'])} / {_ms(c['step_time_s']['off'])} | "
                    f"{stats.fmt(c['get_s_ratio'])} | {stats.fmt(c['data_s_ratio'])} | "
                    f"{stats.fmt(c['step_time_ratio'])} |")
    m = result["machine"]
    return "\n".join(rows) + (
        f"\n\n{result['config']}; {result['size']['reps']} repetitions of {result['size']['block']} steps per side, "
        f"alternating, paired ratio per repetition (median, bootstrap 95% interval). Losses of the two sides "
        f"equal step for step: {all(c['losses_equal'] for c in result['cases'].values())}. Batch get: the reader's "
        f"time to obtain its batch (build it, or take it from the prefetch queue). data_s: the time a step waited for "
        f"its batch (get, host-to-device copy, TP broadcast); at the broadcast the two TP ranks wait for each other, "
        f"so data_s also measures rank skew, which prefetching cannot remove. "
        f"Machine: {m['cpus']} CPUs, load {m['load_avg_at_end'][0]:.1f}, torch {m['torch']}. "
        f"Raw: `benchmarks/results/data_pipeline.json` (`python -m benchmarks.bench_data_pipeline`).")


def main(argv: list[str] | None = None) -> None:
    args = harness.parser(__doc__, "few steps; writes nothing").parse_args(argv)
    result = run(args.quick)
    print(report(result))
    if not args.quick:
        harness.save(result, RESULTS, report(result), section=SECTION)


if __name__ == "__main__":
    main()
