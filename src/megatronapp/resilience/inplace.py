"""The processes of a job with in-place recovery: ranks that live through generations, and warm spares.

A rank (`rank_main`) joins generation 0, builds its `Trainer` and runs the engine's run loop with
`Member.rejoin` as its recovery handler: a failure of the generation sends it to the next one in the same
process, with model, optimizer and data position kept. A spare (`spare_main`) imports torch and the trainer,
says it is ready, and waits; given a rank, it joins that rank's generation as a newcomer, builds its trainer
(with no fault drill and no resume: its state comes from the plan), receives its state and runs from there.

Both report an error the way the engine's launcher does (`error<rank>.json` in the job's run directory, a file,
never a pipe) and end through `launch.exit_rank`.
"""
from __future__ import annotations

import dataclasses
import faulthandler
import json
import os
import signal
import time
import traceback
from pathlib import Path
from typing import Any

import torch

from megatronapp import launch, startup
from megatronapp.config import RunConfig, validate
from megatronapp.parallel import comm
from megatronapp.resilience import generation_protocol as gp
from megatronapp.resilience.member import Member
from megatronapp.train import loop
from megatronapp.train.loop import AfterStep
from megatronapp.train.trainer import Trainer


def enter(member: Member, cfg: RunConfig, g: int) -> tuple[Trainer, AfterStep | None]:
    """Join generation `g` (or a later one if it fails while forming) with a trainer holding the plan's state."""
    trainer: Trainer | None = None
    after: AfterStep | None = None
    while True:
        try:
            plan = member.join(g)
            if plan.source in ("peer", "peer+buddy") and trainer is None and member.rank not in plan.newcomers:
                # a process without state named a survivor: the plan is wrong; this rank fails (and is replaced)
                # rather than train from a fresh model beside peers that hold the run's state
                raise gp.ProtocolError(f"plan of generation {plan.generation}: rank {member.rank} holds no state "
                                       f"but is not among the newcomers {plan.newcomers}")
            if plan.source == "start" or trainer is None:  # build (again): nothing kept is known to be good
                if trainer is not None:
                    trainer.close()
                trainer = None
                comm.reset()
                comm.CONTEXT.new_generation(plan.generation)
                startup.phase("model build")
                # its groups from this generation's store (formed under the short timeout); a resume loads
                trainer = Trainer(cfg, member.rank, group_timeout=member.form_timeout)
                trainer.hooks.on("step_start", member.note_step)
                member.keep_slices(trainer)
            else:
                member.regroup(trainer, plan.generation)
            return trainer, member.settle_in(trainer, plan, after)
        except Exception as e:  # noqa: BLE001 - the generation failed while forming: join the next one
            step = trainer.step if trainer is not None else 0
            if not member.generation_failure(e, step):
                raise
            member.leave(f"{type(e).__name__}: {e}", step)
            if trainer is not None:
                after = member.drop(trainer, after)
            g = member.next_generation(member.g)


def _run(member: Member, cfg: RunConfig, g: int, result_path: str | None) -> None:
    trainer, after = enter(member, cfg, g)
    loop.run(trainer, member.world, result_path, recover=lambda e, a: member.rejoin(trainer, e, a), resume=after)


def _process(rank: int, rundir: str, threads: int, env: dict[str, str], body: Any) -> None:
    """The common frame of a rank or spare process: environment, threads, error file, exit."""
    os.environ.update(env)
    torch.set_num_threads(threads)
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 PID`: every thread's stack on stderr
    code = 0
    try:
        body()
    except BaseException as e:  # report which rank failed (through a file); the supervisor replaces it
        Path(rundir, f"error{rank}.json").write_text(json.dumps(
            {"rank": rank, "message": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc(),
             "time": time.time()}))
        code = 1
    launch.exit_rank(code)


def rank_main(rank: int, world: int, cfg_dict: dict[str, Any], port: int, result_path: str, rundir: str,
              threads: int, env: dict[str, str]) -> None:
    """A rank of generation 0."""
    def body() -> None:
        cfg = RunConfig.from_dict(cfg_dict)
        validate(cfg, world)
        startup.phase("process groups")
        member = Member(port, rank, world, launch.pick_backend(cfg.parallel.backend))
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
        _run(member, cfg, 0, result_path)

    _process(rank, rundir, threads, env, body)


def spare_main(sid: int, world: int, cfg_dict: dict[str, Any], port: int, result_path: str, rundir: str,
               threads: int, env: dict[str, str]) -> None:
    """A warm spare: ready once torch and the trainer are imported; a rank once the supervisor assigns one."""
    cfg = RunConfig.from_dict(cfg_dict)
    # no fault drill (a drill fires once, in the rank it was given to) and no resume: the plan gives the state
    cfg = dataclasses.replace(cfg, inject=[], train=dataclasses.replace(cfg.train, resume=None))
    validate(cfg, world)
    member = Member(port, None, world, launch.pick_backend(cfg.parallel.backend))
    member.control.set(gp.spare_ready_key(sid), repr(time.time()))
    order = gp.read(member.control, gp.spare_assign_key(sid), gp.Assignment)
    member.rank = order.rank

    def body() -> None:
        os.environ.update(RANK=str(order.rank), WORLD_SIZE=str(world), LOCAL_RANK=str(order.rank))
        _run(member, cfg, order.generation, result_path)

    _process(order.rank, rundir, threads, env, body)
