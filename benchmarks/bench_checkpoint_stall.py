"""Training stall per checkpoint save: two-stage async (ours) vs synchronous torch.save and
torch.distributed.checkpoint.async_save (DCP), on the same state, side by side in one process.

The state is shaped like one rank's checkpoint (weights plus AdamW's two moments, 4 MiB..16 MiB tensors). Between
saves a training step changes every tensor in place (so a save must copy, not alias) and computes for a while,
so background writes overlap with it. Each method saves ROUNDS times, round-robin (noise hits all alike); the stall
is the time the training thread spends in the save call, waiting for the previous save of the same method
included (at most one in flight for each). Every save is durable (fsync) before the next one of its method.

    python -m benchmarks.bench_checkpoint_stall [--mib 256] [--rounds 4]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch

from megatronapp.train import checkpoint as ckpt
from megatronapp.train.async_checkpoint import AsyncSaver

RESULTS = Path(__file__).resolve().parent / "results" / "checkpoint_stall.json"


def make_state(mib: int) -> dict[str, Any]:
    """Weights and two moments, a third each, in tensors of 1..4 Mi elements."""
    g = torch.Generator().manual_seed(0)
    n_total, out, i = mib * (1 << 20) // 4 // 3, {"model": {}, "exp_avg": {}, "exp_avg_sq": {}}, 0
    left = n_total
    while left > 0:
        n = min(left, (1 << 20) * (1 + i % 4))
        for part in out:
            out[part][f"layer{i}"] = torch.randn(n, generator=g)
        left -= n
        i += 1
    return {"step": 0, **out}


def train_step(state: dict[str, Any], compute_s: float) -> None:
    for part in ("model", "exp_avg", "exp_avg_sq"):
        for t in state[part].values():
            t.add_(1e-3)
    a = torch.randn(256, 256)
    end = time.perf_counter() + compute_s
    while time.perf_counter() < end:
        a = torch.tanh(a @ a)


class Sync:
    name = "torch.save (sync)"

    def __init__(self, root: Path):
        self.root = root

    def save(self, step: int, state: dict[str, Any]) -> float:
        t0 = time.perf_counter()
        d = self.root / f"step_{step}"
        d.mkdir(parents=True)
        with open(d / "rank00000.pt", "wb") as f:  # the plain peer: torch.save, made durable, no checksum
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        ckpt.fsync_dir(d)
        return time.perf_counter() - t0

    def finish(self) -> None:
        pass


class Dcp:
    name = "DCP async_save"

    def __init__(self, root: Path):
        import torch.distributed.checkpoint as dcp

        self.dcp, self.root, self.future = dcp, root, None

    def save(self, step: int, state: dict[str, Any]) -> float:
        t0 = time.perf_counter()
        self.finish()
        self.future = self.dcp.async_save(state, checkpoint_id=str(self.root / f"step_{step}"))
        return time.perf_counter() - t0

    def finish(self) -> None:
        if self.future is not None:
            self.future.result()
            self.future = None


class Ours:
    name = "two-stage async (ours)"

    def __init__(self, root: Path):
        self.saver = AsyncSaver(root, rank=0, world=1, keep=2)
        self.waits: list[float] = []  # the part of each stall spent waiting for the previous save

    def save(self, step: int, state: dict[str, Any]) -> float:
        t0 = time.perf_counter()
        self.saver.wait()
        self.waits.append(time.perf_counter() - t0)
        return self.waits[-1] + self.saver.save(step, state, {"step": step, "world_size": 1})

    def finish(self) -> None:
        self.saver.wait()


def run(mib: int, rounds: int, compute_s: float) -> dict[str, Any]:
    state = make_state(mib)
    work = Path(tempfile.mkdtemp(prefix="ckpt-bench-", dir=os.environ.get("CKPT_BENCH_DIR")))
    methods = [cls(work / cls.__name__.lower()) for cls in (Sync, Dcp, Ours)]
    stalls: dict[str, list[float]] = {m.name: [] for m in methods}
    # CPU seconds the training thread spent in the save: a load-independent view of the same stall (a machine
    # shared with other jobs stretches wall time, not the work the training thread has to do)
    cpu: dict[str, list[float]] = {m.name: [] for m in methods}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # DCP warns that it runs without a process group: intended here
            for r in range(rounds + 1):  # round 0 warms up (allocations, imports) and is not counted
                for m in methods:
                    state["step"] = r
                    c0 = time.thread_time()
                    stall = m.save(r, state)
                    if r:
                        stalls[m.name].append(stall)
                        cpu[m.name].append(time.thread_time() - c0)
                    train_step(state, compute_s)
            for m in methods:
                m.finish()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in stalls.items()}
    waits = methods[-1].waits[1:]
    med_cpu = {k: statistics.median(v) for k, v in cpu.items()}
    ours = med[Ours.name]
    return {"state_mib": mib, "rounds": rounds, "compute_s_between_saves": compute_s, "stall_s": stalls,
            "median_stall_s": med,
            "ours_wait_for_previous_s": waits, "ours_copy_gib_s": mib / 1024 / ours,
            "sync_over_ours": med[Sync.name] / ours, "dcp_over_ours": med[Dcp.name] / ours,
            "thread_cpu_s": cpu, "median_thread_cpu_s": med_cpu,
            "sync_over_ours_cpu": med_cpu[Sync.name] / med_cpu[Ours.name],
            "dcp_over_ours_cpu": med_cpu[Dcp.name] / med_cpu[Ours.name],
            "load_average": os.getloadavg(),
            "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "machine": {"cpus": os.cpu_count(), "processor": platform.machine(), "torch": torch.__version__}}


def table(res: dict[str, Any]) -> str:
    ours = res["median_stall_s"][Ours.name]
    ours_cpu = res["median_thread_cpu_s"][Ours.name]
    lines = ["| save method | median stall per save (s, wall) | vs ours | training-thread CPU in the save (s) "
             "| vs ours |", "|---|---:|---:|---:|---:|"]
    for name, s in res["median_stall_s"].items():
        c = res["median_thread_cpu_s"][name]
        lines.append(f"| {name} | {s:.3f} | {s / ours:.1f}x | {c:.3f} | {c / ours_cpu:.1f}x |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=256, help="checkpoint state size per rank")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--compute-s", type=float, default=3.0, help="training compute between saves")
    args = ap.parse_args()
    torch.set_num_threads(1)
    res = run(args.mib, args.rounds, args.compute_s)
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(res, indent=2))
    print(table(res))
    print(f"sync / ours = {res['sync_over_ours']:.1f}x wall, {res['sync_over_ours_cpu']:.1f}x CPU (target >= 20x); "
          f"DCP async / ours = {res['dcp_over_ours']:.1f}x wall, {res['dcp_over_ours_cpu']:.1f}x CPU; "
          f"load average {res['load_average'][0]:.1f} on {res['machine']['cpus']} CPUs")


if __name__ == "__main__":
    main()
