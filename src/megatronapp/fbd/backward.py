"""A backward rank of MegaFBD: recompute one chunk's forward from the input a forward instance sent, then its
backward at once; then the engine's DP reduction, clipping and optimizer step, and the weight hand-off.

Order on every backward rank, per step: for each microbatch m in order, for each chunk from last to first
(virtual stage v descending): take the stage input (token ids on v = 0, else the forward instance's message),
recompute the chunk with autograd, run backward (the last virtual stage from its loss, others from the output
gradient the next backward stage sends), send the input gradient to the previous stage. So a rank holds the
activations of one (microbatch, chunk) at a time. The gradient channel is the engine's `StageLinks` (the
`pp.grad.*` groups: one way per group, a header per message).

Checkpoints are the engine's (`Trainer.save` / `Trainer.load`, called on this rank: it has the attributes they
read): backward rank r writes exactly what engine rank r of the same tp x pp x dp layout writes, in the same
directory format (atomic rename, `weights_only` load), and a resume checks the layout as the engine does. The
forward ranks hold no state of their own: their weights arrive from the backward side at every step's start.

Validation (`--eval-interval`) is the engine's too: the backward ranks are a tp x pp x dp layout with the
engine's chunks and pipeline links (`pp.act.*`, which FBD's training leaves unused), so they run the engine's
forward-only pass (`pipeline/evaluation.py`) and average it as the trainer does (`trainer.held_out_loss`): the
val_loss of the coupled run of this layout. Forward instances take no part (they wait for the next weights).
"""
from __future__ import annotations

import time
from pathlib import Path

import torch

from megatronapp import tracing
from megatronapp.config import RunConfig, micro_batch_size
from megatronapp.data.dataset import build_batch_source, build_valid_source, split_microbatches
from megatronapp.fbd.groups import FbdGroups
from megatronapp.fbd.layout import FbdLayout
from megatronapp.fbd.messages import Inbox
from megatronapp.fbd.reader import StepReader
from megatronapp.fbd.weights import WeightLink, param_specs
from megatronapp.parallel import emulation, host_copy
from megatronapp.parallel.data_parallel import GradReducer
from megatronapp.pipeline.evaluation import forward_only
from megatronapp.pipeline.p2p import StageLinks
from megatronapp.train import checkpoint as ckpt
from megatronapp.train import plugins
from megatronapp.train.async_checkpoint import AsyncSaver
from megatronapp.train.optim import build_optimizer
from megatronapp.train.trainer import Trainer, build_chunks, finish_step, held_out_loss


class BackwardRank:
    """State of one backward rank (an ordinary engine rank of the tp x pp x dp layout, minus the pipeline)."""

    role = "backward"
    reports_loss = True
    # the engine's checkpoint code itself (same files and checks), not a copy: it reads step, out, cfg, rank,
    # topo, chunks, optimizer, saver, save_stalls and hooks, which this class has with the same meaning (and
    # `state`/`load_state`, which save and load go through)
    save = Trainer.save
    state = Trainer.state
    finish_saves = Trainer.finish_saves
    load = Trainer.load
    load_state = Trainer.load_state

    def __init__(self, cfg: RunConfig, layout: FbdLayout, groups: FbdGroups, device: torch.device):
        self.cfg, self.layout, self.groups, self.device = cfg, layout, groups, device
        p, t = cfg.parallel, cfg.train
        self.topo = topo = groups.topo
        self.rank, self.coord = topo.rank, topo.coord
        torch.manual_seed(t.seed)
        self.chunks = build_chunks(cfg, topo, device)
        self.params = [q for c in self.chunks for q in c.parameters()]
        self.optimizer = build_optimizer(self.params, t, tp_group=topo.tp_group)
        self.reducer = GradReducer(self.chunks, topo.dp_group, p.grad_bucket_mb)
        self.data, tokenizer = build_batch_source(cfg, self.coord.dp)
        # the held-out split (`--eval-interval`), read only by evaluate()
        self.valid = build_valid_source(cfg, self.coord.dp, tokenizer) if t.eval_interval else None
        self.reader = StepReader(self.data.get, t.data_prefetch, device)
        self.mbs = micro_batch_size(cfg)
        seq = t.seq_len // p.tp if p.sequence_parallel and p.tp > 1 else t.seq_len
        self.act_shape = (self.mbs, seq, cfg.model.hidden_size)
        self.act_dtype = torch.bfloat16 if t.dtype == "bf16" else torch.float32
        self.autocast = (torch.autocast(device.type, dtype=torch.bfloat16) if t.dtype == "bf16"
                         else torch.autocast(device.type, enabled=False))
        self.links = StageLinks(topo, self.act_shape, self.act_dtype, device) if p.pp > 1 else None
        # a stage may receive the inputs of all its chunks of one microbatch from one sender before using any
        self.inbox = Inbox(groups.act, self.act_shape, self.act_dtype, device, window=p.vpp + 1)
        named = {n: q for c in self.chunks for n, q in c.named_parameters()}
        self.weights = WeightLink(layout, param_specs(cfg.model, layout), self.rank, named, groups.weights)
        self.step = 0
        self.peak_saved_bytes = 0  # filled by a benchmark's saved-tensor hooks, if any
        self.out = Path(t.out)
        self.hooks = plugins.Hooks()  # fired by fbd/run.py; `save` announces checkpoints through it
        self.saver = AsyncSaver(self.out / "checkpoints", self.rank, topo.world_size,
                                keep=t.keep_checkpoints) if t.async_save else None
        self.save_stalls: list[float] = []
        self.attempt: str | None = None  # save attempt id, agreed by the backward ranks at their first save
        # --emulate-device: this rank's modelled accelerator (does nothing when off)
        self.emulation = emulation.Emulation(cfg, self.rank, self.coord.dp, self.coord.pp,
                                             sum(q.numel() for q in self.params))
        if t.resume:
            self.load(ckpt.resolve(t.resume))

    # -- geometry -------------------------------------------------------------------------------------------
    def _v(self, chunk: int) -> int:
        return chunk * self.layout.pp + self.coord.pp

    # -- one step -------------------------------------------------------------------------------------------
    def train_step(self) -> dict[str, float]:
        """Hand the current weights to the forward side, then one optimizer step over the global batch, equal
        to the coupled engine's."""
        cfg, L, topo = self.cfg, self.layout, self.topo
        t0 = time.perf_counter()
        self.emulation.begin_step(self.step)  # this step's segments and optimizer step run on this rank's device
        # The forward side of this step waits for exactly these weights (the previous step's result).
        with tracing.span("fbd.weights", "comm"):
            self.weights.send()
        with tracing.span("data", "data"):
            ids, labels = self.reader.get(self.step)
        mbs = host_copy.microbatches_to(split_microbatches(ids, labels, L.microbatches), self.device)
        vpp, V = len(self.chunks), L.virtual_stages
        self.reducer.zero_grad()
        self.inbox.start(self.step, L.backward_inputs(self.rank))
        if self.links is not None:
            grads_in = sum(L.microbatches for c in range(vpp) if self._v(c) != V - 1)
            self.links.start(self.step, {"B": grads_in}, window=2)
        losses: list[float] = []
        wait = 0.0
        scale = 1.0 / L.microbatches
        for m in range(L.microbatches):
            for c in reversed(range(vpp)):
                v = self._v(c)
                final = m == L.microbatches - 1
                if final:
                    self.reducer.before_final_backward(c)
                w0 = time.perf_counter()
                x = mbs[m][0] if v == 0 else self.inbox.take((self.coord.dp, m, v)).requires_grad_(True)
                wait += time.perf_counter() - w0
                with tracing.span("recompute", "compute", chunk=c, microbatch=m), self.autocast, \
                        emulation.segment("R", v, m):
                    out = self.chunks[c](x, labels=mbs[m][1] if v == V - 1 else None)
                grad = None
                if v != V - 1:  # waiting for the next stage is not compute: outside the span (MegaScan's phases)
                    w0 = time.perf_counter()
                    self.links.wait_for(("B", c, m), 600.0, lambda c=c, m=m: self._stuck(c, m))
                    wait += time.perf_counter() - w0
                    grad = self.links.take(("B", c, m)).to(out.dtype)
                with tracing.span("backward", "compute", chunk=c, microbatch=m), emulation.segment("BW", v, m):
                    if grad is None:
                        losses.append(out.detach())  # on the device: one host read per step (global_loss)
                        torch.autograd.backward(out * scale)
                    else:
                        torch.autograd.backward(out, grad)
                del out
                if v > 0:
                    prev_chunk = c - 1 if self.coord.pp == 0 else c
                    self.links.send("B", prev_chunk, m, x.grad)
                del x
                if final:
                    self.reducer.after_final_backward(c)
        self.inbox.finish()
        if self.links is not None:
            self.links.finish()
        loss, grad_norm, lr = finish_step(self.chunks, topo, self.optimizer, self.reducer, cfg, self.step, losses,
                                          self.device)
        self.step += 1
        return {"loss": loss, "grad_norm": grad_norm, "lr": lr, "step_time": time.perf_counter() - t0,
                "wait_s": wait}

    def evaluate(self, iters: int | None = None) -> float:
        """Mean loss of the first `iters` (default train.eval_iters) held-out batches, as the coupled engine
        computes it for this layout (module docstring); every backward rank returns it."""
        if self.valid is None:
            raise RuntimeError("evaluate() needs a held-out split: set train.eval_interval (--eval-interval)")
        iters = self.cfg.train.eval_iters if iters is None else iters

        def forward(mbs: list) -> list[float]:
            return forward_only(self.chunks, self.links, self.coord.pp, self.layout.pp, mbs, self.step)

        return held_out_loss(iters, self._valid_batch, forward, self.topo, self.device, self.autocast)

    def _valid_batch(self, i: int) -> list[tuple[torch.Tensor | None, torch.Tensor | None]]:
        """Held-out batch `i`'s microbatches on this rank: only the stages holding the first and the last virtual
        stage read ids and labels (as the trainer's `_batch`)."""
        m = self.layout.microbatches
        if 0 < self.coord.pp < self.layout.pp - 1:
            return [(None, None)] * m
        ids, labels = self.valid.get(i)
        return host_copy.microbatches_to(split_microbatches(ids, labels, m), self.device)

    def _stuck(self, chunk: int, m: int) -> str:
        return (f"FBD backward rank {self.rank} ({self.coord.label()}) waits for the output gradient of chunk "
                f"{chunk}, microbatch {m} from rank {self.topo.next_rank()}")

    def snapshot_barrier(self) -> None:
        """Called by the engine's `load` (and, in the engine, before each optimizer update): nothing to wait for
        here, since this rank's AsyncSaver copies its snapshot inside `save()` (`overlap_copy` off), so no copy
        of the state is ever in flight while training changes it."""

    def close(self) -> None:
        self.reader.close()
        self.weights.finish_sends()
