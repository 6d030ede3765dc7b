"""Serve a trainer checkpoint from several ranks without building the whole model anywhere.

A checkpoint holds one file per training rank (`train/checkpoint.py`), each with its stage's chunks as TP slices.
When the serving TP size equals the training one, serving TP rank t reads only the files of training TP rank t
(data-parallel replica 0, every pipeline stage, since the serving stages may cut the layers differently) and
copies the tensors it holds straight into its slices. Otherwise it reads the same files for every TP rank, joins
each weight along its partition dimension and takes its own slice (`megatronapp.train.consolidate` does the same
for one process).
"""
from __future__ import annotations

from pathlib import Path

import torch

from megatronapp.model.transformer import TransformerChunk
from megatronapp.parallel.tensor_parallel import shard
from megatronapp.parallel.topology import Coord, rank_of
from megatronapp.train import checkpoint as ckpt


def _files_of(d: Path, tp_index: int) -> list[dict]:
    """The states of training ranks (dp 0, tp `tp_index`, every pp stage) of checkpoint `d`."""
    meta = ckpt.load_meta(d)
    par = meta["config"].get("parallel", {})
    tp, pp, dp = int(par.get("tp", 1)), int(par.get("pp", 1)), int(par.get("dp", 1))
    return [ckpt.load_rank(d, rank_of(Coord(0, stage, tp_index), tp, dp)) for stage in range(pp)]


def load_checkpoint_shard(path: str | Path, chunk: TransformerChunk, tp_index: int | None) -> None:
    """Fill `chunk` (this rank's TP slice when it has a tp group, `tp_index` its TP rank) from checkpoint `path`."""
    d = ckpt.resolve(path)
    meta = ckpt.load_meta(d)
    trained_tp = int(meta["config"].get("parallel", {}).get("tp", 1))
    params = dict(chunk.named_parameters())
    serving_tp = chunk.tp_group.size if chunk.tp_group is not None else 1
    if serving_tp == trained_tp:
        found = _tensors(_files_of(d, tp_index or 0), params, chunk)
        with torch.no_grad():
            for name, p in params.items():
                p.copy_(found[name].to(dtype=p.dtype, device=p.device))
        return
    # different TP sizes: join every training TP rank's slices, then take ours (vocabulary rows re-padded)
    parts = [_tensors(_files_of(d, t), params, chunk) for t in range(trained_tp)]
    dims = _partition_dims(d)
    with torch.no_grad():
        for name, p in params.items():
            dim = dims.get(name, dims.get(chunk.init_name(name)))  # a tied output weight splits as the embedding
            full = torch.cat([x[name] for x in parts], dim=dim) if dim is not None else parts[0][name]
            vocab = getattr(p, "vocab_size", None)
            if vocab is not None:
                full = full[:vocab]
            p.copy_(shard(full, p, chunk.tp_group).to(dtype=p.dtype, device=p.device))


def _tensors(states: list[dict], params: dict, chunk: TransformerChunk) -> dict[str, torch.Tensor]:
    """The checkpoint tensor of every parameter of `chunk` (a tied output weight from the embedding)."""
    held: dict[str, torch.Tensor] = {}
    for state in states:
        for sd in state["chunks"]:
            held.update(sd)
    out, missing = {}, []
    for name in params:
        src = name if name in held else chunk.init_name(name)
        if src not in held:
            missing.append(name)
            continue
        out[name] = held[src]
    if missing:
        raise ckpt.CheckpointError(f"the checkpoint holds no {', '.join(missing[:3])}: was it saved from this "
                                   f"model? (model config in its meta.json)")
    return out


def _partition_dims(d: Path) -> dict[str, int]:
    dims: dict[str, int] = {}
    for state in _files_of(d, 0):
        for pd in state.get("partition_dims", []):
            dims.update(pd)
    return dims
