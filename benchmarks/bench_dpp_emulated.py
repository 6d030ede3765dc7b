"""MegaDPP on emulated devices: real rank processes in the accelerator regime, against the simulator's prediction.

Every rank runs `--emulate-device` (parallel/device_emulation.py): each task computes its real tensors, then the
rank sleeps out the task's modelled device time, so a rank idle in a bubble no longer lends its core to another
rank -- the regime of one accelerator per rank that CPU-bound runs (bench_dpp_real) cannot show. Schedules:
1F1B and ZB-H1 (one chunk per stage), interleaved 1F1B, dpp-adaptive and dpp-zb (vpp 2; the dynamic ones capped
at interleaved 1F1B's peak activations). All five live in the same rank processes (one Trainer each) and take
turns step by step (the order rotates every repetition), barrier-fenced. Step i of every schedule uses the same
jitter draws (a pure function of step, stage, task), so a/b of step i is a paired ratio.

Scenarios: lognormal 0.5 compute jitter; no jitter; a slow stage (rank 1's device at 0.5x speed); a slow wire
(slow-wire=1-2:4 over a modelled wire on which an activation takes half a chunk's forward, as in
bench_dpp_real). At pp 4 (the README's 8-layer model, 16 microbatches) and pp 8 (16 layers, 16 microbatches).

For each schedule and step the simulator gets the very same task costs (`megatronapp.dpp.emulated.predict`, plus
the optimizer's device time and the wire model as per-link latency) and its step time is set against the measured
one. Each launch of fresh rank processes is one block; ratios get 95% intervals from `stats.summarize_blocks`.
Every emulated run's host share (host time over device time, worst rank) is recorded: a run above 0.5 would not
be in the accelerator regime.

Run: python -m benchmarks.bench_dpp_emulated            (writes benchmarks/results/dpp_emulated.json + docs block)
     python -m benchmarks.bench_dpp_emulated --quick    (pp 2, 2 steps, one scenario; writes nothing)
     python -m benchmarks.bench_dpp_emulated --cli      (also the README-style CLI check, one run per schedule)
"""
from __future__ import annotations

import copy
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks import harness, stats
from benchmarks.dpp_runs import dpp_cap, link_model, time_executor, wire_gbps
from megatronapp.config import RunConfig
from megatronapp.parallel import device_emulation as emu

RESULTS = harness.results_path("dpp_emulated")
BLOCK = "intervals:bench_dpp_emulated"
SCHEDULES = ("1f1b", "interleaved-1f1b", "zb-h1", "dpp-adaptive", "dpp-zb")
ONE_CHUNK = ("1f1b", "zb-h1")
DYNAMIC = ("dpp-adaptive", "dpp-zb")
PAIRS = (("dpp-zb", "interleaved-1f1b"), ("dpp-zb", "zb-h1"), ("dpp-adaptive", "interleaved-1f1b"),
         ("zb-h1", "interleaved-1f1b"), ("interleaved-1f1b", "1f1b"))
# Device seconds of one chunk's forward of one microbatch (a layer of the tiny model). 15 ms put pp 4 out of the
# accelerator regime on the shared 2-core host (host share 0.56-0.68 at load average 15-54, dpp-zb worst: its
# split backward has the most, and the shortest, tasks); 30 ms kept pp 8 (4 ranks per core) at 0.13-0.49.
FORWARD_S = 0.03
FORWARD_S_BY_SIZE: dict[str, float] = {}
WIRE_FRACTION = 0.5  # slow-wire case: a modelled activation's wire time, as a share of a chunk's forward
# name -> (extra spec keys, --inject specs)
SCENARIOS: dict[str, tuple[str, list[str]]] = {
    "jitter lognormal 0.5": (",jitter=lognormal:0.5", []),
    "no jitter": ("", []),
    "slow stage (rank 1 at 0.5x)": (",speed=1:0.5", []),
    "slow wire 1-2 x4": ("", ["slow-wire=1-2:4"]),
}
SIZES = {"pp4": {"pp": 4, "vpp": 2, "layers": 8, "microbatches": 16},
         "pp8": {"pp": 8, "vpp": 2, "layers": 16, "microbatches": 16}}
QUICK = {"pp2": {"pp": 2, "vpp": 2, "layers": 4, "microbatches": 4}}
MODEL = {"family": "gpt2", "vocab_size": 256, "hidden_size": 128, "num_heads": 4, "max_seq_len": 128}  # gpt2-tiny
SEQ = 64


def base_config(schedule: str, size: dict[str, int]) -> dict[str, Any]:
    """The README's model (gpt2-tiny, one sample per microbatch) under one schedule."""
    parallel = {"tp": 1, "pp": size["pp"], "dp": 1, "vpp": 1 if schedule in ONE_CHUNK else size["vpp"],
                "microbatches": size["microbatches"], "schedule": "dpp" if schedule in DYNAMIC else schedule}
    if schedule in DYNAMIC:
        parallel.update(dpp_policy=schedule.removeprefix("dpp-"), dpp_max_inflight=dpp_cap(size))
    return {"model": {**MODEL, "num_layers": size["layers"]}, "parallel": parallel,
            "train": {"steps": 10_000, "global_batch_size": size["microbatches"], "seq_len": SEQ, "lr": 1e-3,
                      "warmup_steps": 0, "seed": 5, "progress": False, "peak_tflops": 1.0,
                      "out": str(Path(tempfile.gettempdir()) / "megatronapp-bench-dpp-emulated")}}


def forward_s(size: dict[str, int]) -> float:
    """Device seconds of a middle chunk's forward of one microbatch at this size."""
    return FORWARD_S_BY_SIZE.get(f"pp{size['pp']}", FORWARD_S)


def tflops_for(size: dict[str, int]) -> float:
    """The device rate at which a middle chunk's forward of one microbatch takes forward_s(size)."""
    cfg = RunConfig.from_dict(base_config("interleaved-1f1b", size))
    return emu.chunk_flops(cfg, 1)[0][0] / forward_s(size) / 1e12


def run_config(schedule: str, size: dict[str, int], scenario: str) -> dict[str, Any]:
    extra, inject = SCENARIOS[scenario]
    d = base_config(schedule, size)
    d["emulate_device"] = f"tflops={tflops_for(size):.6g},seed=11{extra}"
    d["inject"] = list(inject)
    return d


def wire_size(size: dict[str, int]) -> dict[str, Any]:
    """The link model's inputs (dpp_runs): a modelled activation (one sample of SEQ tokens) takes WIRE_FRACTION of
    a chunk's forward."""
    return {"pp": size["pp"], "wire_ms": WIRE_FRACTION * forward_s(size) * 1e3, "seq": SEQ,
            "hidden": MODEL["hidden_size"]}


def worker(rank: int, world: int, size: dict[str, int], scenarios: list[str], reps: int, warmup: int,
           outdir: str) -> None:
    """Spawned entry: per scenario, one Trainer per schedule taking turns; each rank saves its records."""
    from megatronapp import faults
    from megatronapp.parallel import comm
    from megatronapp.train.trainer import Trainer

    faults.WIRE_GBPS = wire_gbps(wire_size(size))
    out: dict[str, Any] = {}
    for scenario in scenarios:
        comm.reset()
        trainers = {s: Trainer(RunConfig.from_dict(copy.deepcopy(run_config(s, size, scenario))), rank)
                    for s in SCHEDULES}
        first = trainers[SCHEDULES[0]]
        windows: list[float] = []  # the executor's own window: the pipeline part of the step
        time_executor(trainers.values(), windows)
        injector = faults.install(SCENARIOS[scenario][1], first.topo) if SCENARIOS[scenario][1] else None
        recs: dict[str, list] = {s: [] for s in SCHEDULES}
        for rep in range(warmup + reps):
            for sched in harness.rotation(list(SCHEDULES), rep):
                windows.clear()
                wall, rec = harness.fenced(trainers[sched].train_step)
                if rep >= warmup:
                    recs[sched].append({"step": trainers[sched].step - 1, "wall": wall,
                                        "pipeline": windows[0], "peak_inflight": rec["peak_inflight"]})
        if injector is not None:
            injector.remove()
        out[scenario] = {"stage": first.topo.coord.pp, "recs": recs,
                         "params": {s: sum(q.numel() for q in tr.params) for s, tr in trainers.items()},
                         "emulation": {s: tr.emulation.record() for s, tr in trainers.items()}}
        for tr in trainers.values():
            tr.close()
    harness.report(outdir, rank, out)


def predicted_step(schedule: str, size: dict[str, int], scenario: str, step: int,
                   params: list[int]) -> tuple[float, float]:
    """The simulator's (pipeline, whole step) times for this emulated step: the pipeline from the same task
    costs, the step adding the optimizer's device time."""
    from megatronapp.dpp import emulated

    cfg = RunConfig.from_dict(run_config(schedule, size, scenario))
    sim = emulated.sim_config(cfg, step)
    links = link_model(SCENARIOS[scenario][1], wire_size(size))
    for key, value in links.items():
        setattr(sim, key, value)
    from megatronapp.dpp.simulator import simulate

    pipe = simulate(emulated.schedule_name(cfg), sim, timeline=False).step_time
    return pipe, pipe + emulated.optimizer_seconds(cfg, params)


def summarise(per_rank: list[dict], size: dict[str, int], scenario: str) -> dict[str, Any]:
    """Step times, peaks, host shares and simulator errors of one scenario of one launch."""
    lead = next(r for r in per_rank if r[scenario]["stage"] == 0)[scenario]
    walls = {s: [x["wall"] for x in lead["recs"][s]] for s in SCHEDULES}
    steps = [x["step"] for x in lead["recs"][SCHEDULES[0]]]
    params = {s: [0] * size["pp"] for s in SCHEDULES}
    for r in per_rank:
        for s in SCHEDULES:
            params[s][r[scenario]["stage"]] = r[scenario]["params"][s]
    both = {s: [predicted_step(s, size, scenario, st, params[s]) for st in steps] for s in SCHEDULES}
    predicted = {s: [x[1] for x in both[s]] for s in SCHEDULES}
    errors = {s: [p / m - 1 for p, m in zip(predicted[s], walls[s])] for s in SCHEDULES}
    pipes = {s: [max(r[scenario]["recs"][s][i]["pipeline"] for r in per_rank) for i in range(len(steps))]
             for s in SCHEDULES}
    pipe_errors = {s: [x[0] / m - 1 for x, m in zip(both[s], pipes[s])] for s in SCHEDULES}
    ordered = sorted(per_rank, key=lambda r: r[scenario]["stage"])
    records = {s: emu.summarize("tflops=1", [r[scenario]["emulation"][s] for r in ordered]) for s in SCHEDULES}
    host = {s: records[s]["host_share"] for s in SCHEDULES}
    late = {s: max(x["late_share"] for x in records[s]["ranks"]) for s in SCHEDULES}
    peak = {s: max(x["peak_inflight"] for r in per_rank for x in r[scenario]["recs"][s])
            / (1 if s in ONE_CHUNK else size["vpp"]) for s in SCHEDULES}
    return {"scenario": scenario, "times_s": walls, "predicted_s": predicted,
            "median_step_s": {s: statistics.median(walls[s]) for s in SCHEDULES},
            "sim_error_median": {s: statistics.median(errors[s]) for s in SCHEDULES},
            "sim_error_max_abs": {s: max(map(abs, errors[s])) for s in SCHEDULES},
            "pipeline_s": pipes, "sim_pipeline_error_median": {s: statistics.median(pipe_errors[s]) for s in SCHEDULES},
            "host_share": host, "late_share": late, "peak_activation": peak}


def pooled(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """One scenario over K launches: paired ratios with two-level intervals, simulator errors and host shares."""
    out = {"scenario": rows[0]["scenario"], "blocks": rows, "ratios": {}}
    for a, b in PAIRS:
        blocks = [stats.paired_ratios(r["times_s"][a], r["times_s"][b]) for r in rows]
        sm = stats.summarize_blocks(blocks)
        sm.pop("ratios")
        out["ratios"][f"{a}/{b}"] = sm
        pred = [p / q for r in rows for p, q in zip(r["predicted_s"][a], r["predicted_s"][b])]
        out["ratios"][f"{a}/{b}"]["simulated"] = statistics.median(pred)
    out["sim_error_median"] = {s: statistics.median([r["sim_error_median"][s] for r in rows]) for s in SCHEDULES}
    out["sim_error_max_abs"] = {s: max(r["sim_error_max_abs"][s] for r in rows) for s in SCHEDULES}
    out["sim_pipeline_error_median"] = {s: statistics.median([r["sim_pipeline_error_median"][s] for r in rows])
                                        for s in SCHEDULES}
    out["host_share"] = {s: max(r["host_share"][s] for r in rows) for s in SCHEDULES}
    out["late_share"] = {s: max(r["late_share"][s] for r in rows) for s in SCHEDULES}
    out["peak_activation"] = rows[0]["peak_activation"]
    out["median_step_s"] = {s: statistics.median([t for r in rows for t in r["times_s"][s]]) for s in SCHEDULES}
    return out


def run(sizes: dict[str, dict[str, int]], scenarios: dict[str, list[str]], reps: int, warmup: int,
        blocks: int) -> dict[str, Any]:
    """Every size x its scenarios, in `blocks` launches of fresh processes each."""
    clock = harness.Clock()
    result: dict[str, Any] = {"sizes": {}, "load_avg_at_start": list(clock.load)}
    for name, size in sizes.items():
        launches = []
        for _ in range(blocks):
            per_rank = harness.launch(worker, size["pp"], size, scenarios[name], reps, warmup)
            launches.append([summarise(per_rank, size, sc) for sc in scenarios[name]])
        result["sizes"][name] = {"size": size, "tflops": tflops_for(size), "forward_s": forward_s(size),
                                 "dpp_max_inflight": dpp_cap(size),
                                 "scenarios": [pooled([launch[i] for launch in launches])
                                               for i in range(len(scenarios[name]))]}
        result["sizes"][name]["load_avg_at_end"] = os.getloadavg()
        print(f"{name} done at {clock.wall_s():.0f} s, load {os.getloadavg()}", flush=True)
    worst = max(max(sc["host_share"].values()) for sz in result["sizes"].values() for sc in sz["scenarios"])
    result.update(benchmark="MegaDPP on emulated devices", timestamp=clock.timestamp, wall_s=clock.wall_s(),
                  blocks=blocks, reps=reps, warmup=warmup, forward_s=FORWARD_S,
                  machine=harness.machine(clock, emulated=True, host_share=worst, threads_per_rank=1,
                                          backend="gloo"))
    return result


def cli_check(steps: int = 6) -> dict[str, Any]:
    """The issue's CLI check: `megatronapp train --nproc 4 --pp 4 --vpp 2 --layers 8 --microbatches 16
    --global-batch 16 --emulate-device tflops=...,jitter=lognormal:0.5`, median step time after the first."""
    size = SIZES["pp4"]
    spec = f"tflops={tflops_for(size):.6g},jitter=lognormal:0.5"
    runs = {"interleaved-1f1b": ["--schedule", "interleaved-1f1b", "--vpp", "2"],
            "dpp-zb": ["--schedule", "dpp", "--dpp-policy", "zb", "--vpp", "2"],
            "zb-h1": ["--schedule", "zb-h1"]}
    out = {"spec": spec, "steps": steps, "median_step_s": {}, "host_share": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for name, flags in runs.items():
            d = Path(tmp) / name
            cmd = [sys.executable, "-m", "megatronapp", "train", "--nproc", "4", "--pp", "4", "--layers", "8",
                   "--microbatches", "16", "--global-batch", "16", "--steps", str(steps), "--no-progress",
                   "--out", str(d), "--emulate-device", spec, *flags]
            subprocess.run(cmd, check=True, capture_output=True, env={**os.environ, "PYTHONPATH": os.pathsep.join(
                [str(harness.ROOT / "src"), str(harness.ROOT), os.environ.get("PYTHONPATH", "")])})
            recs = [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()]
            out["median_step_s"][name] = statistics.median(r["step_time"] for r in recs[1:])
            out["host_share"][name] = json.loads((d / "summary.json").read_text())["emulation"]["host_share"]
            out["command_" + name] = " ".join(cmd[1:])
    m = out["median_step_s"]
    out["dpp-zb/interleaved-1f1b"] = m["dpp-zb"] / m["interleaved-1f1b"]
    out["dpp-zb/zb-h1"] = m["dpp-zb"] / m["zb-h1"]
    out["load_avg_at_end"] = os.getloadavg()
    return out


def _forward_ms(result: dict[str, Any]) -> str:
    """'a chunk's forward pp4 15 ms, pp8 30 ms': the device time per size of a stored result."""
    ms = [f"{n} {1e3 * sz.get('forward_s', result['forward_s']):.0f} ms" for n, sz in result["sizes"].items()]
    return "a chunk's forward " + ", ".join(ms)


def _host(share: float) -> str:
    """A host share, flagged when the run was out of the accelerator regime (its ratios are not figures)."""
    out = share > emu.parse_spec("tflops=1").host_share
    return f"{share:.2f}" + (" (out of the accelerator regime: not a figure)" if out else "")


def _load(avg: Any) -> str:
    """A load average triple, rounded, or 'not recorded' (older stored results)."""
    return str(tuple(round(x, 1) for x in avg)) if avg else "not recorded"


def docs_block(result: dict[str, Any]) -> str:
    """docs/benchmarks.md's table: per size and scenario the paired ratios with intervals, simulator error,
    host share and peak activations."""
    lines = ["| size | scenario | dpp-zb / interleaved | dpp-zb / zb-h1 | dpp-adaptive / interleaved "
             "| sim dpp-zb/int | worst sim error | max host share | peak act. int / dpp-zb / zb-h1 |",
             "|---|---|---|---|---|---:|---:|---:|---|"]
    for name, sz in result["sizes"].items():
        for sc in sz["scenarios"]:
            r = sc["ratios"]
            worst = max(sc["sim_error_median"].values(), key=abs)
            pk = sc["peak_activation"]
            lines.append(f"| {name} | {sc['scenario']} | {stats.fmt(r['dpp-zb/interleaved-1f1b'])} "
                         f"| {stats.fmt(r['dpp-zb/zb-h1'])} | {stats.fmt(r['dpp-adaptive/interleaved-1f1b'])} "
                         f"| {r['dpp-zb/interleaved-1f1b']['simulated']:.3f} | {worst:+.1%} "
                         f"| {_host(max(sc['host_share'].values()))} "
                         f"| {pk['interleaved-1f1b']:.2f} / {pk['dpp-zb']:.2f} / {pk['zb-h1']:.2f} |")
    text = "\n".join(lines)
    for name, sz in result["sizes"].items():
        for sc in sz["scenarios"]:
            if "appended" in sc:
                a = sc["appended"]
                text += (f"\n\n{name} {sc['scenario']}: added by a later run ({a['timestamp']}), load average at "
                         f"its start {_load(a['load_avg_at_start'])}, at its end {_load(a['load_avg_at_end'])}.")
    after = ", ".join(f"{n} {_load(sz.get('load_avg_at_end'))}" for n, sz in result["sizes"].items())
    text += (f"\n\n{result['reps']} paired steps per scenario and launch after {result['warmup']} warm-up, "
             f"{stats.blocks_label(result['blocks'])}; worst sim error: the schedule whose median (simulated / "
             f"emulated step - 1) is largest; host share: host time over device time, worst rank and schedule; "
             f"load average (1, 5, 15 min) at the start {_load(result.get('load_avg_at_start'))}, after each size "
             f"{after}, at the end {_load(harness.machine_of(result)['load_avg_at_end'])}.")
    for cli in [result.get("cli")] + result.get("cli_reruns", []):
        if not cli:
            continue
        again = (f" (run again; load average at its end {_load(cli['load_avg_at_end'])})"
                 if cli is not result.get("cli") else "")
        text += (f"\n\nCLI check (`megatronapp train --nproc 4 --pp 4 --layers 8 --microbatches 16 --global-batch 16 "
                 f"--emulate-device {cli['spec']}`, {cli['steps']} steps, median after the first){again}: dpp-zb / "
                 f"interleaved-1f1b {cli['dpp-zb/interleaved-1f1b']:.3f}, dpp-zb / zb-h1 {cli['dpp-zb/zb-h1']:.3f}; "
                 f"host shares {', '.join(f'{k} {v:.2f}' for k, v in cli['host_share'].items())}.")
    return text


def main(argv: list[str] | None = None) -> None:
    ap = harness.parser(__doc__, "pp 2, 2 steps, one scenario; writes nothing", from_json=True, blocks=2)
    ap.add_argument("--reps", type=int, default=6, help="measured steps per schedule and launch")
    ap.add_argument("--sizes", default="pp4,pp8")
    ap.add_argument("--pp8-scenarios", default="jitter lognormal 0.5,no jitter",
                    help="scenarios run at pp 8 (comma-separated names; all four at pp 4)")
    ap.add_argument("--pp4-scenarios", default=",".join(SCENARIOS), help="scenarios run at pp 4")
    ap.add_argument("--keep-earlier", action="store_true",
                    help="keep the stored result's sizes not run now, and the stored result as the earlier run")
    ap.add_argument("--cli", action="store_true", help="also run the CLI check")
    ap.add_argument("--cli-only", action="store_true", help="run the CLI check again into the stored result")
    ap.add_argument("--append", action="store_true",
                    help="add the scenarios run now to the stored result's latest run (their load recorded)")
    args = ap.parse_args(argv)
    if args.from_json or args.cli_only:
        stored = harness.read_result(RESULTS)
        if args.cli_only:
            stored.setdefault("cli_reruns", []).append(cli_check())
            harness.write_result(stored, RESULTS)
        write_docs(stored)
        return
    if args.quick:
        result = run(QUICK, {"pp2": ["jitter lognormal 0.5"]}, reps=2, warmup=2, blocks=1)
        print(docs_block(result))
        print(json.dumps({k: v for k, v in result["sizes"]["pp2"]["scenarios"][0].items() if k != "blocks"}))
        return
    sizes = {k: SIZES[k] for k in args.sizes.split(",")}
    scenarios = {"pp4": [s for s in args.pp4_scenarios.split(",") if s],
                 "pp8": [s for s in args.pp8_scenarios.split(",") if s]}
    earlier = harness.read_result(RESULTS) if args.keep_earlier and RESULTS.exists() else None
    result = run(sizes, scenarios, reps=args.reps, warmup=2, blocks=args.blocks)
    if args.append:
        stored = harness.read_result(RESULTS)
        for name, sz in result["sizes"].items():
            for sc in sz["scenarios"]:
                sc["appended"] = {"timestamp": result["timestamp"], "load_avg_at_start": result["load_avg_at_start"],
                                  "load_avg_at_end": sz["load_avg_at_end"]}
            stored["sizes"].setdefault(name, {**sz, "scenarios": []})["scenarios"] += sz["scenarios"]
        result = stored
    if args.cli:
        result["cli"] = cli_check()
    if earlier is not None:
        earlier.pop("earlier_run", None)
        result["earlier_run"] = earlier
    print(docs_block(result))
    harness.write_result(result, RESULTS)
    write_docs(result)
    print(f"wrote {harness.shown(RESULTS)}")


def write_docs(result: dict[str, Any]) -> None:
    """The interval block of docs/benchmarks.md and docs/megadpp.md (a stored result may carry a later run)."""
    text = docs_block(result)
    if result.get("later_run"):
        text = ("Latest run (current code: a queued task starts where the previous one ended on the device), one "
                "launch:\n\n" + docs_block(result["later_run"]) + "\n\nFirst run (before that change: a late "
                "wake-up of the host counted as device time), one launch, all four scenarios:\n\n" + text)
    if result.get("earlier_run"):
        e = result["earlier_run"]
        text = (f"Latest run ({result['timestamp']}, {_forward_ms(result)}):\n\n{text}\n\n"
                f"Earlier run ({e['timestamp']}, {_forward_ms(e)}):\n\n{docs_block(e)}")
    if result.get("not_measured"):
        text += "\n\nNot measured: " + result["not_measured"] + "."
    for doc in (harness.DOCS, harness.ROOT / "docs" / "megadpp.md"):
        try:
            harness.write_block(doc, BLOCK, text)
        except ValueError as e:
            print(e)


if __name__ == "__main__":
    main()
