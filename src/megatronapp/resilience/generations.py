"""The supervisor's side of in-place recovery (`train --supervise --spares K`): generations, not attempts.

The supervisor owns a TCPStore on 127.0.0.1 and the generation number (`generation_protocol.py`). It starts the
job's ranks (generation 0) and K warm spares, then watches: a rank that exits, a process stopped (SIGSTOP) for
`stop_after_s`, a hang (no progress for the hang timeout, named from the flight recorders as the restart path
does), a generation that does not form within `form_timeout_s`, or a rank reporting that it left. Then:

1. a hung or stopped culprit is SIGKILLed: a hang becomes a crash, and its sockets close;
2. the generation ends: its undecided step commit is decided "abort" (`commit.abort_undecided`), then
   `ctl/end/<g>` is set, which releases every survivor's blocked operations (`member.py`, `sockets.py`);
3. the plan of generation g+1: the lost ranks are newcomers, each taken over by a ready spare, else by a process
   forked on demand from the fork server (`spare_pool.py`; the pool refills in the background, from the fork
   server too); their state comes from a DP peer ("peer", plain DP and AdamW; "peer+buddy" with ZeRO-1: the
   optimizer slice from the DP peer that keeps a copy of it, `buddy.py`), else everyone loads the newest
   checkpoint in place ("disk", the reason in the event); before the job's first commit everyone builds again
   ("start");
4. when the new generation's first step commits, the recovery is recorded with its parts.
With no newcomer to be had (no spare ready and no fork server, or none ready within `spare_wait_s`), no copy of
the state anywhere, or a rank already finished, the job falls back to a full restart (`run()` returns a Failure,
and `supervisor.supervise` restarts every rank from the newest checkpoint, as without spares).
"""
from __future__ import annotations

import dataclasses
import datetime
import json
import multiprocessing.connection
import os
import shutil
import socket
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp

from megatronapp import launch, startup
from megatronapp.config import RunConfig
from megatronapp.parallel.topology import Topology, coord_of
from megatronapp.resilience import agent, inplace
from megatronapp.resilience import generation_protocol as gp
from megatronapp.resilience.buddy import BUDDY_ENV, held_key, parse_held
from megatronapp.resilience.commit import abort_undecided
from megatronapp.resilience.handover import holders, sources
from megatronapp.resilience.spare_pool import ForkServer, SparePool
from megatronapp.resilience.watch import Failure, ProgressClock, confirm_hang, process_state, read_beats
from megatronapp.train import checkpoint as ckpt

EARLY_HEARTBEAT = "megatronapp.resilience.agent:early_start"
FORM_BACKSTOP_MARGIN_S = 30.0  # the supervisor's judgement of a late generation, then its end, before a member's


class SupervisorGaveUp(RuntimeError):
    pass


def _store(port_hint: int = 0) -> tuple[dist.TCPStore, socket.socket]:
    """The supervisor's store, listening on 127.0.0.1 only (TCPStore alone would listen on every interface)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", port_hint))
    sock.listen(1024)
    store = dist.TCPStore("127.0.0.1", sock.getsockname()[1], None, True, master_listen_fd=sock.fileno(),
                          use_libuv=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=60))
    return store, sock


class GenerationJob:
    """One launch of every rank and K spares, recovered in place for as long as it can be."""

    def __init__(self, cfg: RunConfig, opts: Any, log: Callable[[str], None], events: Path, attempt: int = 0):
        self.cfg, self.opts, self.log, self.events, self.attempt = cfg, opts, log, events, attempt
        p = cfg.parallel
        self.world = p.world_size
        self.topo = Topology(p.tp, p.pp, p.dp)
        self.labels = {r: coord_of(r, p.tp, p.pp, p.dp).label() for r in range(self.world)}
        self.out = Path(cfg.train.out)
        self.hb_dir = self.out / ".heartbeat"
        self.result = self.out / ".result.json"
        self.threads = opts.threads or max(1, (os.cpu_count() or 1) // (self.world + opts.spares))
        self.ranks: dict[int, Any] = {}
        self.pool: SparePool | None = None
        self.g = 0
        self.step = self._start_step()  # the committed step the current generation started after
        self.commits = 0  # steps committed in this job
        self.established: set[int] = set()  # ranks whose state is known good (they took their generation's state)
        self.pending: set[int] = set(range(self.world))  # members of the generation that have not taken it yet
        self.formed_at: float | None = None
        self.generation_at = time.time()
        self.recovering: dict[str, Any] | None = None  # the recovery waiting for its first commit
        self.recoveries: list[dict[str, Any]] = []
        self.replacements: list[dict[str, Any]] = []
        self.failures: list[Failure] = []
        self.first_step_at: float | None = None
        self.step_times: list[float] = []

    def _start_step(self) -> int:
        resume = self.cfg.train.resume
        return int(ckpt.load_meta(Path(resume))["step"]) if resume else 0

    # -- processes ------------------------------------------------------------------------------------------
    def _args(self) -> tuple:
        return (self.world, self.cfg.to_dict(), self.port, str(self.result), str(self.rundir), self.threads,
                self.env)

    def _start_rank(self, rank: int) -> Any:
        p = self.ctx.Process(target=startup.entry, name=f"rank{rank}", args=(
            EARLY_HEARTBEAT, rank, self.env, startup.ref_of(inplace.rank_main), *self._args()))
        p.start()
        return p

    def _fork_server(self) -> ForkServer:
        """The fork server for refills and on-demand newcomers, warming in the background (`spare_pool.py`)."""
        return ForkServer(launch.pick_backend(self.cfg.parallel.backend))

    def run(self) -> dict[str, Any] | Failure:
        shutil.rmtree(self.hb_dir, ignore_errors=True)
        self.hb_dir.mkdir(parents=True)
        self.result.unlink(missing_ok=True)
        self.rundir = Path(tempfile.mkdtemp(prefix="megatronapp-job-"))
        self.store, self._listener = _store()
        self.port = self.store.port
        self.env = {"MEGATRONAPP_RUN_ID": uuid.uuid4().hex[:12], **launch.loopback_env(),
                    agent.DIR_ENV: str(self.hb_dir), agent.PERIOD_ENV: str(self.opts.heartbeat_s),
                    BUDDY_ENV: "1" if self.opts.buddy_copy else "0"}
        self.ctx = mp.get_context("spawn")
        server = self._fork_server()  # before the ranks: its preload overlaps theirs, in its own process
        self.pool = SparePool(self.opts.spares, self.store, self._args(), server, self.log, self._event)
        self.store.set(gp.plan_key(0), gp.encode(gp.Plan(generation=0, world=self.world, source="start",
                                                         newcomers=list(range(self.world)), step=self.step,
                                                         form_timeout_s=self._member_backstop(0))))
        self.store.set(gp.GEN, "0")
        self.ranks = {r: self._start_rank(r) for r in range(self.world)}
        for _ in range(self.opts.spares):
            self.pool.start("pool")
        self._event({"event": "generation", "generation": 0, "source": "start", "step": self.step,
                     "newcomers": list(range(self.world)), "replaced": {},
                     "pids": {r: p.pid for r, p in self.ranks.items()}})
        try:
            return self._watch()
        finally:
            self._close()

    def _close(self) -> None:
        procs = [*self.ranks.values(), *(self.pool.close() if self.pool else [])]
        for p in procs:
            if p.exitcode is None:
                p.terminate()
        deadline = time.monotonic() + 3.0
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
            if p.exitcode is None:
                p.kill()  # also a stopped process
                p.join()
        shutil.rmtree(self.rundir, ignore_errors=True)
        # the store owns the listening descriptor and closes it when it goes: closing it here as well would close
        # whatever reused the number by then (a fork server's pipe, the next attempt's store), as a test run saw
        self._listener.detach()

    # -- watching -------------------------------------------------------------------------------------------
    def _wait(self, timeout_s: float) -> None:
        live = [p.sentinel for p in [*self.ranks.values(), *self.pool.processes] if p.exitcode is None]
        if live:
            multiprocessing.connection.wait(live, timeout_s)

    def _tend_generation(self) -> None:
        """Members that took their state; the first commit of a generation (a recovery's end)."""
        for r in list(self.pending):
            if self.store.check([gp.mark_key(self.g, "state", r)]):
                self.pending.discard(r)
                self.established.add(r)
        if self.formed_at is None and self.store.check([gp.first_commit_key(self.g)]):
            self.formed_at = gp.number(self.store.get(gp.first_commit_key(self.g)), gp.first_commit_key(self.g))
            if self.first_step_at is None:
                self.first_step_at = self.formed_at
            if self.recovering is not None:
                self._recovered()

    def _state(self, rank: int) -> str | None:
        return process_state(self.ranks[rank].pid)

    def _watch(self) -> dict[str, Any] | Failure:
        clock = self._clock()
        stopped_since: dict[int, float] = {}
        while True:
            self._wait(0.05)
            self.pool.tend()
            self._tend_generation()
            codes = {r: p.exitcode for r, p in self.ranks.items() if p.exitcode is not None}
            if len(codes) == self.world and not any(codes.values()):
                return self._completed()
            now = time.time()
            culprits: dict[int, str] = {r: self._exit_message(r, c) for r, c in codes.items() if c != 0}
            for r in self.ranks:
                if r not in codes and self._state(r) == "T":
                    since = stopped_since.setdefault(r, now)
                    if now - since >= self.opts.stop_after_s:
                        culprits[r] = f"process stopped (SIGSTOP?) for {now - since:.1f} s"
                else:
                    stopped_since.pop(r, None)
            failure = None
            if culprits:
                r = min(culprits, key=lambda x: (codes.get(x, 0) >= 0, x))  # one killed by a signal first
                failure = Failure("exit" if r in codes else "hang", r, self.labels[r], culprits[r],
                                  self._beat_step(r), now, noticed_at=now,
                                  signal=launch.signal_name(-codes[r]) if codes.get(r, 0) < 0 else None)
            elif self.formed_at is None and now - self.generation_at > self._form_timeout(self.g):
                failure = self._formation_failure(now)
            elif self.formed_at is not None:
                beats = read_beats(self.hb_dir, self.world)
                clock.update(beats)
                self.step_times = clock.step_times
                idle = clock.overdue(beats)
                if idle is not None:
                    failure = self._hang(beats, clock)
                else:
                    failure = self._left(now)
            if failure is None:
                continue
            outcome = self._recover(failure)
            if outcome is not None:
                return outcome
            clock, stopped_since = self._clock(), {}

    def _clock(self) -> ProgressClock:
        return ProgressClock(self.world, self.opts.hang_timeout_s, self.opts.startup_timeout_s,
                             state_of=self._state)

    def _beat_step(self, rank: int) -> int:
        return read_beats(self.hb_dir, self.world).get(rank, {}).get("step", -1)

    def _exit_message(self, rank: int, code: int) -> str:
        if code < 0:
            return f"killed by signal {launch.signal_name(-code)}"
        err = self.rundir / f"error{rank}.json"
        if err.is_file():
            try:
                return str(json.loads(err.read_text())["message"])[:2000]
            except (OSError, ValueError, KeyError):
                pass
        return f"exited with code {code}"

    def _left(self, now: float) -> Failure | None:
        """A rank that reported leaving the generation `left_grace_s` ago while no process died or stopped: it
        left on an error of its own (a victim of a death reports too, but the death is seen within the grace)."""
        for r in range(self.world):
            key = gp.mark_key(self.g, "left", r)
            if self.store.check([key]) and now - gp.number(self.store.get(key), key) >= self.opts.left_grace_s:
                try:
                    why = gp.read(self.store, gp.left_key(self.g, r), gp.Left).reason
                except gp.ProtocolError as e:
                    why = str(e)
                return Failure("left", r, self.labels[r], f"left generation {self.g}: {why}", self._beat_step(r),
                               now, noticed_at=now)
        return None

    def _hang(self, beats: dict[int, dict[str, Any]], clock: ProgressClock) -> Failure | None:
        """The hang, named; None when late heartbeats show progress after all (`watch.confirm_hang`)."""
        return confirm_hang(clock, beats, lambda: read_beats(self.hb_dir, self.world), self._state, self.labels,
                            self.opts.heartbeat_s)

    def _form_timeout(self, g: int) -> float:
        """How long generation `g` may take to commit its first step before the supervisor names its late rank."""
        return self.opts.startup_timeout_s if g == 0 else self.opts.form_timeout_s

    def _member_backstop(self, g: int) -> float:
        """The members' own formation timeout in generation `g`: after the supervisor's judgement and the time to
        end the generation (which releases every wait), so it fires only when the supervisor is gone."""
        return self._form_timeout(g) + FORM_BACKSTOP_MARGIN_S

    def _formation_failure(self, now: float) -> Failure:
        """A generation that did not commit a step within form_timeout_s: blame its first member that never began
        to join it (stuck in an earlier generation), else the first that did not take its state (stuck or slow),
        else the lowest rank. Being a hang, the culprit is killed and replaced."""
        absent = [r for r in range(self.world) if not self.store.check([gp.mark_key(self.g, "plan", r)])]
        if absent:
            r, why = absent[0], "never began to join it"
        else:
            r = (sorted(self.pending) or [0])[0]
            why = "had not taken its state" if self.pending else "did not commit"
        return Failure("hang", r, self.labels[r], f"generation {self.g} did not commit a step within "
                       f"{now - self.generation_at:.0f} s; rank {r} {why}", self._beat_step(r), now, noticed_at=now)

    def _completed(self) -> dict[str, Any] | Failure:
        if not self.result.is_file():
            return Failure("exit", 0, self.labels[0], "the ranks exited without a result", -1, time.time())
        return json.loads(self.result.read_text())

    # -- recovering -----------------------------------------------------------------------------------------
    def _recover(self, failure: Failure) -> Failure | None:
        """End the generation, replace its lost ranks and publish the next; a Failure when only a full restart
        can go on (no spare, no copy of the state, a rank already finished)."""
        noticed = failure.noticed_at or time.time()
        self.failures.append(failure)
        self._event({"event": "failure", "generation": self.g, **dataclasses.asdict(failure)})
        self.log(f"generation {self.g}: rank {failure.rank} ({failure.label}) failed: {failure.message}")
        culprit = self.ranks[failure.rank]
        if failure.kind == "hang" and culprit.exitcode is None:  # a hang or a stop becomes a crash: sockets close
            culprit.kill()
            culprit.join()
        commits = abort_undecided(self.store, self.g)
        self.store.set(gp.end_key(self.g), failure.message[:2000])
        ended = time.time()
        self.commits += commits
        self.step += commits
        codes = {r: p.exitcode for r, p in self.ranks.items() if p.exitcode is not None}
        if any(c == 0 for c in codes.values()):
            return self._fallback(failure, "a rank had already finished the run")
        if len(self.failures) > self.opts.max_restarts:
            raise SupervisorGaveUp(f"gave up after {self.opts.max_restarts} in-place recoveries; last failure: "
                                   f"rank {failure.rank} ({failure.label}): {failure.message}")
        lost = sorted(codes)
        self.established -= set(lost)  # a rank's state died with its process: whoever takes it over has none yet
        newcomers = sorted(set(lost) | (self.pending - self.established))  # a survivor's state is good
        why_disk = None
        if self.commits == 0 and not all(r in self.established for r in range(self.world) if r not in lost):
            source = "start"
        else:
            source, why_disk = self._memory_source(newcomers)
            if source is None:
                newest, _ = ckpt.newest_usable(self.out / "checkpoints")
                if newest is None:
                    return self._fallback(failure, f"{why_disk}, and no checkpoint exists")
                source, self.step = "disk", int(ckpt.load_meta(newest)["step"])
        asked = time.time()
        taken = self.pool.take(len(lost), self.opts.spare_wait_s, self._wait)
        if taken is None:
            return self._fallback(failure, f"no newcomer for rank(s) {', '.join(map(str, lost))}: "
                                           f"{self.pool.shortfall}")
        old_pids = {r: p.pid for r, p in self.ranks.items()}
        self.g += 1
        plan = gp.Plan(generation=self.g, world=self.world, newcomers=newcomers, source=source, step=self.step,
                       form_timeout_s=self._member_backstop(self.g))
        self.store.set(gp.plan_key(self.g), gp.encode(plan))
        for r, spare in zip(lost, taken):
            self.ranks[r] = spare.process
            (self.rundir / f"error{r}.json").unlink(missing_ok=True)
            self.store.set(gp.spare_assign_key(spare.sid), gp.encode(gp.Assignment(rank=r, generation=self.g)))
        self.store.set(gp.GEN, str(self.g))
        published = time.time()
        self.pool.refill()  # in the background: forked from the fork server when it is ready, else spawned
        self.pending, self.formed_at, self.generation_at = set(newcomers), None, published
        # which path supplied each newcomer; for one forked on demand, how long it took from the ask to ready
        swap = {r: {"old_pid": old_pids[r], "new_pid": s.process.pid, "spare": s.sid, "path": s.path,
                    "method": s.method, **({"ready_s": s.ready_at - asked} if s.path == "fork server" else {})}
                for r, s in zip(lost, taken)}
        self.replacements += [{"generation": self.g, "rank": r, **v} for r, v in swap.items()]
        self._event({"event": "generation", "generation": self.g, "source": source, "step": self.step,
                     "newcomers": newcomers, "replaced": swap, "pids": {r: p.pid for r, p in self.ranks.items()},
                     **({"why_disk": why_disk} if source == "disk" else {})})
        self.log(f"generation {self.g}: " + ", ".join(
            f"rank {r} ({self.labels[r]}) taken over by " + {
                "warm spare": f"warm spare {v['spare']} (pid {v['new_pid']})",
                "starting spare": f"spare {v['spare']} (pid {v['new_pid']}, ready during the wait)",
                "fork server": f"spare {v['spare']} forked on demand from the fork server (pid {v['new_pid']}, "
                               f"ready {v.get('ready_s', 0.0):.2f} s after the ask)"}[v["path"]]
            for r, v in swap.items()) + f"; state from {source}"
            + (f" (step {self.step}: {why_disk})" if source == "disk" else ""))
        fork_ready = [s.ready_at for s in taken if s.path == "fork server"]
        self.recovering = {"generation": self.g, "failed_generation": self.g - 1, "noticed_at": noticed,
                           "ended_at": ended, "asked_at": asked, "published_at": published, "source": source,
                           "lost": lost, "newcomers": newcomers, "step": self.step, "rank": failure.rank,
                           "kind": failure.kind, "paths": {r: v["path"] for r, v in swap.items()},
                           "forked_ready_at": max(fork_ready) if fork_ready else None,
                           **({"why_disk": why_disk} if source == "disk" else {})}
        return None

    def _memory_source(self, newcomers: list[int]) -> tuple[str | None, str]:
        """Where in memory every newcomer's state is, or (None, why not). "peer": a surviving DP peer holds it all
        (plain DP and AdamW; LAMB's update holds a collective, so a failure inside it can leave survivors
        half-updated); "peer+buddy" (ZeRO-1, whose DP peers hold different optimizer slices): a DP peer holds the
        replicated state and each newcomer's buddy a whole copy of its slice after the last committed step."""
        c = self.cfg
        if c.train.optimizer != "adamw":
            return None, f"optimizer {c.train.optimizer}: a failure inside its update can leave survivors half-updated"
        if sources(self.topo, newcomers) is None:
            return None, "no DP peer of a lost rank survived"
        if not c.parallel.zero:
            return "peer", ""
        if not self.opts.buddy_copy:
            return None, "ZeRO-1 without buddy copies (--no-buddy-copy): no peer holds a lost rank's slice"
        keepers = holders(self.topo, newcomers)
        if keepers is None:
            return None, "ZeRO-1: a lost rank's buddy (the DP peer keeping its optimizer slice) was lost too"
        for r, b in keepers.items():
            key = held_key(r)
            held = parse_held(self.store.get(key)) if self.store.check([key]) else None
            if held is None or held[1] != self.ranks[b].pid:
                return None, f"ZeRO-1: rank {b} holds no copy of rank {r}'s optimizer slice yet"
            if held[0] != self.step:
                return None, (f"ZeRO-1: rank {b}'s copy of rank {r}'s optimizer slice is of step {held[0]}, not of "
                              f"the last committed step {self.step} (the failure came between an update and the "
                              f"end of its copy)")
        return "peer+buddy", ""

    def _fallback(self, failure: Failure, why: str) -> Failure:
        self.log(f"no in-place recovery ({why}): restarting every rank")
        self._event({"event": "fallback", "generation": self.g, "why": why, "path": "restart"})
        return failure

    def _recovered(self) -> None:
        """The recovering generation committed its first step: record the recovery's timeline."""
        rec, g = self.recovering, self.recovering["generation"]
        self.recovering = None

        def marks(gen: int, what: str, ranks: list[int]) -> list[float]:
            keys = [gp.mark_key(gen, what, r) for r in ranks]
            return [gp.number(self.store.get(k), k) for k in keys if self.store.check([k])]

        survivors = [r for r in range(self.world) if r not in rec["lost"]]
        left = marks(rec["failed_generation"], "left", survivors)
        timeline = {"noticed": rec["noticed_at"], "survivors_out": max(left) if left else None,
                    "ended": rec["ended_at"], "asked": rec["asked_at"],
                    "forked_ready": rec["forked_ready_at"], "published": rec["published_at"],
                    "spare_ready": max(marks(g, "plan", rec["newcomers"]), default=None),
                    "groups_rebuilt": max(marks(g, "groups", list(range(self.world))), default=None),
                    "state_transferred": max(marks(g, "state", list(range(self.world))), default=None),
                    "first_commit": self.formed_at}
        out = {**rec, "timeline": timeline, "recovery_s": self.formed_at - rec["noticed_at"]}
        self.recoveries.append(out)
        self._event({"event": "recovered", **out})
        self.log(f"generation {g} committed its first step {out['recovery_s']:.2f} s after the failure was "
                 f"noticed (state from {rec['source']}; newcomers from "
                 + ", ".join(f"rank {r}: {path}" for r, path in rec["paths"].items()) + ")")

    def account(self) -> dict[str, Any]:
        """What this job's in-place recoveries did, for the run summary (its failures in order, the one that ended
        the job in a full restart included)."""
        return {"generations": self.g + 1, "failures": list(self.failures), "replacements": self.replacements,
                "inplace_recoveries": self.recoveries}

    def _event(self, record: dict[str, Any]) -> None:
        with self.events.open("a", encoding="utf-8") as f:
            f.write(json.dumps({"time": time.time(), "attempt": self.attempt, **record}, default=str) + "\n")
