"""MegaDPP on real ranks: dpp-adaptive vs interleaved 1F1B step time, with and without injected link delays, and
the discrete-event simulator calibrated from the same run, predicted vs measured.

4 gloo ranks on CPU, pp=4 vpp=2, 8 microbatches (a small GPT-2). Both schedules live in the same rank processes
(one Trainer each) and alternate step by step (interleaved first on even repetitions, dpp first on odd ones),
each step fenced by barriers, so machine noise falls on both alike. dpp runs with its cap at interleaved 1F1B's
peak (the same memory). Link delays go through the engine's comm seam:
  slow-link  `megatronapp.faults` slow-link=A-B:MS: every send over the link sleeps MS on the sender's thread
             before it is issued (the sending stage is blocked, the message leaves late);
  spike      the same kind of delay, but only on a random share of the sends (drawn from the step, the two ranks
             and the message tag, so both schedules meet the same slow messages); faults.py has no jitter mode.
Every rank records its compute spans (and the time blocked before each send) through `megatronapp.tracing`;
`megatronapp.dpp.calibrate` turns them into simulator inputs. Reported per case: median step times and the
paired ratio dpp/interleaved, and for each schedule the simulator's predicted pipeline time against the measured
one (three ways: the public SimConfig model calibrated from the schedule's own run, the same calibrated from the
interleaved run of the case (a true prediction for dpp), and a replay of each step's own task costs).

Run: python -m benchmarks.bench_dpp_real           (writes benchmarks/results/dpp_real.json)
     python -m benchmarks.bench_dpp_real --quick   (tiny model, 2 ranks, 1 step; writes nothing)
"""
from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import platform
import random
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

from megatronapp.config import RunConfig
from megatronapp.dpp.calibrate import StepTimings, TaskTiming, calibrate, replay
from megatronapp.dpp.policies import default_target
from megatronapp.dpp.simulator import simulate
from megatronapp.launch import spawn
from megatronapp.pipeline.tasks import StageView

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "dpp_real.json"
TARGET_SIM_ERROR = 0.15  # the bar: simulator within 15% of the measured step

# name -> (faults specs, spike links "A-B,C-D" or "", spike probability, spike ms)
FULL_CASES: dict[str, tuple[list[str], str, float, float]] = {
    "none": ([], "", 0.0, 0.0),
    "slow-link 1-2 10ms": (["slow-link=1-2:10"], "", 0.0, 0.0),
    "slow-link 0-1,2-3 5ms": (["slow-link=0-1:5", "slow-link=2-3:5"], "", 0.0, 0.0),
    "spike 1-2 p=0.25 20ms": ([], "1-2", 0.25, 20.0),
}
QUICK_CASES = {"none": ([], "", 0.0, 0.0), "slow-link 0-1 2ms": (["slow-link=0-1:2"], "", 0.0, 0.0),
               "spike 0-1 p=0.5 2ms": ([], "0-1", 0.5, 2.0)}
FULL = {"pp": 4, "vpp": 2, "microbatches": 8, "hidden": 128, "layers": 8, "heads": 4, "seq": 64, "warmup": 2,
        "steps": 20}
QUICK = {"pp": 2, "vpp": 2, "microbatches": 4, "hidden": 32, "layers": 4, "heads": 4, "seq": 16, "warmup": 0,
         "steps": 1}
FIRST_WARMUP = 3  # extra warm-up repetitions before the first case
SCHEDULES = ("interleaved-1f1b", "dpp")
SIM_NAME = {"interleaved-1f1b": "interleaved-1f1b", "dpp": "dpp-adaptive"}


def dpp_cap(size: dict[str, int]) -> int:
    """Interleaved 1F1B's peak activations (stage 0): dpp gets the same memory."""
    return default_target(StageView(stage=0, pp=size["pp"], vpp=size["vpp"], microbatches=size["microbatches"]))


def run_config(schedule: str, size: dict[str, int]) -> dict[str, Any]:
    """The run config of one schedule: a small untied GPT-2, one sample per microbatch."""
    parallel = {"tp": 1, "pp": size["pp"], "dp": 1, "vpp": size["vpp"], "microbatches": size["microbatches"],
                "schedule": schedule}
    if schedule == "dpp":
        parallel.update(dpp_policy="adaptive", dpp_max_inflight=dpp_cap(size))
    return {
        "model": {"family": "gpt2", "vocab_size": 256, "hidden_size": size["hidden"], "num_layers": size["layers"],
                  "num_heads": size["heads"], "max_seq_len": size["seq"], "tie_embeddings": False},
        "parallel": parallel,
        "train": {"steps": 10_000, "global_batch_size": size["microbatches"], "seq_len": size["seq"], "lr": 1e-3,
                  "warmup_steps": 0, "grad_clip": 1.0, "seed": 5, "progress": False, "peak_tflops": 1.0,
                  "out": str(Path(tempfile.gettempdir()) / "megatronapp-bench-dpp-real")},
    }


class TaskRecorder:
    """A span sink keeping this rank's compute spans and the time each task blocked its stage before a send."""

    def __init__(self) -> None:
        self.tasks: list[list] = []  # [kind, chunk, microbatch, start, end, blocked]
        self._last: list | None = None
        self._main = threading.main_thread()

    def open(self, name: str, cat: str, meta: dict[str, Any]) -> Any:
        now = time.perf_counter()
        if cat == "compute":
            self.flush()
            return (name, meta, now)
        if name == "send" and self._last is not None and threading.current_thread() is self._main:
            self._last[5] = now - self._last[4]  # payload copy plus any delay an interceptor slept before it
            self.flush()
        return None

    def close(self, token: Any) -> None:
        if token is not None:
            name, meta, t0 = token
            self._last = ["F" if name == "forward" else "B", meta["chunk"], meta["microbatch"], t0,
                          time.perf_counter(), 0.0]

    def step(self, iteration: int, begin: bool) -> None:
        return None

    def flush(self) -> None:
        if self._last is not None:
            self.tasks.append(self._last)
            self._last = None

    def take(self) -> list[list]:
        self.flush()
        out, self.tasks = self.tasks, []
        return out


class LinkSpikes:
    """Comm interceptor: a send over one of `links` sleeps `ms` with probability `p`, drawn from (seed, rep,
    sender, receiver, tag) so every schedule meets the same slow messages in a repetition."""

    def __init__(self, rank: int, links: str, p: float, ms: float, seed: int = 0):
        self.rank, self.p, self.ms, self.seed = rank, p, ms, seed
        self.links = [tuple(sorted(int(r) for r in link.split("-"))) for link in links.split(",") if link]
        self.rep = 0

    def __call__(self, op: Any) -> None:
        if op.name != "send" or op.peer is None or tuple(sorted((self.rank, op.peer))) not in self.links:
            return
        if random.Random(f"{self.seed}:{self.rep}:{self.rank}:{op.peer}:{op.tag}").random() < self.p:
            time.sleep(self.ms / 1000.0)


def worker(rank: int, world: int, size: dict[str, int], cases: dict[str, tuple], outdir: str) -> None:
    """Spawned entry: both schedules' Trainers, every case alternating them; each rank saves its records."""
    import torch.distributed as dist

    from megatronapp import faults, tracing
    from megatronapp.parallel import comm
    from megatronapp.train.trainer import Trainer

    comm.reset()
    trainers = {}
    for sched in SCHEDULES:
        torch.manual_seed(5)
        trainers[sched] = Trainer(RunConfig.from_dict(copy.deepcopy(run_config(sched, size))), rank)
    windows: list[float] = []
    for tr in trainers.values():  # the executor's own window, for the per-task overhead
        inner = tr.executor.step

        def timed_step(*a: Any, _inner: Any = inner, **k: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return _inner(*a, **k)
            finally:
                windows.append(time.perf_counter() - t0)
        tr.executor.step = timed_step
    recorder = TaskRecorder()
    tracing.install(recorder)
    out: dict[str, Any] = {"stage": trainers["dpp"].topo.coord.pp, "cases": {}}
    try:
        for case, (specs, spike_links, p, ms) in cases.items():
            injector = faults.install(specs, trainers["dpp"].topo) if specs else None
            spikes = LinkSpikes(rank, spike_links, p, ms) if spike_links else None
            if spikes is not None:
                comm.add_interceptor(spikes)
            recs: dict[str, list] = {s: [] for s in SCHEDULES}
            # the first case also warms the processes up (allocator, first-touch, thread pools)
            warmup = size["warmup"] + (FIRST_WARMUP if case == next(iter(cases)) and size["warmup"] else 0)
            for rep in range(warmup + size["steps"]):
                if spikes is not None:
                    spikes.rep = rep
                for sched in (SCHEDULES if rep % 2 == 0 else SCHEDULES[::-1]):
                    dist.barrier()
                    recorder.take()
                    windows.clear()
                    t0 = time.perf_counter()
                    rec = trainers[sched].train_step()
                    dist.barrier()
                    wall = time.perf_counter() - t0
                    if rep >= warmup:
                        recs[sched].append({"wall": wall, "step_time": rec["step_time"], "wait_s": rec["wait_s"],
                                            "executor_s": windows[0], "tasks": recorder.take()})
            if spikes is not None:
                comm.remove_interceptor(spikes)
            if injector is not None:
                injector.remove()
            out["cases"][case] = recs
            gc.collect()
    finally:
        tracing.uninstall(recorder)
    (Path(outdir) / f"rank{rank}.json").write_text(json.dumps(out))


def step_timings(per_rank: list[dict], case: str, sched: str, i: int, size: dict[str, int]) -> StepTimings:
    """Step i of one schedule in one case, merged over ranks."""
    tasks, execs, waits = [], [0.0] * size["pp"], [0.0] * size["pp"]
    for r in per_rank:
        s, rec = r["stage"], r["cases"][case][sched][i]
        tasks += [TaskTiming(s, *t) for t in rec["tasks"]]
        execs[s], waits[s] = rec["executor_s"], rec["wait_s"]
    return StepTimings(size["pp"], size["vpp"], size["microbatches"], tasks, execs, waits)


def _err(pred: float, real: float) -> float:
    return pred / real - 1.0


def summarise(per_rank: list[dict], case: str, size: dict[str, int]) -> dict[str, Any]:
    """Times, ratios and simulator predictions of one case."""
    n = size["steps"]
    lead = next(r for r in per_rank if r["stage"] == 0)["cases"][case]
    walls = {s: [rec["wall"] for rec in lead[s]] for s in SCHEDULES}
    steps = {s: [step_timings(per_rank, case, s, i, size) for i in range(n)] for s in SCHEDULES}
    spans = {s: [st.makespan() for st in steps[s]] for s in SCHEDULES}
    cals = {s: calibrate(steps[s]) for s in SCHEDULES}
    cap = dpp_cap(size)
    row: dict[str, Any] = {
        "case": case, "median_step_s": {s: statistics.median(walls[s]) for s in SCHEDULES},
        "median_pipeline_s": {s: statistics.median(spans[s]) for s in SCHEDULES},
        "paired_ratio": statistics.median(a / b for a, b in zip(walls["dpp"], walls["interleaved-1f1b"])),
        "paired_pipeline_ratio": statistics.median(a / b for a, b in zip(spans["dpp"], spans["interleaved-1f1b"])),
        "calibration": {s: cals[s].to_dict() for s in SCHEDULES}, "sim": {},
        "times_s": walls, "pipeline_s": spans,
    }
    # median seconds each stage stayed blocked after a task (payload copy, injected delay), by task kind
    row["blocked_s"] = {s: [{k: statistics.median([t.blocked for st in steps[s] for t in st.tasks
                                                    if t.stage == stage and t.kind == k]) for k in "FB"}
                            for stage in range(size["pp"])] for s in SCHEDULES}
    row["ratio"] = row["median_step_s"]["dpp"] / row["median_step_s"]["interleaved-1f1b"]
    for s in SCHEDULES:
        real_pipe, real_step = row["median_pipeline_s"][s], row["median_step_s"][s]
        outside = real_step - real_pipe  # data, optimizer, loss and norm all-reduces, barriers: not simulated
        mi = cap if s == "dpp" else None
        own = simulate(SIM_NAME[s], cals[s].sim_config(mi), timeline=False).step_time
        cross = simulate(SIM_NAME[s], cals["interleaved-1f1b"].sim_config(mi), timeline=False).step_time
        cal = cals[s]
        replays = [replay(SIM_NAME[s], st, cal.overhead, cal.latency, mi).step_time for st in steps[s]]
        row["sim"][s] = {
            "own_config_s": own, "own_config_err": _err(own, real_pipe),
            "from_interleaved_s": cross, "from_interleaved_err": _err(cross, real_pipe),
            "replay_median_err": statistics.median(_err(p, m) for p, m in zip(replays, spans[s])),
            "replay_max_abs_err": max(abs(_err(p, m)) for p, m in zip(replays, spans[s])),
            "step_err_own_config": _err(own + outside, real_step),
        }
    sim_i = simulate("interleaved-1f1b", cals["interleaved-1f1b"].sim_config(), timeline=False).step_time
    sim_d = simulate("dpp-adaptive", cals["interleaved-1f1b"].sim_config(cap), timeline=False).step_time
    row["predicted_ratio_from_interleaved"] = sim_d / sim_i
    return row


def run(quick: bool = False, steps: int | None = None) -> dict[str, Any]:
    """Run every case on real ranks; the summary with per-case ratios and simulator errors."""
    size, cases = (dict(QUICK), QUICK_CASES) if quick else (dict(FULL), FULL_CASES)
    if steps is not None:
        size["steps"] = steps
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        spawn(worker, size["pp"], size, cases, tmp)
        per_rank = [json.loads((Path(tmp) / f"rank{r}.json").read_text()) for r in range(size["pp"])]
    rows = [summarise(per_rank, c, size) for c in cases]
    cfg = RunConfig.from_dict(run_config("dpp", size))
    return {
        "benchmark": "MegaDPP on real ranks: dpp-adaptive vs interleaved 1F1B, simulator calibrated and checked",
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "wall_s": round(time.perf_counter() - t0, 1),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "load_avg_at_end": os.getloadavg(),
                    "python": platform.python_version(), "torch": torch.__version__, "threads_per_rank": 1,
                    "backend": "gloo"},
        "config": {"size": size, "dpp_max_inflight": dpp_cap(size), "params": cfg.model.num_params(),
                   "cases": {c: {"inject": v[0], "spike_links": v[1], "spike_p": v[2], "spike_ms": v[3]}
                             for c, v in cases.items()},
                   "protocol": "both schedules in the same rank processes, alternating step by step, "
                               "barrier-fenced; medians over the measured steps after warm-up (2 per case, 3 more "
                               "before the first); pipeline time: first task start to last task end over all ranks"},
        "target_sim_error": TARGET_SIM_ERROR, "cases": rows,
    }


def table(result: dict[str, Any]) -> str:
    """Two Markdown tables: step times and ratios, then simulator errors (pipeline time, predicted/measured - 1)."""
    lines = ["| case | interleaved (s/step) | dpp (s/step) | dpp/int | paired | pipeline paired | sim dpp/int |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for r in result["cases"]:
        med = r["median_step_s"]
        lines.append(f"| {r['case']} | {med['interleaved-1f1b']:.4f} | {med['dpp']:.4f} | {r['ratio']:.3f} "
                     f"| {r['paired_ratio']:.3f} | {r['paired_pipeline_ratio']:.3f} "
                     f"| {r['predicted_ratio_from_interleaved']:.3f} |")
    lines += ["", "| case | schedule | SimConfig (own run) | SimConfig (from interleaved) | replay median "
              "| replay worst | whole step (own) |", "|---|---|---:|---:|---:|---:|---:|"]
    for r in result["cases"]:
        for s in SCHEDULES:
            e = r["sim"][s]
            lines.append(f"| {r['case']} | {s} | {e['own_config_err']:+.1%} | {e['from_interleaved_err']:+.1%} "
                         f"| {e['replay_median_err']:+.1%} | {e['replay_max_abs_err']:.1%} "
                         f"| {e['step_err_own_config']:+.1%} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny model on 2 ranks, 1 measured step; writes nothing")
    ap.add_argument("--steps", type=int, default=None, help="measured steps per schedule (after warm-up)")
    args = ap.parse_args(argv)
    result = run(quick=args.quick, steps=args.steps)
    print(table(result))
    print(f"wall {result['wall_s']} s, load average at end {result['machine']['load_avg_at_end']}")
    if args.quick:
        return
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {RESULTS.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
