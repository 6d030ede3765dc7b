"""Drills: kill the newcomer of a recovery while its generation forms, N times, and count how often a healthy rank
was lost (docs/resilience.md, "What we learned"). Each drill is one supervised tp2 x pp2 x dp2 job with 2 spares:
rank 1 is killed in its forward of iteration 3, and the spare that takes it over is SIGKILLed at `--moment`
("assigned": as soon as the supervisor published the generation; "plan" or "joined": once the newcomer reached
that mark). With `--job every-phase` a drill is instead the job of
`test_kills_at_every_phase_and_a_stop_are_replaced_in_place_bit_identical` (six kills and a stop at different
phases, no newcomer killed). Prints one line a drill and a summary as JSON: drills where the supervisor named a
formation failure or replaced a rank that was not killed ("stuck"), and seconds from the newcomer's kill to the
next committed step.

With `--dump-after S`, a generation published S seconds ago that has not committed gets every rank's Python
stacks (SIGUSR1: on the job's stderr, after a line "=== SIGUSR1 rank R pid P"), heartbeats, and native stacks (gdb)
in `--dump-dir`; with FORM_KILL_TRACE=1 also each process's membership trace (`MEGATRONAPP_MEMBER_TRACE`).

    PYTHONPATH=src python -m tests.form_kill_drills --drills 10 --moment assigned
    FORM_KILL_TRACE=1 PYTHONPATH=src python -m tests.form_kill_drills --job every-phase --drills 20 --dump-after 20
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from megatronapp.resilience.supervisor import supervise
from tests import inplace_jobs as jobs


def dump_if_stuck(out: Path, stop: threading.Event, after_s: float, dest: Path) -> None:
    """Every generation after the first that has not committed `after_s` seconds after it was published: every
    rank's Python stacks (SIGUSR1, on the job's stderr, all ranks first: gdb stops a process for seconds on a loaded
    host), heartbeats, and native stacks (gdb) into `dest/gen<g>`."""
    dumped: set[int] = set()
    while not stop.wait(0.5):
        events = jobs.events(out)
        gens = [e for e in events if e["event"] == "generation" and e["generation"] > 0]
        if not gens or gens[-1]["generation"] in dumped or time.time() - gens[-1]["time"] < after_s:
            continue
        g = gens[-1]["generation"]
        if any(e["event"] == "recovered" and e["generation"] == g for e in events):
            continue
        dumped.add(g)
        d = dest / f"gen{g}"
        d.mkdir(parents=True, exist_ok=True)
        for rank, pid in gens[-1]["pids"].items():
            print(f"=== SIGUSR1 rank {rank} pid {pid}", file=sys.stderr, flush=True)
            try:
                os.kill(pid, signal.SIGUSR1)
            except OSError:
                continue
            time.sleep(0.5)  # one rank's dump at a time on the shared stderr
        shutil.copytree(out / ".heartbeat", d / "heartbeat", dirs_exist_ok=True)
        for rank, pid in gens[-1]["pids"].items():
            with open(d / f"rank{rank}-pid{pid}.gdb.txt", "w") as f:
                subprocess.run(["gdb", "-p", str(pid), "-batch", "-ex", "thread apply all bt"], stdout=f,
                               stderr=subprocess.STDOUT, timeout=120, check=False)


def drill(out: Path, moment: str, steps: int, form_timeout_s: float, dump_after_s: float | None = None,
          dump_dir: Path | None = None, job: str = "kill-newcomer") -> dict:
    mp = pytest.MonkeyPatch()
    ports = jobs.spy_store_port(mp)
    killed: list[dict] = []
    stop = threading.Event()
    if job == "kill-newcomer":
        when = jobs.assigned if moment == "assigned" else jobs.has_mark(moment)
        threading.Thread(target=jobs.kill_first_newcomer, args=(out, ports, killed, stop, when), daemon=True).start()
    if dump_after_s is not None:
        threading.Thread(target=dump_if_stuck, args=(out, stop, dump_after_s, dump_dir), daemon=True).start()
    if dump_dir is not None and os.environ.get("FORM_KILL_TRACE"):  # member transitions, a file per process
        dump_dir.mkdir(parents=True, exist_ok=True)
        os.environ["MEGATRONAPP_MEMBER_TRACE"] = str(dump_dir.resolve())
    t0 = time.time()
    logs: list[str] = []
    drills = ["kill=1:3:forward"] if job == "kill-newcomer" else jobs.EVERY_PHASE
    try:
        summary = supervise(jobs.cfg(out, drills, steps=steps),
                            jobs.opts(spares=2 if job == "kill-newcomer" else 1, form_timeout_s=form_timeout_s),
                            logs.append)
    finally:
        stop.set()
        mp.undo()
    failures = summary.get("failures", [])
    formation = [f for f in failures if "did not commit a step within" in f["message"]]
    drilled = {1} if job == "kill-newcomer" else {int(d.split("=")[1].split(":")[0]) for d in drills}
    lost_healthy = sorted({r["rank"] for r in summary.get("replacements", [])} - drilled)
    recovered = [e for e in jobs.events(out) if e["event"] == "recovered"]
    after_kill = None
    if killed:
        later = [e for e in recovered if e.get("generation", -1) > killed[0]["generation"]]
        if later:
            after_kill = later[0]["timeline"]["first_commit"] - killed[0]["time"]
    return {"killed": bool(killed), "steps": summary.get("steps"), "restarts": summary.get("restarts"),
            "stuck": bool(formation or lost_healthy), "lost_healthy": lost_healthy,
            "formation_failures": [f["message"] for f in formation],
            "kill_to_next_commit_s": after_kill, "job_s": time.time() - t0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--drills", type=int, default=10)
    ap.add_argument("--job", default="kill-newcomer", choices=["kill-newcomer", "every-phase"])
    ap.add_argument("--moment", default="assigned", choices=["assigned", "plan", "joined"])
    ap.add_argument("--steps", type=int, default=None, help="default 6 (kill-newcomer), 12 (every-phase)")
    ap.add_argument("--form-timeout", type=float, default=60.0)
    ap.add_argument("--dump-after", type=float, default=None,
                    help="seconds after the kill with no commit: dump every rank's stacks (needs gdb)")
    ap.add_argument("--dump-dir", default="form-kill-stacks")
    a = ap.parse_args()
    steps = a.steps if a.steps is not None else (6 if a.job == "kill-newcomer" else jobs.STEPS)
    rows = []
    with tempfile.TemporaryDirectory(prefix="form-kill-") as tmp:
        for i in range(a.drills):
            row = drill(Path(tmp) / f"run{i}", a.moment, steps, a.form_timeout, a.dump_after,
                        Path(a.dump_dir) / f"drill{i}", a.job)
            rows.append(row)
            print(json.dumps({"drill": i, **row}), flush=True)
    times = [r["kill_to_next_commit_s"] for r in rows if r["kill_to_next_commit_s"] is not None]
    print(json.dumps({"job": a.job, "moment": a.moment, "drills": len(rows), "stuck": sum(r["stuck"] for r in rows),
                      "completed": sum(r["steps"] == steps for r in rows),
                      "kill_to_next_commit_s": {"median": statistics.median(times) if times else None,
                                                "max": max(times, default=None), "all": times}}))


if __name__ == "__main__":
    main()
