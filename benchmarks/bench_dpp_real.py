"""MegaDPP on real ranks: dpp-zb and dpp-adaptive vs interleaved 1F1B and ZB-H1 step time, with and without
injected link faults, and the discrete-event simulator calibrated from the same run, predicted vs measured.

4 gloo ranks on CPU, pp=4, 8 microbatches (a small GPT-2). interleaved 1F1B, dpp-adaptive and dpp-zb run it cut in
vpp=2 chunks per stage; ZB-H1 runs one chunk per stage (it needs vpp=1), i.e. the same model with each stage's two
chunks merged. All four live in the same rank processes (one Trainer each) and take turns step by step (the order
rotates every repetition), each step fenced by barriers, so machine noise falls on all alike. The dynamic policies
run with their cap at interleaved 1F1B's peak (the same memory); ZB-H1 holds 1F1B's (less). Faults go through the
engine's comm seam (`megatronapp.faults`):
  slow-link  slow-link=A-B:MS: every send over the link sleeps MS on the sender's thread before it is issued (the
             sending stage is blocked, the message leaves late);
  spike      the same kind of delay, but only on a random share of the sends (drawn from the step, the two ranks
             and the message tag, so every schedule meets the same slow messages); this benchmark's interceptor;
  slow-wire  slow-wire=A-B:FACTOR: delivery is late by (FACTOR-1) nominal wire times, the sender goes on;
  jitter     jitter=A-B:lognormal:SIGMA: delivery is late by a nominal wire time times a lognormal draw (mean 1).
The nominal wire time is a message's bytes at `faults.WIRE_GBPS`; at its 1 GB/s an activation of this tiny model
(33 KB) takes 33 us against a chunk's 5 ms forward, so the workers model a slower wire (`wire_ms` per
activation, about half a forward), the ratio of a real activation on an inter-node link to a layer's compute.
Every rank records its compute spans ("forward", "backward", "weight_grad" for W) and the time blocked before each
send through `megatronapp.tracing`; `megatronapp.dpp.calibrate` turns them into simulator inputs, and the injected
wire faults become the simulator's per-link latency and link jitter. Reported per case: median step times, paired
ratios, and for each schedule the simulator's predicted pipeline time against the measured one (the public
SimConfig model calibrated from the schedule's own run, the same calibrated from the interleaved run (a true
prediction), and a replay of each step's own task costs).

Intervals: step i of every schedule ran in the same rotation, so a/b of step i is a paired ratio; its median gets a
95% interval by bootstrap over the steps, or with --blocks K over K launches of fresh rank processes (two-level
bootstrap; the simulator columns then come from the first block). "within noise" when the interval holds 1.0.

Run: python -m benchmarks.bench_dpp_real           (writes benchmarks/results/dpp_real.json, docs interval block)
     python -m benchmarks.bench_dpp_real --blocks 3 (3 independent launches, pooled)
     python -m benchmarks.bench_dpp_real --from-json (re-render the docs intervals from the stored result)
     python -m benchmarks.bench_dpp_real --quick   (tiny model, 2 ranks, 1 step; writes nothing)
"""
from __future__ import annotations

import copy
import dataclasses
import gc
import random
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks import harness, stats
from benchmarks.dpp_runs import act_bytes, dpp_cap, link_model, time_executor, wire_gbps
from megatronapp.config import RunConfig
from megatronapp.dpp.calibrate import StepTimings, TaskTiming, calibrate
from megatronapp.dpp.simulator import SimConfig, simulate

RESULTS = harness.results_path("dpp_real")
BLOCK = "intervals:bench_dpp_real"
TARGET_SIM_ERROR = 0.15  # the bar: simulator within 15% of the measured step

# name -> (faults specs, spike links "A-B,C-D" or "", spike probability, spike ms)
ALL_LINKS_JITTER = [f"jitter={a}-{(a + 1) % 4}:lognormal:0.5" for a in range(4)]  # 3-0: chunk 0 -> chunk 1
FULL_CASES: dict[str, tuple[list[str], str, float, float]] = {
    "none": ([], "", 0.0, 0.0),
    "slow-link 1-2 10ms": (["slow-link=1-2:10"], "", 0.0, 0.0),
    "slow-link 0-1,2-3 5ms": (["slow-link=0-1:5", "slow-link=2-3:5"], "", 0.0, 0.0),
    "spike 1-2 p=0.25 20ms": ([], "1-2", 0.25, 20.0),
    "slow-wire 1-2 x4": (["slow-wire=1-2:4"], "", 0.0, 0.0),
    "jitter all links lognormal 0.5": (ALL_LINKS_JITTER, "", 0.0, 0.0),
}
QUICK_CASES = {"none": ([], "", 0.0, 0.0), "slow-link 0-1 2ms": (["slow-link=0-1:2"], "", 0.0, 0.0),
               "spike 0-1 p=0.5 2ms": ([], "0-1", 0.5, 2.0), "slow-wire 0-1 x4": (["slow-wire=0-1:4"], "", 0.0, 0.0),
               "jitter 0-1 lognormal 0.5": (["jitter=0-1:lognormal:0.5"], "", 0.0, 0.0)}
# wire_ms: nominal wire time of one activation (see the docstring)
FULL = {"pp": 4, "vpp": 2, "microbatches": 8, "hidden": 128, "layers": 8, "heads": 4, "seq": 64, "warmup": 2,
        "steps": 20, "wire_ms": 2.5}
QUICK = {"pp": 2, "vpp": 2, "microbatches": 4, "hidden": 32, "layers": 4, "heads": 4, "seq": 16, "warmup": 0,
         "steps": 1, "wire_ms": 0.5}
FIRST_WARMUP = 3  # extra warm-up repetitions before the first case
SCHEDULES = ("interleaved-1f1b", "dpp-adaptive", "dpp-zb", "zb-h1")  # the simulator's names too
DYNAMIC = ("dpp-adaptive", "dpp-zb")
PAIRS = (("dpp-adaptive", "interleaved-1f1b"), ("dpp-zb", "interleaved-1f1b"), ("dpp-zb", "zb-h1"),
         ("zb-h1", "interleaved-1f1b"))
SIM_SEEDS = 5  # link-jitter draws averaged for a SimConfig prediction


def pair_name(a: str, b: str) -> str:
    return f"{a}/{b}"


def run_config(schedule: str, size: dict[str, int]) -> dict[str, Any]:
    """The run config of one schedule: a small untied GPT-2, one sample per microbatch (ZB-H1: one chunk a stage)."""
    parallel = {"tp": 1, "pp": size["pp"], "dp": 1, "vpp": 1 if schedule == "zb-h1" else size["vpp"],
                "microbatches": size["microbatches"], "schedule": "dpp" if schedule in DYNAMIC else schedule}
    if schedule in DYNAMIC:
        parallel.update(dpp_policy=schedule.removeprefix("dpp-"), dpp_max_inflight=dpp_cap(size))
    return {
        "model": {"family": "gpt2", "vocab_size": 256, "hidden_size": size["hidden"], "num_layers": size["layers"],
                  "num_heads": size["heads"], "max_seq_len": size["seq"], "tie_embeddings": False},
        "parallel": parallel,
        "train": {"steps": 10_000, "global_batch_size": size["microbatches"], "seq_len": size["seq"], "lr": 1e-3,
                  "warmup_steps": 0, "grad_clip": 1.0, "seed": 5, "progress": False, "peak_tflops": 1.0,
                  "out": str(Path(tempfile.gettempdir()) / "megatronapp-bench-dpp-real")},
    }


KIND = {"forward": "F", "backward": "B", "weight_grad": "W"}  # the executor's compute spans


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
            self._last = [KIND[name], meta["chunk"], meta["microbatch"], t0, time.perf_counter(), 0.0]

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


def worker(rank: int, world: int, size: dict[str, Any], cases: dict[str, tuple], outdir: str) -> None:
    """Spawned entry: every schedule's Trainer, every case taking turns; each rank saves its records."""
    from megatronapp import faults, tracing
    from megatronapp.parallel import comm
    from megatronapp.train.trainer import Trainer

    faults.WIRE_GBPS = wire_gbps(size)  # see the module docstring: a wire as slow, relative to compute, as a real one
    comm.reset()
    trainers = {}
    for sched in SCHEDULES:
        torch.manual_seed(5)
        trainers[sched] = Trainer(RunConfig.from_dict(copy.deepcopy(run_config(sched, size))), rank)
    windows: list[float] = []  # the executor's own window, for the per-task overhead
    time_executor(trainers.values(), windows)
    recorder = TaskRecorder()
    tracing.install(recorder)
    topo = trainers["interleaved-1f1b"].topo
    out: dict[str, Any] = {"stage": topo.coord.pp, "cases": {}}
    try:
        for case, (specs, spike_links, p, ms) in cases.items():
            injector = faults.install(specs, topo) if specs else None
            spikes = LinkSpikes(rank, spike_links, p, ms) if spike_links else None
            if spikes is not None:
                comm.add_interceptor(spikes)
            recs: dict[str, list] = {s: [] for s in SCHEDULES}
            # the first case also warms the processes up (allocator, first-touch, thread pools)
            warmup = size["warmup"] + (FIRST_WARMUP if case == next(iter(cases)) and size["warmup"] else 0)
            for rep in range(warmup + size["steps"]):
                if spikes is not None:
                    spikes.rep = rep
                for sched in harness.rotation(list(SCHEDULES), rep):  # each goes first as often as the others
                    recorder.take()
                    windows.clear()
                    wall, rec = harness.fenced(trainers[sched].train_step)
                    if rep >= warmup:
                        recs[sched].append({"wall": wall, "step_time": rec["step_time"], "wait_s": rec["wait_s"],
                                            "executor_s": windows[0], "peak_inflight": rec["peak_inflight"],
                                            "tasks": recorder.take()})
            if spikes is not None:
                comm.remove_interceptor(spikes)
            if injector is not None:
                injector.remove()
            out["cases"][case] = recs
            gc.collect()
    finally:
        tracing.uninstall(recorder)
    harness.report(outdir, rank, out)


def step_timings(per_rank: list[dict], case: str, sched: str, i: int, size: dict[str, Any]) -> StepTimings:
    """Step i of one schedule in one case, merged over ranks."""
    tasks, execs, waits = [], [0.0] * size["pp"], [0.0] * size["pp"]
    for r in per_rank:
        s, rec = r["stage"], r["cases"][case][sched][i]
        tasks += [TaskTiming(s, *t) for t in rec["tasks"]]
        execs[s], waits[s] = rec["executor_s"], rec["wait_s"]
    vpp = 1 if sched == "zb-h1" else size["vpp"]
    return StepTimings(size["pp"], vpp, size["microbatches"], tasks, execs, waits)


def _err(pred: float, real: float) -> float:
    return pred / real - 1.0


def predict(name: str, cfg: SimConfig, seeds: int) -> float:
    """Mean simulated pipeline time over link-jitter seeds (one run when nothing is random)."""
    if cfg.link_jitter == "none" and cfg.compute_jitter == "none":
        seeds = 1
    return statistics.fmean(simulate(name, dataclasses.replace(cfg, seed=k), timeline=False).step_time
                            for k in range(seeds))


def summarise(per_rank: list[dict], case: str, size: dict[str, Any], specs: list[str]) -> dict[str, Any]:
    """Times, paired ratios and simulator predictions of one case."""
    n = size["steps"]
    lead = next(r for r in per_rank if r["stage"] == 0)["cases"][case]
    walls = {s: [rec["wall"] for rec in lead[s]] for s in SCHEDULES}
    steps = {s: [step_timings(per_rank, case, s, i, size) for i in range(n)] for s in SCHEDULES}
    spans = {s: [st.makespan() for st in steps[s]] for s in SCHEDULES}
    cals = {s: calibrate(steps[s]) for s in SCHEDULES}
    cap = dpp_cap(size)
    links = link_model(specs, size)
    row: dict[str, Any] = {
        "case": case, "inject": specs, "sim_links": links,
        "median_step_s": {s: statistics.median(walls[s]) for s in SCHEDULES},
        "median_pipeline_s": {s: statistics.median(spans[s]) for s in SCHEDULES},
        # busiest stage's activations held at once, in whole-stage units (ZB-H1's chunk is a whole stage)
        "peak_activation": {s: max(rec["peak_inflight"] for r in per_rank for rec in r["cases"][case][s])
                            / (1 if s == "zb-h1" else size["vpp"]) for s in SCHEDULES},
        "ratio": {}, "paired_ratio": {}, "paired_pipeline_ratio": {}, "predicted_ratio": {},
        "calibration": {s: cals[s].to_dict() for s in SCHEDULES}, "sim": {},
        "times_s": walls, "pipeline_s": spans,
    }
    for a, b in PAIRS:
        k = pair_name(a, b)
        row["ratio"][k] = row["median_step_s"][a] / row["median_step_s"][b]
        row["paired_ratio"][k] = statistics.median(x / y for x, y in zip(walls[a], walls[b]))
        row["paired_pipeline_ratio"][k] = statistics.median(x / y for x, y in zip(spans[a], spans[b]))
    # median seconds each stage stayed blocked after a task (payload copy, injected delay), by task kind
    row["blocked_s"] = {s: [{k: statistics.median([t.blocked for st in steps[s] for t in st.tasks
                                                    if t.stage == stage and t.kind == k] or [0.0]) for k in "FBW"}
                            for stage in range(size["pp"])] for s in SCHEDULES}
    own = {}
    for s in SCHEDULES:
        real_pipe, real_step = row["median_pipeline_s"][s], row["median_step_s"][s]
        outside = real_step - real_pipe  # data, optimizer, loss and norm all-reduces, barriers: not simulated
        mi = cap if s in DYNAMIC else None
        cal = cals[s]
        own[s] = predict(s, dataclasses.replace(cal.sim_config(mi), **links), SIM_SEEDS)
        entry = {"own_config_s": own[s], "own_config_err": _err(own[s], real_pipe),
                 "step_err_own_config": _err(own[s] + outside, real_step)}
        if s != "zb-h1":  # the interleaved run's costs are per chunk of vpp=2; ZB-H1 runs whole stages
            cross = predict(s, dataclasses.replace(cals["interleaved-1f1b"].sim_config(mi), **links), SIM_SEEDS)
            entry.update(from_interleaved_s=cross, from_interleaved_err=_err(cross, real_pipe))
        replays = []
        for i, st in enumerate(steps[s]):  # every task at its own measured cost
            cfg = SimConfig(pp=st.pp, vpp=st.vpp, microbatches=st.microbatches, latency=cal.latency,
                            max_inflight=mi, task_costs=st.task_costs(cal.overhead), seed=i)
            replays.append(simulate(s, dataclasses.replace(cfg, **links), timeline=False).step_time)
        errs = [_err(p, m) for p, m in zip(replays, spans[s])]
        entry.update(replay_median_err=statistics.median(errs), replay_max_abs_err=max(map(abs, errs)))
        row["sim"][s] = entry
    for a, b in PAIRS:
        row["predicted_ratio"][pair_name(a, b)] = own[a] / own[b]
    return row


def intervals(row: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Paired step-time ratios of one case with their 95% intervals (pooled over blocks when there are several)."""
    blocks = row.get("blocks") or [{"times_s": row["times_s"]}]
    out = {}
    for a, b in PAIRS:
        sm = stats.summarize_blocks([stats.paired_ratios(bl["times_s"][a], bl["times_s"][b]) for bl in blocks])
        sm.pop("ratios")
        out[pair_name(a, b)] = sm
    return out


def _with_intervals(result: dict[str, Any]) -> None:
    for row in result["cases"]:
        row["intervals"] = intervals(row)


def docs_block(result: dict[str, Any]) -> str:
    """The interval table of docs/benchmarks.md: every case x the four paired ratios."""
    order = (PAIRS[1], PAIRS[2], PAIRS[3], PAIRS[0])
    lines = ["| case | " + " | ".join(f"{a} / {b}" for a, b in order) + " |", "|---|" + "---|" * len(order)]
    for r in result["cases"]:
        iv = r.get("intervals") or intervals(r)
        lines.append(f"| {r['case']} | " + " | ".join(stats.fmt(iv[pair_name(a, b)]) for a, b in order) + " |")
    blocks = result.get("blocks", 1)
    n = len(result["cases"][0]["times_s"]["dpp-zb"])
    return "\n".join(lines) + (f"\n\n{n} paired steps per case, {stats.blocks_label(blocks)}; load average at the "
                               f"end {tuple(round(x, 1) for x in result['machine']['load_avg_at_end'])}. "
                               "\"worse\" = the first schedule is slower with the whole interval above 1.")


def _pool_blocks(runs: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Rows of the first launch, with every launch's step times kept per block and the paired ratios pooled."""
    rows = runs[0]
    for i, row in enumerate(rows):
        row["blocks"] = [{"times_s": rr[i]["times_s"], "pipeline_s": rr[i]["pipeline_s"]} for rr in runs]
        for key, field in (("paired_ratio", "times_s"), ("paired_pipeline_ratio", "pipeline_s")):
            for a, b in PAIRS:
                row[key][pair_name(a, b)] = statistics.median(
                    x / y for bl in row["blocks"] for x, y in zip(bl[field][a], bl[field][b]))
    return rows


def run(quick: bool = False, steps: int | None = None, blocks: int = 1) -> dict[str, Any]:
    """Run every case on real ranks in `blocks` independent launches; the summary with per-case ratios, their
    intervals and simulator errors (those of the first launch)."""
    size, cases = (dict(QUICK), QUICK_CASES) if quick else (dict(FULL), FULL_CASES)
    if steps is not None:
        size["steps"] = steps
    clock = harness.Clock()
    runs = []
    for _ in range(blocks):
        per_rank = harness.launch(worker, size["pp"], size, cases)
        runs.append([summarise(per_rank, c, size, cases[c][0]) for c in cases])
    rows = runs[0] if blocks == 1 else _pool_blocks(runs)
    for row in rows:
        row["intervals"] = intervals(row)
    cfg = RunConfig.from_dict(run_config("dpp-zb", size))
    return {
        "benchmark": "MegaDPP on real ranks: dpp-zb and dpp-adaptive vs interleaved 1F1B and ZB-H1, simulator "
                     "calibrated and checked",
        "timestamp": clock.timestamp, "wall_s": clock.wall_s(),
        "machine": harness.machine(clock, threads_per_rank=1, backend="gloo"),
        "config": {"size": size, "dpp_max_inflight": dpp_cap(size), "params": cfg.model.num_params(),
                   "message_bytes": act_bytes(size), "wire_gbps": wire_gbps(size),
                   "cases": {c: {"inject": v[0], "spike_links": v[1], "spike_p": v[2], "spike_ms": v[3]}
                             for c, v in cases.items()},
                   "protocol": "all schedules in the same rank processes, taking turns step by step (the order "
                               "rotates every repetition), barrier-fenced; medians over the measured steps after "
                               "warm-up (2 per case, 3 more before the first); pipeline time: first task start to "
                               "last task end over all ranks; zb-h1 runs the same model as one chunk per stage"},
        "target_sim_error": TARGET_SIM_ERROR, "blocks": blocks, "cases": rows,
    }


def table(result: dict[str, Any]) -> str:
    """Two Markdown tables: step times and paired ratios (measured, and predicted by the simulator from each run's
    own calibration), then simulator errors (pipeline time, predicted/measured - 1)."""
    lines = ["| case | interleaved | dpp-adaptive | dpp-zb | zb-h1 (s/step) | ada/int | zb/int | dpp-zb/int "
             "| dpp-zb/zb-h1 | sim dpp-zb/int | sim dpp-zb/zb-h1 |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in result["cases"]:
        med, pr, pred = r["median_step_s"], r["paired_ratio"], r["predicted_ratio"]
        lines.append(f"| {r['case']} | " + " | ".join(f"{med[s]:.4f}" for s in SCHEDULES) + " | "
                     + " | ".join(f"{pr[pair_name(*p)]:.3f}" for p in (PAIRS[0], PAIRS[3], PAIRS[1], PAIRS[2]))
                     + f" | {pred[pair_name(*PAIRS[1])]:.3f} | {pred[pair_name(*PAIRS[2])]:.3f} |")
    lines += ["", "| case | schedule | SimConfig (own run) | SimConfig (from interleaved) | replay median "
              "| replay worst | whole step (own) |", "|---|---|---:|---:|---:|---:|---:|"]
    for r in result["cases"]:
        for s in SCHEDULES:
            e = r["sim"][s]
            cross = f"{e['from_interleaved_err']:+.1%}" if "from_interleaved_err" in e else "-"
            lines.append(f"| {r['case']} | {s} | {e['own_config_err']:+.1%} | {cross} "
                         f"| {e['replay_median_err']:+.1%} | {e['replay_max_abs_err']:.1%} "
                         f"| {e['step_err_own_config']:+.1%} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = harness.parser(__doc__, "tiny model on 2 ranks, 1 measured step; writes nothing", from_json=True, blocks=1)
    ap.add_argument("--steps", type=int, default=None, help="measured steps per schedule (after warm-up)")
    args = ap.parse_args(argv)
    if args.from_json:
        stored = harness.rerender(RESULTS, docs_block, block=BLOCK, refresh=_with_intervals)
        print(docs_block(stored))
        return
    result = run(quick=args.quick, steps=args.steps, blocks=args.blocks)
    print(table(result))
    print(f"wall {result['wall_s']} s, load average at end {result['machine']['load_avg_at_end']}")
    if not args.quick:
        harness.save(result, RESULTS, docs_block(result), block=BLOCK)


if __name__ == "__main__":
    main()
