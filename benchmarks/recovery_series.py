"""Many in-place drills in one job: faults one after another, each recovered before the next strikes.

On a loaded host a job's start (every rank and spare importing torch) took minutes, so one job per drill did not
fit the time; here one job with one spare per fault (all started with the ranks, so a ready spare is waiting at
each fault; the pool still refills in the background after each take-over) takes the faults in turn. Before each,
the driver waits until the previous recovery committed and every rank finished a drawn number (2-3) of further
steps, then waits a drawn delay (0-MAX_DELAY_S) and strikes a drawn rank: kill -9 or SIGSTOP. Hangs are injected
(`--inject hang=RANK:STEP`, distinct ranks, steps 3 apart), each timed from the hung rank's last phase change.
The parts of each recovery come from its `recovered` event, as in recovery_inplace.py; the steps computed again
beyond the interrupted ones are those of the whole job (metrics.jsonl records marked `replayed`).
"""
from __future__ import annotations

import json
import os
import random
import signal
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks import recovery_inplace
from benchmarks.recovery_inplace import beats

MAX_DELAY_S = 1.5
_MARKS = recovery_inplace._MARKS


def _events(out: Path) -> list[dict[str, Any]]:
    try:
        return [json.loads(line) for line in (out / "resilience.jsonl").read_text().splitlines() if line.strip()]
    except (OSError, ValueError):
        return []


def _recovered(out: Path) -> int:
    return sum(1 for e in _events(out) if e["event"] == "recovered")


def series(flags: list[str], world: int, kinds: list[str], rng: random.Random, hang_timeout_s: float = 3.0,
           timeout_s: float = 1500.0) -> list[dict[str, Any]]:
    """One job of `world` ranks (`flags` without --steps/--spares/--out) and the faults `kinds` ("kill" and
    "stop", or only "hang"), one drill record per fault."""
    n = len(kinds)
    hang = kinds and all(k == "hang" for k in kinds)
    if hang:
        victims = rng.sample(range(world), n)
        plan = [{"kind": "hang", "victim": v, "step": 3 + 3 * i, "delay_s": 0.0, "hang_timeout_s": hang_timeout_s}
                for i, v in enumerate(victims)]
        steps = 3 + 3 * n + 3
        extra = [a for f in plan for a in ("--inject", f"hang={f['victim']}:{f['step']}")] + \
            ["--hang-timeout", str(hang_timeout_s)]
    else:
        plan, steps, extra = [], 4 + 4 * n, []
    deadline = time.time() + timeout_s
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run"
        hb = out / ".heartbeat"
        proc = recovery_inplace.start([*flags, "--steps", str(steps), "--spares", str(n),
                                       "--max-restarts", str(n + 1), *extra,
                                       "--out", str(out)], Path(tmp))
        stopped: int | None = None
        try:
            struck = _hangs(proc, hb, plan, deadline) if hang else \
                _strikes(proc, out, world, kinds, rng, plan, deadline)
            for f, (t, phase, pid) in zip(plan, struck):
                f.update(struck_at=t, phase_at_fault=phase, victim_pid=pid)
            recovery_inplace.finish(proc, max(1.0, deadline - time.time()))
        except BaseException:
            stopped = next((f.get("victim_pid") for f in plan if f["kind"] == "stop"), None)
            recovery_inplace.stop(proc, stopped)
            raise
        events = _events(out)
        summary = json.loads((out / "summary.json").read_text())
        ran = recovery_inplace.run_stats(out)
    recovered = [e for e in events if e["event"] == "recovered"]
    failures = [e for e in events if e["event"] == "failure"]
    drills = []
    for i, f in enumerate(plan):
        if i >= len(recovered) or i >= len(failures):
            drills.append({**f, "error": f"no recovery recorded for fault {i + 1}"})
            continue
        tl = recovered[i]["timeline"]
        parts = {k: (tl[m] - f["struck_at"] if tl.get(m) is not None else None) for k, m in _MARKS.items()}
        drills.append({**f, **parts, "total": parts["first_commit"], "replayed_steps": ran["replayed_steps"],
                       "step_time_s": ran["step_time_s"], "named_rank": failures[i]["rank"],
                       "failure_kind": failures[i]["kind"], "restarts": summary.get("restarts", 0),
                       "longest_pause_s": failures[i].get("longest_pause_s"),
                       "source": recovered[i]["source"], "waited_for_spare_s": tl["published"] - tl["ended"],
                       "host_share": summary.get("emulation", {}).get("host_share"), "load_avg": f["load_avg"],
                       "series": {"faults": n, "steps": steps}})
    return drills


def _wait(proc: Any, deadline: float, what: str) -> None:
    if proc.poll() is not None or time.time() > deadline:
        raise RuntimeError(f"the job ended or stalled {what}: {recovery_inplace.log_tail(proc)}")
    time.sleep(0.02)


def _strikes(proc: Any, out: Path, world: int, kinds: list[str], rng: random.Random, plan: list[dict[str, Any]],
             deadline: float) -> list[tuple[float, str, int]]:
    hb = out / ".heartbeat"
    struck = []
    after = rng.randint(2, 3)
    for i, kind in enumerate(kinds):
        while True:  # the previous recovery committed, and every rank finished `after` steps
            b = beats(hb)
            if _recovered(out) >= i and len(b) == world and min(x.get("step", -1) for x in b.values()) >= after \
                    and all(x.get("pid") is not None for x in b.values()):
                break
            _wait(proc, deadline, f"before fault {i + 1}")
        f = {"kind": kind, "victim": rng.randrange(world), "step": after,
             "delay_s": round(rng.uniform(0.0, MAX_DELAY_S), 3)}
        until = time.time() + f["delay_s"]
        while time.time() < until:
            _wait(proc, deadline, f"before fault {i + 1}")
        b = beats(hb)[f["victim"]]
        t = time.time()
        os.kill(b["pid"], signal.SIGKILL if kind == "kill" else signal.SIGSTOP)
        f["load_avg"] = os.getloadavg()[0]
        plan.append(f)
        struck.append((t, str(b.get("phase")), b["pid"]))
        while _recovered(out) < i + 1:
            _wait(proc, deadline, f"recovering from fault {i + 1}")
        b = beats(hb)
        after = max(x.get("step", -1) for x in b.values()) + rng.randint(2, 3)
    return struck


def _hangs(proc: Any, hb: Path, plan: list[dict[str, Any]], deadline: float) -> list[tuple[float, str, int]]:
    """Each hung rank's last phase change before the supervisor replaced it (its file then holds another pid)."""
    pids: dict[int, int] = {}
    last: dict[int, dict[str, Any]] = {}
    done: dict[int, tuple[float, str, int]] = {}
    while len(done) < len(plan):
        b = beats(hb)
        for f in plan:
            v = f["victim"]
            if v in done or v not in b:
                continue
            mine = b[v]
            if v not in pids and mine.get("step", -1) >= 0 and mine.get("pid") is not None:
                pids[v] = mine["pid"]
            if v in pids and mine.get("pid") == pids[v]:
                last[v] = mine
            elif v in pids and v in last:
                done[v] = (last[v]["phase_since"], str(last[v]["phase"]), pids[v])
                f["load_avg"] = os.getloadavg()[0]
        _wait(proc, deadline, "while the hangs strike")
    return [done[f["victim"]] for f in plan]
