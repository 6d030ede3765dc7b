"""`megatronapp resilience watch`: the driver of a multi-host job started by torchrun on every host.

One process anywhere that sees the heartbeat directory runs the local supervisor's detection (`watch.py`) on the
ranks of the current round: a hang (no progress for the hang timeout) is named from the flight recorders,
with the waits tree; a rank whose heartbeat stopped is named as stopped or dead (remote processes are out of
sight). It cannot signal remote processes, so it acts by writing the round's restart decision (`decision.py`):
every rank leaves, each host's torchrun agent starts a new rendezvous round, and the workers resume from the
newest intact checkpoint (`elastic.py`). It ends when every rank of the round has finished its run.

torchrun also restarts the workers by itself: after a worker failed, and when a standby host replaces one whose
rendezvous keep-alive expired. The driver follows the job's current start (`fence.py`) and, when a host left with
a start, names it with its ranks and address, as lost or cut off (`hosts.py`).
"""
from __future__ import annotations

import dataclasses
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatronapp.parallel.topology import coord_of
from megatronapp.resilience import decision, fence, hosts
from megatronapp.resilience.watch import Failure, ProgressClock, judge_hang, read_beats, settle


@dataclass
class DriverOptions:
    world: int
    hang_timeout_s: float | None = None  # None: 10x the slowest step seen, at least 30 s
    max_restarts: int = 3  # decisions before the driver gives up (torchrun's own --max-restarts bounds the job)
    heartbeat_s: float = 1.0  # the ranks' heartbeat interval (staleness is judged against it)
    startup_timeout_s: float = 300.0  # before the first step of a round (imports, model build, resume)
    give_up_after_s: float | None = None  # no heartbeat of the round for this long: stop watching (None: never)


def _log(msg: str) -> None:
    print(f"megatronapp driver: {msg}", file=sys.stderr, flush=True)


def labels_of(beats: dict[int, dict[str, Any]], world: int) -> dict[int, str]:
    """Grid labels of every rank, from the layout any heartbeat carries."""
    for b in beats.values():
        layout = b.get("layout")
        if isinstance(layout, list) and len(layout) == 3 and all(isinstance(n, int) and n > 0 for n in layout) \
                and layout[0] * layout[1] * layout[2] == world:
            return {r: coord_of(r, *layout).label() for r in range(world)}
    return {r: str(beats.get(r, {}).get("label", "?")) for r in range(world)}


def current_start(hb_dir: Path, round_: int) -> fence.Start | None:
    """The start of the workers that rank 0 recorded for this round, if any (a bad record: none)."""
    try:
        record = fence.read(hb_dir)
    except fence.StartError:
        return None
    return record if record is not None and record.round == round_ else None


def round_beats(hb_dir: Path, world: int, round_: int,
                every: dict[int, dict[str, Any]] | None = None) -> dict[int, dict[str, Any]]:
    """Heartbeats of this round's ranks from the current start of its workers (a file left by an earlier round,
    or by workers torchrun has since restarted within the round, is not one). The current start is the recorded
    one (`fence.py`); without a record, the start with the freshest beat."""
    beats = {r: b for r, b in (read_beats(hb_dir, world) if every is None else every).items()
             if b.get("round") == round_}
    record = current_start(hb_dir, round_)
    if record is not None:
        return {r: b for r, b in beats.items() if b.get("start") == record.start}
    newest: dict[Any, float] = {}
    for b in beats.values():
        newest[b.get("start")] = max(newest.get(b.get("start"), 0.0), b["time"])
    if len(newest) > 1:
        start = max(newest, key=newest.get)
        beats = {r: b for r, b in beats.items() if b.get("start") == start}
    return beats


def watch(hb_dir: Path, opts: DriverOptions, log: Callable[[str], None] = _log) -> dict[str, Any]:
    """Watch rounds until one completes; returns {"completed", "round", "steps", "failures"}."""
    hb_dir = Path(hb_dir)
    hb_dir.mkdir(parents=True, exist_ok=True)
    round_ = decision.rounds_decided(hb_dir)  # a restarted driver continues the numbering
    failures: list[Failure] = []
    stale_after = max(3 * opts.heartbeat_s, 2.0)
    log(f"watching {opts.world} rank(s) in {hb_dir}, round {round_}")
    left: list[hosts.HostLeft] = []
    while True:
        clock = ProgressClock(opts.world, opts.hang_timeout_s, opts.startup_timeout_s)
        seen_at, start = time.time(), None
        starts = StartLog()
        waiting_for: list[int] = []
        while True:
            time.sleep(0.2)
            every = read_beats(hb_dir, opts.world)
            starts.observe(every, round_)
            beats = round_beats(hb_dir, opts.world, round_, every)
            if beats:
                seen_at = max(seen_at, max(b["time"] for b in beats.values()))  # the last beat, not the last read
                now_start = next(iter(beats.values())).get("start")
                if start is not None and now_start != start:
                    # torchrun restarted the workers (a worker failed by itself, or a standby host replaced a
                    # host whose keep-alive expired): a new start-up allowance, and a look at who left
                    log(f"round {round_}: the workers were restarted by torchrun (a worker failed or a host left; "
                        f"no decision)")
                    clock = ProgressClock(opts.world, opts.hang_timeout_s, opts.startup_timeout_s)
                    starts.replaced(start, now_start, current_start(hb_dir, round_))
                start = now_start
            for gone in starts.departures(beats, opts.world, stale_after):
                left.append(gone)
                log(f"round {round_}: {gone.message}")
                _event(hb_dir / "driver.jsonl", {"event": "host-left", **dataclasses.asdict(gone)})
            # (ranks that failed by themselves are restarted by torchrun within the round, without a decision)
            if len(beats) == opts.world and all(b.get("phase") == "shutdown" and not b.get("failed")
                                                for b in beats.values()):
                steps = {b["step"] for b in beats.values()}
                log(f"round {round_} completed: every rank finished at step {max(steps)}")
                return _result(True, round_, beats, failures, left)
            if opts.give_up_after_s is not None and time.time() - seen_at > opts.give_up_after_s:
                log(f"no heartbeat of round {round_} for {opts.give_up_after_s:.0f} s: stopped watching")
                return _result(False, round_, beats, failures, left)
            clock.update(beats)  # progress finer than steps: any rank's phase or communication ops
            idle = clock.overdue(beats)
            if idle is not None and _hang_possible(beats, stale_after):
                late = stopped_after_stall(beats, clock.last_progress, stale_after)
                if not late:
                    break
                if late != waiting_for:  # said once per set of ranks
                    waiting_for = late
                    log(f"round {round_}: rank(s) {', '.join(map(str, late))} stopped beating after the job "
                        f"stalled: their agent stopped them (torchrun restarts the workers, e.g. with a standby "
                        f"host); waiting for the new start instead of deciding")
        beats = settle(beats, lambda r=round_: round_beats(hb_dir, opts.world, r), None, stale_after, opts.heartbeat_s)
        labels = labels_of(beats, opts.world)
        failure = judge_hang(beats, opts.world, labels, idle, clock.timeout(), stale_after, None,
                             clock.longest_pause, clock.stuck)
        silent = [r for r in range(opts.world) if r not in beats or time.time() - beats[r]["time"] > stale_after]
        whole = hosts.whole_hosts(silent, starts.last_beats(start), labels)
        if whole:  # every rank of a host went silent at once: the host, not a process
            failure.message += (f"; every rank of {' and '.join(whole)} stopped beating: the host is lost (down, "
                                f"or cut off)")
        failures.append(failure)
        log(f"round {round_}: {failure.message}")
        log("waits (who waits for whom, in which op):\n" + failure.tree)
        if len(failures) > opts.max_restarts:
            log(f"gave up after {opts.max_restarts} restart(s): the ranks are left to torchrun")
            return _result(False, round_, beats, failures, left)
        reason = failure.message.split(";", 1)[0]  # "hang: no progress for S s (...)"
        d = decision.Decision(round_, failure.rank, failure.label, reason)
        target = decision.write(hb_dir, d)
        _event(hb_dir / "driver.jsonl", {"event": "decision", **dataclasses.asdict(d), "file": str(target),
                                         "failure": dataclasses.asdict(failure)})
        log(f"round {round_}: restart decided ({target.name}); every rank exits with code "
            f"{decision.RESTART_EXIT_CODE} and torchrun starts round {round_ + 1}")
        round_ += 1


def stopped_after_stall(beats: dict[int, dict[str, Any]], last_progress: float, stale_after: float) -> list[int]:
    """Ranks whose heartbeat stopped well after the job last made progress (a step, or any rank completing a
    communication op). They did not stall it: a rank that stalls a job by dying or stopping goes silent while its
    peers still complete the ops that do not need it, and they block right after. Something stopped them later:
    their torchrun agent, which restarts the workers when a host's rendezvous keep-alive expired and a standby
    host waits (the cause, a host lost or cut off, then shows in who is missing from the new start), or after a
    worker failed. A decision now would race torchrun and blame the wrong host."""
    now = time.time()
    return sorted(r for r, b in beats.items()
                  if now - b["time"] > stale_after and b["time"] > last_progress + stale_after)


def _hang_possible(beats: dict[int, dict[str, Any]], stale_after: float) -> bool:
    """Whether a lack of progress can be a hang the driver should act on. Not when no rank of this start beats:
    a hung rank's heartbeat thread keeps beating, so every heartbeat stale means the workers are gone (torchrun
    is restarting them after a crash, or the job ended) and a decision would reach no one. Not when a rank
    failed by itself: torchrun sees its exit and restarts every worker without the driver."""
    now = time.time()
    if any(b.get("failed") for b in beats.values()):
        return False
    return any(now - b["time"] <= stale_after for b in beats.values())


def _result(completed: bool, round_: int, beats: dict[int, dict[str, Any]], failures: list[Failure],
            left: list[hosts.HostLeft]) -> dict[str, Any]:
    return {"completed": completed, "round": round_, "steps": max((b["step"] for b in beats.values()), default=-1),
            "failures": [dataclasses.asdict(f) for f in failures], "hosts_left": [dataclasses.asdict(h) for h in left]}


class StartLog:
    """The last beat of every rank of every start of one round seen so far, and the replacements to judge once the
    new start's ranks have all beaten (their addresses say which hosts it runs on)."""

    def __init__(self) -> None:
        self.beats: dict[Any, dict[int, dict[str, Any]]] = {}
        self._pending: list[tuple[Any, Any, float]] = []  # (old start, new start, when the new one began)

    def observe(self, every: dict[int, dict[str, Any]], round_: int) -> None:
        for r, b in every.items():
            if b.get("round") == round_:
                self.beats.setdefault(b.get("start"), {})[r] = b

    def last_beats(self, start: Any) -> dict[int, dict[str, Any]]:
        return self.beats.get(start, {})

    def replaced(self, old: Any, new: Any, record: fence.Start | None) -> None:
        began = record.time if record is not None and record.start == new else time.time()
        self._pending.append((old, new, began))

    def departures(self, current: dict[int, dict[str, Any]], world: int, stale_after: float) -> list[hosts.HostLeft]:
        """The hosts that left with a replacement whose new start has now beaten on every rank."""
        if not self._pending or len(current) < world:
            return []
        labels = labels_of(current, world)
        out: list[hosts.HostLeft] = []
        for old, new, began in self._pending:
            if new == next(iter(current.values())).get("start"):
                out += hosts.departures(self.last_beats(old), current, began, stale_after, labels)[0]
        self._pending = [p for p in self._pending if p[1] != next(iter(current.values())).get("start")]
        return out


def _event(path: Path, record: dict[str, Any]) -> None:
    with path.open("a", encoding="utf-8") as f:
        f.write(json.dumps({"time": time.time(), **record}) + "\n")
