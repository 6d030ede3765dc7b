"""The hang clock counts progress finer than steps: any rank's phase or communication ops moving. So a hang timeout
can be a fraction of a step, and a job whose ops move while no step ends is still caught by the step limit."""
from __future__ import annotations

import time

from megatronapp.resilience import watch


def _beat(rank: int, step: int = 3, issued: int = 0, completed: int = 0, phase: str = "step 4") -> dict:
    now = time.time()
    return {"rank": rank, "time": now, "step": step, "phase": phase, "phase_since": now, "step_time_s": 2.0,
            "flight": {"open": [], "recent": [], "issued": {"pp.act.up 0->1": issued},
                       "completed": {"pp.act.up 0->1": completed}}}


def _running(clock: watch.ProgressClock, ops: int) -> dict:
    beats = {r: _beat(r, issued=ops, completed=ops) for r in range(2)}
    clock.update(beats)
    return beats


def test_ops_moving_inside_a_step_are_progress_and_their_end_is_a_hang():
    began = time.time()
    clock = watch.ProgressClock(2, hang_timeout_s=1.5, startup_timeout_s=300.0)
    clock.update({r: _beat(r, step=2) for r in range(2)})
    clock.update({r: _beat(r, step=3) for r in range(2)})  # every rank ended a step: the attempt has started
    beats = _running(clock, 5)
    clock.last_step -= 3.0  # a step takes longer than the hang timeout (2 s steps, 1.5 s timeout) ...
    clock.last_progress -= 1.0
    beats = _running(clock, 6)  # ... but its ops move: no hang
    assert clock.overdue(beats) is None
    # the 1 s without activity was seen as the longest pause (plus whatever this test itself took, however slow)
    assert 1.0 <= clock.longest_pause <= 1.0 + (time.time() - began)
    clock.last_progress -= 1.6  # nothing moved on any rank for the hang timeout: a hang
    idle = clock.overdue(beats)
    assert idle is not None and idle > 1.5
    # one rank's completion (a peer still finishing what does not need the hung rank) is progress
    beats[1] = _beat(1, issued=7, completed=7)
    clock.update(beats)
    assert clock.overdue(beats) is None
    # a phase change is progress too (a rank entering its optimizer update)
    clock.last_progress -= 2.0
    beats[0] = _beat(0, issued=6, completed=6, phase="optimizer")
    clock.update(beats)
    assert clock.overdue(beats) is None


def test_ops_that_move_while_no_step_ends_are_judged_by_the_step_limit():
    """A rank busy in a loop of ops (ops move, no step ends) is no blind spot: past 10x the slowest step (at
    least 30 s, at least the hang timeout) it is a hang."""
    clock = watch.ProgressClock(2, hang_timeout_s=1.5, startup_timeout_s=300.0)
    clock.update({r: _beat(r, step=2) for r in range(2)})
    beats = _running(clock, 1)
    clock.last_step -= 29.0
    beats = _running(clock, 2)
    assert clock.overdue(beats) is None  # under the 30 s floor of the step limit
    clock.last_step -= 2.0
    beats = _running(clock, 3)
    busy = clock.overdue(beats)
    assert busy is not None and busy > 30.0


def test_the_failure_message_says_the_margin():
    beats = {r: _beat(r) for r in range(2)}
    failure = watch.judge_hang(beats, 2, {0: "A", 1: "B"}, 1.8, 1.5, 5.0, None, longest_pause=0.4)
    assert failure.message.startswith("hang: no progress for 1.8 s (no step, phase or communication op: hang "
                                      "timeout 1.5 s, the longest pause before 0.4 s); the job waits")
    assert failure.message.split(";", 1)[0].endswith("0.4 s)")  # the driver's decision keeps the whole reason


def test_step_times_kept_bounded():
    clock = watch.ProgressClock(1, hang_timeout_s=None, startup_timeout_s=300.0)
    for step in range(500):
        clock.update({0: {**_beat(0, step=step), "step_time_s": 1.0 + step / 1000}})
    assert len(clock.step_times) <= 64 and max(clock.step_times) == 1.499
    assert clock.timeout() == 30.0  # 10x the slowest step (15 s) is under the 30 s floor


def _tp_beats(ops_other: int, waiting: bool, t: float) -> dict:
    """Rank 0 hung at a step's start (no op open), rank 1 its TP peer waiting for it in an all-reduce (or not yet),
    rank 2 of another DP replica still running its own micro-batches."""
    key = "tp[0, 1]"
    open_op = {"op": "all_reduce", "key": key, "seq": 5, "peer": None, "ranks": [0, 1]}
    hung = {**_beat(0), "time": t, "flight": {"open": [], "recent": [], "issued": {key: 4}, "completed": {key: 4}}}
    peer = {**_beat(1), "time": t, "flight": {"open": [open_op] if waiting else [], "recent": [],
                                              "issued": {key: 5 if waiting else 4}, "completed": {key: 4}}}
    other = {**_beat(2, issued=ops_other, completed=ops_other), "time": t}
    return {0: hung, 1: peer, 2: other}


def _earlier(clock: watch.ProgressClock, s: float) -> None:
    for r in clock.moved:
        clock.moved[r] -= s
    clock.beat_seen = {r: (t, seen - s) for r, (t, seen) in clock.beat_seen.items()}


def test_a_rank_others_wait_for_is_hung_while_the_rest_of_the_job_still_runs():
    clock = watch.ProgressClock(3, hang_timeout_s=1.5, startup_timeout_s=300.0)
    clock.update({r: _beat(r, step=2) for r in range(3)})
    t = time.time()
    clock.update(_tp_beats(10, True, t))
    assert clock.roots == [0]
    _earlier(clock, 1.6)  # rank 0's (and rank 1's) activity and heartbeat were last seen 1.6 s ago ...
    beats = _tp_beats(11, True, t)  # ... rank 2 still moves; no new heartbeat of rank 0 since then
    clock.update(beats)
    assert clock.overdue(beats) is None  # judged only on a heartbeat seen the limit after its last activity
    beats = _tp_beats(12, True, t + 0.5)  # rank 0 beats again, still without activity: hung
    clock.update(beats)
    idle = clock.overdue(beats)
    assert idle is not None and idle > 1.5 and clock.stuck == [0]
    failure = watch.judge_hang(beats, 3, {r: f"r{r}" for r in range(3)}, idle, 1.5, 5.0, None, 0.3, clock.stuck)
    assert failure.rank == 0 and failure.message.startswith("hang: rank 0 made no progress for")
    # the same pause with nobody waiting for rank 0 (its peer has not reached the op yet): not a hang
    calm = watch.ProgressClock(3, hang_timeout_s=1.5, startup_timeout_s=300.0)
    calm.update({r: _beat(r, step=2) for r in range(3)})
    calm.update(_tp_beats(10, False, t))
    _earlier(calm, 1.6)
    beats = _tp_beats(11, False, t + 0.5)
    calm.update(beats)
    assert calm.roots == [] and calm.overdue(beats) is None
