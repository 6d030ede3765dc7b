"""MegaScope during training: step time with the live page sampling every N steps vs off.

One process trains the demo model (gpt2-tiny, seq 64, batch 16); blocks of `every` steps alternate between no
observer and a `TrainingScope(every=N)` whose sampled step runs a KV-cached probe generation with capture on and
streams it to a connected WebSocket client that reads every message, as a browser would (with no page open the
probe is skipped and costs nothing).
Target (issue 14): <= 2% overhead at the default sampling. Writes benchmarks/results/scope_training.json.
"""
from __future__ import annotations

import inspect
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

from megatronapp.config import ParallelConfig, RunConfig, TrainConfig, preset
from megatronapp.launch import free_port
from megatronapp.scope.training import TrainingScope
from megatronapp.train.trainer import Trainer

RESULTS = Path(__file__).resolve().parent / "results" / "scope_training.json"


class _Reader:
    """A browser stand-in: one WebSocket that reads (and counts) every message the page would get."""

    def __init__(self, port: int):
        from websockets.sync.client import connect

        self._conn = connect(f"ws://127.0.0.1:{port}/ws", open_timeout=30, max_size=None)
        self.ws = self._conn.__enter__()  # the websockets API wants a context manager
        self.ws.recv(timeout=30)  # hello: from here on this client counts as a watcher
        self.messages, self.bytes = 0, 0
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            for msg in self.ws:
                self.messages += 1
                self.bytes += len(msg)
        except Exception:  # noqa: BLE001, S110  (closed at the end of the benchmark)
            pass

    def stop(self) -> None:
        self._conn.__exit__(None, None, None)
        self.thread.join(timeout=10)


def main(argv: list[str] | None = None) -> int:
    args = argv if argv is not None else sys.argv[1:]
    quick = "--quick" in args
    torch.set_num_threads(1)
    default_every = inspect.signature(TrainingScope).parameters["every"].default
    every = int(args[args.index("--every") + 1]) if "--every" in args else default_every
    blocks = int(args[args.index("--blocks") + 1]) if "--blocks" in args else 4
    every, blocks = (2, 1) if quick else (every, blocks)
    cfg = RunConfig(model=preset("gpt2-tiny"), parallel=ParallelConfig(microbatches=1),
                    train=TrainConfig(steps=10_000, global_batch_size=16, seq_len=64, peak_tflops=1.0,
                                      progress=False, out="/tmp/megatronapp-bench-scope"))
    tr = Trainer(cfg)
    scope = TrainingScope(free_port(), every=every, announce=lambda _msg: None)
    reader = _Reader(scope.server.port)
    times: dict[str, list[float]] = {"off": [], "scope": []}
    # CPU time of this process (the server's thread included) as well as wall time: on a machine shared with
    # other jobs the wall clock mostly measures them, while CPU time still measures the work MegaScope adds
    cpu: dict[str, list[float]] = {"off": [], "scope": []}
    try:
        for _ in range(2):  # warm-up
            tr.train_step()
        for _ in range(blocks):
            for mode in ("off", "scope"):
                t0, c0 = time.perf_counter(), time.process_time()
                for _ in range(every):
                    rec = tr.train_step()
                    if mode == "scope":
                        scope.on_step(tr.step, tr.chunks, rec)
                times[mode].append((time.perf_counter() - t0) / every)
                cpu[mode].append((time.process_time() - c0) / every)
    finally:
        reader.stop()
        scope.close()
    off, on = statistics.median(times["off"]), statistics.median(times["scope"])
    c_off, c_on = statistics.median(cpu["off"]), statistics.median(cpu["scope"])
    load = os.getloadavg()[0]
    result = {"every": every, "blocks": blocks, "median_step_s": {"off": off, "scope": on},
              "overhead": on / off - 1, "median_cpu_s": {"off": c_off, "scope": c_on},
              "overhead_cpu": c_on / c_off - 1, "load_average": load, "raw_s_per_step": times,
              "raw_cpu_s_per_step": cpu, "page_messages": reader.messages, "page_bytes": reader.bytes,
              "target": 0.02, "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    print(f"step time off {off * 1e3:.1f} ms, with MegaScope every {every} steps {on * 1e3:.1f} ms: "
          f"overhead {100 * (on / off - 1):+.1f}%; CPU time {c_off * 1e3:.1f} vs {c_on * 1e3:.1f} ms: "
          f"{100 * (c_on / c_off - 1):+.1f}% (target <= 2%; load average {load:.1f})")
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
