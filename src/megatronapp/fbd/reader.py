"""Batches of an FBD rank, built ahead by the engine's prefetch worker when `train.data_prefetch` > 0.

Backward ranks and forward stage 0 read batches themselves (a batch is a pure function of (seed, step)); no
FBD rank shares a batch through a collective, so the worker cannot change any group's collective order. As in
the trainer, the worker is (re)started at the step asked for, so a resumed run prefetches from its first step.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from megatronapp.data.prefetch import Batch, Prefetcher


class StepReader:
    """`get(step)`: `make(step)` now (depth 0) or from a Prefetcher `depth` steps ahead."""

    def __init__(self, make: Callable[[int], Batch], depth: int, device: torch.device):
        self.make, self.depth, self.pin = make, depth, device.type == "cuda"
        self.prefetcher: Prefetcher | None = None

    def get(self, step: int) -> Batch:
        if self.depth == 0:
            return self.make(step)
        if self.prefetcher is None or self.prefetcher.next_step != step:
            self.close()
            self.prefetcher = Prefetcher(self.make, step, self.depth, pin_memory=self.pin)
        return self.prefetcher.get(step)

    def close(self) -> None:
        if self.prefetcher is not None:
            self.prefetcher.close()
            self.prefetcher = None
