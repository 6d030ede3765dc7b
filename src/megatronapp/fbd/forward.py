"""A forward rank of MegaFBD: run the model without autograd for the microbatches of its instance and send every
backward virtual stage the exact input it needs.

Per step: receive the weights the backward side produced in the previous step (or its initial weights), then for
each job (dp replica, microbatch) of this instance, in order: take the input (token ids on forward stage 0, else
the previous forward stage's message), run this stage's segments (whole backward virtual stages) under
`torch.no_grad()`, and after segment v send its output, the input of virtual stage v + 1, to that stage's
backward ranks (one per backward TP rank: the whole hidden state, or under sequence parallelism with a
forward tp below tp the backward TP rank's sequence slice, `layout.input_part`). A forward rank never waits
for a backward rank inside a step, only for the weights at its start.

A forward rank holds no state of its own across steps: its weights come from the backward side at every step's
start, its batches are a pure function of (seed, step). So it saves nothing, and a resumed run only tells it
the step to go on from (the checkpoint's `meta.json`); the first hand-off then brings the loaded weights.
"""
from __future__ import annotations

import time
from collections import deque

import torch

from megatronapp import tracing
from megatronapp.config import RunConfig, micro_batch_size
from megatronapp.data.dataset import BatchSource, build_batch_source, split_microbatches
from megatronapp.fbd.groups import FbdGroups, PairLinks
from megatronapp.fbd.layout import FbdLayout
from megatronapp.fbd.messages import Inbox, Outbox
from megatronapp.fbd.reader import StepReader
from megatronapp.fbd.weights import WeightLink, param_specs, segment
from megatronapp.parallel import emulation, host_copy
from megatronapp.parallel.tensor_parallel import SEQ_DIM
from megatronapp.train import checkpoint as ckpt


class ForwardRank:
    """State of one rank of one forward instance."""

    role = "forward"
    reports_loss = False  # it computes no loss: the run loop neither logs nor evaluates here

    def __init__(self, cfg: RunConfig, layout: FbdLayout, groups: FbdGroups, rank: int, device: torch.device):
        self.cfg, self.layout, self.groups, self.device, self.rank = cfg, layout, groups, device, rank
        p, t = cfg.parallel, cfg.train
        self.instance, self.stage, self.tp_rank = layout.forward_coord(rank)
        tp_group = groups.forward_tp if layout.tp_f > 1 else None
        # Sequence parallelism is kept only where the forward splits like the backward (tp_f == tp): then each
        # forward TP rank holds exactly its backward peer's sequence slice.
        self.sp = p.sequence_parallel and layout.tp_f == p.tp and p.tp > 1
        self.segments = {v: segment(cfg.model, layout, v, tp_group, device, t.seed, self.sp)
                         for v in layout.forward_segments(self.stage)}
        for seg in self.segments.values():
            seg.requires_grad_(False)
        self.mbs = micro_batch_size(cfg)
        self.hidden = cfg.model.hidden_size
        seq_f = t.seq_len // p.tp if self.sp else t.seq_len
        self.dtype = torch.bfloat16 if t.dtype == "bf16" else torch.float32
        self.autocast = (torch.autocast(device.type, dtype=torch.bfloat16) if t.dtype == "bf16"
                         else torch.autocast(device.type, enabled=False))
        seq_b = t.seq_len // p.tp if p.sequence_parallel and p.tp > 1 else t.seq_len
        self.to_backward = Outbox(groups.act, (self.mbs, seq_b, self.hidden), self.dtype, device)
        chain_shape = (self.mbs, seq_f, self.hidden)
        self.to_next = self.from_prev = None
        if groups.forward_next is not None:
            nxt = PairLinks.single(groups.forward_next, self._chain_rank(self.stage + 1))
            self.to_next = Outbox(nxt, chain_shape, self.dtype, device)
        if groups.forward_chain is not None:
            prev = PairLinks.single(groups.forward_chain, self._chain_rank(self.stage - 1))
            self.from_prev = Inbox(prev, chain_shape, self.dtype, device)
        self.jobs = layout.jobs(self.instance)
        self.sources: dict[int, BatchSource] = {}
        if self.stage == 0 and self.segments:
            base, _ = build_batch_source(cfg, 0)
            for d in sorted({d for d, _ in self.jobs}):
                self.sources[d] = BatchSource(base.tokens, t.seq_len, t.global_batch_size, d, p.dp, t.seed)
        # every replica this instance serves, stacked along a new first dimension: one prefetched item per step
        self.reader = StepReader(self._read, t.data_prefetch, device)
        named = {n: q for seg in self.segments.values() for n, q in seg.named_parameters()}
        self.weights = WeightLink(layout, param_specs(cfg.model, layout), rank, named, groups.weights)
        self.step = ckpt.load_meta(ckpt.resolve(t.resume))["step"] if t.resume else 0
        self.weight_changes: list[float] = []  # largest change per hand-off (the first must be 0: equal init)
        # --emulate-device: this rank's modelled accelerator (does nothing when off)
        self.emulation = emulation.Emulation(cfg, rank, self.instance, self.stage,
                                             sum(q.numel() for seg in self.segments.values() for q in seg.parameters()))

    def _read(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        got = [self.sources[d].get(step) for d in sorted(self.sources)]
        return torch.stack([ids for ids, _ in got]), torch.stack([labels for _, labels in got])

    def _prev_stage_active(self) -> bool:
        return self.stage > 0 and bool(self.layout.forward_segments(self.stage - 1))

    def _next_stage_active(self) -> bool:
        return self.stage + 1 < self.layout.pp_f and bool(self.layout.forward_segments(self.stage + 1))

    def _chain_rank(self, stage: int) -> int:
        return self.layout.forward_rank(self.instance, stage, self.tp_rank)

    def receive_weights(self) -> None:
        """Wait for the backward side's weights (the hand-off after its last optimizer step)."""
        with tracing.span("fbd.weights", "comm"):
            self.weight_changes.append(self.weights.receive())

    def train_step(self) -> dict[str, float]:
        """Receive fresh weights, then run and ship the forward of every job of this instance."""
        L = self.layout
        t0 = time.perf_counter()
        self.emulation.begin_step(self.step)
        self.receive_weights()
        if not self.segments:  # a forward stage that would only hold the last virtual stage has nothing to do
            self.step += 1
            return {"step_time": time.perf_counter() - t0}
        if self.from_prev is not None and self._prev_stage_active():
            first = min(self.segments)
            self.from_prev.start(self.step, {self._chain_rank(self.stage - 1): [(d, m, first) for d, m in self.jobs]})
        sends = deque(L.forward_sends(self.rank))
        batches = {}
        if self.sources:
            with tracing.span("data", "data"):
                ids, labels = self.reader.get(self.step)
            batches = {d: split_microbatches(ids[i], labels[i], L.microbatches)
                       for i, d in enumerate(sorted(self.sources))}
        with torch.no_grad(), self.autocast:
            for d, m in self.jobs:
                if self.stage == 0:
                    x = host_copy.to_device(batches[d][m][0], self.device)
                else:
                    x = self.from_prev.take((d, m, min(self.segments)))
                for v, seg in self.segments.items():
                    with tracing.span("forward", "compute", virtual_stage=v, microbatch=m), \
                            emulation.segment("F", v, m):
                        x = seg(x)
                    while sends and sends[0][1] == (d, m, v + 1):  # the plan's order (layout.forward_sends)
                        dst, key = sends.popleft()
                        i = L.input_part(L.input_receivers(v + 1, d).index(dst), self.cfg.parallel.sequence_parallel)
                        part = x if i is None else x.chunk(L.tp, dim=SEQ_DIM)[i]
                        self.to_backward.send(dst, self.step, key, part)
                if self._next_stage_active():
                    self.to_next.send(self._chain_rank(self.stage + 1), self.step, (d, m, max(self.segments) + 1), x)
        if sends:
            raise RuntimeError(f"FBD forward rank {self.rank}: inputs planned but not sent: {list(sends)[:4]}")
        if self.from_prev is not None and self._prev_stage_active():
            self.from_prev.finish()
        self.to_backward.finish()
        if self.to_next is not None:
            self.to_next.finish()
        self.step += 1
        return {"step_time": time.perf_counter() - t0}

    def close(self) -> None:
        self.reader.close()
