"""A rank's membership of the job's generations: join one, leave it on a failure, join the next in the same process.

The supervisor owns the store and the generation number (`generations.py`); a rank talks to it over two
long-lived connections made before any generation (`control`: plans, reports, outcomes; `watch`: a thread blocked
until the supervisor ends the rank's generation) and one connection per generation (its process groups' store,
under the generation's prefix, and its step commits). Both long-lived connections exist before a generation's
first socket, so leaving a generation (`sockets.GenerationSockets.leave`) never shuts them.

Leaving a generation, in order: release its sockets (the receiving side of each is shut: this rank's blocked
operations fail; the connections stay open for its peers, each released by its own watcher or thread, until this
rank's groups of the next generation exist: `sockets.py`), report `Left`, drop the step in progress
(`Trainer.drop_step`: reducer, pipeline links, an unfinished save; RNG back to the step's start if the step was not
committed), destroy the process groups. Joining the next: wait for its plan, make its process groups from its
store prefix, give this rank's existing groups the new ones (`topology.adopt`: model, optimizer, data iterator
and every object holding a group stay as they are), take the state the plan says (a newcomer from a DP peer,
`handover.py`, with ZeRO-1 its optimizer slice from its buddy, `buddy.py`; everyone from the newest checkpoint
when memory holds no copy), and hand the commit point to the
trainer. A failure while joining (a newcomer or survivor dying during the recovery) is left the same way, and the
rank waits for the generation after.
"""
from __future__ import annotations

import datetime
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist

from megatronapp.parallel import comm
from megatronapp.parallel import topology as topology_mod
from megatronapp.resilience import generation_protocol as gp
from megatronapp.resilience.buddy import BUDDY_ENV, BuddyCopy
from megatronapp.resilience.commit import StepAborted, StepCommit
from megatronapp.resilience.handover import hand_over
from megatronapp.resilience.sockets import GenerationSockets
from megatronapp.train import checkpoint as ckpt
from megatronapp.train.loop import AfterStep

WEEK = datetime.timedelta(days=7)


def connect(port: int, timeout: datetime.timedelta) -> dist.TCPStore:
    """A client connection to the supervisor's store on 127.0.0.1."""
    return dist.TCPStore("127.0.0.1", port, None, False, timeout=timeout)


class GenerationEnded(RuntimeError):
    """The generation this rank is joining ended before the rank was in it."""


class Member:
    """This process's part in the job's generations, as rank `rank` (a spare learns its rank later)."""

    def __init__(self, port: int, rank: int | None, world: int, backend: str, timeout_s: float = 300.0,
                 victim_wait_s: float = 60.0, form_timeout_s: float = 30.0):
        self.port, self.rank, self.world, self.backend = port, rank, world, backend
        self.timeout = datetime.timedelta(seconds=timeout_s)
        # A group's timeout while it forms, the backstop of its rendezvous (each generation's plan sets it past
        # the supervisor's own judgement of the generation); the groups get `timeout` once they exist. A pair
        # whose peer died before connecting waits five times it in `Pair::connect` (gloo's listening side): the
        # generation's end releases that wait (`sockets.py`), not this timeout.
        self.form_timeout = datetime.timedelta(seconds=form_timeout_s)
        self.victim_wait_s = victim_wait_s  # a rank whose collective failed waits this long for the generation's end
        self.control = connect(port, WEEK)
        self._watch_store = connect(port, WEEK)
        self.g = -1  # the generation joined (or being joined)
        self.store: Any = None  # the generation's own connection
        self.commit: StepCommit | None = None
        self._lock = threading.Condition()
        self._sockets: GenerationSockets | None = None
        self._retired: list[GenerationSockets] = []  # earlier generations' sockets, closed once the next one formed
        self._shut = self._reported = True
        self.rng: dict[str, Any] | None = None  # RNG at the start of step `rng_step` (its state if it is dropped)
        self.rng_step = -1
        self.buddy: BuddyCopy | None = None  # ZeRO-1: the per-step copy of the slices (`keep_slices`)
        threading.Thread(target=self._watch, name="generation-watch", daemon=True).start()

    # -- the supervisor's word ------------------------------------------------------------------------------
    def next_generation(self, after: int) -> int:
        """The first generation newer than `after` the supervisor names (waits for it)."""
        deadline = time.monotonic() + self.timeout.total_seconds()
        while True:
            g = gp.number(self.control.get(gp.GEN), gp.GEN, int)
            if g > after:
                return g
            if time.monotonic() > deadline:
                raise TimeoutError(f"rank {self.rank}: the supervisor named no generation after {after} within "
                                   f"{self.timeout.total_seconds():.0f} s")
            time.sleep(0.005)

    def ended(self, g: int) -> bool:
        return bool(self.control.check([gp.end_key(g)]))

    def mark(self, what: str) -> None:
        """Tell the supervisor when this rank reached a part of joining its generation (the recovery's split)."""
        self.control.set(gp.mark_key(self.g, what, self.rank), repr(time.time()))

    # -- joining and leaving --------------------------------------------------------------------------------
    def join(self, g: int) -> gp.Plan:
        """Join generation `g`: its plan, its store connection, its default process group."""
        plan = gp.read(self.control, gp.plan_key(g), gp.Plan)
        if plan.world != self.world or plan.generation != g:
            raise gp.ProtocolError(f"store key {gp.plan_key(g)}: a plan for generation {plan.generation} of "
                                   f"{plan.world} ranks; this job has {self.world}")
        self.form_timeout = datetime.timedelta(seconds=plan.form_timeout_s)  # past the supervisor's judgement
        trace(self, "join", g=g)
        with self._lock:
            self.g, self._shut, self._reported = g, False, False
            if self._sockets is not None:
                self._retired.append(self._sockets)
            self._sockets = GenerationSockets(self.world)  # before the generation's first connection
            self._lock.notify_all()
        self.mark("plan")
        self.store = connect(self.port, self.timeout)
        with self._lock:
            self._sockets.forming()
            released = self._shut
        if released:  # the generation ended before its store connection existed: nothing would release it now
            raise GenerationEnded(f"generation {g} ended while rank {self.rank} joined it")
        restart_group_names()
        dist.init_process_group(self.backend, store=dist.PrefixStore(gp.prefix(g), self.store), rank=self.rank,
                                world_size=self.world, timeout=self.form_timeout)
        self.mark("joined")
        trace(self, "joined")
        self.commit = StepCommit(self.store, self.control, g, self.world)
        return plan

    def leave(self, why: str, step: int) -> None:
        """Leave the current generation (idempotent): release its operations, report, destroy its groups.
        Every socket of the generation is shut down here, even one whose groups were still forming when the
        generation's end released it (then only its store connection was shut and its listeners answered): the
        rank is out of the generation's operations now. The connections stay open for the peers until this rank's
        groups of the next generation exist (`sockets.py`, "Why the connections stay open"): a live peer whose
        groups formed over a pair of a half-made group is released by its own watcher, as the generation ended."""
        self._release(whole=True)
        trace(self, "leave", why=why[:120])
        with self._lock:
            report, self._reported = not self._reported, True
        if report:
            try:
                self.control.set(gp.left_key(self.g, self.rank),
                                 gp.encode(gp.Left(generation=self.g, rank=self.rank, step=step, reason=why[:2000])))
                self.mark("left")
            except Exception as e:  # noqa: BLE001 - the supervisor is gone: nothing to rejoin
                _exit(f"rank {self.rank}: cannot report to the supervisor's store ({e}); exiting")
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001, S110 - groups aborted (NCCL) or half made: nothing left to release
                pass

    def formed(self, topo: Any) -> None:
        """Every process group of the generation exists (the default one and `topo`'s): they get the operations'
        timeout, and leaving the generation now shuts down all of its sockets."""
        groups = {id(g.pg): g.pg for g in [*topo.groups.values(), *topo.links.values()] if g.pg is not None}
        for pg in groups.values():
            dist.distributed_c10d._set_pg_timeout(self.timeout, pg)
        with self._lock:
            self._sockets.formed()
            ended = self._shut
            if ended:  # the generation ended while its groups formed: only the store connection was shut then
                self._sockets.leave()
            else:  # every member joined this generation: none operates on an earlier one's connections any more
                for old in self._retired:
                    old.close()
                self._retired.clear()
        trace(self, "formed", ended=ended)
        if ended:
            raise GenerationEnded(f"generation {self.g} ended while rank {self.rank} formed its groups")
        self.mark("groups")

    def _release(self, whole: bool = False, by: str = "main") -> None:
        """Release the generation's operations (`GenerationSockets.leave`). `whole`: every socket of the generation,
        also while its groups form (the caller is out of them); once done, nothing more is left to release."""
        with self._lock:
            s = self._sockets
            if s is None or (self._shut and (not whole or s.whole_left)):
                return
            self._shut = True
            if whole:
                s.formed()
            n = s.leave()
            trace(self, "release", by=by, whole=s.whole_left, sockets=n)

    def _watch(self) -> None:
        """Wait for the end of each generation this rank joins; release its operations when it comes."""
        g = 0
        while True:
            with self._lock:
                while self.g < g:
                    self._lock.wait()
            try:
                self._watch_store.wait([gp.end_key(g)], WEEK)
            except Exception as e:  # noqa: BLE001
                if "timeout" in str(e).lower():
                    continue
                _exit(f"rank {self.rank}: lost the supervisor's store ({e}); exiting")
            # the check and the release under one lock: otherwise the main thread may join g + 1 in between, and the
            # generation released would be the new one (the Condition's lock is re-entrant)
            with self._lock:
                trace(self, "end seen", ended=g)
                if self.g == g:
                    self._release(by="watcher")
            g += 1

    # -- a failure ------------------------------------------------------------------------------------------
    def generation_failure(self, exc: BaseException, step: int) -> bool:
        """Whether `exc` ended this rank's generation (the rank then rejoins) rather than being its own error.
        A failed collective or store operation is reported at once and counts once the supervisor ends the
        generation (within `victim_wait_s`)."""
        if isinstance(exc, StepAborted) or self.ended(self.g):
            return True
        if not isinstance(exc, (RuntimeError, OSError, TimeoutError)):
            return False
        self.leave(f"{type(exc).__name__}: {exc}", step)
        deadline = time.monotonic() + self.victim_wait_s
        while time.monotonic() < deadline:
            if self.ended(self.g):
                return True
            time.sleep(0.01)
        return False

    def keep_slices(self, trainer: Any) -> None:
        """ZeRO-1 over dp > 1: copy this rank's optimizer slice to its buddy after each step, keep its ward's
        (`buddy.py`), at each step's start, a point every rank passes once per step in the same order."""
        p = trainer.cfg.parallel
        if not p.zero or p.dp < 2 or os.environ.get(BUDDY_ENV, "1") == "0":
            self.buddy = None
            return
        self.buddy = BuddyCopy(trainer, lambda key, value: self.control.set(key, value))
        trainer.hooks.on("step_start", self.buddy.copy)

    def note_step(self, step: int) -> None:
        """`step_start` hook: the RNG state a dropped step returns to."""
        self.rng, self.rng_step = ckpt.rng_state(), step

    def drop(self, trainer: Any, after: AfterStep | None) -> AfterStep | None:
        """Forget the step in progress (its update was not applied, or was and is kept: the commit decides)."""
        abandoned = trainer.drop_step()
        if self.buddy is not None:
            self.buddy.drop()  # a copy cut off is never used
        if self.rng is not None and self.rng_step == trainer.step:  # the step was not committed
            ckpt.set_rng_state(self.rng)
        if after is not None and abandoned == after.step and after.done >= 2:
            after = AfterStep(after.step, after.record, 1, after.ran_here)  # its save never completed: again
        return after

    def take_state(self, trainer: Any, plan: gp.Plan, after: AfterStep | None) -> AfterStep | None:
        """The state the plan says, once the generation's groups exist; returns where this rank now stands."""
        if plan.source == "peer":
            return hand_over(trainer, plan.newcomers, after)
        if plan.source == "peer+buddy":
            if self.buddy is None:
                raise gp.ProtocolError(f"plan of generation {plan.generation}: state from buddies, but this rank "
                                       f"keeps no copies (not ZeRO-1 over dp > 1, or the copies are off)")
            return hand_over(trainer, plan.newcomers, after, buddy=self.buddy)
        if self.buddy is not None:
            self.buddy.forget()  # every rank builds again or loads a checkpoint: no held copy is of that state
        if plan.source == "disk":
            d = ckpt.step_dir(Path(trainer.out) / "checkpoints", plan.step)
            if not ckpt.is_complete(d):
                raise gp.ProtocolError(f"plan of generation {plan.generation}: checkpoint step {plan.step} is not "
                                       f"complete in {d.parent}")
            trainer.load(d)
            return AfterStep(trainer.step)
        return after

    def regroup(self, trainer: Any, generation: int) -> None:
        """A kept trainer's groups made again from `generation`'s store; the objects that hold the old ones keep
        their `Group`s (`topology.adopt`)."""
        comm.CONTEXT.new_generation(generation)
        p = trainer.cfg.parallel
        topology_mod.adopt(trainer.topo, topology_mod.build(p.tp, p.pp, p.dp, trainer.rank,
                                                            timeout=self.form_timeout))

    def settle_in(self, trainer: Any, plan: Any, after: AfterStep | None) -> AfterStep | None:
        """The generation's groups exist: say so, take the plan's state, and commit steps through this member."""
        self.formed(trainer.topo)
        after = self.take_state(trainer, plan, after)
        self.mark("state")
        trainer.commit = self.commit
        return after

    def rejoin(self, trainer: Any, exc: BaseException, after: AfterStep) -> AfterStep | None:
        """The run loop's recovery handler (`loop.Recover`): None for an error that is this rank's own."""
        if not self.generation_failure(exc, trainer.step):
            return None
        why = f"{type(exc).__name__}: {exc}"
        while True:
            self.leave(why, trainer.step)
            after = self.drop(trainer, after)
            try:
                plan = self.join(self.next_generation(self.g))
                self.regroup(trainer, plan.generation)
                return self.settle_in(trainer, plan, after)
            except Exception as e:  # noqa: BLE001 - a failure during the recovery: the next generation
                if not self.generation_failure(e, trainer.step):
                    raise
                # its message, not the exception: the traceback holds the frames that hold the half-made groups
                # (and their listeners, where a late peer's connection would wait unread) while the next one forms
                why = f"{type(e).__name__}: {e}"


def trace(member: Member, what: str, **more: Any) -> None:
    """A line per membership transition into `$MEGATRONAPP_MEMBER_TRACE/member-<pid>.txt` when that variable names
    a folder (off by default): for following a recovery drill rank by rank."""
    folder = os.environ.get("MEGATRONAPP_MEMBER_TRACE")
    if not folder:
        return
    with open(Path(folder, f"member-{os.getpid()}.txt"), "a") as f:
        f.write(f"{time.time():.3f} rank={member.rank} g={member.g} {threading.current_thread().name}: {what} "
                f"{more}\n")


def restart_group_names() -> None:
    """Make this process name its next default group as every other member of a generation names it ("0").

    torch names a process group from a process-wide counter (its store keys start with the name) and resets the
    counter only when a formed WORLD group is destroyed. An `init_process_group` that failed (a generation that
    ended while it formed) leaves the counter advanced and no group to destroy: this rank would then wait for keys
    of another name than a newcomer's or a survivor's whose last generation formed, and the generation would never
    form. There is no public reset, so the counter is set where torch's own destroy sets it."""
    if dist.is_initialized():
        raise RuntimeError("a generation's default group is joined only after the previous one was destroyed")
    dist.distributed_c10d._world.group_count = 0


def _exit(msg: str) -> None:
    print(f"megatronapp: {msg}", file=sys.stderr, flush=True)
    os._exit(1)
