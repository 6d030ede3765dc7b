"""Megatron-style tensor parallelism: autograd mappings, parallel linear layers, vocab-parallel embedding and loss.

Each mapping is a pair of conjugate collectives (what forward does, backward undoes):
  copy_to_tp            identity        | all-reduce
  reduce_from_tp        all-reduce      | identity
  gather_from_tp(dim)   all-gather      | keep own slice
  scatter_to_tp(dim)    keep own slice  | all-gather
  gather_from_sp        all-gather seq  | reduce-scatter seq      (sequence parallelism, [b, s, h])
  reduce_scatter_to_sp  reduce-scatter  | all-gather seq
With `tp_comm_overlap` the last two, around the GEMMs of the parallel linear layers, are cut into chunks that
overlap with those GEMMs (tp_overlap.py).
All communication goes through megatronapp.parallel.comm. With no group, or a group of one, every mapping is
the identity and every layer is a plain layer.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from megatronapp.parallel import comm, tp_overlap, weight_grad
from megatronapp.parallel.topology import Group

SEQ_DIM = 1  # hidden states are [batch, seq, hidden]


def tp_size(group: Group | None) -> int:
    """Number of tensor-parallel ranks in `group` (1 when None)."""
    return 1 if group is None else group.size


def tp_rank(group: Group | None) -> int:
    """This process's index inside `group` (0 when None or alone)."""
    if group is None or group.size == 1:
        return 0
    return group.rank_in(dist.get_rank())


def _active(group: Group | None) -> bool:
    return group is not None and group.size > 1


def _own_slice(x: torch.Tensor, group: Group, dim: int) -> torch.Tensor:
    size = x.shape[dim]
    if size % group.size:
        raise ValueError(f"dimension {dim} of size {size} is not divisible by the tp group size {group.size}")
    return x.chunk(group.size, dim=dim)[tp_rank(group)].contiguous()


def _all_reduce(x: torch.Tensor, group: Group) -> torch.Tensor:
    # comm reduces in place; work on a copy so autograd never sees a saved tensor change under it.
    return comm.all_reduce(x.contiguous().clone(), group)


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        return _all_reduce(g, ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group) -> torch.Tensor:
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        return g, None


class _GatherFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim = group, dim
        return comm.all_gather(x.contiguous(), group, dim=dim)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        return _own_slice(g, ctx.group, ctx.dim), None, None


class _ScatterToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim = group, dim
        return _own_slice(x, group, dim)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        return comm.all_gather(g.contiguous(), ctx.group, dim=ctx.dim), None, None


class _ReduceScatterToSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group = group
        return comm.reduce_scatter(x.contiguous(), group, dim=SEQ_DIM)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        return comm.all_gather(g.contiguous(), ctx.group, dim=SEQ_DIM), None


class _GatherFromSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group = group
        return comm.all_gather(x.contiguous(), group, dim=SEQ_DIM)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        return comm.reduce_scatter(g.contiguous(), ctx.group, dim=SEQ_DIM), None


def copy_to_tp(x: torch.Tensor, group: Group | None) -> torch.Tensor:
    """Identity forward, all-reduce of the gradient backward (input of a column-parallel layer)."""
    return _CopyToTP.apply(x, group) if _active(group) else x


def reduce_from_tp(x: torch.Tensor, group: Group | None) -> torch.Tensor:
    """All-reduce forward, identity backward (output of a row-parallel layer)."""
    return _ReduceFromTP.apply(x, group) if _active(group) else x


def gather_from_tp(x: torch.Tensor, group: Group | None, dim: int = -1) -> torch.Tensor:
    """Concatenate the shards along `dim`; backward keeps this rank's slice of the gradient."""
    if not _active(group):
        return x
    return _GatherFromTP.apply(x, group, dim % x.dim())


def scatter_to_tp(x: torch.Tensor, group: Group | None, dim: int = -1) -> torch.Tensor:
    """Keep this rank's slice along `dim`; backward gathers the gradient."""
    if not _active(group):
        return x
    return _ScatterToTP.apply(x, group, dim % x.dim())


def gather_from_sp(x: torch.Tensor, group: Group | None) -> torch.Tensor:
    """[b, s/tp, h] -> [b, s, h]; backward reduce-scatters the gradient along the sequence."""
    return _GatherFromSP.apply(x, group) if _active(group) else x


def reduce_scatter_to_sp(x: torch.Tensor, group: Group | None) -> torch.Tensor:
    """Partial [b, s, h] -> summed [b, s/tp, h]; backward all-gathers the gradient along the sequence."""
    return _ReduceScatterToSP.apply(x, group) if _active(group) else x


def scatter_to_sp(x: torch.Tensor, group: Group | None) -> torch.Tensor:
    """Replicated [b, s, h] -> this rank's [b, s/tp, h]; backward all-gathers."""
    return scatter_to_tp(x, group, dim=SEQ_DIM)


def mark_tensor_parallel(p: nn.Parameter, partition_dim: int) -> nn.Parameter:
    """Tag a TP-sharded parameter: its full tensor is split into equal contiguous slices along `partition_dim`."""
    p.tensor_parallel = True
    p.partition_dim = partition_dim
    return p


def mark_vocab_parallel(p: nn.Parameter, vocab_size: int) -> nn.Parameter:
    """Tag a weight whose rows are the padded vocabulary split across TP ranks; rows >= vocab_size are padding
    (zero, masked out of loss and sampling, so they get no gradient and stay zero)."""
    mark_tensor_parallel(p, 0)
    p.vocab_size = vocab_size
    return p


def shard(full: torch.Tensor, p: nn.Parameter, group: Group | None) -> torch.Tensor:
    """This rank's slice of a parameter's full tensor (the full tensor itself when `p` is not sharded).

    For a vocab-parallel weight, `full` may hold only the real vocab_size rows: the slice then comes back with
    its padding rows zero, so a checkpoint or initial value without padding loads at any tp.
    """
    vocab = getattr(p, "vocab_size", None)
    if vocab is not None and full.shape[0] == vocab:
        local = p.shape[0]
        start = tp_rank(group) * local
        rows = full[start:start + local]
        padding = full.new_zeros(local - rows.shape[0], *full.shape[1:])
        return torch.cat([rows, padding]) if padding.shape[0] else rows.contiguous()
    if not getattr(p, "tensor_parallel", False) or not _active(group):
        return full
    return _own_slice(full, group, p.partition_dim)


def _divide(n: int, group: Group | None, what: str) -> int:
    size = tp_size(group)
    if n % size:
        raise ValueError(f"{what}={n} is not divisible by the tensor-parallel size {size}")
    return n // size


class ColumnParallelLinear(nn.Module):
    """y = x A^T + b with A split by rows (output features) across TP ranks; y stays sharded unless gathered.

    With sequence parallelism the input is [b, s/tp, h] and is all-gathered along the sequence first; with
    `tp_comm_overlap` chunks (> 0) that all-gather is cut into chunks overlapped with the GEMM (tp_overlap.py).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, tp_group: Group | None = None,
                 sequence_parallel: bool = False, gather_output: bool = False, tp_comm_overlap: int = 0):
        super().__init__()
        self.tp_group, self.gather_output = tp_group, gather_output
        self.sequence_parallel = sequence_parallel and _active(tp_group)
        self.overlap_chunks = tp_comm_overlap if self.sequence_parallel else 0
        self.in_features, self.out_features = in_features, out_features
        local = _divide(out_features, tp_group, "output features")
        self.weight = mark_tensor_parallel(nn.Parameter(torch.empty(local, in_features)), 0)
        self.bias = mark_tensor_parallel(nn.Parameter(torch.zeros(local)), 0) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = column_parallel_linear(x, (self,))
        return gather_from_tp(y, self.tp_group, dim=-1) if self.gather_output else y


def column_parallel_linear(x: torch.Tensor, layers: tuple[ColumnParallelLinear, ...]) -> torch.Tensor:
    """Column-parallel layers that read the same input, run as one: one input collective and one GEMM over their
    local weights stacked [W_1 shard; W_2 shard; ...]; their local outputs side by side [.., sum of local outs].

    Each rank's stack holds its own shard of every layer, so it is still a set of whole output units per layer
    (SwiGLU's gate and up) while the parameters, their names and shards stay those of the separate layers.
    """
    first = layers[0]
    group, sp, chunks = first.tp_group, first.sequence_parallel, first.overlap_chunks
    if any((m.tp_group, m.sequence_parallel, m.overlap_chunks) != (group, sp, chunks) for m in layers):
        raise ValueError("column_parallel_linear: the layers must share tp group, sequence parallelism and overlap")
    weights = tuple(m.weight for m in layers)
    biases = tuple(m.bias for m in layers) if all(m.bias is not None for m in layers) else None
    if any(m.bias is not None for m in layers) and biases is None:
        raise ValueError("column_parallel_linear: either every layer has a bias or none has")
    if chunks:
        return tp_overlap.gather_linear(x, weights, biases, group, chunks)
    x = gather_from_sp(x, group) if sp else copy_to_tp(x, group)
    return weight_grad.linear_stacked(x, weights, biases)  # split backward: W may be deferred


class RowParallelLinear(nn.Module):
    """y = x A^T + b with A split by columns (input features); partial outputs are summed across TP ranks.

    With sequence parallelism the sum is a reduce-scatter along the sequence (cut into chunks overlapped with
    the GEMM when `tp_comm_overlap` > 0), and the bias (added after it on a sequence slice) gets a partial
    gradient: it is marked `sequence_parallel`.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, tp_group: Group | None = None,
                 sequence_parallel: bool = False, tp_comm_overlap: int = 0):
        super().__init__()
        self.tp_group = tp_group
        self.sequence_parallel = sequence_parallel and _active(tp_group)
        self.overlap_chunks = tp_comm_overlap if self.sequence_parallel else 0
        self.in_features, self.out_features = in_features, out_features
        local = _divide(in_features, tp_group, "input features")
        self.weight = mark_tensor_parallel(nn.Parameter(torch.empty(out_features, local)), 1)
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None
        if self.bias is not None and self.sequence_parallel:
            self.bias.sequence_parallel = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.overlap_chunks:
            y = tp_overlap.linear_reduce_scatter(x, self.weight, self.tp_group, self.overlap_chunks)
        else:
            y = weight_grad.linear(x, self.weight)
            y = reduce_scatter_to_sp(y, self.tp_group) if self.sequence_parallel else reduce_from_tp(y, self.tp_group)
        return y + self.bias if self.bias is not None else y


class VocabParallelEmbedding(nn.Module):
    """Embedding table split by vocabulary rows; each rank looks up its own ids and the results are summed.

    `num_embeddings` is the padded row count (see ModelConfig.padded_vocab_size); ids are < `vocab_size`.
    With sequence parallelism the sum is a reduce-scatter, so the output is this rank's [b, s/tp, h].
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, tp_group: Group | None = None,
                 sequence_parallel: bool = False, vocab_size: int | None = None):
        super().__init__()
        self.tp_group = tp_group
        self.sequence_parallel = sequence_parallel and _active(tp_group)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.vocab_size = num_embeddings if vocab_size is None else vocab_size
        local = _divide(num_embeddings, tp_group, "padded vocab size")
        self.vocab_start = tp_rank(tp_group) * local
        self.vocab_end = self.vocab_start + local
        self.weight = mark_vocab_parallel(nn.Parameter(torch.empty(local, embedding_dim)), self.vocab_size)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if not _active(self.tp_group):
            return F.embedding(ids, self.weight)
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local_ids = (ids - self.vocab_start).masked_fill(outside, 0)
        out = F.embedding(local_ids, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return reduce_scatter_to_sp(out, self.tp_group)
        return reduce_from_tp(out, self.tp_group)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, labels: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.in_dtype = logits.dtype
        logits = logits.float()
        # Softmax over a vocabulary split across ranks: global max, global sum of exp, and the target logit
        # taken from the one rank that owns it.
        logits_max = logits.max(dim=-1).values
        comm.all_reduce(logits_max, group, op="max")
        shifted = logits - logits_max.unsqueeze(-1)
        local_v = logits.shape[-1]
        start = tp_rank(group) * local_v
        outside = (labels < start) | (labels >= start + local_v)
        local_labels = (labels - start).masked_fill(outside, 0)
        target = shifted.gather(-1, local_labels.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        comm.all_reduce(target, group)
        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)
        comm.all_reduce(sum_exp, group)
        loss = sum_exp.log() - target
        softmax = exp / sum_exp.unsqueeze(-1)
        ctx.save_for_backward(softmax, local_labels, outside)
        return loss

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        softmax, local_labels, outside = ctx.saved_tensors
        grad = softmax.clone()
        hit = (~outside).to(grad.dtype)
        grad.scatter_add_(-1, local_labels.unsqueeze(-1), -hit.unsqueeze(-1))
        return (grad * g.unsqueeze(-1)).to(ctx.in_dtype), None, None


def mask_vocab_padding(local_logits: torch.Tensor, vocab_size: int, group: Group | None) -> torch.Tensor:
    """Logits sharded along the padded vocabulary [.., v/tp] with padding ids (>= vocab_size) set to -inf, so
    softmax gives them probability 0 and no gradient; the tensor itself when this shard holds no padding."""
    local_v = local_logits.shape[-1]
    real = vocab_size - tp_rank(group) * local_v  # real ids in this shard (<= 0: the whole shard is padding)
    if real >= local_v:
        return local_logits
    padding = torch.arange(local_v, device=local_logits.device) >= real
    return local_logits.masked_fill(padding, float("-inf"))


def vocab_parallel_cross_entropy(local_logits: torch.Tensor, labels: torch.Tensor, group: Group | None,
                                 vocab_size: int | None = None) -> torch.Tensor:
    """Per-token cross-entropy [b, s] from logits sharded along the vocabulary [b, s, v/tp]; never gathers them.

    With `vocab_size`, ids >= vocab_size are padding: they take no part in the softmax, so the loss equals the
    loss over the real vocabulary alone and padding rows of the output weight get a zero gradient.
    """
    if not _active(group):
        if vocab_size is not None:
            local_logits = local_logits[..., :vocab_size]
        flat = F.cross_entropy(local_logits.float().flatten(0, -2), labels.flatten(), reduction="none")
        return flat.view(labels.shape)
    if vocab_size is not None:
        local_logits = mask_vocab_padding(local_logits, vocab_size, group)
    return _VocabParallelCrossEntropy.apply(local_logits, labels, group)


def sync_sequence_parallel_grads(module: nn.Module, tp_group: Group | None) -> None:
    """All-reduce over TP the gradients of parameters marked `sequence_parallel` (one collective per dtype)."""
    if not _active(tp_group):
        return
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for p in module.parameters():
        if getattr(p, "sequence_parallel", False) and p.grad is not None:
            by_dtype.setdefault(p.grad.dtype, []).append(p.grad)
    for grads in by_dtype.values():
        flat = torch.cat([g.reshape(-1) for g in grads])
        comm.all_reduce(flat, tp_group)
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()
