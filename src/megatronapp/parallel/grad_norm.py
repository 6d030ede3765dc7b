"""Global gradient-norm clipping that is correct across TP, PP and DP.

After DP reduction every replica holds the same gradients, so the norm is taken over one model replica:
TP-sharded parameters contribute their shard, parameters replicated across TP are counted on TP rank 0 only,
the tied-embedding copy on the last pipeline stage is skipped, and the sum of squares is all-reduced over the
TP and PP groups.
"""
from __future__ import annotations

import torch
from torch import nn

from megatronapp.parallel import comm
from megatronapp.parallel.topology import Topology


def _counted_params(chunks: list[nn.Module], topo: Topology):
    pp, coord = topo.pp, topo.coord
    for c, chunk in enumerate(chunks):
        shared = chunk.shared_embedding_weight() if hasattr(chunk, "shared_embedding_weight") else None
        first_virtual = c * pp + coord.pp == 0
        for p in chunk.parameters():
            if p.grad is None:
                continue
            if shared is not None and p is shared and not first_virtual:
                continue  # the last stage's copy of a tied embedding: counted on the first stage
            if not getattr(p, "tensor_parallel", False) and coord.tp != 0:
                continue
            yield p


def global_grad_norm(chunks: list[nn.Module], topo: Topology) -> float:
    """L2 norm of the whole model's gradient, identical on every rank."""
    return float(_global_norm(chunks, topo))


def _global_norm(chunks: list[nn.Module], topo: Topology) -> torch.Tensor:
    """The global norm as a float64 tensor [1] on the parameters' device."""
    grads = [p.grad.detach() for p in _counted_params(chunks, topo)]
    # on the parameters' device: NCCL reduces CUDA tensors only
    device = next((p.device for c in chunks for p in c.parameters()), torch.device("cpu"))
    sq = torch.zeros(1, dtype=torch.float64, device=device)
    if grads:  # one fused norm over all tensors (torch's foreach kernels), squared once in float64
        sq += torch.nn.utils.get_total_norm(grads, norm_type=2.0, foreach=True).double() ** 2
    comm.all_reduce(sq, topo.tp_group)
    comm.all_reduce(sq, topo.pp_group)
    return sq.sqrt()


def clip_grad_norm(chunks: list[nn.Module], topo: Topology, max_norm: float) -> float:
    """Scale all gradients so the global norm is at most `max_norm` (0 disables); return the norm before."""
    total = _global_norm(chunks, topo)
    norm = float(total)  # the step's one host read of it: the metrics and the clip decision
    if max_norm > 0 and max_norm / (norm + 1e-6) < 1.0:
        params = [p for chunk in chunks for p in chunk.parameters() if p.grad is not None]
        # the norm as torch.tensor(norm) would hold it (fp32), but already on the device: no host-to-device copy
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total.to(torch.float32).reshape(()), foreach=True)
    return norm
