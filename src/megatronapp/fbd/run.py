"""Run a MegaFBD job: `megatronapp train --fbd ...` lands here (the engine's `train()` dispatches by import path).

Ranks 0..Wb-1 are the backward layout, the ranks after them the forward instances (fbd/layout.py). Rank 0, a
backward rank, writes metrics.jsonl and summary.json like the coupled trainer, with the same losses.
"""
from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megatronapp.config import ConfigError, RunConfig, plugin_entries, validate
from megatronapp.fbd.backward import BackwardRank
from megatronapp.fbd.forward import ForwardRank
from megatronapp.fbd.groups import build as build_groups
from megatronapp.fbd.layout import FbdLayout
from megatronapp.parallel import comm
from megatronapp.train.metrics import MetricsLog, Progress, peak_memory_bytes


def layout_of(cfg: RunConfig) -> FbdLayout:
    p = cfg.parallel
    return FbdLayout(tp=p.tp, pp=p.pp, dp=p.dp, vpp=p.vpp, tp_f=p.fbd_forward_tp, pp_f=p.fbd_forward_pp,
                     n_f=p.fbd_forward_instances, microbatches=p.microbatches)


def build_rank(cfg: RunConfig, rank: int) -> BackwardRank | ForwardRank | None:
    """This rank's role in the job (None: a rank beyond the job, as in shared test launches). Creates every
    process group of the job, so all ranks of the world must call it."""
    if cfg.train.hf_checkpoint or cfg.train.resume:
        raise ConfigError("MegaFBD does not load train.hf_checkpoint or train.resume yet; drop --fbd or those flags")
    comm.set_semantics(cfg.parallel.comm_semantics)
    layout = layout_of(cfg)
    world = dist.get_world_size() if dist.is_initialized() else 1
    if world < layout.total:
        raise ConfigError(f"MegaFBD needs {layout.total} ranks (parallel.total_ranks), this world has {world}; "
                          f"set --nproc {layout.total}")
    groups = build_groups(layout, rank)
    device = torch.device("cuda", torch.cuda.current_device()) if (
        dist.is_initialized() and dist.get_backend() == "nccl") else torch.device("cpu")
    if rank >= layout.total:
        return None
    if layout.is_forward(rank):
        return ForwardRank(cfg, layout, groups, rank, device)
    return BackwardRank(cfg, layout, groups, device)


def run_rank(rank: int, world: int, cfg_dict: dict[str, Any], result_path: str | None = None) -> dict[str, Any]:
    """Entry point of one rank of a MegaFBD job."""
    cfg = RunConfig.from_dict(cfg_dict)
    validate(cfg, world)
    comm.reset()
    r = build_rank(cfg, rank)
    if r is None:
        return {}
    t = cfg.train
    lead = rank == 0
    out = Path(t.out)
    log = MetricsLog(out / "metrics.jsonl") if lead else None
    progress = Progress(t.steps, enabled=lead and t.progress)
    tb = None
    if lead and t.tensorboard:  # the engine's writer, imported only with the flag
        from megatronapp.train.tensorboard import TensorBoardLog

        tb = TensorBoardLog(t.tensorboard)
    tokens_per_step = t.global_batch_size * t.seq_len
    history: list[dict[str, float]] = []
    t_start = time.perf_counter()
    try:
        while r.step < t.steps:
            rec = r.train_step()
            if r.role != "backward":
                continue
            rec.update(step=r.step, tokens_per_s=tokens_per_step / rec["step_time"],
                       mem_bytes=peak_memory_bytes(r.device))
            history.append(rec)
            if lead:
                log.log(rec)
                if tb is not None:
                    tb.log(rec)
                progress.update(r.step, rec["loss"], rec["tokens_per_s"], 0.0, rec["mem_bytes"], rec["lr"])
    finally:
        r.close()
        if log is not None:
            log.close()
        if tb is not None:
            tb.close()
    wall = time.perf_counter() - t_start
    summary = {"steps": r.step, "role": r.role, "world_size": world, "out": str(out),
               "first_loss": history[0]["loss"] if history else math.nan,
               "final_loss": history[-1]["loss"] if history else math.nan,
               "losses": [h["loss"] for h in history], "tokens_per_s": tokens_per_step * r.step / wall,
               "peak_mem_bytes": peak_memory_bytes(r.device)}
    if lead:
        progress.close({k: v for k, v in summary.items() if k != "losses"})
        (out / "summary.json").write_text(json.dumps(summary, indent=2))
        if result_path:
            Path(result_path).write_text(json.dumps(summary))
    return summary


def train(cfg: RunConfig, threads: int | None = None) -> dict[str, Any]:
    """Run a MegaFBD job on local ranks: the backward layout plus the forward instances."""
    from megatronapp.launch import pick_backend, spawn

    validate(cfg)
    if plugin_entries(cfg):
        raise ConfigError(f"MegaFBD runs attach no plug-ins yet (--trace, --inject, --scope-port, --attach: "
                          f"{plugin_entries(cfg)}); drop them or --fbd")
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        raise ConfigError("MegaFBD runs on local ranks only for now (not under torchrun); start it without torchrun")
    Path(cfg.train.out).mkdir(parents=True, exist_ok=True)
    world = cfg.parallel.total_ranks
    result = Path(cfg.train.out) / ".result.json"
    result.unlink(missing_ok=True)
    spawn(run_rank, world, cfg.to_dict(), str(result), backend=pick_backend(cfg.parallel.backend),
          threads=threads or max(1, (os.cpu_count() or 1) // world))
    return json.loads(result.read_text())
