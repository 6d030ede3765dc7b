"""Cut a model's layers into pipeline stages and virtual chunks.

A pure function of config numbers, below config.py: the FLOP model (flops.py) and every layer above it
(parallel/, train/, the modules) cut layers the same way."""
from __future__ import annotations

from megatronapp.errors import ConfigError


def split_layers(num_layers: int, pp: int, vpp: int = 1) -> list[tuple[int, int]]:
    """Layer ranges [start, end) of the pp*vpp virtual stages, in virtual-stage order.

    Uneven counts give the extra layers to the middle virtual stages, because the first holds the embedding
    and the last the output layer and loss: this evens out the work more than front-loading would.
    """
    V = pp * vpp
    if num_layers < V:
        raise ConfigError(f"model.num_layers={num_layers} < pp*vpp = {V}: every pipeline chunk needs a layer")
    base, extra = divmod(num_layers, V)
    # Middle-out: virtual stages nearest the centre get the remainder first.
    by_centre = sorted(range(V), key=lambda v: (abs(v - (V - 1) / 2), v))
    sizes = [base + (1 if v in set(by_centre[:extra]) else 0) for v in range(V)]
    ranges, start = [], 0
    for n in sizes:
        ranges.append((start, start + n))
        start += n
    return ranges


def stage_chunks(num_layers: int, pp: int, vpp: int, stage: int) -> list[tuple[int, int]]:
    """Layer ranges of the chunks of one pipeline rank: chunk c is virtual stage c*pp + stage."""
    ranges = split_layers(num_layers, pp, vpp)
    return [ranges[c * pp + stage] for c in range(vpp)]
