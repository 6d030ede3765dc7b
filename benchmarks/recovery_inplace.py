"""In-place recovery from a `kill -9` on 8 emulated devices (`--spares 1`), split in the parts of a generation.

The same job as `recovery_emulated.py` (tp2 x pp2 x dp2, `--emulate-device`, a checkpoint every 2 steps) with one
warm spare: after every rank has finished step 3 this sends SIGKILL to one rank, and reads from the supervisor's
`recovered` event (`resilience/generations.py`) when each part of the recovery was reached, in seconds after the
kill:
  detection          the supervisor sees the rank's exit
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


def drill(flags: list[str], victim: int, beats: Any, timeout_s: float = 600.0) -> dict[str, Any]:
    """One supervised job with `--spares 1`, one kill -9 of `victim` after step 3; each part's time after the kill.
    `beats(dir)`: the heartbeats by rank (recovery_emulated's reader)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run"
        hb = out / ".heartbeat"
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        proc = subprocess.Popen([sys.executable, "-m", "megatronapp", "train", *flags, "--spares", "1",
                                 "--out", str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        deadline = time.time() + timeout_s
        killed_at = None
        while killed_at is None:
            if proc.poll() is not None or time.time() > deadline:
                proc.kill()
                raise RuntimeError(f"the job ended or stalled before the kill: {proc.communicate()[1][-2000:]}")
            b = beats(hb)
            if len(b) == 8 and min(x.get("step", 0) for x in b.values()) >= 3:
                killed_at = time.time()
                os.kill(b[victim]["pid"], signal.SIGKILL)
            time.sleep(0.05)
        _, err = proc.communicate(timeout=max(1.0, deadline - time.time()))
        if proc.returncode != 0:
            raise RuntimeError(f"the supervised job failed (exit {proc.returncode}): {err[-2000:]}")
        events = [json.loads(line) for line in (out / "resilience.jsonl").read_text().splitlines()]
        replayed = sum(1 for line in (out / "metrics.jsonl").read_text().splitlines()
                       if json.loads(line).get("replayed"))
        summary = json.loads((out / "summary.json").read_text())
    recovered = [e for e in events if e["event"] == "recovered"]
    if not recovered or summary.get("restarts"):
        raise RuntimeError(f"the kill was not recovered in place: {[e['event'] for e in events]}")
    timeline = recovered[0]["timeline"]
    parts = {k: (timeline[m] - killed_at if timeline.get(m) is not None else None) for k, m in _MARKS.items()}
    return {**parts, "total": parts["first_commit"], "replayed_steps": replayed,
            "restarts": summary.get("restarts", 0), "source": recovered[0]["source"],
            "host_share": summary.get("emulation", {}).get("host_share"), "load_avg": os.getloadavg()[0]}
