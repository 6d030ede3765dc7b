"""Data-parallel gradient reduction in buckets, overlapped with the last backward of each chunk.

Gradients accumulate locally over microbatches. During the *final* backward of a chunk, a parameter's
gradient is complete as soon as autograd has accumulated into it (post-accumulate-grad hook); when every
parameter of a bucket is complete the bucket is flattened and all-reduced asynchronously on the DP group while
backward goes on. `finish()` waits for the reductions and writes the averaged gradients back.
Reduction is always in fp32 (gradients of fp32 master weights), whatever the compute dtype.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from megatronapp.parallel import comm
from megatronapp.parallel.topology import Group


@dataclass
class _Bucket:
    params: list[nn.Parameter]
    pending: int = 0
    flat: torch.Tensor | None = None
    handle: comm.Handle | None = None
    ready: set[int] = field(default_factory=set)


class GradReducer:
    """Implements the executor's GradSync: averages gradients over `dp_group` with overlap."""

    def __init__(self, chunks: list[nn.Module], dp_group: Group, bucket_mb: float = 4.0, overlap: bool = True):
        self.dp_group, self.overlap = dp_group, overlap
        self.buckets: dict[int, list[_Bucket]] = {}
        self._armed: int | None = None
        self._hooks = []
        limit = int(bucket_mb * 2**20)
        for c, chunk in enumerate(chunks):
            # Reverse registration order approximates the order in which backward finishes gradients.
            params = [p for p in chunk.parameters() if p.requires_grad][::-1]
            buckets, cur, size = [], [], 0
            for p in params:
                cur.append(p)
                size += p.numel() * 4
                if size >= limit:
                    buckets.append(_Bucket(cur))
                    cur, size = [], 0
            if cur:
                buckets.append(_Bucket(cur))
            self.buckets[c] = buckets
            if dp_group.size > 1 and overlap:
                for bi, b in enumerate(buckets):
                    for p in b.params:
                        self._hooks.append(p.register_post_accumulate_grad_hook(self._make_hook(c, bi, p)))

    def _make_hook(self, chunk: int, bi: int, p: nn.Parameter):
        def hook(param: torch.Tensor) -> None:
            if self._armed != chunk:
                return
            b = self.buckets[chunk][bi]
            b.ready.add(id(p))
            if len(b.ready) == len(b.params) and b.handle is None:
                self._launch(b)
        return hook

    def _launch(self, b: _Bucket) -> None:
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in b.params]
        b.flat = torch.cat([g.reshape(-1).float() for g in grads])
        b.handle = comm.all_reduce_async(b.flat, self.dp_group)

    # -- GradSync ---------------------------------------------------------------------------------------
    def before_final_backward(self, chunk: int) -> None:
        self._armed = chunk

    def after_final_backward(self, chunk: int) -> None:
        self._armed = None
        if self.dp_group.size == 1:
            return
        for b in self.buckets[chunk]:  # buckets with unused params (or no overlap) go now
            if b.handle is None:
                self._launch(b)

    def finish(self) -> None:
        """Wait for every bucket and write the DP-averaged gradients back into `.grad`."""
        if self.dp_group.size == 1:
            return
        inv = 1.0 / self.dp_group.size
        for buckets in self.buckets.values():
            for b in buckets:
                if b.handle is None:
                    self._launch(b)
                b.handle.wait()
                offset = 0
                for p in b.params:
                    n = p.numel()
                    g = b.flat[offset:offset + n].view_as(p).mul_(inv).to(p.dtype)
                    if p.grad is None:
                        p.grad = g.clone()
                    else:
                        p.grad.copy_(g)
                    offset += n
                b.flat, b.handle = None, None
                b.ready.clear()

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
