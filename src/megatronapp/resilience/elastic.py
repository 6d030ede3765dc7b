"""One rank of a supervised multi-host job: `torchrun ... -m megatronapp train --heartbeat-dir DIR`.

torchrun's elastic agent on each host starts the workers and, when one fails, restarts every worker of every
host through a new rendezvous round (up to its `--max-restarts`). Before training, the workers of a round agree
on what the round is (`prepare`):

- its number: the driver's decisions written so far (`decision.rounds_decided`, read by rank 0), so each rank
  polls for the one decision that can stop this round;
- whether it is a restart: any rank's TORCHELASTIC_RESTART_COUNT > 0 or any decision written. torchrun counts
  restarts per host, and a host whose workers were restarted because another host's failed does not count
  them, so one host's count alone cannot tell; the maximum over all ranks can;
- on a restart, the checkpoint to resume: rank 0 picks the newest complete one under `<out>/checkpoints` whose
  files pass their checksums (a torn newest one is skipped, and said) and every rank takes its choice, so all
  hosts load the same step. Fault drills (`--inject`) are dropped: a drill fires once, as under --supervise.

Then the heartbeat agent is attached with the round in its environment.
"""
from __future__ import annotations

import dataclasses
import os
import sys
import uuid
from pathlib import Path
from typing import Any

import torch.distributed as dist

from megatronapp import faults
from megatronapp.config import ConfigError, RunConfig
from megatronapp.launch import init_distributed
from megatronapp.resilience import agent, decision
from megatronapp.train import checkpoint as ckpt

AGENT_PLUGIN = "megatronapp.resilience.agent:plugin"


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or "GROUP_RANK" in os.environ


def plan_round(restart_counts: list[int], decided: int, out: Path, resume: str | None
               ) -> tuple[int, bool, str | None, list[str]]:
    """(round, restarted, checkpoint to resume, notes) from every rank's torchrun restart count and the decisions
    written; run on rank 0."""
    restarted = max(restart_counts, default=0) > 0 or decided > 0
    notes: list[str] = []
    if restarted:
        newest, notes = ckpt.newest_usable(out / "checkpoints")
        if newest is not None:
            resume = str(newest)
    return decided, restarted, resume, notes


def prepare(cfg: RunConfig, heartbeat_dir: str, heartbeat_s: float) -> RunConfig:
    """Join the torchrun job, agree on the round with every rank, and return this rank's config for it."""
    if not under_torchrun():
        raise ConfigError("--heartbeat-dir is for ranks started by torchrun (a multi-host job watched by "
                          "`megatronapp resilience watch`); on one host use --supervise --nproc N")
    if heartbeat_s <= 0:
        raise ConfigError(f"--heartbeat-interval {heartbeat_s}: must be > 0 seconds")
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # Seen on torch 2.13 (gloo): with the rendezvous TCP store shared, a restarted round's workers read the
        # previous round's process-group keys (peer addresses) and fail connecting to dead peers, so every restart
        # fails. Without sharing, rank 0 of each round hosts a fresh store.
        raise ConfigError("--heartbeat-dir: torchrun shares its rendezvous TCP store with the workers, and a "
                          "restarted round then reads the previous round's process-group keys and cannot connect; "
                          "start torchrun with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in its environment on every "
                          "host")
    hb_dir = Path(heartbeat_dir)
    hb_dir.mkdir(parents=True, exist_ok=True)
    rank, world = init_distributed(cfg.parallel.backend)
    counts: list[Any] = [None] * world
    dist.all_gather_object(counts, int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")))
    plan: list[Any] = [None]
    if rank == 0:
        plan[0] = plan_round(counts, decision.rounds_decided(hb_dir), Path(cfg.train.out), cfg.train.resume)
    dist.broadcast_object_list(plan, src=0)
    round_, restarted, resume, notes = plan[0]
    # this start of the workers: torchrun may restart them within a round (a worker crashed, no decision), and the
    # driver must then give the new start its start-up allowance instead of judging it by the old clock
    start_id: list[Any] = [uuid.uuid4().hex[:12] if rank == 0 else None]
    dist.broadcast_object_list(start_id, src=0)
    # a drill fires once; a kill-save drill that names this torchrun restart is this restart's
    kept = faults.armed_in_restart(cfg.inject, int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0))
    if rank == 0:
        for note in notes:
            print(f"megatronapp: checkpoint {note}", file=sys.stderr, flush=True)
        if restarted:
            print(f"megatronapp: round {round_} (torchrun restart counts {sorted(set(counts))}): resuming from "
                  f"{Path(resume).name if resume else 'scratch (no checkpoint yet)'}; fault drills off"
                  + (f" but this restart's: {', '.join(kept)}" if kept else ""),
                  file=sys.stderr, flush=True)
    os.environ.update({agent.DIR_ENV: str(hb_dir), agent.PERIOD_ENV: str(heartbeat_s),
                       agent.ROUND_ENV: str(round_), agent.START_ENV: start_id[0]})
    run = dataclasses.replace(cfg, attach=list(dict.fromkeys([*cfg.attach, AGENT_PLUGIN])))
    if restarted:
        run.inject = kept
    run.train = dataclasses.replace(cfg.train, resume=resume)
    return run
