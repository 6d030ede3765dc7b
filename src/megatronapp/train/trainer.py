"""The engine's training rank: build the stage, run pipeline steps, reduce, clip, step, checkpoint.

`train(cfg)` launches `world_size` local ranks (or, under torchrun, runs as the current rank) and returns the
run summary. Each rank builds a `Trainer` and hands it to the run loop (`train/loop.py`: logging, evaluation,
MFU, checkpoint timing, hooks, summary), which MegaFBD drives too. This file imports no optional module: each
rank attaches the plug-ins the config names by import path (`config.plugin_entries`: the MegaScan tracer for
`--trace`, fault drills for `--inject`, MegaScope for `--scope-port`, then every `--attach`) and the loop fires
their lifecycle hooks (`train/plugins.py`). Module-provided schedules (`--schedule dpp`) come through the same
resolver. With no plug-in, no module code runs.
"""
from __future__ import annotations

import dataclasses
import json
import os
import secrets
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megatronapp import gpu_setup, startup, tracing
from megatronapp.config import FBD_TRAIN, RunConfig, micro_batch_size, plugin_entries, validate
from megatronapp.data.dataset import build_batch_source, build_valid_source, split_microbatches
from megatronapp.data.prefetch import Prefetcher
from megatronapp.model.transformer import TransformerChunk, sync_sequence_parallel_grads
from megatronapp.parallel import comm, emulation, host_copy
from megatronapp.parallel import topology as topology_mod
from megatronapp.parallel.data_parallel import GradReducer
from megatronapp.parallel.distributed_optimizer import DistributedOptimizer
from megatronapp.parallel.grad_norm import clip_grad_norm
from megatronapp.partition import stage_chunks
from megatronapp.pipeline.executor import PipelineExecutor
from megatronapp.train import checkpoint as ckpt
from megatronapp.train import loop, plugins, reshard
from megatronapp.train.async_checkpoint import AsyncSaver
from megatronapp.train.checkpoint_read import read_state
from megatronapp.train.optim import build_optimizer, lr_at, set_lr


def make_policy(cfg: RunConfig):
    """The pipeline policy for cfg.parallel.schedule: the engine's static ones, or a module's factory found by
    import path (`plugins.SCHEDULE_FACTORIES`, e.g. MegaDPP for "dpp")."""
    factory = plugins.schedule_factory(cfg.parallel.schedule)
    if factory is not None:
        return factory(cfg)
    from megatronapp.pipeline.schedules import StaticPolicy

    return StaticPolicy(cfg.parallel.schedule)


def build_chunks(cfg: RunConfig, topo: topology_mod.Topology, device: torch.device) -> list[torch.nn.Module]:
    """This rank's model chunks, identical to the matching slices of the single-process model."""
    p, m = cfg.parallel, cfg.model
    stage = topo.coord.pp
    ranges = stage_chunks(m.num_layers, p.pp, p.vpp, stage)
    chunks = []
    for c, (start, end) in enumerate(ranges):
        v = c * p.pp + stage
        chunk = TransformerChunk(m, start, end, pre_process=v == 0, post_process=v == p.pp * p.vpp - 1,
                                 tp_group=topo.tp_group, sequence_parallel=p.sequence_parallel,
                                 recompute=cfg.train.recompute, seed=cfg.train.seed, device=device,
                                 tp_comm_overlap=p.tp_comm_overlap_chunks if p.tp_comm_overlap else 0)
        if cfg.train.hf_checkpoint:
            from megatronapp.model.hf import load_hf_weights

            load_hf_weights(chunk, cfg.train.hf_checkpoint)
        chunks.append(chunk)
    return chunks


def sync_replicated_grads(chunks: list[torch.nn.Module], topo: topology_mod.Topology,
                          sequence_parallel: bool) -> None:
    """Sum the gradients of replicated copies: tied embeddings across stages, sequence-parallel partials."""
    for chunk in chunks:
        shared = chunk.shared_embedding_weight()
        if shared is not None and shared.grad is not None and topo.embedding_group.size > 1:
            comm.all_reduce(shared.grad, topo.embedding_group)
        if sequence_parallel and topo.tp > 1:
            sync_sequence_parallel_grads(chunk, topo.tp_group)


def global_loss(losses: list[float] | list[torch.Tensor], topo: topology_mod.Topology, device: torch.device) -> float:
    """Mean loss of the global batch, known on every rank (the last stage has it; DP replicas average)."""
    if losses and isinstance(losses[0], torch.Tensor):  # a GPU's microbatch losses, still on the device
        t = torch.stack([x.to(torch.float64) for x in losses]).mean().reshape(1)
    else:
        t = torch.tensor([sum(losses) / len(losses) if losses else 0.0], dtype=torch.float64, device=device)
    comm.all_reduce(t, topo.pp_group)
    comm.all_reduce(t, topo.dp_group)
    return float(t) / topo.dp


def held_out_loss(iters: int, batch: Callable[[int], Any], forward: Callable[[Any], list[float]],
                  topo: topology_mod.Topology, device: torch.device, autocast: AbstractContextManager) -> float:
    """Mean loss of the held-out batches 0..iters-1 (`batch(i)`: this rank's microbatches), each through
    `forward` (a forward-only pass of the whole pipeline) and averaged like a training loss (`global_loss`):
    the same fixed batches at every call, so successive values are comparable. Every rank returns it."""
    losses: list[float] = []
    for i in range(iters):
        with tracing.span("data", "data"):
            mbs = batch(i)
        with autocast, tracing.span("evaluate", "compute"):
            losses.append(global_loss(forward(mbs), topo, device))
    return sum(losses) / len(losses)


def finish_step(chunks: list[torch.nn.Module], topo: topology_mod.Topology, optimizer: Any, reducer: GradReducer,
                cfg: RunConfig, step: int, losses: list[float], device: torch.device,
                before_update: Any = None) -> tuple[float, float, float]:
    """After the step's backwards: DP reduction, replicated gradients, global clipping, the step's loss, LR and
    optimizer step. `before_update()`, if given, runs right before the optimizer changes parameters or state (the
    checkpoint snapshot barrier, and a plug-in's commit point): every collective of the step that precedes the
    update has completed by then. Returns (global loss, gradient norm before clipping, learning rate)."""
    reducer.finish()
    if isinstance(reducer, DistributedOptimizer):  # ZeRO-1: each rank holds its slice of the reduced gradient
        reducer.sync_replicated_grads(cfg.parallel.sequence_parallel)
        grad_norm = reducer.clip_grad_norm(cfg.train.grad_clip)
    else:
        sync_replicated_grads(chunks, topo, cfg.parallel.sequence_parallel)
        grad_norm = clip_grad_norm(chunks, topo, cfg.train.grad_clip)
    # the loss before the update: a step's collectives then all precede its commit point (train/loop.py)
    loss = global_loss(losses, topo, device)
    lr = lr_at(step, cfg.train)
    set_lr(optimizer, lr)
    if before_update is not None:
        before_update()
    with tracing.span("optimizer", "optimizer"), emulation.optimizer_task():
        optimizer.step()
    return loss, grad_norm, lr


class Trainer:
    """State of one rank's training run; the run loop's role (`train/loop.RankRole`) for the engine."""

    role = "coupled"  # summary.json's `role` (MegaFBD's ranks are "backward" or "forward")
    reports_loss = True  # every rank learns the step's loss (global_loss)

    def __init__(self, cfg: RunConfig, rank: int = 0, group_timeout: Any = None):
        """`group_timeout` (a timedelta): the timeout of the process groups this builds (None: torch's default);
        in-place recovery forms a generation's groups under a short one."""
        self.cfg = cfg
        p, t = cfg.parallel, cfg.train
        self.device = torch.device("cuda", torch.cuda.current_device()) if (
            dist.is_initialized() and dist.get_backend() == "nccl") else torch.device("cpu")
        torch.manual_seed(t.seed)
        gpu_setup.math_modes(self.device, t.tf32)
        comm.set_semantics(p.comm_semantics)
        # a dynamic schedule (a module's factory) makes per-task decisions that TP peers share on the host
        self.topo = topology_mod.build(p.tp, p.pp, p.dp, rank,
                                       tp_control=plugins.schedule_factory(p.schedule) is not None,
                                       timeout=group_timeout)
        self.rank = self.topo.rank
        self.out = Path(t.out)
        self.chunks = build_chunks(cfg, self.topo, self.device)
        self.params = [q for c in self.chunks for q in c.parameters()]
        if p.zero:  # the distributed optimizer is both the DP gradient reducer and the optimizer
            self.reducer = self.optimizer = DistributedOptimizer(self.chunks, self.topo, t, p.grad_bucket_mb,
                                                                 overlap=p.dp_overlap)
        else:
            self.optimizer = build_optimizer(self.params, t, tp_group=self.topo.tp_group)
        self.data, self.tokenizer = build_batch_source(cfg, self.topo.coord.dp)
        # the held-out split (`--eval-interval`): read only by evaluate(), never by a training step
        self.valid = build_valid_source(cfg, self.topo.coord.dp, self.tokenizer) if t.eval_interval else None
        self.prefetcher: Prefetcher | None = None  # started by the first step, at that step (resume included)
        self.mbs = micro_batch_size(cfg)
        seq = t.seq_len // p.tp if p.sequence_parallel else t.seq_len
        if not p.zero:
            self.reducer = GradReducer(self.chunks, self.topo.dp_group, p.grad_bucket_mb, overlap=p.dp_overlap)
        self.policy = make_policy(cfg)
        # --emulate-device: this rank's modelled accelerator (does nothing when off)
        self.emulation = emulation.Emulation(cfg, self.rank, self.topo.coord.dp, self.topo.coord.pp,
                                             sum(q.numel() for q in self.params))
        self.executor = PipelineExecutor(self.chunks, self.topo, self.policy, microbatches=p.microbatches,
                                         act_shape=(self.mbs, seq, cfg.model.hidden_size), device=self.device,
                                         # bf16 runs send bf16 activations and gradients, as Megatron does
                                         act_dtype=torch.bfloat16 if t.dtype == "bf16" else torch.float32,
                                         max_inflight=p.dpp_max_inflight, grad_sync=self.reducer,
                                         pp_overlap=p.pp_overlap)
        self.step = 0
        self.hooks = plugins.Hooks()
        # overlap_copy: the snapshot is copied during the next step; train_step holds the barrier before the update
        self.saver = AsyncSaver(self.out / "checkpoints", self.rank, self.topo.world_size,
                                keep=t.keep_checkpoints, overlap_copy=True) if t.async_save else None
        self.save_stalls: list[float] = []  # seconds each save held up training
        self.attempt: str | None = None  # this launch's save attempt id, agreed by every rank at its first save
        self.autocast = (torch.autocast(self.device.type, dtype=torch.bfloat16) if t.dtype == "bf16"
                         else nullcontext())
        self.load_s = 0.0  # seconds the resume load took (the recovery benchmark splits a restart with it)
        # a plug-in's commit point (resilience's step transaction): called with the step's index right before the
        # update, every collective of the step done; returns to apply the update, raises to leave it unapplied
        self.commit: Callable[[int], None] | None = None
        if t.resume:
            startup.phase("resume")
            t_load = time.perf_counter()
            self.load(ckpt.resolve(t.resume))
            self.load_s = time.perf_counter() - t_load

    # -- plug-ins -------------------------------------------------------------------------------------------
    def attach_plugins(self) -> None:
        """Resolve and call every plug-in of the config in order, then fire `rank_start`."""
        plugins.attach(self, plugin_entries(self.cfg))

    def detach_plugins(self, raise_errors: bool = True) -> None:
        """Fire `shutdown` (every plug-in's, even if one fails) and forget the hooks."""
        plugins.detach(self.hooks, raise_errors)

    # -- one step -------------------------------------------------------------------------------------------
    def train_step(self) -> dict[str, float]:
        """One optimizer step over the global batch; returns loss, grad norm and timings."""
        cfg, topo = self.cfg, self.topo
        t0 = time.perf_counter()
        with tracing.span("data", "data"):
            mbs = self._batch()
        data_s = time.perf_counter() - t0
        self.reducer.zero_grad()
        self.emulation.begin_step(self.step)  # this step's tasks and optimizer step run on this rank's device
        with self.autocast:
            result = self.executor.step(mbs, loss_scale=1.0 / cfg.parallel.microbatches)
        loss, grad_norm, lr = finish_step(self.chunks, topo, self.optimizer, self.reducer, cfg, self.step,
                                          result.losses, self.device, before_update=self._before_update)
        self.step += 1
        return {"loss": loss, "grad_norm": grad_norm, "lr": lr, "step_time": time.perf_counter() - t0,
                "data_s": data_s, "wait_s": result.wait_s, "peak_inflight": result.peak_inflight,
                "peak_recv_buffers": result.peak_recv_buffers}

    def _before_update(self) -> None:
        self.snapshot_barrier()
        if self.commit is not None:
            self.commit(self.step)

    def drop_step(self) -> int | None:
        """Forget a step its failed generation of process groups cannot finish (in-place recovery): reducer and
        pipeline state in flight, the save attempt id, a background save that cannot complete (its step is
        returned, or None). Model, optimizer, RNG and data position are untouched."""
        self.reducer.reset()
        self.executor.reset()
        self.attempt = None
        return self.saver.abandon() if self.saver is not None else None

    def evaluate(self, iters: int | None = None) -> float:
        """Mean loss of the first `iters` (default train.eval_iters) batches of the held-out split: forward only
        on every stage, no gradient, no weight or optimizer change; the same fixed batches at every call, so
        successive values are comparable. Every rank returns it."""
        if self.valid is None:
            raise RuntimeError("evaluate() needs a held-out split: set train.eval_interval (--eval-interval)")
        iters = self.cfg.train.eval_iters if iters is None else iters
        return held_out_loss(iters, lambda i: self._batch(self.valid, i), self.executor.forward_only, self.topo,
                             self.device, self.autocast)

    # -- data -----------------------------------------------------------------------------------------------
    def _read(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This DP rank's (ids, labels) of `step`: from the prefetch worker, or built now with data_prefetch=0."""
        depth = self.cfg.train.data_prefetch
        if depth == 0:
            return self.data.get(step)
        if self.prefetcher is None or self.prefetcher.next_step != step:  # first step, or a jump (load)
            if self.prefetcher is not None:
                self.prefetcher.close()
            self.prefetcher = Prefetcher(self.data.get, step, depth, pin_memory=self.device.type == "cuda")
        return self.prefetcher.get(step)

    def _batch(self, source: Any = None, index: int = 0) -> list[tuple[torch.Tensor | None, torch.Tensor | None]]:
        """The step's microbatches on this rank's device (or, with `source`, that source's batch `index`).

        Only the first pipeline stage embeds ids and only the last computes the loss (the executor reads ids
        in chunk v=0 and labels in the last chunk, both of which live on those stages even when interleaved),
        so middle stages read nothing. Within a TP group every rank needs the same rows: TP rank 0 reads them
        and broadcasts one [2, rows, seq] tensor (ids, labels) to its peers, as Megatron-LM does.

        Why the broadcast is NCCL-safe: it is issued here, on the training thread, at the same point of every
        step on every member of the TP group (all members share the pipeline stage, so all or none of them
        take this path), before the executor issues the step's TP collectives; the prefetch worker only builds
        tensors and never communicates. Collective order on the TP group is therefore identical on every
        member, which is what NCCL (and --comm-semantics nccl) requires. Issuing it from the worker instead
        would race with the step's TP all-reduces unless it had a process group of its own.
        """
        cfg, topo = self.cfg, self.topo
        m = cfg.parallel.microbatches
        if 0 < topo.coord.pp < topo.pp - 1:
            return [(None, None)] * m
        tp = topo.tp_group
        read = (lambda: self._read(self.step)) if source is None else (lambda: source.get(index))
        if tp.size == 1:  # nobody to share with: no staging tensor, no broadcast
            ids, labels = read()
            return split_microbatches(*(host_copy.to_device(t, self.device) for t in (ids, labels)), m)
        both = torch.empty((2, self.data.local_batch, cfg.train.seq_len), dtype=torch.long, device=self.device)
        if tp.ranks[0] == self.rank:
            ids, labels = read()
            host_copy.copy_into(both[0], ids)  # pinned by the prefetch worker on CUDA (else pinned here)
            host_copy.copy_into(both[1], labels)
        comm.broadcast(both, tp.ranks[0], tp)
        return split_microbatches(both[0], both[1], m)

    def close(self) -> None:
        """Stop the data worker (normal end, or a failed run: called from run_rank's finally)."""
        if self.prefetcher is not None:
            self.prefetcher.close()
            self.prefetcher = None
        self.emulation.close()

    # -- checkpoints ----------------------------------------------------------------------------------------
    def save(self) -> Path:
        """Checkpoint this step: synchronously, or (async_save) snapshot now and write in the background."""
        t0 = time.perf_counter()
        root = self.out / "checkpoints"
        meta = {"step": self.step, "world_size": self.topo.world_size, "config": self.cfg.to_dict()}
        state = self.state()
        if self.attempt is None:
            self.attempt = agree_attempt(self.topo, self.device)
        if self.saver is not None:
            self.finish_saves()  # at most one save in flight
            self.saver.save(self.step, state, meta, attempt=self.attempt)
            self.save_stalls.append(time.perf_counter() - t0)
            return ckpt.step_dir(root, self.step)
        ckpt.save_rank(root, self.step, self.rank, state, self.attempt)
        comm.barrier(self.topo.groups["world"])
        d = ckpt.step_dir(root, self.step)
        if self.rank == 0:
            d = ckpt.finalize(root, self.step, meta, keep=self.cfg.train.keep_checkpoints, attempt=self.attempt)
        comm.barrier(self.topo.groups["world"])
        self.save_stalls.append(time.perf_counter() - t0)
        self.hooks.fire("checkpoint_saved", self.step, d)
        return d

    def state(self) -> dict[str, Any]:
        """This rank's training state as a checkpoint file holds it (references to the live tensors)."""
        return {"step": self.step, "chunks": [c.state_dict() for c in self.chunks],
                "optimizer": self.optimizer.state_dict(), "rng": ckpt.rng_state(),
                "coord": dataclasses.asdict(self.topo.coord),
                # which dimension each TP shard splits, so `consolidate` can rebuild full tensors
                "partition_dims": [{n: q.partition_dim for n, q in c.named_parameters()
                                    if getattr(q, "tensor_parallel", False)} for c in self.chunks]}

    def snapshot_barrier(self) -> None:
        """Before anything changes the saved state: the snapshot of the save in flight must be complete. Its wait
        counts in that save's stall."""
        if self.saver is not None and self.saver.overlap_copy:
            waited = self.saver.snapshot_barrier()
            if waited and self.save_stalls:
                self.save_stalls[-1] += waited

    def finish_saves(self) -> None:
        """Wait for a background save (and announce it); a no-op for synchronous checkpoints."""
        done = self.saver.wait() if self.saver is not None else None
        if done is not None:
            self.hooks.fire("checkpoint_saved", done, ckpt.step_dir(self.out / "checkpoints", done))

    def load(self, d: Path) -> None:
        self.snapshot_barrier()  # loading overwrites the state a save in flight may still be copying
        meta = ckpt.load_meta(d)
        saved = meta.get("config", {}).get("parallel", {})
        if reshard.layout_changed(saved, dataclasses.asdict(self.cfg.parallel)):  # another tp/pp/vpp/dp/zero
            reshard.load(self, d)
            return
        # plain DP: one reader per DP group broadcasts to its replicas; ZeRO-1 slices differ, each rank reads its own
        self.load_state(read_state(d, self.topo, sharded=bool(self.cfg.parallel.zero), device=self.device))

    def load_state(self, state: dict[str, Any]) -> None:
        """Take a state of this rank's layout and coordinate (`state()`'s form: from a checkpoint or a peer)."""
        for chunk, sd in zip(self.chunks, state["chunks"]):
            chunk.load_state_dict(sd)
        self.optimizer.load_state_dict(state["optimizer"])
        ckpt.set_rng_state(state["rng"])
        self.step = state["step"]


def agree_attempt(topo: topology_mod.Topology, device: torch.device) -> str:
    """A random id every rank of this launch agrees on (the largest of their draws), naming the temporary
    directories of its saves: files an earlier attempt left at the same step are never in them. Not
    TORCHELASTIC_RUN_ID, which is `none` under static rendezvous and survives torchrun restarts; not drawn from
    torch's RNG, whose state the checkpoint saves. A launch saves each step at most once."""
    draw = torch.tensor([secrets.randbits(62)], dtype=torch.int64, device=device)
    comm.all_reduce(draw, topo.groups["world"], op="max", label="checkpoint_attempt")
    return f"{int(draw):016x}"


def run_rank(rank: int, world: int, cfg_dict: dict[str, Any], result_path: str | None = None) -> dict[str, Any]:
    """Entry point of one rank (spawned locally or started by torchrun): the run loop around a `Trainer`."""
    cfg = RunConfig.from_dict(cfg_dict)
    validate(cfg, world)
    comm.reset()
    startup.phase("model build")
    return loop.run(Trainer(cfg, rank), world, result_path)


def train(cfg: RunConfig, threads: int | None = None) -> dict[str, Any]:
    """Validate, then run the job: as this rank under torchrun, else on cfg.parallel.world_size local ranks."""
    from megatronapp.launch import external_launch, init_distributed

    validate(cfg)
    prepare_gpu_launch(cfg)
    if cfg.parallel.fbd:  # MegaFBD owns its run loop; reached by import path, so the engine imports no module
        return plugins.resolve(FBD_TRAIN, "parallel.fbd")(cfg, threads)
    plugins.resolve_all(plugin_entries(cfg))  # a bad --attach fails here, once, not in every spawned rank
    Path(cfg.train.out).mkdir(parents=True, exist_ok=True)
    if external_launch():
        rank, world = init_distributed(cfg.parallel.backend)
        with ckpt.OutLock(cfg.train.out) if rank == 0 else nullcontext():
            return run_rank(rank, world, cfg.to_dict())
    with ckpt.OutLock(cfg.train.out):  # two jobs writing one run directory would corrupt each other's steps
        return _train_local(cfg, threads)


def prepare_gpu_launch(cfg: RunConfig) -> None:
    """Before any rank touches a GPU: refuse emulated NCCL rules on NCCL, and put what CUDA reads at context
    creation into this process's environment, which torchrun's rank (this process) and spawned ranks inherit."""
    from megatronapp.launch import pick_backend

    backend = pick_backend(cfg.parallel.backend)
    gpu_setup.check_semantics(cfg, backend)
    os.environ.update(gpu_setup.launch_env(cfg, backend))


def _train_local(cfg: RunConfig, threads: int | None) -> dict[str, Any]:
    from megatronapp.launch import pick_backend, spawn

    if cfg.train.resume:
        # Checked once here (every file's checksum), so the ranks load a known-good step: a torn or corrupt
        # newest checkpoint falls back to the previous complete one, with a warning.
        cfg = dataclasses.replace(cfg, train=dataclasses.replace(
            cfg.train, resume=str(ckpt.resolve(cfg.train.resume, verify_files=True))))
    world = cfg.parallel.world_size
    result = Path(cfg.train.out) / ".result.json"
    result.unlink(missing_ok=True)
    n_threads = threads or max(1, (os.cpu_count() or 1) // world)
    spawn(run_rank, world, cfg.to_dict(), str(result), backend=pick_backend(cfg.parallel.backend),
          threads=n_threads)
    if not result.is_file():
        raise RuntimeError("the ranks exited without a result. Ranks are started with the 'spawn' method, which "
                           "re-imports the calling script: guard a script that calls train() with "
                           "`if __name__ == '__main__':`")
    return json.loads(result.read_text())
