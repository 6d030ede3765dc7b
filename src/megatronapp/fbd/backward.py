"""A backward rank of MegaFBD: recompute one chunk's forward from the input a forward instance sent, then its
backward at once; then the engine's DP reduction, clipping and optimizer step, and the weight hand-off.

Order on every backward rank, per step: for each microbatch m in order, for each chunk from last to first
(virtual stage v descending): take the stage input (token ids on v = 0, else the forward instance's message),
recompute the chunk with autograd, run backward (the last virtual stage from its loss, others from the output
gradient the next backward stage sends), send the input gradient to the previous stage. So a rank holds the
activations of one (microbatch, chunk) at a time. The gradient channel is the engine's `StageLinks` (the
`pp.grad.*` groups: one way per group, a header per message).
"""
from __future__ import annotations

import time

import torch

from megatronapp import tracing
from megatronapp.config import RunConfig, micro_batch_size
from megatronapp.data.dataset import build_batch_source, split_microbatches
from megatronapp.fbd.groups import FbdGroups
from megatronapp.fbd.layout import FbdLayout
from megatronapp.fbd.messages import Inbox
from megatronapp.fbd.weights import WeightLink, param_specs
from megatronapp.parallel.data_parallel import GradReducer
from megatronapp.pipeline.p2p import StageLinks
from megatronapp.train.optim import build_optimizer
from megatronapp.train.trainer import build_chunks, finish_step


class BackwardRank:
    """State of one backward rank (an ordinary engine rank of the tp x pp x dp layout, minus the pipeline)."""

    role = "backward"

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
        self.data, _ = build_batch_source(cfg, self.coord.dp)
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

    # -- geometry -------------------------------------------------------------------------------------------
    def _v(self, chunk: int) -> int:
        return chunk * self.layout.pp + self.coord.pp

    # -- one step -------------------------------------------------------------------------------------------
    def train_step(self) -> dict[str, float]:
        """Hand the current weights to the forward side, then one optimizer step over the global batch, equal
        to the coupled engine's."""
        cfg, L, topo = self.cfg, self.layout, self.topo
        t0 = time.perf_counter()
        # The forward side of this step waits for exactly these weights (the previous step's result).
        with tracing.span("fbd.weights", "comm"):
            self.weights.send()
        ids, labels = self.data.get(self.step)
        mbs = [(a.to(self.device), b.to(self.device)) for a, b in split_microbatches(ids, labels, L.microbatches)]
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
                with tracing.span("recompute", "compute", chunk=c, microbatch=m), self.autocast:
                    out = self.chunks[c](x, labels=mbs[m][1] if v == V - 1 else None)
                with tracing.span("backward", "compute", chunk=c, microbatch=m):
                    if v == V - 1:
                        losses.append(float(out.detach()))
                        torch.autograd.backward(out * scale)
                    else:
                        w0 = time.perf_counter()
                        self.links.wait_for(("B", c, m), 600.0, lambda c=c, m=m: self._stuck(c, m))
                        wait += time.perf_counter() - w0
                        grad = self.links.take(("B", c, m)).to(out.dtype)
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

    def _stuck(self, chunk: int, m: int) -> str:
        return (f"FBD backward rank {self.rank} ({self.coord.label()}) waits for the output gradient of chunk "
                f"{chunk}, microbatch {m} from rank {self.topo.next_rank()}")

    def close(self) -> None:
        self.weights.finish_sends()
