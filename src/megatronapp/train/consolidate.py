"""Rebuild one full model from a sharded checkpoint (any tp/pp/vpp/dp), e.g. to generate, serve or export it.

The consolidated state dict has the real vocabulary only: the rows a run padded the vocabulary with for its
tensor-parallel size (ModelConfig.padded_vocab_size) are dropped, so it is the same whatever tp trained it.

A checkpoint is data (docs/resilience.md, "What a checkpoint may decide"): its meta.json is read as a typed run
config whose `world_size` must be its layout's tp x pp x dp with a rank file for each, every (stage, TP rank) of
data-parallel replica 0 must be held by a rank file, and the joined weights must be exactly the tensors and shapes
the saved model config describes, checked before any model is built. A checkpoint that is not whole is refused
with a message naming the file and the field, never exported or served in part. The tokenizer a checkpoint's run
used is a path it names: it is read only when the user names it (`tokenizer_spec`).
"""
from __future__ import annotations

import os
from itertools import islice
from pathlib import Path
from typing import Any

import torch

from megatronapp.config import ConfigError, ModelConfig, RunConfig, validate_model
from megatronapp.files import short
from megatronapp.train import checkpoint as ckpt

VOCAB_WEIGHTS = ("embedding.word.weight", "output.weight")  # rows are the (padded) vocabulary


def checkpoint_config(d: Path) -> tuple[dict[str, Any], RunConfig]:
    """(meta.json, the run config it holds) of complete checkpoint `d`, read as data: the config's types and the
    model's shape checked, `world_size` equal to tp x pp x dp of its layout, a rank file present for every rank."""
    meta = ckpt.load_meta(d)
    where = d / "meta.json"
    saved = meta.get("config")
    if not isinstance(saved, dict):
        raise ckpt.CheckpointError(f"{where}: no 'config' object (the run config the checkpoint was saved with)")
    try:
        run = RunConfig.from_dict(saved)
        validate_model(run.model)
    except ConfigError as e:
        raise ckpt.CheckpointError(f"{where}: {short(e)}") from None
    p = run.parallel
    if min(p.tp, p.pp, p.dp) < 1:
        raise ckpt.CheckpointError(f"{where}: parallel.tp={p.tp}, pp={p.pp}, dp={p.dp}: each must be >= 1")
    world = meta.get("world_size")
    if isinstance(world, bool) or not isinstance(world, int):
        raise ckpt.CheckpointError(f"{where}: world_size={short(repr(world), 60)} is not a number of ranks")
    if world != p.tp * p.pp * p.dp:
        raise ckpt.CheckpointError(f"{where}: world_size={world}, but its layout tp={p.tp} x pp={p.pp} x dp={p.dp} "
                                   f"has {p.tp * p.pp * p.dp} ranks: not a whole checkpoint of that layout")
    names = set(os.listdir(d))
    # the first few missing: the search stops there, so a claim of 10^9 ranks costs the files present, not 10^9
    missing = list(islice((f for f in map(ckpt.rank_file, range(world)) if f not in names), 5))
    if missing:
        raise ckpt.CheckpointError(f"checkpoint {d}: {', '.join(missing)} missing of its {world} rank files; the "
                                   f"checkpoint is not whole")
    return meta, run


def tokenizer_spec(d: Path, run: RunConfig, given: str | None) -> str:
    """The tokenizer to read with checkpoint `d`: the one the user names (`given`), else the byte tokenizer when
    the run used it. A tokenizer path saved in meta.json is never opened on the checkpoint's word (a planted path
    would be read, or exported); the user is asked to name it, as `train --resume` asks."""
    if given is not None:
        return given
    saved = run.train.tokenizer
    if saved == "byte":
        return "byte"
    raise ckpt.CheckpointError(f"checkpoint {d} was trained with train.tokenizer={short(repr(saved), 200)}; pass "
                               f"--tokenizer PATH (a checkpoint does not choose the files read with it)")


def _coord(state: Any, file: Path, run: RunConfig) -> dict[str, int]:
    """A rank file's coordinate, checked against the layout."""
    p = run.parallel
    coord = state.get("coord") if isinstance(state, dict) else None
    if not isinstance(coord, dict) or not all(
            isinstance(coord.get(k), int) and not isinstance(coord.get(k), bool) and 0 <= coord[k] < n
            for k, n in (("dp", p.dp), ("pp", p.pp), ("tp", p.tp))):
        raise ckpt.CheckpointError(f"{file}: 'coord' = {short(repr(coord), 80)} is not a (dp, pp, tp) position of "
                                   f"the layout tp={p.tp} pp={p.pp} dp={p.dp}")
    return coord


def _chunks(state: dict, file: Path) -> list[tuple[dict[str, torch.Tensor], dict[str, int]]]:
    """(state dict, partition dims) of each model chunk a rank file holds, checked to be tensors and ints."""
    chunks, dims = state.get("chunks"), state.get("partition_dims")
    if dims is None and isinstance(chunks, list):
        dims = [{}] * len(chunks)
    if not isinstance(chunks, list) or not isinstance(dims, list) or len(dims) != len(chunks):
        raise ckpt.CheckpointError(f"{file}: 'chunks' and 'partition_dims' are not lists of one entry per model "
                                   f"chunk")
    for sd, pd in zip(chunks, dims):
        if not isinstance(sd, dict) or not all(isinstance(k, str) and isinstance(t, torch.Tensor)
                                               for k, t in sd.items()):
            raise ckpt.CheckpointError(f"{file}: a model chunk is not a mapping of parameter names to tensors")
        if not isinstance(pd, dict) or not all(isinstance(v, int) and not isinstance(v, bool) for v in pd.values()):
            raise ckpt.CheckpointError(f"{file}: a chunk's partition_dims is not a mapping of names to dimensions")
    return list(zip(chunks, dims))


def _join(d: Path, name: str, parts: dict[int, torch.Tensor], dim: int | None, tp: int) -> torch.Tensor:
    """One parameter from its TP slices (a replicated one: TP rank 0's)."""
    if dim is None:
        return parts[min(parts)]
    if sorted(parts) != list(range(tp)):
        raise ckpt.CheckpointError(f"checkpoint {d}: {name} is held by TP ranks {sorted(parts)} of {tp}; the "
                                   f"checkpoint is not whole")
    try:
        return torch.cat([parts[t] for t in range(tp)], dim=dim)
    except (RuntimeError, IndexError) as e:
        raise ckpt.CheckpointError(f"checkpoint {d}: the TP slices of {name} do not join along dimension {dim} "
                                   f"({short(e, 160)})") from None


def _check_shapes(d: Path, cfg: ModelConfig, full: dict[str, torch.Tensor]) -> None:
    """The joined weights must be the model meta.json describes: the same names and shapes."""
    from megatronapp.model.transformer import expected_shapes

    held = {n: tuple(t.shape) for n, t in full.items()}
    try:
        want = expected_shapes(cfg, held)
    except ValueError as e:
        raise ckpt.CheckpointError(f"{d / 'meta.json'}: {e} in the rank files") from None
    missing, extra = sorted(set(want) - set(held)), sorted(set(held) - set(want))
    if missing or extra:
        raise ckpt.CheckpointError(f"checkpoint {d}: the rank files do not hold the model meta.json describes "
                                   f"(missing {missing[:4]}, unexpected {extra[:4]}); the checkpoint is not whole")
    for name, shape in want.items():
        if held[name] != shape:
            raise ckpt.CheckpointError(f"checkpoint {d}: {name} has shape {held[name]}, the model meta.json "
                                       f"describes {shape}")


def consolidate(path: str | Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Model config and a state dict (real vocabulary rows only) from a complete, whole checkpoint directory."""
    d = ckpt.resolve(path)
    _, run = checkpoint_config(d)
    cfg, p = run.model, run.parallel
    shards: dict[str, dict[int, torch.Tensor]] = {}
    dims: dict[str, int] = {}
    held: set[tuple[int, int]] = set()
    for rank in range(p.tp * p.pp * p.dp):
        file = d / ckpt.rank_file(rank)
        state = ckpt.load_rank(d, rank)
        coord = _coord(state, file, run)
        if coord["dp"] != 0:
            continue  # DP replicas hold the same weights
        held.add((coord["pp"], coord["tp"]))
        for sd, pdims in _chunks(state, file):
            for name, t in sd.items():
                if name == "output.weight" and cfg.tie_embeddings:
                    continue  # the last stage's copy of the tied embedding
                shards.setdefault(name, {})[coord["tp"]] = t
                if name in pdims:
                    dims[name] = pdims[name]
    lost = [f"pp={s} tp={t}" for s in range(p.pp) for t in range(p.tp) if (s, t) not in held]
    if lost:
        raise ckpt.CheckpointError(f"checkpoint {d}: no rank file holds {', '.join(lost[:4])} of data-parallel "
                                   f"replica 0; the checkpoint is not whole")
    full = {}
    for name, parts in shards.items():
        full[name] = _join(d, name, parts, dims.get(name), p.tp)
        if name in VOCAB_WEIGHTS:
            full[name] = full[name][:cfg.vocab_size].clone()
    _check_shapes(d, cfg, full)
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
