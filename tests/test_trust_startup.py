"""A rank stopped while a supervised restart starts up is named within 30 s, not after the 300 s start-up
allowance (issue 27, item 8): the ranks beat from their first instruction, and a rank silent while its peers
beat (they wait for it in the process-group rendezvous) is judged by the hang timeout. Real processes (pp 2):
attempt 0 loses a rank to SIGKILL after step 3; the test SIGSTOPs a rank of attempt 1 as soon as its process
exists, before its first heartbeat; attempt 2 resumes from step 2 and finishes the run."""
from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

from megatronapp.cli import build_parser, config_from_args
from megatronapp.resilience.supervisor import Options, supervise
from megatronapp.train.metrics import read_metrics
from tests.jobs import heartbeats as _beats
from tests.jobs import tiny_flags

STEPS = 6
FLAGS = tiny_flags("--nproc", "2", "--pp", "2", "--steps", str(STEPS), "--save-interval", "2", "--attach",
                   "tests.plugin_probe:paced_steps", hidden=32)


def _rank_processes() -> list[int]:
    """This process's spawned rank processes (not multiprocessing's resource tracker), oldest first."""
    me, pids = os.getpid(), []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmd = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == me and b"spawn_main" in cmd:
            pids.append(int(entry.name))
    return sorted(pids)


def _saboteur(out: Path, record: dict, stop: threading.Event) -> None:
    while not stop.is_set():  # attempt 0: SIGKILL rank 1 once both ranks finished step 3 (a checkpoint at 2)
        beats = _beats(out)
        if len(beats) == 2 and min(b["step"] for b in beats.values()) >= 3:
            first = set(_rank_processes())
            os.kill(beats[1]["pid"], signal.SIGKILL)
            break
        time.sleep(0.02)
    while not stop.is_set():  # attempt 1: SIGSTOP its last-started rank the moment it exists
        fresh = [p for p in _rank_processes() if p not in first]
        if len(fresh) == 2:
            os.kill(fresh[1], signal.SIGSTOP)
            record.update(stopped_at=time.time(), pid=fresh[1])
            return
        time.sleep(0.01)


def test_a_rank_stopped_while_a_restart_starts_up_is_named_within_30_s_and_the_run_finishes(tmp_path):
    out = tmp_path / "run"
    cfg = config_from_args(build_parser().parse_args(["train", *FLAGS, "--out", str(out)]))
    record: dict = {}
    stop = threading.Event()
    saboteur = threading.Thread(target=_saboteur, args=(out, record, stop), daemon=True)
    saboteur.start()
    logs: list[str] = []
    try:
        opts = Options(hang_timeout_s=8.0, heartbeat_s=0.3, max_restarts=3, diagnose_on_restart=False)
        summary = supervise(cfg, opts, logs.append)
    finally:
        stop.set()
        if record.get("pid"):  # the supervisor SIGKILLs it; never leave a stopped process behind
            try:
                os.kill(record["pid"], signal.SIGKILL)
            except ProcessLookupError:
                pass
    text = "\n".join(logs)
    assert "stopped_at" in record, f"the run ended before attempt 1 started:\n{text}"
    failures = summary["failures"]
    assert summary["restarts"] == 2 and len(failures) == 2, text
    assert failures[0]["kind"] == "exit" and failures[0]["rank"] == 1
    named = failures[1]
    # rank 1 of attempt 1 (the later-started process) is named, stopped, from the supervisor's own report
    assert named["kind"] == "hang" and named["rank"] == 1, text
    assert "the job waits for rank 1 (DP0-PP1-TP0): process stopped (SIGSTOP?)" in text, text
    # named by the hang timeout (8 s), long before the 300 s start-up allowance (which the old code waited out)
    assert named["detected_at"] - record["stopped_at"] < opts.startup_timeout_s / 2, text
    assert summary["steps"] == STEPS
    steps = [r["step"] for r in read_metrics(out / "metrics.jsonl") if not r.get("replayed")]
    assert steps == list(range(1, STEPS + 1))
