"""The driver of `megatronapp train --supervise`: launch the ranks, watch their heartbeats, detect a rank that
exits or is killed and a hang, name the cause, stop the rest, and resume from the newest intact checkpoint.

One attempt = one launch of every rank. The driver polls the ranks' exit status and their heartbeat files
(`<out>/.heartbeat/rank*.json`, written by `resilience.agent`). An attempt fails when a rank exits non-zero (the
one killed by a signal, else the earliest error, is named with its grid coordinates) or when no rank's step
advances for the hang timeout (the cause is named from the flight recorders, see `attribution.py`). Then every
rank is stopped and the next attempt resumes from the newest complete checkpoint whose files pass their checksums,
with fault drills (`--inject`) left out, up to `max_restarts` times. Events go to `<out>/resilience.jsonl`.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatronapp import launch
from megatronapp.config import ConfigError, RunConfig, plugin_entries, validate
from megatronapp.parallel.topology import coord_of
from megatronapp.resilience import agent, recovery, shrink
from megatronapp.resilience.generations import EARLY_HEARTBEAT, GenerationJob, SupervisorGaveUp
from megatronapp.resilience.stragglers import Straggler, StragglerWatch
from megatronapp.resilience.watch import (
    Failure,
    ProgressClock,
    confirm_hang,
    default_hang_timeout,  # noqa: F401  (imported from here by callers)
    process_state,
    read_beats,
)
from megatronapp.train import checkpoint as ckpt
from megatronapp.train import plugins
from megatronapp.train.trainer import run_rank

AGENT_PLUGIN = "megatronapp.resilience.agent:plugin"


@dataclass
class Options:
    hang_timeout_s: float | None = None  # None: 10x the slowest step seen, at least 30 s
    max_restarts: int = 3
    heartbeat_s: float = 1.0
    # before the first step of an attempt (imports, model build, resume), while no rank has finished its start-up
    # and every rank still beats (watch.ProgressClock)
    startup_timeout_s: float = 300.0
    threads: int | None = None
    diagnose_on_restart: bool = True  # run the diagnostics on the job's layout before each restart
    diagnose_budget_s: float = 120.0  # wall-clock budget of those diagnostics
    allow_shrink: bool = False  # restart without the evicted rank's DP replica (a smaller dp)
    straggler_windows: int = 3  # with tracing on: a MegaScan finding repeated over this many windows is reported
    straggler_min_slowdown: float = 1.10  # ... if it slows its rank by at least this factor
    evict_stragglers: bool = False  # ... and treated as a failure (stop, diagnose, evict, restart)
    # in-place recovery (generations.py): warm spares; without one, a failure restarts every rank
    spares: int = 0
    buddy_copy: bool = True  # ZeRO-1: copy each rank's optimizer slice to a DP peer after each step (buddy.py)
    spare_wait_s: float = 120.0  # a failure finding no ready spare waits this long for a starting one
    stop_after_s: float = 1.0  # a rank's process stopped (SIGSTOP) this long is a hang, killed and replaced
    form_timeout_s: float = 120.0  # a generation after a recovery must commit a step within this
    left_grace_s: float = 1.0  # a rank that left while none died: acted on after this (a death is seen first)


def _log(msg: str) -> None:
    print(f"megatronapp supervisor: {msg}", file=sys.stderr, flush=True)


class Attempt:
    """One launch of every rank, watched until it succeeds or fails."""

    def __init__(self, cfg: RunConfig, number: int, opts: Options, log: Callable[[str], None]):
        self.cfg, self.number, self.opts, self.log = cfg, number, opts, log
        self.out = Path(cfg.train.out)
        self.hb_dir = self.out / ".heartbeat"
        p = cfg.parallel
        self.world = p.world_size
        self.labels = {r: coord_of(r, p.tp, p.pp, p.dp).label() for r in range(self.world)}
        self.step_times: list[float] = []
        self.first_step_at: float | None = None
        self.watch: StragglerWatch | None = None
        self.inplace: dict[str, Any] = {}  # with spares: the in-place recoveries of this attempt
        tc = cfg.trace
        if tc.enabled and opts.straggler_windows > 0:
            self.watch = StragglerWatch(Path(tc.dir or self.out / "trace"), tc.interval, tc.iterations, self.world,
                                        opts.straggler_windows, min_factor=opts.straggler_min_slowdown)

    def beats(self) -> dict[int, dict[str, Any]]:
        return read_beats(self.hb_dir, self.world)

    def run(self) -> dict[str, Any] | Failure:
        if self.opts.spares:  # the ranks recover in place while they can (generations.py)
            job = GenerationJob(self.cfg, self.opts, self.log, self.out / "resilience.jsonl", self.number)
            try:
                return job.run()
            finally:
                self.first_step_at, self.step_times, self.inplace = job.first_step_at, job.step_times, job.account()
        shutil.rmtree(self.hb_dir, ignore_errors=True)
        self.hb_dir.mkdir(parents=True)
        result = self.out / ".result.json"
        result.unlink(missing_ok=True)
        threads = self.opts.threads or max(1, (os.cpu_count() or 1) // self.world)
        job = launch.start(run_rank, self.world, self.cfg.to_dict(), str(result),
                           backend=launch.pick_backend(self.cfg.parallel.backend), threads=threads,
                           env={agent.DIR_ENV: str(self.hb_dir), agent.PERIOD_ENV: str(self.opts.heartbeat_s)},
                           prelude=EARLY_HEARTBEAT)  # each rank beats before it imports torch
        try:
            return self._watch(job, result)
        finally:
            job.close()

    def _watch(self, job: launch.LocalJob, result: Path) -> dict[str, Any] | Failure:
        clock = ProgressClock(self.world, self.opts.hang_timeout_s, self.opts.startup_timeout_s, early=True,
                              state_of=lambda r: process_state(job.pids[r]))
        while True:
            job.wait(0.2)
            if job.exits():
                noticed = time.time()
                time.sleep(0.5)  # let the victims of a dead rank fail too, so the cause is told from them
                return self._exit_failure(job, noticed)
            if not job.running():
                if not result.is_file():
                    return Failure("exit", 0, self.labels[0], "the ranks exited without a result", -1, time.time())
                summary = json.loads(result.read_text())
                if self.watch is not None and clock.start_step is not None:  # the windows the run ended with
                    self._stragglers(self.watch.poll(clock.start_step, summary.get("steps", 0), final=True))
                return summary
            beats = self.beats()
            clock.update(beats)
            if self.watch is not None and clock.start_step is not None:
                failure = self._stragglers(self.watch.poll(clock.start_step, min(clock.steps(beats))))
                if failure is not None:
                    job.stop(grace_s=1.0)
                    return failure
            self.step_times, self.first_step_at = clock.step_times, clock.first_step_at
            idle = clock.overdue(beats)
            if idle is not None:
                failure = self._hang_failure(beats, job, clock)
                if failure is None:  # late heartbeats showed progress: the host was slow, not the job
                    continue
                job.stop(grace_s=1.0)
                return failure

    def _stragglers(self, found: list[Straggler]) -> Failure | None:
        """Report persistent stragglers; with evict_stragglers, the first one that names a single rank is a
        failure (a slow link has two ends and no single culprit: it is reported, for `diagnose --group`)."""
        failure = None
        for s in found:
            where = ", ".join(f"rank {r} ({self.labels[r]})" for r in s.ranks if r in self.labels)
            msg = (f"persistent straggler: {s.kind} {where} in {len(s.windows)} trace windows in a row "
                   f"(windows {', '.join(map(str, s.windows))}): {s.describe}")
            self.log(msg)
            _event(self.out / "resilience.jsonl", {"event": "straggler", "attempt": self.number,
                                                   **dataclasses.asdict(s)})
            if self.opts.evict_stragglers and failure is None and len(s.ranks) == 1:
                r = s.ranks[0]
                failure = Failure("straggler", r, self.labels[r], msg, -1, time.time())
        return failure

    def _exit_failure(self, job: launch.LocalJob, noticed: float | None = None) -> Failure:
        cause = launch.first_failure(job.exits())
        job.stop()
        step = self.beats().get(cause.rank, {}).get("step", -1)
        sig = launch.signal_name(cause.signum) if cause.signum else None
        return Failure("exit", cause.rank, self.labels[cause.rank], cause.message, step, time.time(), signal=sig,
                       noticed_at=noticed)

    def _hang_failure(self, beats: dict[int, dict[str, Any]], job: launch.LocalJob,
                      clock: ProgressClock) -> Failure | None:
        """The hang, named; None when late heartbeats show progress after all (`watch.confirm_hang`)."""
        return confirm_hang(clock, beats, self.beats, lambda r: process_state(job.pids[r]), self.labels,
                            self.opts.heartbeat_s)


def attempt_config(cfg: RunConfig, number: int, log: Callable[[str], None],
                   replicas: list[int] | None = None) -> RunConfig:
    """The config of attempt `number`: the heartbeat agent attached; after a failure, resume from the newest intact
    checkpoint of the run (or the original --resume, or scratch) with fault drills off (they must not re-arm).
    A checkpoint saved with a larger dp than `cfg` (the job shrank) is converted first, taking DP replicas
    `replicas` (default: the first ones)."""
    run = dataclasses.replace(cfg, attach=list(dict.fromkeys([*cfg.attach, AGENT_PLUGIN])))
    resume = cfg.train.resume
    if number > 0:
        run.inject = []
        newest, notes = ckpt.newest_usable(Path(cfg.train.out) / "checkpoints")
        for note in notes:
            log(f"checkpoint {note}")
        if newest is not None:
            resume = str(newest)
            saved_dp = int(ckpt.load_meta(newest)["config"]["parallel"]["dp"])
            if saved_dp != cfg.parallel.dp:
                keep = replicas if replicas and len(replicas) == cfg.parallel.dp and max(replicas) < saved_dp \
                    else list(range(cfg.parallel.dp))
                root = Path(cfg.train.out) / "resharded" / f"dp{cfg.parallel.dp}"
                resume = str(shrink.reshard(newest, root, cfg, keep))
                log(f"{newest.name} (dp={saved_dp}) converted for dp={cfg.parallel.dp} from DP replica(s) "
                    f"{', '.join(map(str, keep))}: {resume}")
        log(f"restart {number}: resuming from {newest.name if newest else resume or 'scratch (no checkpoint yet)'}")
    if resume:
        resume = str(ckpt.resolve(resume, verify_files=True))
    run.train = dataclasses.replace(cfg.train, resume=resume)
    return run


def supervise(cfg: RunConfig, opts: Options | None = None, log: Callable[[str], None] = _log) -> dict[str, Any]:
    """Run the job under the driver; returns the final run summary plus `restarts`, `failures` (every failure in
    order, those recovered in place with spares included) and `recovery_s` (failure detected -> first step of the
    resumed run done, for full restarts)."""
    opts = opts or Options()
    if "TORCHELASTIC_RUN_ID" in os.environ or "GROUP_RANK" in os.environ:
        raise ConfigError("--supervise launches and watches its ranks on this machine; it does not run under "
                          "torchrun. Under torchrun pass --heartbeat-dir DIR (a directory every host sees) and "
                          "torchrun's --max-restarts, and run `megatronapp resilience watch --heartbeat-dir DIR "
                          "--world N` once (docs/resilience.md, 'Several hosts')")
    validate(cfg)
    plugins.resolve_all([*plugin_entries(cfg), AGENT_PLUGIN])
    out = Path(cfg.train.out)
    out.mkdir(parents=True, exist_ok=True)
    events = out / "resilience.jsonl"
    if opts.allow_shrink and cfg.parallel.dp > 1:
        shrink.shrunk_config(cfg, cfg.parallel.dp - 1)  # refuse now (ZeRO-1, a batch that cannot split), not later
        # the machine does not grow when the job shrinks: keep each rank's intra-op threads (more threads on the
        # same cores made a shrunk 1-rank attempt's steps take > 4 s at load 30 as OpenMP threads spun)
        cpus = os.cpu_count() or 1
        opts = dataclasses.replace(opts, threads=opts.threads or max(1, cpus // cfg.parallel.world_size))
    failures: list[Failure] = []  # the failures that restarted every rank
    seen: list[Failure] = []  # every failure in order, those recovered in place included (the summary's)
    recovery_s: list[float] = []
    evicted: list[dict[str, Any]] = []
    diagnoses: list[dict[str, Any]] = []
    stragglers: list[Straggler] = []
    inplace: dict[str, list] = {"replacements": [], "inplace_recoveries": []}
    generations = 0
    layout, replicas = cfg, None
    with ckpt.OutLock(out):
        number = 0
        while True:
            att = Attempt(attempt_config(layout, number, log, replicas), number, opts, log)
            outcome = att.run()
            # A resumed attempt short enough to finish between two heartbeats shows no progress to the watch
            # loop: it still recovered, and its first step was done by the time it completed (an upper bound).
            bound = failures and att.first_step_at is None and not isinstance(outcome, Failure)
            if bound:
                att.first_step_at = time.time()
            if failures and att.first_step_at is not None:
                recovery_s.append(att.first_step_at - failures[-1].detected_at)
                _event(events, {"event": "recovered", "attempt": number, "recovery_s": recovery_s[-1],
                                **({"upper_bound": True} if bound else {})})
            if att.watch is not None:
                stragglers += att.watch.reported
            for key in inplace:
                inplace[key] += att.inplace.get(key, [])
            generations += att.inplace.get("generations", 0)
            seen += [f for f in att.inplace.get("failures", []) if f is not outcome]
            if not isinstance(outcome, Failure):
                outcome.update(stragglers=[dataclasses.asdict(s) for s in stragglers])
                outcome.update(restarts=number, failures=[dataclasses.asdict(f) for f in seen],
                               recovery_s=recovery_s, evicted=evicted, diagnoses=diagnoses, dp=layout.parallel.dp)
                if opts.spares:
                    outcome.update(generations=generations, **inplace)
                _event(events, {"event": "completed", "attempt": number, "steps": outcome.get("steps")})
                _merge_summary(out / "summary.json", outcome)
                return outcome
            failures.append(outcome)
            seen.append(outcome)
            _event(events, {"event": "failure", "attempt": number, **dataclasses.asdict(outcome)})
            if outcome.kind == "exit":
                log(f"rank {outcome.rank} ({outcome.label}) failed at step {outcome.step}: {outcome.message}")
            elif outcome.kind == "straggler":
                log(f"stopping the job to evict the straggler rank {outcome.rank} ({outcome.label})")
            else:
                log(outcome.message)
                log("waits (who waits for whom, in which op):\n" + outcome.tree)
            number += 1
            done = _already_finished(cfg)
            if done is not None:  # it failed after its final checkpoint (e.g. while exiting): nothing to redo
                log(f"the final checkpoint {done['checkpoint']} is complete: not restarting")
                done.update(restarts=number - 1, failures=[dataclasses.asdict(f) for f in seen],
                            recovery_s=recovery_s, evicted=evicted, diagnoses=diagnoses)
                return done
            if number > opts.max_restarts:
                raise SupervisorGaveUp(f"gave up after {opts.max_restarts} restart(s); last failure: rank "
                                       f"{outcome.rank} ({outcome.label}): {outcome.message}")
            plan = recovery_plan(layout, cfg, outcome, opts, log)
            _event(events, recovery.record(plan, number - 1))
            evicted += [{**dataclasses.asdict(e), "attempt": number - 1, "dp_before": layout.parallel.dp}
                        for e in plan.evicted]
            if plan.diagnosis is not None:
                diagnoses.append({**plan.diagnosis, "attempt": number - 1})
            if plan.replicas is not None:
                layout, replicas = plan.layout, plan.replicas


def recovery_plan(layout: RunConfig, first: RunConfig, failure: Failure, opts: Options,
                  log: Callable[[str], None]) -> recovery.Plan:
    """Diagnose, evict and choose the next layout (recovery.py) with this driver's options."""
    return recovery.plan_restart(layout, first, failure, diagnose_on_restart=opts.diagnose_on_restart,
                                 diagnose_budget_s=opts.diagnose_budget_s, allow_shrink=opts.allow_shrink,
                                 threads=opts.threads, log=log)


def _already_finished(cfg: RunConfig) -> dict[str, Any] | None:
    """The run's summary if its newest intact checkpoint is already the final step, else None."""
    out = Path(cfg.train.out)
    newest, _ = ckpt.newest_usable(out / "checkpoints")
    if newest is None or int(ckpt.load_meta(newest).get("step", -1)) < cfg.train.steps:
        return None
    summary = out / "summary.json"
    if summary.is_file():
        return json.loads(summary.read_text())
    return {"steps": cfg.train.steps, "final_loss": float("nan"), "checkpoint": str(newest), "out": str(out)}


def _merge_summary(path: Path, outcome: dict[str, Any]) -> None:
    """Add the driver's account (restarts, failures, evictions, diagnoses, stragglers, final dp) to the run's
    summary.json, which rank 0 wrote without it."""
    keys = ("restarts", "failures", "recovery_s", "evicted", "diagnoses", "stragglers", "dp", "generations",
            "replacements", "inplace_recoveries")
    try:
        summary = json.loads(path.read_text()) if path.is_file() else {}
    except (OSError, json.JSONDecodeError):
        return  # a torn summary is rank 0's to rewrite; the driver's account is in resilience.jsonl too
    summary.update({k: outcome[k] for k in keys if k in outcome})
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(summary, indent=2, default=str))
    os.replace(tmp, path)


def _event(path: Path, record: dict[str, Any]) -> None:
    with path.open("a", encoding="utf-8") as f:
        f.write(json.dumps({"time": time.time(), **record}) + "\n")
