"""Data-parallel gradient reduction in buckets, overlapped with the last backward of each chunk.

Every parameter's `.grad` is a view into a flat fp32 buffer of its bucket (Megatron's grad buffer, DDP's
gradient_as_bucket_view), so autograd accumulates microbatch gradients straight into the buffer and a bucket is
all-reduced without copies. During the *final* backward of a chunk, a parameter's gradient is complete as soon as
autograd has accumulated into it (post-accumulate-grad hook); when every parameter of a bucket is complete the
buffer is all-reduced asynchronously on the DP group while backward goes on. `finish()` waits and averages.

Every DP replica issues the bucket all-reduces in one fixed order (chunks from last to first, the order in which
their final backwards end under every static schedule; buckets in index order within a chunk), whatever order
its pipeline policy ran the backwards in: a bucket that is ready early waits for the ones before it. Replicas
running a dynamic (MegaDPP) policy decide their task orders independently, and NCCL, like gloo, would hang or
average different chunks' gradients together if the collectives of one group were issued in different orders.
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
    buffer: torch.Tensor
    handle: comm.Handle | None = None
    ready: set[int] = field(default_factory=set)
    views: list[torch.Tensor] = field(default_factory=list)

    def bind(self) -> None:
        """Point every parameter's .grad at its slice of the buffer."""
        self.views, offset = [], 0
        for p in self.params:
            n = p.numel()
            p.grad = self.buffer[offset:offset + n].view_as(p)
            self.views.append(p.grad)
            offset += n


class GradReducer:
    """Implements the executor's GradSync: owns the gradient buffers and averages them over `dp_group`."""

    def __init__(self, chunks: list[nn.Module], dp_group: Group, bucket_mb: float = 4.0, overlap: bool = True):
        self.dp_group, self.overlap = dp_group, overlap
        self.buckets: dict[int, list[_Bucket]] = {}
        self._armed: int | None = None
        self._hooks = []
        self._order: list[tuple[int, int]] = []  # (chunk, bucket) in issue order, the same on every replica
        self._next = 0  # position in _order of the next bucket to issue
        self.bucket_bytes = int(bucket_mb * 2**20)
        for c, chunk in enumerate(chunks):
            self.buckets[c] = []
            for ps in self._bucket_params(chunk):
                bucket = _Bucket(ps, self._new_buffer(ps))
                bucket.bind()
                self.buckets[c].append(bucket)
            self._order[:0] = [(c, bi) for bi in range(len(self.buckets[c]))]  # later chunks go first
            if dp_group.size > 1 and overlap:
                for bi, b in enumerate(self.buckets[c]):
                    for p in b.params:
                        self._hooks.append(p.register_post_accumulate_grad_hook(self._make_hook(c, bi, p)))

    def _solo(self, chunk: nn.Module) -> set[int]:
        """Ids of parameters that get a bucket of their own (none in plain DP)."""
        return set()

    def _bucket_params(self, chunk: nn.Module) -> list[list[nn.Parameter]]:
        """The chunk's trainable parameters cut into buckets of about `bucket_bytes` of fp32 gradient."""
        # Reverse registration order approximates the order in which backward finishes gradients.
        params = [p for p in chunk.parameters() if p.requires_grad][::-1]
        solo = self._solo(chunk)
        groups, cur, size = [], [], 0
        for p in params:
            if id(p) in solo:
                if cur:
                    groups.append(cur)
                groups.append([p])
                cur, size = [], 0
                continue
            cur.append(p)
            size += p.numel() * 4
            if size >= self.bucket_bytes:
                groups.append(cur)
                cur, size = [], 0
        if cur:
            groups.append(cur)
        return groups

    def _new_buffer(self, params: list[nn.Parameter]) -> torch.Tensor:
        # fp32 whatever the parameter dtype: gradients are reduced in fp32
        return torch.zeros(sum(p.numel() for p in params), dtype=torch.float32, device=params[0].device)

    def _start(self, b: _Bucket, chunk: int, bi: int) -> comm.Handle:
        """Issue the bucket's collective over the DP group."""
        return comm.all_reduce_async(b.buffer, self.dp_group, label=f"grad chunk {chunk} bucket {bi}")

    def _average(self, b: _Bucket, inv: float) -> None:
        """Turn the reduced sum into the mean (in the part of the buffer this rank uses)."""
        b.buffer.mul_(inv)

    def zero_grad(self) -> None:
        """Zero every gradient buffer (and re-bind a .grad something replaced)."""
        for buckets in self.buckets.values():
            for b in buckets:
                b.buffer.zero_()
                if any(p.grad is not v for p, v in zip(b.params, b.views)):
                    b.bind()

    def _make_hook(self, chunk: int, bi: int, p: nn.Parameter):
        def hook(param: torch.Tensor) -> None:
            if self._armed != chunk:
                return
            b = self.buckets[chunk][bi]
            b.ready.add(id(p))
            if len(b.ready) == len(b.params):
                self._issue_ready()
        return hook

    def _issue_ready(self) -> None:
        """Issue buckets in the fixed order for as long as the next one is complete."""
        while self._next < len(self._order):
            c, bi = self._order[self._next]
            b = self.buckets[c][bi]
            if len(b.ready) < len(b.params):
                return
            b.handle = self._start(b, c, bi)
            self._next += 1

    # -- GradSync ---------------------------------------------------------------------------------------
    def before_final_backward(self, chunk: int) -> None:
        self._armed = chunk

    def after_final_backward(self, chunk: int) -> None:
        self._armed = None
        if self.dp_group.size == 1:
            return
        for b in self.buckets[chunk]:  # complete now, including params that got no gradient (or no overlap)
            b.ready.update(id(p) for p in b.params)
        self._issue_ready()

    def finish(self) -> None:
        """Wait for every bucket and average over the DP replicas (in place in the buffers)."""
        if self.dp_group.size == 1:
            return
        inv = 1.0 / self.dp_group.size
        for buckets in self.buckets.values():  # a chunk with no final backward on this step (none today)
            for b in buckets:
                b.ready.update(id(p) for p in b.params)
        self._issue_ready()
        for c, bi in self._order:
            b = self.buckets[c][bi]
            b.handle.wait()
            self._average(b, inv)
            b.handle = None
            b.ready.clear()
        self._next = 0

    def reset(self) -> None:
        """Forget a step that will not finish (a failed generation): its collectives' handles and readiness. The
        gradients themselves are zeroed by the next step's `zero_grad`."""
        self._armed, self._next = None, 0
        for buckets in self.buckets.values():
            for b in buckets:
                b.handle = None
                b.ready.clear()

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

