"""What benchmarks/gpu_check.py and gpu_check_ranks.py share: the run's state, results, and running commands."""
from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "megatronapp"]


class CheckFailed(Exception):
    """A check's assertion, with what was seen."""


class CheckSkipped(Exception):
    """A check that cannot run here, with the reason (printed as SKIP, never as a pass)."""


def expect(ok: bool, message: str) -> None:
    if not ok:
        raise CheckFailed(message)


@dataclass
class Run:
    """What the checks share: where files go, which device kind, how long is left."""

    out: Path
    kind: str  # "cuda", or "cpu" when rehearsing
    quick: bool = False
    gpus: int = 1
    deadline: float = math.inf
    facts: dict[str, Any] = field(default_factory=dict)  # for the JSON file

    @property
    def steps(self) -> int:
        return 30 if self.kind == "cuda" else 4

    @property
    def save_at(self) -> int:
        return 10 if self.kind == "cuda" else 2

    def left(self, want: float) -> float:
        """Seconds a command may take: `want`, or what remains of the whole check."""
        remaining = self.deadline - time.monotonic()
        if remaining < 10:
            raise CheckSkipped("out of time: the whole check has a time limit")
        return min(want, remaining)


# -- running commands ------------------------------------------------------------------------------------------
def env() -> dict[str, str]:
    """The ranks import the project from src/ and the plug-ins above from the repository root (nothing installed)."""
    e = dict(os.environ, PYTHONUNBUFFERED="1")
    paths = [str(ROOT / "src"), str(ROOT), e.get("PYTHONPATH", "")]
    e["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    return e


def tail(text: str, lines: int = 15) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def run_cmd(cmd: list[str], timeout: float, extra_env: dict[str, str] | None = None) -> str:
    """Run a command in its own process group; its stdout, or CheckFailed with the output's tail."""
    proc = subprocess.Popen(cmd, cwd=ROOT, env={**env(), **(extra_env or {})}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        stop(proc)
        raise CheckFailed(f"`{' '.join(cmd[2:8])} ...` ran past {timeout:.0f} s") from None
    if proc.returncode:
        raise CheckFailed(f"`{' '.join(cmd[2:8])} ...` exited {proc.returncode}:\n{tail(err or out)}")
    return out


def run_cli(args: list[str], timeout: float, extra_env: dict[str, str] | None = None) -> str:
    return run_cmd([*CLI, *args], timeout, extra_env)


def run_together(cmds: list[tuple[list[str], dict[str, str]]], timeout: float) -> None:
    """Run commands at once (a GPU job beside its CPU reference); CheckFailed naming the first that failed."""
    procs = [subprocess.Popen(cmd, cwd=ROOT, env={**env(), **extra}, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True, start_new_session=True) for cmd, extra in cmds]
    deadline = time.monotonic() + timeout
    try:
        errors = []
        for (cmd, _), proc in zip(cmds, procs):
            try:
                _, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise CheckFailed(f"`{' '.join(cmd[2:8])} ...` ran past {timeout:.0f} s") from None
            if proc.returncode:
                errors.append(f"`{' '.join(cmd[2:8])} ...` exited {proc.returncode}:\n{tail(err)}")
        if errors:
            raise CheckFailed("\n".join(errors))
    finally:
        for proc in procs:
            stop(proc)


def stop(proc: subprocess.Popen) -> None:
    """Stop a process this script started, with everything it spawned (its own process group)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        if proc.poll() is not None:
            return
        os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            pass


def metrics(run_dir: Path) -> dict[int, dict]:
    """Rank 0's step records of a run, by step."""
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {r["step"]: r for r in recs}
