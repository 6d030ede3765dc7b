"""Rebuild one full model from a sharded checkpoint (any tp/pp/vpp/dp), e.g. to generate or to serve it.

The consolidated state dict has the real vocabulary only: the rows a run padded the vocabulary with for its
tensor-parallel size (ModelConfig.padded_vocab_size) are dropped, so it is the same whatever tp trained it.
"""
from __future__ import annotations

from pathlib import Path

import torch

from megatronapp.config import ModelConfig
from megatronapp.train import checkpoint as ckpt

VOCAB_WEIGHTS = ("embedding.word.weight", "output.weight")  # rows are the (padded) vocabulary


def consolidate(path: str | Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Model config and a state dict (real vocabulary rows only) from a complete checkpoint directory."""
    d = ckpt.resolve(path)
    meta = ckpt.load_meta(d)
    cfg = ModelConfig(**meta["config"]["model"])
    shards: dict[str, dict[int, torch.Tensor]] = {}
    dims: dict[str, int] = {}
    for rank in range(int(meta["world_size"])):
        state = ckpt.load_rank(d, rank)
        coord = state["coord"]
        if coord["dp"] != 0:
            continue  # DP replicas hold the same weights
        for sd, pdims in zip(state["chunks"], state.get("partition_dims", [{}] * len(state["chunks"]))):
            for name, t in sd.items():
                if name == "output.weight" and cfg.tie_embeddings:
                    continue  # the last stage's copy of the tied embedding
                shards.setdefault(name, {})[coord["tp"]] = t
                if name in pdims:
                    dims[name] = pdims[name]
    full = {}
    for name, parts in shards.items():
        ordered = [parts[t] for t in sorted(parts)]
        full[name] = torch.cat(ordered, dim=dims[name]) if name in dims else ordered[0]
        if name in VOCAB_WEIGHTS:
            full[name] = full[name][:cfg.vocab_size].clone()
    return cfg, full


def load_model(path: str | Path, seed: int = 0):
    """A one-process model with the weights of a (possibly sharded) checkpoint."""
    from megatronapp.model.transformer import build_model, load_unpadded_state_dict

    cfg, state = consolidate(path)
    model = build_model(cfg, seed=seed)
    try:
        load_unpadded_state_dict(model, state)  # adds this model's own vocabulary padding rows (zero)
    except KeyError as e:
        raise ckpt.CheckpointError(f"checkpoint {path} does not match its model config: {e.args[0]}") from None
    return model
