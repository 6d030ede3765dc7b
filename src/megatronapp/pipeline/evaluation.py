"""Evaluation through a pipeline stage: forward every microbatch through every chunk, no graph, no backward.

One implementation for whoever holds a stage's chunks and its pipeline channels: the engine's executor
(`PipelineExecutor.forward_only`) and MegaFBD's backward ranks (the same tp x pp x dp layout and chunks), so a
layout evaluates the same way whichever way it trains.

Whatever the training schedule, every stage runs its forwards in (microbatch, chunk) order: a task's input comes
from the previous virtual stage, which runs the same microbatch's earlier chunk, so by induction every wait is
answered (no policy, no TP broadcast of choices: TP peers run the same fixed order). Messages use the training
channels (`pp.act.*`) and headers, with a step number of their own that every stage passes alike.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from megatronapp import tracing
from megatronapp.pipeline.p2p import StageLinks


def forward_only(chunks: Sequence[nn.Module], links: StageLinks | None, stage: int, pp: int,
                 microbatches: Sequence[tuple[torch.Tensor | None, torch.Tensor | None]], step: int,
                 timeout_s: float = 600.0) -> list[float]:
    """The per-microbatch losses on the stage holding the last virtual stage (else an empty list) of stage
    `stage` of `pp` with `chunks` (chunk c is virtual stage c * pp + stage), over `links` (None when pp = 1)."""
    vpp = len(chunks)
    last_v = pp * vpp - 1
    m = len(microbatches)
    if links is not None:
        expected = sum(m for c in range(vpp) if c * pp + stage != 0)
        links.start(step, {"F": expected, "B": 0}, vpp)
    losses: list[float] = []
    with torch.no_grad():
        for mb, (ids, labels) in enumerate(microbatches):
            for c in range(vpp):
                v = c * pp + stage
                if v == 0:
                    x = ids
                else:
                    key = ("F", c, mb)
                    links.wait_for(key, timeout_s, lambda k=key: f"evaluation: stage {stage} waits for the "
                                   f"activation of chunk {k[1]}, microbatch {k[2]}")
                    links.drain_new()
                    x = links.take(key)
                with tracing.span("eval_forward", "compute", chunk=c, microbatch=mb):
                    out = chunks[c](x, labels=labels if v == last_v else None)
                if v == last_v:
                    losses.append(float(out))
                else:  # the next stage continues v with the same chunk, or the next one after the last stage
                    links.send("F", c + 1 if stage == pp - 1 else c, mb, out)
    if links is not None:
        links.finish()
    return losses
