"""The detection shared by the local supervisor and the multi-host driver: step progress from heartbeats, the hang
clock, and the judgement of a hang (who the job waits for, with the waits tree).

Both watchers read the same heartbeat files (`agent.py`). They differ in what they can see of a rank's process:
the local supervisor reads `/proc/<pid>` (stopped, dead, running), the driver of a multi-host job cannot, so there
`state_of` is None and a stale heartbeat alone means "stopped or dead".
"""
from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megatronapp.resilience.attribution import culprits, op_text, wait_edges, wait_tree


@dataclass
class Failure:
    kind: str  # exit | hang | straggler
    rank: int
    label: str
    message: str
    step: int
    detected_at: float
    tree: str = ""
    signal: str | None = None
    waits: list[dict[str, Any]] = field(default_factory=list)
    noticed_at: float | None = None  # an exit: when the driver saw it (detected_at is after the job was stopped)


def default_hang_timeout(step_times: list[float]) -> float:
    """Sized from measured step times: 10x the slowest seen, at least 30 s."""
    return max(30.0, 10.0 * max(step_times)) if step_times else 30.0


def read_beats(hb_dir: Path, world: int) -> dict[int, dict[str, Any]]:
    """The newest heartbeat of every rank that has one; a torn or foreign file counts as no heartbeat."""
    out = {}
    for r in range(world):
        try:
            beat = json.loads((hb_dir / f"rank{r:05d}.json").read_text())
        except (OSError, ValueError):
            continue
        # the fields the watchers compute with; a file without them (foreign, or written by another version) is
        # no heartbeat rather than a crash of the watcher
        if isinstance(beat, dict) and isinstance(beat.get("time"), (int, float)) and \
                isinstance(beat.get("step"), int) and isinstance(beat.get("phase", ""), str):
            out[r] = beat
    return out


class ProgressClock:
    """Step progress of one attempt (one launch of every rank) and when it last moved."""

    def __init__(self, world: int, hang_timeout_s: float | None, startup_timeout_s: float):
        self.world, self.hang_timeout_s, self.startup_timeout_s = world, hang_timeout_s, startup_timeout_s
        self.start_step: int | None = None
        self.progress: tuple | None = None
        self.last_progress = time.time()
        self.step_times: list[float] = []
        self.first_step_at: float | None = None

    def steps(self, beats: dict[int, dict[str, Any]]) -> tuple:
        return tuple(beats.get(r, {}).get("step", -1) for r in range(self.world))

    def update(self, beats: dict[int, dict[str, Any]]) -> None:
        steps = self.steps(beats)
        if self.start_step is None and len(beats) == self.world:
            self.start_step = min(steps)
        if steps != self.progress:
            self.progress, self.last_progress = steps, time.time()
            self.step_times += [b["step_time_s"] for b in beats.values() if b.get("step_time_s")]
            if self.first_step_at is None and self.start_step is not None and min(steps) > self.start_step:
                self.first_step_at = time.time()

    def timeout(self) -> float:
        return self.hang_timeout_s or default_hang_timeout(self.step_times)

    def overdue(self, beats: dict[int, dict[str, Any]]) -> float | None:
        """Seconds without progress if that is past the limit (a hang), else None."""
        # started: a step has completed on every rank in this attempt (a rank stopped right after its first
        # step of a resumed attempt must not get the start-up allowance)
        started = self.first_step_at is not None or (
            len(beats) == self.world and all(b.get("step_time_s") is not None for b in beats.values()))
        # ranks past their last step stop beating and make no progress while they exit: not a hang
        finishing = len(beats) == self.world and all(b.get("phase") == "shutdown" for b in beats.values())
        timeout = self.timeout()
        limit = timeout if started and not finishing else max(timeout, self.startup_timeout_s)
        idle = time.time() - self.last_progress
        return idle if idle > limit else None


def settle(beats: dict[int, dict[str, Any]], reread: Callable[[], dict[int, dict[str, Any]]],
           state_of: Callable[[int], str | None] | None, stale_after: float, poll_s: float
           ) -> dict[int, dict[str, Any]]:
    """Before judging, give ranks whose heartbeat is stale but that may still run up to two more staleness
    periods to beat again. On an overloaded host every heartbeat thread can starve for seconds at once (seen:
    three of four ranks 3.8 s behind at load 9); naming such a rank the cause would hide the rank that the fresh
    flight recorders point at. Ranks known stopped or dead (`state_of`, where the process is visible) are not
    waited for."""
    deadline = time.time() + 2 * stale_after
    while time.time() < deadline:
        now = time.time()
        late = [r for r, b in beats.items() if now - b["time"] > stale_after
                and (state_of is None or state_of(r) not in ("T", "Z", None))]
        if not late:
            break
        time.sleep(poll_s)
        beats = reread()
    return beats


def judge_hang(beats: dict[int, dict[str, Any]], world: int, labels: dict[int, str], idle_s: float,
               timeout: float, stale_after: float, state_of: Callable[[int], str | None] | None) -> Failure:
    """Name the rank a hung job waits for, from the heartbeats' flight recorders: a rank whose heartbeat stopped
    first (it is stopped or dead whatever its frozen recorder says), else the root of the wait edges."""
    now = time.time()
    notes: dict[int, str] = {}
    unresponsive = []
    for r in range(world):
        b = beats.get(r)
        if b is None or now - b["time"] > stale_after:
            unresponsive.append(r)
            age = "never" if b is None else f"not for {now - b['time']:.1f} s"
            if state_of is None:  # a remote rank: its process is out of sight
                notes[r] = f"heartbeat stopped (the process is stopped or dead); heartbeat {age}"
            else:
                state = state_of(r)
                what = {"T": "stopped (SIGSTOP?)", "Z": "dead", None: "gone"}.get(state, f"state {state}")
                notes[r] = f"process {what}; heartbeat {age}"
        elif b.get("open_op") is None:
            notes[r] = f"not in a communication op: in phase '{b['phase']}' for {now - b['phase_since']:.1f} s"
    flights = {r: b["flight"] for r, b in beats.items() if isinstance(b.get("flight"), dict)}
    steps = {r: b["step"] for r, b in beats.items()}
    names = culprits(flights, unresponsive, steps) or [min(steps, key=steps.get, default=0)]
    cause = names[0]
    tree = wait_tree(names, flights, labels, notes)
    waits = [{"waiter": e.waiter, "target": e.target, "op": op_text(e.op), "why": e.why}
             for e in wait_edges(flights)]
    label = labels.get(cause, "?")
    msg = (f"hang: no step progress for {idle_s:.1f} s (hang timeout {timeout:.0f} s); the job waits for "
           f"rank {cause} ({label}): {notes.get(cause, 'waits for no one')}")
    return Failure("hang", cause, label, msg, steps.get(cause, -1), now, tree=tree, waits=waits)
