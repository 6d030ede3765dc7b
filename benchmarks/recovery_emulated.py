"""Recovery on emulated devices: in place (`--spares 1`) against restarting every rank, split in parts.

A supervised job (`megatronapp train --supervise`, tp2 x pp2 x dp2 = 8 ranks, `--emulate-device`, a checkpoint
every 2 steps) runs until every rank has finished a drawn step; then one drawn rank fails. The draws (rank, step,
and a delay after the step so the fault lands anywhere in the next one) come from a seeded generator and are
recorded with each drill. Kinds of drill, interleaved so that a drift of the host's load falls on all alike:
  in place, kill -9     the job with one warm spare (benchmarks/recovery_inplace.py): parts of the generation
  in place, SIGSTOP     the same with SIGSTOP (named after the supervisor's `stop_after_s`, 1 s)
  in place, hang        `--inject hang=RANK:STEP` (named by the hang timeout, which the time includes)
  restart the world     the same kill -9 (the same draw as the in-place drill it follows) without spares: every
                        rank is stopped and started again from the newest checkpoint. Its parts, from the run's own
                        records:
      detection   kill -> the supervisor sees the rank's exit (the failure's `noticed_at`)
      stop        -> the job's other ranks are stopped (the failure's `detected_at`; includes a 0.5 s settle wait so
                     the victims of a dead rank report too)
      restart     -> the last rank of the new attempt to start training has started, joined its process groups
                     and built its model (its heartbeat `started_at` minus its `load_s`)
      load        -> that rank has loaded the checkpoint (its `load_s`)
      first step  -> every rank has finished a step again (the supervisor's `recovery_s` after detection)
Each drill is a fresh job; medians with a bootstrap 95% interval over drills. A drill that fails (the job did not
recover, or the supervisor named another rank first) is recorded with its reason and left out of the medians.
"""
from __future__ import annotations

import json
import os
import random
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks import harness, recovery_inplace, stats

RESULTS = harness.results_path("recovery_emulated")
# ~1.2 s of device time per rank and step for this tiny model: 8 ranks share 2 cores, and at 0.0005 TFLOP/s (25 ms
# per step) the host's work per task was 9-160x its device time, far out of the accelerator regime
SPEC = "tflops=0.00001"
STEPS = 9
DRAWN_STEPS = (2, 5)  # the fault strikes after one of these steps (inclusive), leaving >= 3 steps to run
MAX_DELAY_S = 1.5  # ... and up to this long after it: about one step, so any phase of the next step
# The in-place hang drills' --hang-timeout and heartbeat period. A hang is judged on activity (any phase or
# communication op of a rank others wait for, `watch.ProgressClock`), whose longest healthy pause here is 0.6-0.8 s
# as seen through 0.25 s heartbeats (1.0-1.1 s through 0.5 s ones): each drill records the pause seen before it.
HANG_TIMEOUT_S = 1.5
HANG_HEARTBEAT_S = 0.25
HANGS_PER_JOB = 5
LAYOUTS = {4: (1, 2, 2), 8: (2, 2, 2), 16: (2, 2, 4)}  # world -> (tp, pp, dp): every layout has a DP peer
PARTS = ("detection", "stop", "restart", "load", "first_step")
TARGETS = {"kill": 3.0, "stop": 5.0, "hang": 5.0}  # issue 41: seconds from the fault to the next committed step


def flags(world: int = 8, steps: int | None = STEPS) -> list[str]:
    """The supervised job of `world` ranks. Each rank holds the same work per step whatever the layout: one
    micro-batch per microbatch and DP replica (global batch 2 x dp), and with tp1 (4 ranks) a device twice as fast,
    so that each rank's device time per step is the same as with tp2."""
    tp, pp, dp = LAYOUTS[world]
    spec = SPEC if tp == 2 else "tflops=0.00002"
    return ["--nproc", str(world), "--tp", str(tp), "--pp", str(pp), "--dp", str(dp),
            *(["--steps", str(steps)] if steps is not None else []), "--save-interval", "2", "--layers", "2",
            "--hidden", "64", "--global-batch", str(2 * dp),
            "--microbatches", "2", "--seq-len", "32", "--no-progress", "--peak-tflops", "1", "--supervise",
            "--no-diagnose-on-restart", "--heartbeat-interval", "0.5", "--emulate-device", spec]


def draw(rng: random.Random, kind: str, world: int, hang_timeout_s: float = HANG_TIMEOUT_S) -> dict[str, Any]:
    """One fault: the rank, the step after which it strikes and the delay after that step."""
    fault = {"kind": kind, "victim": rng.randrange(world), "step": rng.randint(*DRAWN_STEPS),
             "delay_s": round(rng.uniform(0.0, MAX_DELAY_S), 3)}
    if kind == "hang":  # a hang strikes by itself, at the start of the drawn step
        fault.update(delay_s=0.0, hang_timeout_s=hang_timeout_s)
    return fault


def restart_drill(fault: dict[str, Any], world: int = 8, timeout_s: float = 600.0) -> dict[str, Any]:
    """One supervised job without spares and one kill -9 (`fault`); the parts of its restart in seconds."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run"
        hb = out / ".heartbeat"
        proc = recovery_inplace.start([*flags(world), "--out", str(out)], Path(tmp))
        try:
            killed_at, phase, _ = recovery_inplace._strike(proc, hb, world, fault, time.time() + timeout_s)
            recovery_inplace.finish(proc, timeout_s)
        except BaseException:
            recovery_inplace.stop(proc)
            raise
        events = [json.loads(line) for line in (out / "resilience.jsonl").read_text().splitlines()]
        final = recovery_inplace.beats(hb)  # the heartbeats of the attempt that recovered (reset per attempt)
        emulation = json.loads((out / "summary.json").read_text()).get("emulation", {})
        ran = recovery_inplace.run_stats(out)
    failure = next(e for e in events if e["event"] == "failure")
    recovered = next(e for e in events if e["event"] == "recovered")
    # the parts follow the rank that started training last, so they add up to the total
    last = max(final.values(), key=lambda b: b["started_at"])
    again = failure["detected_at"] + recovered["recovery_s"]
    parts = {"detection": failure["noticed_at"] - killed_at, "stop": failure["detected_at"] - failure["noticed_at"],
             "restart": last["started_at"] - last["load_s"] - failure["detected_at"], "load": last["load_s"],
             "first_step": again - last["started_at"]}
    return {**fault, **parts, "total": again - killed_at, **ran, "phase_at_fault": phase,
            "signal": failure.get("signal"), "named_rank": failure["rank"],
            "host_share": emulation.get("host_share"), "load_avg": os.getloadavg()[0],
            "times": {"killed_at": killed_at, "noticed_at": failure["noticed_at"],
                      "detected_at": failure["detected_at"], "training_again_at": again,
                      "started_at": {r: b["started_at"] for r, b in final.items()},
                      "load_s": {r: b["load_s"] for r, b in final.items()}}}


def valid(d: dict[str, Any]) -> bool:
    """A drill that measured what it meant to: it recovered, and the first failure named was the drawn rank."""
    # drills stored before the draws named rank 5, always, under `rank_named`
    return "error" not in d and d.get("named_rank", d.get("rank_named")) == d.get("victim", 5)


def median_ci(values: list[float]) -> dict[str, Any]:
    lo, hi = stats.bootstrap_ci(values)
    return {"median_s": statistics.median(values), "ci95": [lo, hi], "n": len(values)}


def summarize(drills: list[dict[str, Any]], parts: tuple[str, ...]) -> dict[str, Any]:
    """Median and interval of each part over the valid drills (a part a drill did not reach is left out)."""
    ok = [d for d in drills if valid(d)]
    out = {}
    for k in (*parts, "total", "step_time_s"):
        values = [d[k] for d in ok if d.get(k) is not None]
        if values:
            out[k] = median_ci(values)
    return out


def run_drill(kind: str, fault: dict[str, Any], world: int = 8) -> dict[str, Any]:
    """One drill; a failed one is returned with its reason (and left out of the medians)."""
    try:
        if kind == "restart":
            return restart_drill(fault, world)
        return recovery_inplace.drill(flags(world), world, fault)
    except (RuntimeError, subprocess.TimeoutExpired, OSError, ValueError, KeyError, StopIteration) as e:
        return {**fault, "error": f"{type(e).__name__}: {str(e)[-1500:]}"}


def show(kind: str, i: int, d: dict[str, Any]) -> None:
    head = f"{kind} {i + 1}: rank {d['victim']} after step {d['step']} +{d['delay_s'] or 0:.2f} s"
    if "error" in d:
        print(f"{head}: FAILED {d['error'][-300:]}", flush=True)
        return
    keys = PARTS if kind == "restart" else recovery_inplace.PARTS
    print(f"{head} ({d['phase_at_fault']}): " + ", ".join(f"{k} {d[k]:.2f}" for k in (*keys, "total")
                                                            if d.get(k) is not None)
          + f" s; named rank {d['named_rank']}, {d['replayed_steps']} step(s) again, step "
            f"{d['step_time_s'] or 0:.2f} s, load {d['load_avg']:.1f}", flush=True)


def series(kinds: list[str], rng: random.Random, world: int = 8, hang_timeout_s: float = HANG_TIMEOUT_S
           ) -> list[dict[str, Any]]:
    """The faults `kinds` in one job (recovery_series.py); a failed job is recorded against each of its faults."""
    from benchmarks import recovery_series

    if not kinds:
        return []
    try:
        job = flags(world, None)
        if kinds[0] == "hang":  # finer heartbeats: the hang clock sees activity only through them
            job[job.index("--heartbeat-interval") + 1] = str(HANG_HEARTBEAT_S)
        return recovery_series.series(job, world, kinds, rng, hang_timeout_s)
    except (RuntimeError, subprocess.TimeoutExpired, OSError, ValueError, KeyError) as e:
        return [{"kind": k, "victim": None, "step": None, "delay_s": 0.0,
                 "error": f"{type(e).__name__}: {str(e)[-1500:]}"} for k in kinds]


def main(kills: int, restarts: int, stops: int, hangs: int, seed: int = 41, hang_timeout_s: float = HANG_TIMEOUT_S,
         write: bool = True) -> dict[str, Any]:
    """The in-place kill -9 and SIGSTOP drills in one job (drawn order), the hangs in a second, and `restarts`
    restart-the-world drills (one job each; with none, the stored ones are kept with their timestamp); with
    `write`, the result and its docs block."""
    clock = harness.Clock()
    rng = random.Random(seed)
    kinds = ["kill"] * kills + ["stop"] * stops
    rng.shuffle(kinds)
    drills: dict[str, list[dict[str, Any]]] = {"kill": [], "restart": [], "stop": [], "hang": []}
    # the hangs strike distinct ranks of a job (an injected hang is the rank's): a job per HANGS_PER_JOB
    hang_jobs = [["hang"] * min(HANGS_PER_JOB, hangs - i) for i in range(0, hangs, HANGS_PER_JOB)]
    for d in series(kinds, rng) + [d for job in hang_jobs for d in series(job, rng, hang_timeout_s=hang_timeout_s)]:
        drills[d["kind"]].append(d)
        show(d["kind"], len(drills[d["kind"]]) - 1, d)
    for i in range(restarts):
        d = run_drill("restart", draw(rng, "kill", 8))
        drills["restart"].append(d)
        show("restart", i, d)
    # a kind not run this time keeps its stored drills, with when they were measured
    old = harness.read_result(RESULTS) if RESULTS.is_file() else {}
    kept = {}
    for kind, key, n in (("restart", "drills", restarts), ("kill", "inplace_drills", kills),
                         ("stop", "stop_drills", stops), ("hang", "hang_drills", hangs)):
        if not n and old.get(key):
            drills[kind] = old[key]
            kept[kind] = old.get("kept", {}).get(kind) or (old.get("restart_from") if kind == "restart" else None) \
                or old.get("timestamp")
    restart_from = kept.get("restart")
    result = {"spec": SPEC, "flags": flags(8, None), "seed": seed, "drawn_steps": list(DRAWN_STEPS),
              "max_delay_s": MAX_DELAY_S, "hang_timeout_s": hang_timeout_s,
              "hang_heartbeat_s": HANG_HEARTBEAT_S, "restart_from": restart_from, "kept": kept,
              # the restart-the-world drills keep the keys bench_multihost reads
              "drills": drills["restart"], "summary": summarize(drills["restart"], PARTS),
              "inplace_drills": drills["kill"], "inplace_summary": summarize(drills["kill"], recovery_inplace.PARTS),
              "stop_drills": drills["stop"], "stop_summary": summarize(drills["stop"], recovery_inplace.PARTS),
              "hang_drills": drills["hang"], "hang_summary": summarize(drills["hang"], recovery_inplace.PARTS),
              "wall_s": clock.wall_s(), "timestamp": clock.timestamp}
    result["claims"] = claims(result)
    shares = [d["host_share"] for ds in drills.values() for d in ds if d.get("host_share") is not None]
    result["machine"] = harness.machine(clock, emulated=True, host_share=max(shares, default=None))
    for name, key in (("restart the world", "summary"), ("in place, kill -9", "inplace_summary"),
                      ("in place, SIGSTOP", "stop_summary"), ("in place, hang", "hang_summary")):
        print(f"{name}: " + " | ".join(f"{k} {v['median_s']:.2f} [{v['ci95'][0]:.2f}, {v['ci95'][1]:.2f}]"
                                       for k, v in result[key].items()))
    print("claims: " + "; ".join(f"{k}: {v['claim']}" for k, v in result["claims"].items()))
    if write:
        harness.save(result, RESULTS, docs_body(result), block="recovery-emulated")
    return result


def claims(res: dict[str, Any]) -> dict[str, Any]:
    """Each in-place kind against its target (the whole interval must be under it), and the steps computed again
    beyond the interrupted one over every in-place drill (the target is none)."""
    out = {}
    for kind, key in (("kill", "inplace_summary"), ("stop", "stop_summary"), ("hang", "hang_summary")):
        t = res[key].get("total")
        if t is not None:
            out[kind] = {"target_s": TARGETS[kind], "median_s": t["median_s"], "ci95": t["ci95"],
                         "claim": stats.claim(*t["ci95"], TARGETS[kind])}
    again = [d["replayed_steps"] for k in ("inplace_drills", "stop_drills", "hang_drills") for d in res[k]
             if valid(d)]
    out["steps_again"] = {"values": sorted(set(again)), "claim": "met" if again and not any(again) else "missed"}
    return out


def _cell(s: dict[str, Any], k: str) -> str:
    v = s.get(k)
    return f"{v['median_s']:.2f} [{v['ci95'][0]:.2f}, {v['ci95'][1]:.2f}]" if v else "-"


def _label(key: str) -> str:
    return "step time (the job's median, for scale)" if key == "step_time_s" else key.replace("_", " ")


def _failed(drills: list[dict[str, Any]]) -> int:
    return sum(1 for d in drills if not valid(d))


def docs_body(res: dict[str, Any]) -> str:
    s = res["summary"]
    kinds = (("inplace", "kill -9"), ("stop", "SIGSTOP"), ("hang", f"hang (timeout {res['hang_timeout_s']:g} s)"))
    rows = "\n".join(f"| {_label(k)} | " + " | ".join(_cell(res[f"{n}_summary"], k) for n, _ in kinds)
                     + " |" for k in (*recovery_inplace.PARTS, "step_time_s"))
    counts = " / ".join(f"{sum(map(valid, res[f'{n}_drills']))}" for n, _ in kinds)
    failed = sum(_failed(res[f"{n}_drills"]) for n, _ in kinds) + _failed(res["drills"])
    c = res["claims"]
    verdicts = "; ".join(f"{name}: {c[k]['median_s']:.2f} s [{c[k]['ci95'][0]:.2f}, {c[k]['ci95'][1]:.2f}] against "
                         f"<= {c[k]['target_s']:g} s, **{c[k]['claim']}**"
                         for k, name in (("kill", "kill -9"), ("stop", "SIGSTOP"), ("hang", "hang")) if k in c)
    restart_rows = "\n".join(f"| {_label(k)} | {_cell(s, k)} |" for k in (*PARTS, "total", "step_time_s") if k in s)
    loads = [d["load_avg"] for k in ("drills", "inplace_drills", "stop_drills", "hang_drills") for d in res[k]
             if "load_avg" in d]
    shares = [d["host_share"] for k in ("drills", "inplace_drills", "stop_drills", "hang_drills") for d in res[k]
              if d.get("host_share") is not None]
    again_restart = sorted({d["replayed_steps"] for d in res["drills"] if valid(d) and "replayed_steps" in d})
    restart_when = f", measured {res['restart_from']} and kept" if res.get("restart_from") else ""
    stored_before_draws = any("victim" not in d for d in res["drills"])
    restart_what = ("kill -9 of rank 5 after every rank finished step 3" if stored_before_draws
                    else f"kill -9 of a drawn rank a drawn 0-{MAX_DELAY_S:g} s after a drawn step "
                         f"{DRAWN_STEPS[0]}-{DRAWN_STEPS[1]}")
    kept_note = "".join(f"; {k} drills measured {t}" for k, t in res.get("kept", {}).items() if k != "restart")
    hang_steps = sorted({d["step"] for d in res["hang_drills"] if d.get("step") is not None})
    seen = [d["longest_pause_s"] for d in res["hang_drills"] if d.get("longest_pause_s") is not None]
    pauses = f"{min(seen):.2f}-{max(seen):.2f} s" if seen else "not recorded (drills stored before it was)"
    return f"""**Recovery on emulated devices** (`python -m benchmarks.bench_recovery --emulated`): a supervised \
tp2 x pp2 x dp2 job (8 ranks, `--emulate-device {res['spec']}`, a checkpoint every 2 steps) with one warm spare \
per fault takes its faults one after another (`benchmarks/recovery_series.py`: a job's start took minutes on \
this loaded host, so one job per drill did not fit; after each take-over a new spare starts in the background, \
importing torch on the same 2 cores while the next drills run). Before each kill -9 or SIGSTOP (their order drawn) the \
driver waits until the previous recovery committed and every rank finished 2-3 more steps (drawn), then a drawn \
delay of 0-{MAX_DELAY_S:g} s, and strikes a drawn rank (seed {res['seed']}; each draw recorded in \
`benchmarks/results/recovery_emulated.json`); the hangs, in jobs of their own (up to {HANGS_PER_JOB} each), are \
injected on distinct drawn ranks at \
steps {', '.join(map(str, hang_steps)) or '-'}. Seconds from the fault to each part of the recovery, median \
[bootstrap 95% interval] over drills (valid drills: {counts}):

| reached | kill -9 | SIGSTOP (named after 1 s stopped) | {kinds[2][1]} |
|---|---:|---:|---:|
{rows}

Against the issue's targets (the whole interval must be under the target): {verdicts}. Steps computed again \
beyond the interrupted one, over every in-place drill: {', '.join(map(str, c['steps_again']['values']))} \
(**{c['steps_again']['claim']}**). The hang's time starts when the rank blocks and includes the hang timeout; a \
hang is judged on activity (no phase change or communication op of a rank that others wait for, \
`resilience/watch.py`), seen through heartbeats every {res.get('hang_heartbeat_s', 0.5):g} s in the hang jobs; \
the longest healthy pause of such a rank seen before each hang: {pauses}. A \
SIGSTOP's includes the supervisor's 1 s before it calls a stopped process a hang. The first commit is one step \
run again (the interrupted one) after the state is in place, so about a step time of it is the step itself.

Restarting every rank instead (the same job without spares, {restart_what}; \
{sum(map(valid, res['drills']))} drills, one job each{restart_when}), seconds from the kill:

| part | median [95% CI] (s) |
|---|---:|
{restart_rows}

Detection: the driver sees the rank's exit; stop: a 0.5 s settle wait and stopping the other ranks; restart: \
launching 8 processes, importing torch, joining the process groups and building the model; load: the checkpoint \
load (both for the rank that started training last, so the parts add up to the total); first step: until every \
rank has finished a step again. Steps computed again after a restart (since the checkpoint): \
{', '.join(map(str, again_restart)) or '-'}. Failed drills (not recovered, or another rank named first; recorded \
with their reason): {failed}. Load average {min(loads, default=0):.1f}-{max(loads, default=0):.1f} on 2 cores \
shared with other jobs; host share of the runs (worst rank, host over device time) \
{min(shares, default=0):.2f}-{max(shares, default=0):.2f} (under 0.5: the emulated devices set the pace). \
Recorded {res['timestamp']}, {res['wall_s']:.0f} s{kept_note}."""
