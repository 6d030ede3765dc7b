"""Run a MegaFBD job: `megatronapp train --fbd ...` lands here (the engine's `train()` dispatches by import path).

Ranks 0..Wb-1 are the backward layout, the ranks after them the forward instances (fbd/layout.py). Each rank
runs the engine's run loop (`train/loop.py`) around its role, seen through `fbd/host.RankHost`: rank 0, a
backward rank, writes metrics.jsonl and summary.json like the coupled trainer, with the same losses, validation
loss and MFU counting; every rank, of either role, attaches the run's plug-ins (`--trace`, `--inject`,
`--attach`) and fires the engine's lifecycle hooks; backward ranks save and resume with the engine's checkpoint
code.
"""
from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megatronapp import gpu_setup
from megatronapp.config import ConfigError, RunConfig, plugin_entries, validate
from megatronapp.fbd.backward import BackwardRank
from megatronapp.fbd.forward import ForwardRank
from megatronapp.fbd.groups import build as build_groups
from megatronapp.fbd.host import RankHost
from megatronapp.fbd.layout import FbdLayout, weight_plan
from megatronapp.fbd.weights import param_specs
from megatronapp.parallel import comm
from megatronapp.train import checkpoint as ckpt
from megatronapp.train import loop, plugins
from megatronapp.train.trainer import prepare_gpu_launch


def layout_of(cfg: RunConfig) -> FbdLayout:
    p = cfg.parallel
    return FbdLayout(tp=p.tp, pp=p.pp, dp=p.dp, vpp=p.vpp, tp_f=p.fbd_forward_tp, pp_f=p.fbd_forward_pp,
                     n_f=p.fbd_forward_instances, microbatches=p.microbatches)


def build_rank(cfg: RunConfig, rank: int) -> BackwardRank | ForwardRank | None:
    """This rank's role in the job (None: a rank beyond the job, as in shared test launches). Creates every
    process group of the job, so all ranks of the world must call it. With `train.resume`, backward ranks load
    their checkpoint files and forward ranks take the step from it."""
    if cfg.train.hf_checkpoint:
        raise ConfigError("MegaFBD does not load train.hf_checkpoint yet; drop --fbd or --hf")
    comm.set_semantics(cfg.parallel.comm_semantics)
    layout = layout_of(cfg)
    world = dist.get_world_size() if dist.is_initialized() else 1
    if world < layout.total:
        raise ConfigError(f"MegaFBD needs {layout.total} ranks (parallel.total_ranks), this world has {world}; "
                          f"set --nproc {layout.total}")
    plan = weight_plan(layout, param_specs(cfg.model, layout))
    groups = build_groups(layout, rank, {(tr.src, tr.dst) for tr in plan})
    device = torch.device("cuda", torch.cuda.current_device()) if (
        dist.is_initialized() and dist.get_backend() == "nccl") else torch.device("cpu")
    gpu_setup.math_modes(device, cfg.train.tf32)
    if rank >= layout.total:
        return None
    if layout.is_forward(rank):
        return ForwardRank(cfg, layout, groups, rank, device)
    return BackwardRank(cfg, layout, groups, device)


def run_rank(rank: int, world: int, cfg_dict: dict[str, Any], result_path: str | None = None) -> dict[str, Any]:
    """Entry point of one rank of a MegaFBD job: the engine's run loop (plug-ins, lifecycle hooks, trace windows,
    logging, validation, MFU, checkpoints, summary) around this rank's role."""
    cfg = RunConfig.from_dict(cfg_dict)
    validate(cfg, world)
    comm.reset()
    r = build_rank(cfg, rank)
    if r is None:
        return {}
    return loop.run(RankHost(cfg, layout_of(cfg), rank, r, r.groups.job), world, result_path)


def train(cfg: RunConfig, threads: int | None = None) -> dict[str, Any]:
    """Run a MegaFBD job on local ranks: the backward layout plus the forward instances."""
    from megatronapp.launch import external_launch, pick_backend, spawn

    validate(cfg)
    plugins.resolve_all(plugin_entries(cfg))  # a bad --attach fails here, once, not in every spawned rank
    prepare_gpu_launch(cfg)
    if external_launch():
        raise ConfigError("MegaFBD runs on local ranks only for now (not under torchrun); start it without torchrun")
    Path(cfg.train.out).mkdir(parents=True, exist_ok=True)
    with ckpt.OutLock(cfg.train.out):  # two jobs writing one run directory would corrupt each other's steps
        if cfg.train.resume:  # checked once (every file's checksum), as the engine does: ranks load a good step
            cfg = dataclasses.replace(cfg, train=dataclasses.replace(
                cfg.train, resume=str(ckpt.resolve(cfg.train.resume, verify_files=True))))
        world = cfg.parallel.total_ranks
        result = Path(cfg.train.out) / ".result.json"
        result.unlink(missing_ok=True)
        spawn(run_rank, world, cfg.to_dict(), str(result), backend=pick_backend(cfg.parallel.backend),
              threads=threads or max(1, (os.cpu_count() or 1) // world))
        return json.loads(result.read_text())
