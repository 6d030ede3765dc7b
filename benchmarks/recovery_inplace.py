"""In-place recovery drills on emulated devices (`--spares 1`), split in the parts of a generation.

A supervised job with one warm spare runs until every rank has finished a drawn step, then one drawn rank fails in
one of three ways, and this reads from the supervisor's `recovered` event (`resilience/generations.py`) when each
part of the recovery was reached, in seconds after the fault:
  kill   SIGKILL sent by this benchmark, a drawn delay after the drawn step (so it lands in any phase of a step)
  stop   SIGSTOP sent the same way: the supervisor names the stopped process after `stop_after_s` and kills it
  hang   `--inject hang=RANK:STEP`: the rank blocks at the start of the drawn step with its heartbeat alive, so
         only the hang timeout (no progress, not even a communication op, for `--hang-timeout` s) names it; the
         fault's moment is the
         hung rank's last phase change (its heartbeat's `phase_since`), the timeout included in what follows
The parts:
  detection          the supervisor has named the failed rank
  survivors out      the last survivor has left the failed generation (its `left` mark)
  spare ready        the spare has read the new generation's plan (its `plan` mark)
  groups rebuilt     every member has made the new generation's process groups
  state transferred  every member holds its state (the newcomer's came from its DP peer)
  first commit       the new generation's first step committed (training again)
and how many steps were computed again beyond the interrupted one (records marked `replayed` in metrics.jsonl).
"""
from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

PARTS = ("detection", "survivors_out", "spare_ready", "groups_rebuilt", "state_transferred", "first_commit")
_MARKS = {"detection": "noticed", "survivors_out": "survivors_out", "spare_ready": "spare_ready",
          "groups_rebuilt": "groups_rebuilt", "state_transferred": "state_transferred",
          "first_commit": "first_commit"}
FAULTS = ("kill", "stop", "hang")


def beats(hb: Path) -> dict[int, dict[str, Any]]:
    """The heartbeats of a job by rank (a file being rewritten is read next time)."""
    out = {}
    for f in hb.glob("rank*.json"):
        try:
            out[int(f.stem[4:])] = json.loads(f.read_text())
        except (ValueError, OSError):
            continue
    return out


def quiet_job(flags: list[str], timeout_s: float = 600.0) -> tuple[dict[str, Any], dict[str, Any]]:
    """A supervised job without a fault (`megatronapp train FLAGS`, its --out given here): its `run_stats` and its
    summary.json."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run"
        proc = start([*flags, "--out", str(out)], Path(tmp))
        try:
            finish(proc, timeout_s)
        except BaseException:
            stop(proc)
            raise
        return run_stats(out), json.loads((out / "summary.json").read_text())


def run_stats(out: Path) -> dict[str, Any]:
    """What a finished job's metrics.jsonl says: steps computed again (`replayed`) and the median step time of the
    steady state (steps after the first two, replays left out)."""
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steady = [r["step_time"] for r in recs if r.get("step", 0) > 2 and not r.get("replayed") and r.get("step_time")]
    return {"replayed_steps": sum(1 for r in recs if r.get("replayed")),
            "step_time_s": statistics.median(steady) if steady else None}


def drill(flags: list[str], world: int, fault: dict[str, Any], timeout_s: float = 600.0) -> dict[str, Any]:
    """One supervised job with `--spares 1` and one `fault` ({"kind", "victim", "step", "delay_s"}, and for a hang
    "hang_timeout_s"); each part's time after the fault."""
    kind, victim, step = fault["kind"], fault["victim"], fault["step"]
    extra = ["--inject", f"hang={victim}:{step}", "--hang-timeout", str(fault["hang_timeout_s"])] \
        if kind == "hang" else []
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run"
        proc = start(["--spares", "1", *flags, *extra, "--out", str(out)], Path(tmp))
        struck, phase, pid = None, None, None
        try:
            struck, phase, pid = _strike(proc, out / ".heartbeat", world, fault, time.time() + timeout_s)
            finish(proc, timeout_s)
        except BaseException:
            stop(proc, pid if kind == "stop" else None)
            raise
        events = [json.loads(line) for line in (out / "resilience.jsonl").read_text().splitlines()]
        summary = json.loads((out / "summary.json").read_text())
        ran = run_stats(out)
    recovered = [e for e in events if e["event"] == "recovered"]
    failures = [e for e in events if e["event"] == "failure"]
    if not recovered or summary.get("restarts"):
        raise RuntimeError(f"the fault was not recovered in place: {[e['event'] for e in events]}")
    timeline = recovered[0]["timeline"]
    parts = {k: (timeline[m] - struck if timeline.get(m) is not None else None) for k, m in _MARKS.items()}
    return {**fault, **parts, "total": parts["first_commit"], **ran, "phase_at_fault": phase, "victim_pid": pid,
            "named_rank": failures[0]["rank"] if failures else None, "failures": len(failures),
            "failure_kind": failures[0]["kind"] if failures else None, "restarts": summary.get("restarts", 0),
            "longest_pause_s": failures[0].get("longest_pause_s") if failures else None,
            "source": recovered[0]["source"], "host_share": summary.get("emulation", {}).get("host_share"),
            "load_avg": os.getloadavg()[0]}


def start(args: list[str], tmp: Path) -> subprocess.Popen:
    """`megatronapp train ARGS` in a session of its own (its ranks and spares with it), its output to a file in
    `tmp` (a pipe nobody reads while the drill waits could fill and block the job)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    log = (tmp / "job.log").open("w")
    proc = subprocess.Popen([sys.executable, "-m", "megatronapp", "train", *args], stdout=log,
                            stderr=subprocess.STDOUT, env=env, start_new_session=True)
    proc.log = tmp / "job.log"  # type: ignore[attr-defined]
    log.close()
    return proc


def log_tail(proc: subprocess.Popen, chars: int = 2000) -> str:
    try:
        return proc.log.read_text(errors="replace")[-chars:]  # type: ignore[attr-defined]
    except OSError:
        return ""


def finish(proc: subprocess.Popen, timeout_s: float) -> None:
    """Wait for the job; an error with its output's tail when it failed."""
    proc.wait(timeout=timeout_s)
    if proc.returncode != 0:
        raise RuntimeError(f"the supervised job failed (exit {proc.returncode}): {log_tail(proc)}")


def stop(proc: subprocess.Popen, stopped: int | None = None) -> None:
    """End a drill's job that went wrong: every process of its session (the supervisor started it in a session of
    its own, its ranks and spares are in it), a rank this drill stopped (SIGSTOP) included."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()
    if stopped is not None:
        try:
            os.kill(stopped, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _strike(proc: subprocess.Popen, hb: Path, world: int, fault: dict[str, Any], deadline: float
            ) -> tuple[float, str, int]:
    """Wait until every rank has finished `fault["step"]` steps, then the fault: (its moment, the victim's phase
    then, the victim's pid). A hang strikes by itself: its moment is the hung process's last phase change, read
    from its heartbeat until the supervisor replaces it (the newcomer's heartbeat has another pid)."""
    kind, victim = fault["kind"], fault["victim"]
    armed_at = None
    pid, last = None, None
    while True:
        if proc.poll() is not None or time.time() > deadline:
            raise RuntimeError(f"the job ended or stalled before the {kind}: {log_tail(proc)}")
        b = beats(hb)
        if kind == "hang":
            mine = b.get(victim)
            if pid is None and mine and mine.get("step", -1) >= 0:
                pid = mine["pid"]
            if mine and mine.get("pid") == pid:
                last = mine
            elif pid is not None and last is not None:  # replaced: its last beat held the hang's phase
                return last["phase_since"], last["phase"], pid
        elif armed_at is None:
            if len(b) == world and min(x.get("step", 0) for x in b.values()) >= fault["step"]:
                armed_at = time.time()
        elif time.time() >= armed_at + fault["delay_s"]:
            pid, struck = b[victim]["pid"], time.time()
            os.kill(pid, signal.SIGKILL if kind == "kill" else signal.SIGSTOP)
            return struck, str(b[victim].get("phase")), pid
        time.sleep(0.02)
