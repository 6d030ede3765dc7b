"""The detection shared by the local supervisor and the multi-host driver: step progress from heartbeats, the hang
clock, and the judgement of a hang (who the job waits for, with the waits tree).

Both watchers read the same heartbeat files (`agent.py`). They differ in what they can see of a rank's process:
the local supervisor reads `/proc/<pid>` (stopped, dead, running), the driver of a multi-host job cannot, so there
`state_of` is None and a stale heartbeat alone means "stopped or dead".
"""
from __future__ import annotations

import errno
import json
import os
import stat
import sys
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
    longest_pause_s: float | None = None  # a hang: the longest time without activity seen before (the margin)


def process_state(pid: int) -> str | None:
    """A local process's state letter from /proc ('R', 'S', 'T' stopped, 'Z' dead), None when it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def default_hang_timeout(step_times: list[float]) -> float:
    """Sized from measured step times: 10x the slowest seen, at least 30 s."""
    return max(30.0, 10.0 * max(step_times)) if step_times else 30.0


BEAT_MAX_BYTES = 4 << 20  # a heartbeat is a few KiB (the flight recorder keeps a bounded window)
_NUM, _INT, _STR = (int, float), (int,), (str,)
# Every field a watcher computes with or prints, and the types it may have (None allowed where listed).
_FIELDS: dict[str, tuple[tuple[type, ...], bool]] = {
    "time": (_NUM, False), "step": (_INT, False), "phase": (_STR, False), "phase_since": (_NUM, False),
    "rank": (_INT, True), "pid": (_INT, True), "label": (_STR, True), "host": (_STR, True), "round": (_INT, True),
    "addr": (_STR, True), "node": (_INT, True),
    "start": (_STR, True), "layout": ((list,), True), "failed": ((bool,), True), "checkpoint": (_STR, True),
    "tokens_per_s": (_NUM, True), "step_time_s": (_NUM, True), "mem_bytes": (_NUM, True),
    "flight": ((dict,), True), "open_op": ((dict,), True), "last_op": ((dict,), True)}
_OP_FIELDS: dict[str, tuple[tuple[type, ...], bool]] = {
    "op": (_STR, False), "key": (_STR, False), "seq": (_INT, False), "peer": (_INT, True),
    "ranks": ((list,), False)}
_reported: set[tuple[str, str]] = set()


class BadBeat(ValueError):
    """A heartbeat file that is not one (wrong type, link, oversized, torn, a field of the wrong type)."""


def _typed(value: Any, types: tuple[type, ...], nullable: bool) -> bool:
    if value is None:
        return nullable
    if isinstance(value, bool) and bool not in types:
        return False
    return isinstance(value, types) and not (isinstance(value, float) and value != value)  # NaN is no time


def check_beat(beat: Any) -> dict[str, Any]:
    """`beat` if every field the watchers use has its type (and the flight recorder's ops theirs), else BadBeat."""
    if not isinstance(beat, dict):
        raise BadBeat(f"holds {type(beat).__name__}, not an object")
    for name, (types, nullable) in _FIELDS.items():
        if name in beat and not _typed(beat[name], types, nullable) or name not in beat and not nullable:
            raise BadBeat(f"field {name!r} is {str(beat.get(name))[:40]!r} ({type(beat.get(name)).__name__})")
    flight = beat.get("flight")
    ops = [beat[k] for k in ("open_op", "last_op") if beat.get(k) is not None]
    if flight is not None:
        for part in ("open", "recent"):
            if not isinstance(flight.get(part, []), list):
                raise BadBeat(f"flight.{part} is not a list")
            ops += flight.get(part, [])
        if not isinstance(flight.get("issued", {}), dict) or \
                not all(_typed(v, _INT, False) for v in flight.get("issued", {}).values()):
            raise BadBeat("flight.issued is not a map of sequence numbers")
    for op in ops:
        if not isinstance(op, dict) or not all(_typed(op.get(k), t, n) for k, (t, n) in _OP_FIELDS.items()) \
                or not all(_typed(m, _INT, False) for m in op["ranks"]):
            raise BadBeat(f"a flight-recorder op is malformed: {str(op)[:80]}")
    return beat


def read_beat_file(path: Path) -> dict[str, Any]:
    """One heartbeat file, opened without following a link (a shared directory may hold planted ones), size-
    checked before it is read. OSError when it is absent; BadBeat when it is not a heartbeat."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise BadBeat("not a regular file")
        if st.st_size > BEAT_MAX_BYTES:
            raise BadBeat(f"{st.st_size} bytes, over {BEAT_MAX_BYTES}")
        data = os.read(fd, BEAT_MAX_BYTES + 1)
    finally:
        os.close(fd)
    try:
        return check_beat(json.loads(data))
    except (ValueError, RecursionError) as e:
        raise BadBeat(str(e)[:120] if isinstance(e, BadBeat) else f"not JSON ({str(e)[:80]})") from None


def read_beats(hb_dir: Path, world: int) -> dict[int, dict[str, Any]]:
    """The newest heartbeat of every rank that has one. A torn file counts as no heartbeat; a link, or a file
    that is not a heartbeat, is named once on stderr and skipped: never a crash of the watcher."""
    out = {}
    for r in range(world):
        path = hb_dir / f"rank{r:05d}.json"
        try:
            out[r] = read_beat_file(path)
        except BadBeat as e:
            if (str(path), str(e)) not in _reported and len(_reported) < 10_000:
                _reported.add((str(path), str(e)))
                print(f"megatronapp: skipping heartbeat {path}: {e}", file=sys.stderr, flush=True)
        except OSError as e:
            if e.errno == errno.ELOOP and (str(path), "link") not in _reported:  # O_NOFOLLOW met a symlink
                _reported.add((str(path), "link"))
                print(f"megatronapp: skipping heartbeat {path}: a symbolic link", file=sys.stderr, flush=True)
    return out


def _seq_sum(flight: Any, part: str) -> int:
    seqs = (flight or {}).get(part) or {}
    return sum(v for v in seqs.values() if isinstance(v, int) and not isinstance(v, bool))


def activity(beat: dict[str, Any]) -> tuple:
    """What a watcher can see a rank do: its step and phase, and the communication ops it has issued and completed
    (its flight recorder's per-stream sequence numbers, summed). Any of them moving is progress. A step holds many
    ops (each micro-batch's sends and receives, the gradient reduction), so the longest pause between two of them
    is a fraction of a step: a hang timeout judged on them can be short where one judged on steps could not."""
    flight = beat.get("flight")
    return beat.get("step", -1), beat.get("phase"), _seq_sum(flight, "issued"), _seq_sum(flight, "completed")


class ProgressClock:
    """Progress of one attempt (one launch of every rank) and when it last moved: steps, and finer, any rank's
    phase or communication ops (`activity`). A hang is no activity on any rank for the hang timeout; a job whose
    ops keep moving while no step ends for the longer step limit (10x the slowest step, at least 30 s, and at
    least the hang timeout) is judged as hung too, so that a rank busy in a loop of ops is no blind spot."""

    def __init__(self, world: int, hang_timeout_s: float | None, startup_timeout_s: float, early: bool = False,
                 state_of: Callable[[int], str | None] | None = None):
        """`early`: every rank beats from the first thing it does (`agent.early_start`), so a rank that never
        beat while its peers did is missing, not slow; without it a rank beats only once its trainer is built.
        `state_of(rank)`: the rank's process state where it is visible (the local supervisor: 'T' stopped, 'Z'
        dead, None gone); then a silent rank counts only if its process is stopped or dead, since on an
        overloaded host a running rank's heartbeat (or its very first one) can be late by more than the hang
        timeout (seen: 7 s at load 68)."""
        self.world, self.hang_timeout_s, self.startup_timeout_s = world, hang_timeout_s, startup_timeout_s
        self.early, self.state_of = early, state_of
        self.start_step: int | None = None
        self.progress: tuple | None = None  # every rank's step
        self.last_step = time.time()  # when a step last ended on some rank
        self.seen: tuple | None = None  # every rank's activity
        self.last_progress = time.time()  # when any rank's activity last moved
        self.moved: dict[int, float] = {}  # per rank: when its activity last moved (as the watcher saw it)
        self.beat_seen: dict[int, tuple] = {}  # per rank: its newest heartbeat's time, and when the watcher saw it
        self.roots: list[int] = []  # ranks others wait for in an op, themselves waiting for no one
        self.stuck: list[int] = []  # roots judged hung by `overdue`
        self.longest_pause = 0.0  # the longest time without activity (of the job, or of a root) once started
        self.step_times: list[float] = []
        self.first_step_at: float | None = None
        self.first_beat_at: float | None = None  # the first heartbeat of this attempt, from any rank

    def steps(self, beats: dict[int, dict[str, Any]]) -> tuple:
        return tuple(beats.get(r, {}).get("step", -1) for r in range(self.world))

    def update(self, beats: dict[int, dict[str, Any]]) -> None:
        steps = self.steps(beats)
        now = time.time()
        if beats and self.first_beat_at is None:
            self.first_beat_at = now
        # the step an attempt starts from is known once every rank has built its trainer (an early heartbeat
        # says step -1 in a "start-up: ..." phase)
        if self.start_step is None and len(beats) == self.world and not any(map(in_startup, beats.values())):
            self.start_step = min(steps)
        if steps != self.progress:
            self.progress, self.last_step = steps, now
            self.step_times = sorted({*self.step_times, *(b["step_time_s"] for b in beats.values()
                                                          if b.get("step_time_s"))})[-64:]
            if self.first_step_at is None and self.start_step is not None and min(steps) > self.start_step:
                self.first_step_at = now
        seen = tuple(activity(beats[r]) if r in beats else None for r in range(self.world))
        if seen != self.seen:
            if self.first_step_at is not None:
                self.longest_pause = max(self.longest_pause, now - self.last_progress)
            for r, act in enumerate(seen):
                if self.seen is None or act != self.seen[r]:
                    if self.first_step_at is not None and r in self.roots and r in self.moved:
                        self.longest_pause = max(self.longest_pause, now - self.moved[r])
                    self.moved[r] = now
            self.seen, self.last_progress = seen, now
        fresh = False
        for r, b in beats.items():
            if self.beat_seen.get(r, (None,))[0] != b["time"]:
                self.beat_seen[r] = (b["time"], now)
                fresh = True
        if fresh:  # the wait edges change only with a new heartbeat
            flights = {r: b["flight"] for r, b in beats.items() if isinstance(b.get("flight"), dict)}
            edges = wait_edges(flights)
            self.roots = sorted({e.target for e in edges} - {e.waiter for e in edges})

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
        # Start-up judged by progress: once a rank has finished its start-up (it began a step: groups built,
        # model loaded), a rank that is still silent or has not begun is behind its peers, who wait for it in
        # their first collective; it is judged by the hang timeout. The long allowance only covers a start-up
        # no rank has finished, or a first step every rank has begun (warm-up), while every rank beats.
        begun = [r for r, b in beats.items() if b.get("step_time_s") is not None
                 or str(b.get("phase", "")).startswith("step ")]
        behind = bool(begun) and len(begun) < self.world
        timeout = self.timeout()
        # A rank silent for the hang timeout while a peer still beats is stopped or dead (its heartbeat thread
        # beats whatever its training thread does, from the first thing the rank does: agent.early_start), or
        # it never started while its peers did: no start-up allowance covers that either.
        silent = bool(self.silent(beats, timeout)) and any(time.time() - b["time"] <= timeout
                                                           for b in beats.values())
        limit = timeout if (started or behind or silent) and not finishing \
            else max(timeout, self.startup_timeout_s)
        now = time.time()
        idle = now - self.last_progress
        self.stuck = []
        if idle > limit:
            return idle
        # A rank the others wait for, itself waiting for no one, without activity for the limit: hung, although
        # ranks that do not need it yet still progress (another DP replica runs its whole backward before it
        # needs the hung rank in the gradient reduction). Judged on a heartbeat of that rank the watcher saw the
        # limit after its last activity, so a rank whose heartbeat thread is starved by a loaded host (its
        # activity unseen, not absent) is never judged on old news.
        self.stuck = [r for r in self.roots if r in self.moved
                      and self.beat_seen.get(r, (0.0, 0.0))[1] - self.moved[r] > limit]
        if self.stuck:
            return max(now - self.moved[r] for r in self.stuck)
        # ops that move while no step ends (a loop of ops): the step limit, never shorter than the hang timeout
        busy = now - self.last_step
        return busy if busy > max(limit, default_hang_timeout(self.step_times)) else None

    def silent(self, beats: dict[int, dict[str, Any]], timeout: float) -> list[int]:
        """With early heartbeats, ranks without a heartbeat for `timeout` s: one that stopped beating (not because
        it is exiting), or one that never beat although a peer has beaten for that long. Without them (the
        multi-host driver) none: there a start's ranks beat only from rank_start, and during a torchrun restart the
        files still hold the previous start's stale beats, which the driver tells apart by their start id."""
        if not self.early:
            return []
        now = time.time()
        never = self.first_beat_at is not None and now - self.first_beat_at > timeout
        quiet = [r for r in range(self.world)
                 if (r not in beats and never)
                 or (r in beats and now - beats[r]["time"] > timeout and beats[r].get("phase") != "shutdown")]
        if self.state_of is None:
            return quiet
        return [r for r in quiet if self.state_of(r) in ("T", "Z", None)]


def in_startup(beat: dict[str, Any]) -> bool:
    """Whether a heartbeat comes from a rank still starting (imports, process groups, model build, resume)."""
    return str(beat.get("phase", "")).startswith("start-up")


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


def confirm_hang(clock: ProgressClock, beats: dict[int, dict[str, Any]],
                 reread: Callable[[], dict[int, dict[str, Any]]], state_of: Callable[[int], str | None] | None,
                 labels: dict[int, str], heartbeat_s: float) -> Failure | None:
    """A hang `clock.overdue` saw, settled (`settle`) and named (`judge_hang`); None when the heartbeats that came
    in while settling show progress after all (a slow host starves every heartbeat thread at once)."""
    stale = max(3 * heartbeat_s, 2.0)
    beats = settle(beats, reread, state_of, stale, heartbeat_s)
    clock.update(beats)
    idle = clock.overdue(beats)
    if idle is None:
        return None
    return judge_hang(beats, clock.world, labels, idle, clock.timeout(), stale, state_of, clock.longest_pause,
                      clock.stuck)


def judge_hang(beats: dict[int, dict[str, Any]], world: int, labels: dict[int, str], idle_s: float,
               timeout: float, stale_after: float, state_of: Callable[[int], str | None] | None,
               longest_pause: float = 0.0, stuck: list[int] | None = None) -> Failure:
    """Name the rank a hung job waits for, from the heartbeats' flight recorders: a rank whose heartbeat stopped
    first (it is stopped or dead whatever its frozen recorder says), else the root of the wait edges.
    `longest_pause`: the longest time without activity the watcher saw while the job ran (the timeout's margin).
    `stuck`: the ranks the clock found without activity while others wait for them (`ProgressClock.stuck`)."""
    now = time.time()
    notes: dict[int, str] = {}
    unresponsive = []
    for r in range(world):
        b = beats.get(r)
        if b is None or now - b["time"] > stale_after:
            unresponsive.append(r)
            age = "never" if b is None else f"not for {now - b['time']:.1f} s, last in phase '{b['phase']}'"
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
    if stuck and not unresponsive:
        names = [r for r in names if r in stuck] or sorted(stuck)
    cause = names[0]
    tree = wait_tree(names, flights, labels, notes)
    waits = [{"waiter": e.waiter, "target": e.target, "op": op_text(e.op), "why": e.why}
             for e in wait_edges(flights)]
    label = labels.get(cause, "?")
    pause = f", the longest pause before {longest_pause:.1f} s" if longest_pause else ""
    what = f"rank {', '.join(map(str, stuck))} made no progress for {idle_s:.1f} s while others wait for it" \
        if stuck else f"no progress for {idle_s:.1f} s"
    msg = (f"hang: {what} (no step, phase or communication op: hang timeout {timeout:g} s{pause}); the job waits "
           f"for rank {cause} ({label}): {notes.get(cause, 'waits for no one')}")
    return Failure("hang", cause, label, msg, steps.get(cause, -1), now, tree=tree, waits=waits,
                   longest_pause_s=longest_pause or None)
