"""MegaScope during training: step time with the live page sampling every N steps vs off.

One process trains the demo model (gpt2-tiny, seq 64, batch 16); blocks of `every` steps alternate between no
observer and a `TrainingScope(every=N)` whose sampled step runs a KV-cached probe generation with capture on and
streams it (no browser connected: the cost measured is the capture and compression, which run regardless).
Target from the issue: <= 5% overhead at the default sampling. Writes benchmarks/results/scope_training.json.
"""
from __future__ import annotations

import inspect
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from megatronapp.config import ParallelConfig, RunConfig, TrainConfig, preset
from megatronapp.launch import free_port
from megatronapp.scope.training import TrainingScope
from megatronapp.train.trainer import Trainer

RESULTS = Path(__file__).resolve().parent / "results" / "scope_training.json"


def main(argv: list[str] | None = None) -> int:
    args = argv if argv is not None else sys.argv[1:]
    quick = "--quick" in args
    torch.set_num_threads(1)
    default_every = inspect.signature(TrainingScope).parameters["every"].default
    every = int(args[args.index("--every") + 1]) if "--every" in args else default_every
    every, blocks = (2, 1) if quick else (every, 4)
    cfg = RunConfig(model=preset("gpt2-tiny"), parallel=ParallelConfig(microbatches=1),
                    train=TrainConfig(steps=10_000, global_batch_size=16, seq_len=64, peak_tflops=1.0,
                                      progress=False, out="/tmp/megatronapp-bench-scope"))
    tr = Trainer(cfg)
    scope = TrainingScope(free_port(), every=every, announce=lambda _msg: None)
    times: dict[str, list[float]] = {"off": [], "scope": []}
    try:
        for _ in range(2):  # warm-up
            tr.train_step()
        for _ in range(blocks):
            for mode in ("off", "scope"):
                t0 = time.perf_counter()
                for _ in range(every):
                    rec = tr.train_step()
                    if mode == "scope":
                        scope.on_step(tr.step, tr.chunks, rec)
                times[mode].append((time.perf_counter() - t0) / every)
    finally:
        scope.close()
    off, on = statistics.median(times["off"]), statistics.median(times["scope"])
    result = {"every": every, "blocks": blocks, "median_step_s": {"off": off, "scope": on},
              "overhead": on / off - 1, "raw_s_per_step": times, "target": 0.05,
              "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    print(f"step time off {off * 1e3:.1f} ms, with MegaScope every {every} steps {on * 1e3:.1f} ms: "
          f"overhead {100 * (on / off - 1):+.1f}% (target <= 5%)")
    if not quick:
        runs = json.loads(RESULTS.read_text()) if RESULTS.is_file() else {}
        runs = runs if "by_every" in runs else {"by_every": {}}
        runs["by_every"][str(every)] = result
        runs["default_every"] = default_every
        RESULTS.write_text(json.dumps(runs, indent=2))
        print(f"wrote {RESULTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
