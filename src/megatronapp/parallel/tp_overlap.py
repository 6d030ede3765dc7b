"""Tensor-parallel communication overlap (MegaScale §3.3, Megatron's `--tp-comm-overlap`): with sequence
parallelism, the collectives around a GEMM are cut into chunks along the sequence and run while the GEMM works.

  column-parallel forward   all-gather x [b, s/tp, h] -> x W^T      chunk k+1 travels while chunk k multiplies
  column-parallel backward  g W -> reduce-scatter along the sequence each chunk's reduce-scatter starts as soon
                                                                    as its GEMM ends; dW runs while the last travel
  row-parallel forward      x W^T -> reduce-scatter                 as the column backward
  row-parallel backward     all-gather g -> g W, and dW             as the column forward

Chunk k of the local sequence holds positions [k s_c, (k+1) s_c) of every rank's shard, so its gathered rows
are the positions {r s/tp + k s_c + i} for every TP rank r: the GEMM of a chunk covers tp * s_c rows scattered
over the full sequence, and its result is written back to them. Every rank issues the same collectives in the
same order (chunk 0, 1, ...), as NCCL requires; all are issued at once and waited for in order, so on GPUs they
queue on NCCL's stream while the GEMMs run on the compute stream, and on gloo they progress on gloo's threads.
The numbers equal the plain path's: each output row is the same dot products and each sum the same terms.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from megatronapp.parallel import comm, weight_grad
from megatronapp.parallel.topology import Group

Matmul = Callable[[torch.Tensor], torch.Tensor]  # [tp, b, s_c, in] -> [tp, b, s_c, out]


def chunk_len(local_seq: int, chunks: int) -> int:
    """Positions per chunk of a local sequence slice; a clear error when `chunks` does not divide it."""
    if chunks < 1 or local_seq % chunks:
        raise ValueError(f"parallel.tp_comm_overlap_chunks={chunks} must divide the local sequence length "
                         f"{local_seq} (seq_len / tp)")
    return local_seq // chunks


def gather_matmul(x: torch.Tensor, group: Group, chunks: int, fn: Matmul,
                  keep_input: bool = True) -> tuple[torch.Tensor | None, torch.Tensor]:
    """All-gather the sequence-sharded `x` [b, s/tp, h] in chunks, each GEMM `fn` running as soon as its chunk
    has arrived (while later chunks travel). Returns (the gathered x [b, s, h] if `keep_input`, fn(x) [b, s, n])."""
    b, s_loc, h = x.shape
    tp, s_c = group.size, chunk_len(s_loc, chunks)
    pending = [comm.all_gather_async(x[:, k * s_c:(k + 1) * s_c].contiguous(), group,
                                     label=f"sp chunk {k}/{chunks}") for k in range(chunks)]
    full = x.new_empty(b, tp, chunks, s_c, h) if keep_input else None
    out = None
    for k, (xk, handle) in enumerate(pending):
        handle.wait()  # xk: [tp, b, s_c, h], every member's chunk
        yk = fn(xk)
        if out is None:
            out = yk.new_empty(b, tp, chunks, s_c, yk.shape[-1])
        out[:, :, k] = yk.transpose(0, 1)
        if full is not None:
            full[:, :, k] = xk.transpose(0, 1)
    s = tp * s_loc
    return (None if full is None else full.view(b, s, h)), out.view(b, s, out.shape[-1])


def matmul_reduce_scatter_start(x: torch.Tensor, group: Group, chunks: int,
                                fn: Matmul) -> list[tuple[torch.Tensor, comm.Handle]]:
    """GEMM `fn` of the full-sequence `x` [b, s, f] chunk by chunk, starting each chunk's reduce-scatter along the
    sequence as soon as its GEMM ends; finish with `matmul_reduce_scatter_finish`."""
    b, s, f = x.shape
    tp = group.size
    s_c = chunk_len(s // tp, chunks)
    x5 = x.reshape(b, tp, chunks, s_c, f)
    return [comm.reduce_scatter_async(fn(x5[:, :, k].transpose(0, 1)).contiguous(), group, dim=0,
                                      label=f"sp chunk {k}/{chunks}") for k in range(chunks)]


def matmul_reduce_scatter_finish(pending: list[tuple[torch.Tensor, comm.Handle]]) -> torch.Tensor:
    """Wait for the chunks' reduce-scatters: this rank's summed [b, s/tp, n]."""
    outs = []
    for out, handle in pending:
        handle.wait()
        outs.append(out.squeeze(0))  # [b, s_c, n]
    return torch.cat(outs, dim=1)


class _GatherLinear(torch.autograd.Function):
    """Column-parallel GEMM on a sequence-parallel input, over weights stacked along the output dim."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group, chunks: int, keep: bool, n: int,
                *params: torch.Tensor) -> torch.Tensor:
        weights, biases = params[:n], params[n:] or None
        w = weight_grad.cat_rows(weights)
        b = None if biases is None else weight_grad.cat_rows(biases)
        full, y = gather_matmul(x, group, chunks, lambda t: F.linear(t, w, b), keep_input=keep)
        ctx.group, ctx.chunks, ctx.params = group, chunks, (weights, biases)
        ctx.save_for_backward(full, *weights)
        return y

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        full, *weights = ctx.saved_tensors
        w = weight_grad.cat_rows(weights).to(g.dtype)
        pending = matmul_reduce_scatter_start(g, ctx.group, ctx.chunks, lambda t: t.matmul(w))
        grads = weight_grad.weight_grads(*ctx.params, full, g)  # dW runs while the reduce-scatters travel
        return (matmul_reduce_scatter_finish(pending), None, None, None, None, *grads)


class _LinearReduceScatter(torch.autograd.Function):
    """Row-parallel GEMM whose partial sums are reduce-scattered along the sequence (no bias: added after)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group, chunks: int, weight: torch.Tensor) -> torch.Tensor:
        ctx.group, ctx.chunks, ctx.params = group, chunks, ((weight,), None)
        ctx.save_for_backward(x, weight)
        return matmul_reduce_scatter_finish(matmul_reduce_scatter_start(x, group, chunks,
                                                                        lambda t: F.linear(t, weight)))

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        x, weight = ctx.saved_tensors
        w = weight.to(g.dtype)
        g_full, grad_x = gather_matmul(g.contiguous(), ctx.group, ctx.chunks, lambda t: t.matmul(w))
        return (grad_x, None, None, *weight_grad.weight_grads(*ctx.params, x, g_full))


def gather_linear(x: torch.Tensor, weights: tuple[torch.Tensor, ...], biases: tuple[torch.Tensor, ...] | None,
                  group: Group, chunks: int) -> torch.Tensor:
    """Sequence-parallel x [b, s/tp, h] -> x [W_1; W_2; ...]^T + b over the full sequence [b, s, sum of outs]."""
    keep = torch.is_grad_enabled()  # the gathered input is kept for dW only when a backward may come
    return _GatherLinear.apply(x, group, chunks, keep, len(weights), *weights, *(biases or ()))


def linear_reduce_scatter(x: torch.Tensor, weight: torch.Tensor, group: Group, chunks: int) -> torch.Tensor:
    """Partial x W^T [b, s, n] summed over TP and scattered along the sequence: [b, s/tp, n]."""
    return _LinearReduceScatter.apply(x, group, chunks, weight)
