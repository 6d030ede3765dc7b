"""Split-independent initialisation: each full weight is `randn(full shape) * std` from a generator seeded by
(seed, parameter name), and a rank holds exactly its TP slice of it, so any tp/pp/vpp split holds the weights
of the one-process model.

A rank never materialises a full weight: the generator's stream is drawn row block by row block and only the
rank's own part of each block is kept, so the memory initialisation needs beyond the shard is one block.
"""
from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Iterator

import torch
from torch import nn

from megatronapp.config import ModelConfig
from megatronapp.model.norms import is_norm
from megatronapp.parallel.tensor_parallel import tp_rank, tp_size
from megatronapp.parallel.topology import Group

# Output projections of residual branches get std / sqrt(2 * num_layers) (GPT-2, Megatron).
_RESIDUAL_OUTPUTS = ("attn.proj.weight", "mlp.fc2.weight", "mlp.down.weight")

# Values drawn per block (4 MiB in fp32): the transient memory of initialising one parameter.
BLOCK_NUMEL = 1 << 20

# torch's CPU normal sampler turns uniforms into normals in independent groups of this many consecutive values.
_NORMAL_GROUP = 16


def param_seed(seed: int, name: str) -> int:
    """A stable 63-bit seed for one parameter (Python's hash() is salted per process, so not that)."""
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def full_shape(p: nn.Parameter, group: Group | None) -> tuple[int, ...]:
    """Shape of the unsharded tensor behind a (possibly TP-sharded) parameter; for a vocab-parallel weight, the
    real vocabulary's rows (the padding rows depend on tp, so they are no part of the model's value)."""
    shape = list(p.shape)
    if getattr(p, "vocab_size", None) is not None:
        shape[0] = p.vocab_size
    elif getattr(p, "tensor_parallel", False):
        shape[p.partition_dim] *= tp_size(group)
    return tuple(shape)


def row_blocks(rows: int, row_numel: int, block_numel: int | None = None) -> Iterator[tuple[int, int]]:
    """Row ranges [start, end) whose separate `randn` calls, on one generator, give exactly the values of one
    `randn` over all rows.

    torch's CPU sampler draws one uniform per value and maps each aligned group of 16 to normals on its own;
    a size that is not a multiple of 16 has its last 16 values drawn again. So every block but the last holds a
    multiple of 16 values, and the last one keeps the whole tail (at least 16 values, or the whole tensor).
    """
    align = _NORMAL_GROUP // math.gcd(row_numel, _NORMAL_GROUP)  # rows per multiple of 16 values
    step = max(align, (block_numel or BLOCK_NUMEL) // max(row_numel, 1) // align * align)
    start = 0
    while start < rows:
        end = min(rows, start + step)
        if (rows - end) * row_numel < _NORMAL_GROUP:
            end = rows
        yield start, end
        start = end


def fill_normal_shard(out: torch.Tensor, full: tuple[int, ...], dim: int, rank: int, std: float,
                      gen: torch.Generator, block_numel: int | None = None) -> None:
    """Write into `out` the `rank`-th slice of size out.shape[dim] along `dim` of `randn(full, generator=gen) * std`,
    drawing the full tensor one row block at a time (never all of it).

    Along dim 0 the slices may run past full[0] (a padded vocabulary): rows past it are padding and set to zero.
    """
    rows, row_numel, local = full[0], math.prod(full[1:]), out.shape[dim]
    # Along dim 0 this rank's part is a contiguous run of rows; along another dim it is a slice of every row.
    lo, hi = (rank * local, min((rank + 1) * local, rows)) if dim == 0 else (0, rows)
    out[max(hi - lo, 0):].zero_()
    if hi <= lo:
        return
    for start, end in row_blocks(rows, row_numel, block_numel):
        if start >= hi:
            break  # the rest of the stream belongs to other ranks
        block = torch.randn((end - start, *full[1:]), generator=gen)
        if end <= lo:
            continue  # drawn only to advance the generator to this rank's rows
        # Scale in fp32 before the copy casts, as the one-process `randn(...) * std` does.
        if dim == 0:
            a, b = max(start, lo), min(end, hi)
            out[a - lo:b - lo].copy_(block[a - start:b - start] * std)
        else:
            out[start:end].copy_(block.narrow(dim, rank * local, local) * std)


def init_std(name: str, cfg: ModelConfig) -> float:
    """Standard deviation of the normal initialisation of weight `name`."""
    if name.endswith(_RESIDUAL_OUTPUTS):
        return cfg.init_std / math.sqrt(2.0 * cfg.num_layers)
    return cfg.init_std


def reset_parameters(module: nn.Module, cfg: ModelConfig, seed: int, tp_group: Group | None,
                     init_name: Callable[[str], str] = lambda name: name) -> None:
    """Initialise every parameter of `module` as its slice of the one-process model; `init_name` maps a parameter
    to the name that seeds it (a tied embedding copy is seeded like the embedding it copies)."""
    norm_weights = {id(m.weight) for m in module.modules() if is_norm(m)}
    tp, rank = tp_size(tp_group), tp_rank(tp_group)
    with torch.no_grad():
        for name, p in module.named_parameters():
            name = init_name(name)
            if name.endswith(".bias"):
                p.zero_()
            elif id(p) in norm_weights:
                p.fill_(1.0)
            else:
                sharded = getattr(p, "tensor_parallel", False) and tp > 1
                gen = torch.Generator().manual_seed(param_seed(seed, name))
                fill_normal_shard(p, full_shape(p, tp_group), p.partition_dim if sharded else 0,
                                  rank if sharded else 0, init_std(name, cfg), gen)
