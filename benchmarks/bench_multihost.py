"""Faults across hosts: detection and time to training again, 4 hosts x 2 emulated ranks, per fault kind.

Hosts are network namespaces on this machine (`megatronapp.testing.cluster`); every host runs `megatronapp torchrun`
with `train --heartbeat-dir` (tp2 x pp2 x dp2, 8 ranks, `--emulate-device`, a checkpoint every 2 steps) and
`megatronapp resilience watch` watches. Each drill is a fresh job; once every rank has finished step 3 one fault
is made on host 2 (ranks 4 and 5):

  kill-9     rank 5 SIGKILLed; torchrun restarts every worker of every host (no decision)
  hang       `--inject hang=5:3`: rank 5 blocks at step 4; the driver decides after --hang-timeout 10
  host-lost  host 2 loses power (link cut, then every process killed); a standby host waits and the rendezvous
             store runs on a host of its own; torchrun's keep-alive (1 s x 5) expires and the standby takes over
  partition  host 2's link down until the job trains again without it (standby waiting, store on host 0): the
             cut-off ranks are fenced
  flap       host 2's link down for 2 s: the job should ride through (no restart); its stall is measured

Parts, from the job's own records (seconds after the fault): `detected` the first reaction (a driver decision in
driver.jsonl, or a torchrun agent stopping workers: the time stamp of its log line), `restarted` the new start of the
workers recorded (start.json: rendezvous, process start, process groups), `training again` every rank of the new
start has finished a step. Also: how many of the 8 ranks got a new process (torchrun restarts every worker of every
host), and the load average. Medians with a bootstrap 95% interval over drills; beside them the single-host figure
of benchmarks/results/recovery_emulated.json (same job on one host under `--supervise`, kill -9 of one rank).

    sudo python -m benchmarks.bench_multihost [--repeats 3] [--kinds kill-9,hang,host-lost,partition,flap]
"""
from __future__ import annotations

import datetime
import json
import os
import re
import shutil
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks import harness, stats
from megatronapp.testing import jobs
from megatronapp.testing.cluster import Cluster, missing_capability

RESULTS = harness.results_path("multihost_emulated")
SINGLE = harness.results_path("recovery_emulated")
SPEC = "tflops=0.00001"  # as recovery_emulated.py: ~1.2 s of device time per rank and step
FLAGS = ["--tp", "2", "--pp", "2", "--dp", "2", "--steps", "8", "--save-interval", "2", "--layers", "2",
         "--hidden", "64", "--global-batch", "4", "--microbatches", "2", "--seq-len", "32", "--no-progress",
         "--peak-tflops", "1", "--heartbeat-interval", "0.5", "--emulate-device", SPEC]
KINDS = ("kill-9", "hang", "host-lost", "partition", "flap")
HANG_TIMEOUT, FLAP_S, VICTIM_HOST, VICTIM_RANK = 10.0, 2.0, 2, 5
_LOGLINE = re.compile(r"^[IWE](\d\d)(\d\d) (\d\d):(\d\d):(\d\d)\.(\d+) "
                      r".*(closing signal|failed \(exitcode|Detected \d+ new nodes)", re.M)


def _agent_reactions(text: str, year: int) -> list[float]:
    """Time stamps of the lines where a torchrun agent stops or restarts its workers."""
    out = []
    for m in _LOGLINE.finditer(text):
        mo, d, h, mi, s, frac = m.groups()[:6]
        out.append(datetime.datetime(year, int(mo), int(d), int(h), int(mi), int(s),
                                     int(frac[:6].ljust(6, "0"))).timestamp())
    return out


def _beats(hb: Path) -> dict[int, dict[str, Any]]:
    return {r: b for r in range(8) if (b := jobs.beat(hb, r))}


def drill(kind: str, root: Path) -> dict[str, Any]:
    """One job, one fault after step 3; its parts in seconds."""
    standby = kind in ("host-lost", "partition")
    c = Cluster(4 + standby + (kind == "host-lost"), log_dir=root / "logs")
    job = jobs.Job(c, root / "run", root / "hb", root / "logs")
    env = jobs.env(LOGLEVEL="INFO")
    flags = [*FLAGS, *(["--inject", f"hang={VICTIM_RANK}:3"] if kind == "hang" else [])]
    try:
        if kind == "host-lost":
            endpoint, conf = jobs.start_store(job, 5, env), jobs.rdzv_conf(is_host=False)
        else:
            endpoint, conf = f"{c.hosts[0].addr}:{jobs.PORT}", jobs.rdzv_conf()
        for h in range(4):
            jobs.start_agent(job, h, endpoint, "4", 2, flags, conf, env)
        jobs.start_driver(job, 8, HANG_TIMEOUT, 0.5, env, give_up_after_s=300)
        first = jobs.wait_until(lambda: jobs.start_record(job.hb).get("start"), 600, "the first start") and \
            jobs.start_record(job.hb)["start"]
        if standby:
            jobs.start_agent(job, 4, endpoint, "4", 2, flags, conf, env)
        jobs.wait_until(lambda: len(b := _beats(job.hb)) == 8 and min(x.get("step", -1) for x in b.values()) >= 3,
                        600, "step 3 on every rank")
        pids = {r: b["pid"] for r, b in _beats(job.hb).items()}
        if kind == "kill-9":
            fault = time.time()
            os.kill(pids[VICTIM_RANK], signal.SIGKILL)
        elif kind == "hang":
            jobs.wait_until(lambda: jobs.beat(job.hb, VICTIM_RANK).get("phase") == "step 4", 120, "the hang")
            fault = jobs.beat(job.hb, VICTIM_RANK)["phase_since"]
        elif kind == "host-lost":
            fault = time.time()
            c.lose_host(VICTIM_HOST)
        elif kind == "partition":
            fault = time.time()
            c.cut(VICTIM_HOST)
        else:  # flap: no new start expected; the slowest step is the stall
            fault = time.time()
            c.cut(VICTIM_HOST)
            time.sleep(FLAP_S)
            c.restore(VICTIM_HOST)
        if kind != "flap":
            jobs.wait_until(lambda: jobs.start_record(job.hb).get("start") not in (None, first), 600, "a new start")
            new = jobs.start_record(job.hb)
            jobs.wait_until(lambda: len(b := _beats(job.hb)) == 8 and all(
                x.get("start") == new["start"] and x.get("step_time_s") is not None for x in b.values()),
                600, "a step of the new start")
            again = time.time()
            after = {r: b["pid"] for r, b in _beats(job.hb).items()}
            if kind == "partition":
                c.restore(VICTIM_HOST)
        gone = VICTIM_HOST if standby else None  # its agent died with it, or waits cut off
        result = jobs.finish(job, 900, [h for h in job.agents if h != gone])
        records = _metrics(job.out)
        reactions = [t for h in job.agents for t in _agent_reactions(job.log(f"agent{h}.log"),
                                                                      time.localtime(fault).tm_year) if t >= fault]
        decisions = [json.loads(line)["time"] for line in _lines(job.hb / "driver.jsonl")
                     if json.loads(line).get("event") == "decision"]
    finally:
        c.close()
    out: dict[str, Any] = {"kind": kind, "load_avg": os.getloadavg()[0], "completed": result.get("completed"),
                           "decisions": len(decisions), "hosts_left": result.get("hosts_left", []),
                           "steps_logged": len(records)}
    if kind == "flap":
        times = [rec["step_time"] for rec in records if not rec.get("replayed")]
        out.update(restarts=0 if jobs.start_record(job.hb).get("start") == first else 1,
                   stall=max(times) - statistics.median(times), median_step=statistics.median(times))
        return out
    detected = min([*reactions, *[d for d in decisions if d >= fault]], default=None)
    out.update(detected=(detected - fault) if detected else None, restarted=new["time"] - fault,
               training_again=again - fault, new_processes=sum(after[r] != pids[r] for r in pids),
               hosts=sorted(new["hosts"].values()))
    return out


def _lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.is_file() else []


def _metrics(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in _lines(out / "metrics.jsonl")]


def _summary(values: list[float]) -> dict[str, Any]:
    lo, hi = stats.bootstrap_ci(values)
    return {"median_s": statistics.median(values), "ci95": [lo, hi], "n": len(values)}


def main() -> None:
    ap = harness.parser(__doc__, quick="one kill-9 and one flap drill; writes nothing")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--kinds", default=",".join(KINDS))
    args = ap.parse_args()
    if args.quick:
        args.repeats, args.kinds = 1, "kill-9,flap"
    missing = missing_capability()
    if missing:
        sys.exit(f"bench_multihost: hosts as network namespaces: {missing}")
    kinds = [k for k in args.kinds.split(",") if k]
    bad = sorted(set(kinds) - set(KINDS))
    if bad:
        sys.exit(f"--kinds: unknown {bad}; choose from {', '.join(KINDS)}")
    clock = harness.Clock()
    drills: dict[str, list[dict[str, Any]]] = {k: [] for k in kinds}
    for i in range(args.repeats):
        for kind in kinds:  # interleaved: a slow drift of load touches every kind alike
            root = Path(tempfile.mkdtemp(prefix="bench-multihost-"))
            try:
                d = drill(kind, root)
            finally:
                shutil.rmtree(root, ignore_errors=True)
            drills[kind].append(d)
            print(f"{kind} #{i + 1}: " + ", ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}"
                                                  for k, v in d.items() if k not in ("kind", "hosts_left")),
                  flush=True)
    summary: dict[str, Any] = {}
    for kind, ds in drills.items():
        parts = ("stall",) if kind == "flap" else ("detected", "restarted", "training_again")
        summary[kind] = {p: _summary([d[p] for d in ds if d.get(p) is not None]) for p in parts
                         if any(d.get(p) is not None for d in ds)}
        summary[kind]["new_processes"] = [d.get("new_processes") for d in ds]
        summary[kind]["decisions"] = [d["decisions"] for d in ds]
        summary[kind]["load_avg"] = [round(d["load_avg"], 1) for d in ds]
    single = json.loads(SINGLE.read_text()) if SINGLE.is_file() else None
    result = {"spec": SPEC, "flags": FLAGS, "hosts": 4, "ranks_per_host": 2, "hang_timeout_s": HANG_TIMEOUT,
              "keep_alive_s": 5, "flap_s": FLAP_S, "drills": drills, "summary": summary,
              "single_host": single["summary"] if single else None,
              "single_host_load": ([round(d["load_avg"], 1) for d in single["drills"] if "load_avg" in d]
                                   if single else None),
              "wall_s": clock.wall_s(), "timestamp": clock.timestamp,
              "machine": harness.machine(clock, emulated=True, hosts=4, ranks_per_host=2)}
    for kind, s in summary.items():
        print(kind + ": " + "; ".join(f"{p} {v['median_s']:.2f} s [{v['ci95'][0]:.2f}, {v['ci95'][1]:.2f}]"
                                     for p, v in s.items() if isinstance(v, dict)))
    if not args.quick:
        harness.save(result, RESULTS, docs_body(result), block="multihost-emulated")


def _cell(s: dict[str, Any], part: str) -> str:
    v = s.get(part)
    return f"{v['median_s']:.1f} [{v['ci95'][0]:.1f}, {v['ci95'][1]:.1f}]" if v else "-"


def docs_body(res: dict[str, Any]) -> str:
    rows = []
    for kind, s in res["summary"].items():
        if kind == "flap":
            rows.append(f"| flap ({res['flap_s']:g} s down) | - | - | the step in flight: +{_cell(s, 'stall')} | "
                        f"none (decisions: {sum(s['decisions'])}) | {', '.join(map(str, s['load_avg']))} |")
            continue
        named = sorted({h["verdict"] for d in res["drills"][kind] for h in d["hosts_left"]})
        label = f"{kind} (host named {' / '.join(named)})" if named else kind
        rows.append(f"| {label} | {_cell(s, 'detected')} | {_cell(s, 'restarted')} | {_cell(s, 'training_again')} | "
                    f"{'/'.join(map(str, s['new_processes']))} of 8 | {', '.join(map(str, s['load_avg']))} |")
    single = res.get("single_host")
    beside = (f"One host, the same job under `--supervise` (benchmarks/results/recovery_emulated.json, kill -9 of "
              f"a drawn rank): detection {single['detection']['median_s']:.2f} s, training again "
              f"{single['total']['median_s']:.1f} s [{single['total']['ci95'][0]:.1f}, "
              f"{single['total']['ci95'][1]:.1f}] at load {min(res['single_host_load'])}-"
              f"{max(res['single_host_load'])}." if single else "")
    return f"""**Faults across hosts** (`python -m benchmarks.bench_multihost`, as root): 4 hosts (network \
namespaces) x 2 ranks, tp2 x pp2 x dp2 on emulated devices (`{res['spec']}`), `megatronapp torchrun` on every host, \
`resilience watch` with --hang-timeout {res['hang_timeout_s']:g}, rendezvous keep-alive {res['keep_alive_s']} s, a \
checkpoint every 2 steps; the fault hits host 2 once every rank finished step 3. Seconds after the fault, median \
[bootstrap 95% interval] over drills:

| fault | detected | new start recorded | training again | ranks with a new process | load average |
|---|---:|---:|---:|---:|---|
{chr(10).join(rows)}

Detected: the first reaction (a torchrun agent stopping its workers, or the driver's decision); new start: the \
rendezvous, 8 new processes and their process groups; training again: every rank finished a step of the new \
start. torchrun restarts every worker of every host on every fault (8 of 8 new processes): the recovery is \
dominated by starting 8 Python processes that import torch on 2 shared cores. {beside} Recorded \
{res['timestamp']}; raw drills: `benchmarks/results/multihost_emulated.json`."""


if __name__ == "__main__":
    main()
