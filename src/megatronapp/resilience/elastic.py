"""One rank of a supervised multi-host job: `torchrun ... -m megatronapp train --heartbeat-dir DIR`.

torchrun's elastic agent on each host starts the workers and, when one fails, restarts every worker of every
host through a new rendezvous round (up to its `--max-restarts`). Before training, the workers of a round agree
on what the round is (`prepare`):

- its number: the driver's decisions written so far (`decision.rounds_decided`, read by rank 0), so each rank
  polls for the one decision that can stop this round;
- whether it is a restart: any rank's TORCHELASTIC_RESTART_COUNT > 0, any decision written, or an earlier start
  recorded (`fence.py`). torchrun counts restarts per host, and a host whose workers were restarted because
  another host's failed does not count them, so one host's count alone cannot tell; the maximum over all ranks
  can. A membership change (a standby host replacing a lost one) counts on no host at all: only the start record
  tells that this start is not the job's first;
- on a restart, the checkpoint to resume: rank 0 picks the newest complete one under `<out>/checkpoints` whose
  files pass their checksums (a torn newest one is skipped, and said) and every rank takes its choice, so all
  hosts load the same step. Fault drills (`--inject`) are dropped: a drill fires once, as under --supervise.

Rank 0 then records this start as the current one (`fence.write`: round, start id, every node's address) before
any rank learns the start id, so a rank of a replaced start sees it was replaced. Then the heartbeat agent is
attached with the round, the start and this host's address and node in its environment.
"""
from __future__ import annotations

import dataclasses
import os
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import torch.distributed as dist

from megatronapp import faults
from megatronapp.config import ConfigError, RunConfig
from megatronapp.launch import init_distributed
from megatronapp.multihost import source_address
from megatronapp.resilience import agent, decision, fence
from megatronapp.train import checkpoint as ckpt

AGENT_PLUGIN = "megatronapp.resilience.agent:plugin"


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or "GROUP_RANK" in os.environ


def plan_round(restart_counts: list[int], decided: int, out: Path, resume: str | None, earlier_start: bool = False
               ) -> tuple[int, bool, str | None, list[str]]:
    """(round, restarted, checkpoint to resume, notes) from every rank's torchrun restart count, the decisions
    written and whether an earlier start was recorded; run on rank 0."""
    restarted = max(restart_counts, default=0) > 0 or decided > 0 or earlier_start
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
    addr, node = host_address(), int(os.environ.get("GROUP_RANK", "0") or 0)
    mine = (int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")), addr, node)
    every: list[Any] = [None] * world
    dist.all_gather_object(every, mine)
    plan: list[Any] = [None]
    if rank == 0:
        earlier = _earlier_start(hb_dir)
        plan[0] = plan_round([c for c, _, _ in every], decision.rounds_decided(hb_dir), Path(cfg.train.out),
                             cfg.train.resume, earlier)
        # this start of the workers: torchrun may restart them within a round (a worker crashed, or a standby host
        # replaced a lost one; no decision), and the watcher must then give the new start its start-up allowance;
        # recorded before any rank learns its id, so every rank of an older start can see it was replaced
        start = uuid.uuid4().hex[:12]
        fence.write(hb_dir, fence.Start(plan[0][0], start, time.time(), os.environ.get("TORCHELASTIC_RUN_ID", ""),
                                        {n: a for _, a, n in every}))
        plan.append(start)
    else:
        plan.append(None)
    dist.broadcast_object_list(plan, src=0)
    (round_, restarted, resume, notes), start_id = plan[0], plan[1]
    # a drill fires once; a kill-save drill that names this torchrun restart is this restart's
    kept = faults.armed_in_restart(cfg.inject, int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0))
    if rank == 0:
        for note in notes:
            print(f"megatronapp: checkpoint {note}", file=sys.stderr, flush=True)
        if restarted:
            hosts = ", ".join(f"node {n}: {a}" for n, a in sorted({n: a for _, a, n in every}.items()))
            print(f"megatronapp: round {round_} (torchrun restart counts {sorted({c for c, _, _ in every})}): "
                  f"resuming from {Path(resume).name if resume else 'scratch (no checkpoint yet)'}; fault drills "
                  f"off" + (f" but this restart's: {', '.join(kept)}" if kept else "") + f"; hosts {hosts}",
                  file=sys.stderr, flush=True)
    os.environ.update({agent.DIR_ENV: str(hb_dir), agent.PERIOD_ENV: str(heartbeat_s),
                       agent.ROUND_ENV: str(round_), agent.START_ENV: start_id, agent.ADDR_ENV: addr,
                       agent.NODE_ENV: str(node)})
    run = dataclasses.replace(cfg, attach=list(dict.fromkeys([*cfg.attach, AGENT_PLUGIN])))
    if restarted:
        run.inject = kept
    run.train = dataclasses.replace(cfg.train, resume=resume)
    return run


def host_address() -> str:
    """The address this host reaches rank 0's host from (MASTER_ADDR; on rank 0's host, its own): the host's
    name for the watcher, since in containers and namespaces every host may have the same host name."""
    master = os.environ.get("MASTER_ADDR", "127.0.0.1")
    return source_address(master, int(os.environ.get("MASTER_PORT", "29500") or 29500)) or master


def _earlier_start(hb_dir: Path) -> bool:
    """Whether a start of this job was recorded before (a bad record counts: something started here)."""
    try:
        return fence.read(hb_dir) is not None
    except fence.StartError as e:
        print(f"megatronapp: {e}; taking this start as a restart", file=sys.stderr, flush=True)
        return True
