"""Run a MegaFBD job: `megatronapp train --fbd ...` lands here (the engine's `train()` dispatches by import path).

Ranks 0..Wb-1 are the backward layout, the ranks after them the forward instances (fbd/layout.py). Rank 0, a
backward rank, writes metrics.jsonl and summary.json like the coupled trainer, with the same losses. Every rank,
of either role, attaches the run's plug-ins (`--trace`, `--inject`, `--attach`) through `fbd/host.RankHost` and
fires the engine's lifecycle hooks; backward ranks save and resume with the engine's checkpoint code.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megatronapp import tracing
from megatronapp.config import ConfigError, RunConfig, plugin_entries, validate
from megatronapp.fbd.backward import BackwardRank
from megatronapp.fbd.forward import ForwardRank
from megatronapp.fbd.groups import build as build_groups
from megatronapp.fbd.host import RankHost
from megatronapp.fbd.layout import FbdLayout, weight_plan
from megatronapp.fbd.weights import param_specs
from megatronapp.parallel import comm, device_emulation
from megatronapp.train import checkpoint as ckpt
from megatronapp.train import plugins
from megatronapp.train.metrics import MetricsLog, Progress, peak_memory_bytes, read_metrics


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
    if rank >= layout.total:
        return None
    r: BackwardRank | ForwardRank
    if layout.is_forward(rank):
        r = ForwardRank(cfg, layout, groups, rank, device)
        dp, stage, params = r.instance, r.stage, sum(q.numel() for s in r.segments.values() for q in s.parameters())
    else:
        r = BackwardRank(cfg, layout, groups, device)
        dp, stage, params = r.coord.dp, r.coord.pp, sum(q.numel() for q in r.params)
    if cfg.emulate_device:  # --emulate-device: forward and backward devices alike (speed=RANKS:F sets them apart)
        r.emulated = device_emulation.install(cfg, rank, dp, stage, params)
    else:
        device_emulation.deactivate()
    return r


def _forward_record(step: int) -> dict[str, float]:
    # a forward rank computes no loss: plug-ins reading the engine's record keys get NaN there
    return {"loss": math.nan, "grad_norm": math.nan, "lr": math.nan, "step": step}


def run_rank(rank: int, world: int, cfg_dict: dict[str, Any], result_path: str | None = None) -> dict[str, Any]:
    """Entry point of one rank of a MegaFBD job: the trainer's loop (plug-ins, lifecycle hooks, trace windows,
    checkpoints) around this rank's role."""
    cfg = RunConfig.from_dict(cfg_dict)
    validate(cfg, world)
    comm.reset()
    r = build_rank(cfg, rank)
    if r is None:
        return {}
    t = cfg.train
    lead = rank == 0
    backward = r.role == "backward"
    host = RankHost(cfg, layout_of(cfg), rank, r, r.groups.job)
    out = Path(t.out)
    log = MetricsLog(out / "metrics.jsonl") if lead else None
    # steps this run directory already logged (a resumed run): their records are marked `replayed`, as the engine does
    logged = max((int(x.get("step", 0)) for x in read_metrics(out / "metrics.jsonl")), default=0) \
        if lead and (out / "metrics.jsonl").is_file() else 0
    progress = Progress(t.steps, enabled=lead and t.progress)
    tb = None
    if lead and t.tensorboard:  # the engine's writer, imported only with the flag
        from megatronapp.train.tensorboard import TensorBoardLog

        tb = TensorBoardLog(t.tensorboard, resumed_at=r.step)  # a resumed run replaces the steps after it
    tokens_per_step = t.global_batch_size * t.seq_len
    history: list[dict[str, float]] = []
    ckpt_dir = None
    start_step = r.step
    t_start = time.perf_counter()
    failed = False
    try:
        host.attach_plugins(plugin_entries(cfg))
        while r.step < t.steps:
            host.hooks.fire("step_start", r.step)
            with tracing.step(r.step):
                rec = r.train_step()
            if not backward:
                rec.update(_forward_record(r.step))
                host.hooks.fire("step_end", r.step, rec)
                continue
            rec.update(step=r.step, tokens_per_s=tokens_per_step / rec["step_time"],
                       mem_bytes=peak_memory_bytes(r.device))
            if r.step <= logged:
                rec["replayed"] = True
            history.append(rec)
            if lead:
                log.log(rec)
                if tb is not None:
                    tb.log(rec)
                progress.update(r.step, rec["loss"], rec["tokens_per_s"], 0.0, rec["mem_bytes"], rec["lr"])
            host.hooks.fire("step_end", r.step, rec)
            if t.save_interval and r.step % t.save_interval == 0 and r.step < t.steps:
                r.save()
        if backward:  # as the engine: a final checkpoint; forward ranks hold no state to save
            ckpt_dir = r.save()
            r.finish_saves()
    except BaseException as e:
        failed = True
        host.hooks.teardown("failure", e, raise_errors=False)  # the run's own error is what propagates
        raise
    finally:
        r.close()
        host.detach_plugins(raise_errors=not failed)
        if log is not None:
            log.close()
        if tb is not None:
            tb.close()
    wall = time.perf_counter() - t_start
    summary = {"steps": r.step, "role": r.role, "world_size": world, "out": str(out),
               "first_loss": history[0]["loss"] if history else math.nan,
               "final_loss": history[-1]["loss"] if history else math.nan,
               "losses": [h["loss"] for h in history],
               "tokens_per_s": tokens_per_step * max(1, r.step - start_step) / wall,
               "peak_mem_bytes": peak_memory_bytes(r.device), "checkpoint": str(ckpt_dir) if ckpt_dir else None,
               "emulated": bool(cfg.emulate_device)}
    if r.emulated is not None:  # this rank's own host-vs-device record (benchmarks gather every rank's)
        summary["emulation"] = device_emulation.summarize(cfg.emulate_device, [r.emulated.record()])
    if lead:
        progress.close({k: v for k, v in summary.items() if k != "losses"})
        (out / "summary.json").write_text(json.dumps(summary, indent=2))
        if result_path:
            Path(result_path).write_text(json.dumps(summary))
    return summary


def train(cfg: RunConfig, threads: int | None = None) -> dict[str, Any]:
    """Run a MegaFBD job on local ranks: the backward layout plus the forward instances."""
    from megatronapp.launch import external_launch, pick_backend, spawn

    validate(cfg)
    plugins.resolve_all(plugin_entries(cfg))  # a bad --attach fails here, once, not in every spawned rank
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
