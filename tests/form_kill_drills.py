"""Drills: kill the newcomer of a recovery while its generation forms, N times, and count how often a healthy rank
was lost (docs/resilience.md, "What we learned"). Each drill is one supervised tp2 x pp2 x dp2 job with 2 spares:
rank 1 is killed in its forward of iteration 3, and the spare that takes it over is SIGKILLed at `--moment`
("assigned": as soon as the supervisor published the generation; "plan" or "joined": once the newcomer reached
that mark). Prints one line a drill and a summary as JSON: drills where the supervisor named a formation failure
or replaced a rank that was not killed ("stuck"), and seconds from the newcomer's kill to the next committed step.

    PYTHONPATH=src python -m tests.form_kill_drills --drills 10 --moment assigned
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import pytest

from megatronapp.resilience.supervisor import supervise
from tests import inplace_jobs as jobs


def dump_if_stuck(out: Path, killed: list[dict], stop: threading.Event, after_s: float, dest: Path) -> None:
    """`after_s` seconds after the kill with no generation after it committed: every rank's Python stacks (SIGUSR1,
    on the job's stderr) and native stacks (gdb) into `dest`."""
    while not killed and not stop.is_set():
        time.sleep(0.05)
    if stop.wait(after_s) or not killed:
        return
    if any(e["event"] == "recovered" and e["generation"] > killed[0]["generation"] for e in jobs.events(out)):
        return
    gens = [e for e in jobs.events(out) if e["event"] == "generation"]
    dest.mkdir(parents=True, exist_ok=True)
    for rank, pid in gens[-1]["pids"].items():
        try:
            os.kill(pid, signal.SIGUSR1)
        except OSError:
            continue
        with open(dest / f"rank{rank}-pid{pid}.gdb.txt", "w") as f:
            subprocess.run(["gdb", "-p", str(pid), "-batch", "-ex", "thread apply all bt"], stdout=f,
                           stderr=subprocess.STDOUT, timeout=120, check=False)


def drill(out: Path, moment: str, steps: int, form_timeout_s: float, dump_after_s: float | None = None,
          dump_dir: Path | None = None) -> dict:
    mp = pytest.MonkeyPatch()
    ports = jobs.spy_store_port(mp)
    killed: list[dict] = []
    stop = threading.Event()
    when = jobs.assigned if moment == "assigned" else jobs.has_mark(moment)
    saboteur = threading.Thread(target=jobs.kill_first_newcomer, args=(out, ports, killed, stop, when), daemon=True)
    saboteur.start()
    if dump_after_s is not None:
        threading.Thread(target=dump_if_stuck, args=(out, killed, stop, dump_after_s, dump_dir), daemon=True).start()
    if dump_dir is not None and os.environ.get("FORM_KILL_TRACE"):  # member transitions, a file per process
        dump_dir.mkdir(parents=True, exist_ok=True)
        os.environ["MEGATRONAPP_MEMBER_TRACE"] = str(dump_dir.resolve())
    t0 = time.time()
    logs: list[str] = []
    try:
        summary = supervise(jobs.cfg(out, ["kill=1:3:forward"], steps=steps),
                            jobs.opts(spares=2, form_timeout_s=form_timeout_s), logs.append)
    finally:
        stop.set()
        mp.undo()
    failures = summary.get("failures", [])
    formation = [f for f in failures if "did not commit a step within" in f["message"]]
    lost_healthy = sorted({r["rank"] for r in summary.get("replacements", [])} - {1})
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
    ap.add_argument("--moment", default="assigned", choices=["assigned", "plan", "joined"])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--form-timeout", type=float, default=60.0)
    ap.add_argument("--dump-after", type=float, default=None,
                    help="seconds after the kill with no commit: dump every rank's stacks (needs gdb)")
    ap.add_argument("--dump-dir", default="form-kill-stacks")
    a = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="form-kill-") as tmp:
        for i in range(a.drills):
            row = drill(Path(tmp) / f"run{i}", a.moment, a.steps, a.form_timeout, a.dump_after,
                        Path(a.dump_dir) / f"drill{i}")
            rows.append(row)
            print(json.dumps({"drill": i, **row}), flush=True)
    times = [r["kill_to_next_commit_s"] for r in rows if r["kill_to_next_commit_s"] is not None]
    print(json.dumps({"moment": a.moment, "drills": len(rows), "stuck": sum(r["stuck"] for r in rows),
                      "completed": sum(r["steps"] == a.steps for r in rows),
                      "kill_to_next_commit_s": {"median": statistics.median(times) if times else None,
                                                "max": max(times, default=None), "all": times}}))


if __name__ == "__main__":
    main()
