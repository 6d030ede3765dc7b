"""Resume a checkpoint on another layout: tp, pp, vpp, dp or ZeRO setting different from the one that saved it.

Model and optimizer state are first made whole, per parameter name, from the saved rank files, then cut for this
rank as a fresh run of the new layout cuts its parameters (as Megatron's distributed checkpoints and PyTorch DCP
reshard on load):

- weights: `consolidate` (TP shards joined along their partition dimension, pipeline chunks by their global layer
  names, the real vocabulary only);
- optimizer moments (`exp_avg`, `exp_avg_sq`) and step counts: a plain optimizer's state is per parameter, in the
  order of its two parameter groups (matrices, then 1-D); a ZeRO-1 rank's state is per owned slice of a bucket, in
  `layout` order, and the slices of one parameter from DP ranks 0, 1, ... are consecutive pieces of its flat
  tensor. Joined, each parameter's moments are whole like its weight, then sliced for this rank: whole tensors
  (plain), or the part of this rank's bucket slice (ZeRO-1, located by the slice's offset in the parameter).

A tied embedding's copy on the last stage has the first stage's weight and moments (they are kept equal by the
embedding all-reduce), so only the first stage's is read. The data position is the step: a step's global batch is
the same rows whatever dp (each DP rank reads its block of it), so with the same global batch and sequence length
no sample is seen twice or skipped; a resume that changes either is refused. Every rank reads every rank file of
the checkpoint: simple, and what a small job needs; a large one would read only the files that overlap it.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from megatronapp.config import ModelConfig
from megatronapp.model.transformer import load_unpadded_state_dict
from megatronapp.parallel.distributed_optimizer import DistributedOptimizer
from megatronapp.parallel.tensor_parallel import shard
from megatronapp.train import checkpoint as ckpt
from megatronapp.train.consolidate import VOCAB_WEIGHTS, consolidate

LAYOUT_KEYS = ("tp", "pp", "dp", "vpp", "zero")
MOMENTS = ("exp_avg", "exp_avg_sq")


def layout_changed(saved: dict[str, Any], now: dict[str, Any]) -> bool:
    """Whether the saved parallel config differs from this run's in anything that shapes the state."""
    return any(saved.get(k, 0 if k == "zero" else 1) != now[k] for k in LAYOUT_KEYS)


def _units(state: dict[str, Any]) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of a rank file's parameters in the order its optimizer numbered them (all chunks, in order)."""
    return [(name, tuple(t.shape)) for sd in state["chunks"] for name, t in sd.items()]


def _grouped(units: list, zero: bool) -> list[list]:
    """Units split as the optimizer's parameter groups: matrices (decay) then 1-D (no decay); a plain optimizer
    drops an empty group, ZeRO-1 keeps both."""
    groups = [[u for u in units if len(u[-1]) >= 2], [u for u in units if len(u[-1]) < 2]]
    return groups if zero else [g for g in groups if g]


def full_optimizer_state(d: Path, cfg: ModelConfig) -> tuple[dict[str, dict[str, torch.Tensor]], float]:
    """Whole moments per parameter name (real vocabulary rows only) and the optimizer step count."""
    meta = ckpt.load_meta(d)
    zero = bool(meta["config"]["parallel"].get("zero", 0))
    local: dict[tuple[int, str], dict[str, list[tuple[int, torch.Tensor]]]] = {}  # (tp, name) -> key -> pieces
    dims: dict[str, int] = {}
    step = 0.0
    for rank in range(int(meta["world_size"])):
        state = ckpt.load_rank(d, rank)
        try:
            step = _collect(state, zero, cfg, local, dims, step)
        except (KeyError, TypeError, IndexError, ValueError, AttributeError) as e:
            # a rank file whose optimizer state is not what meta.json's layout says (an edited `zero`, a forged file)
            raise ckpt.CheckpointError(f"{d / ckpt.rank_file(rank)}: its optimizer state does not fit meta.json's "
                                       f"parallel.zero={int(zero)} ({type(e).__name__}: {str(e)[:160]}); was "
                                       f"meta.json edited?") from None
    shapes = dict(_units(ckpt.load_rank(d, 0)))
    joined: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    for (tp, name), by_key in local.items():
        joined.setdefault(name, {})[tp] = {  # ZeRO-1: DP ranks' slices in DP order; plain: the one piece
            m: torch.cat([t.reshape(-1) for _, t in sorted(pieces, key=lambda x: x[0])])
            for m, pieces in by_key.items()}
    out: dict[str, dict[str, torch.Tensor]] = {}
    for name, by_tp in joined.items():
        out[name] = {}
        for m in MOMENTS:
            parts = [by_tp[t][m] for t in sorted(by_tp)]
            shape = _local_shape(d, name, shapes)
            parts = [p.reshape(shape) for p in parts]
            full = torch.cat(parts, dim=dims[name]) if name in dims else parts[0]
            out[name][m] = full[:cfg.vocab_size].clone() if name in VOCAB_WEIGHTS else full
    return out, step


def _collect(state: dict[str, Any], zero: bool, cfg: ModelConfig, local: dict, dims: dict[str, int],
             step: float) -> float:
    """Add one rank file's moments to `local` ((tp, name) -> key -> pieces) and its partition dims to `dims`;
    returns the optimizer step count (`step` when the file has no stepped state)."""
    coord = state["coord"]
    if coord["dp"] != 0 and not zero:
        return step  # plain DP replicas hold the same state
    for pdims in state.get("partition_dims", []):
        dims.update(pdims)
    opt = state["optimizer"]
    params = _units(state)
    if zero:
        units = [(params[i][0], n, params[i][1]) for i, n in opt["layout"]]
        opt = opt["inner"]
    else:
        units = [(name, None, shape) for name, shape in params]
    for saved, group in zip(opt["param_groups"], _grouped(units, zero)):
        for key, (name, _, _) in zip(saved["params"], group):
            s = opt["state"].get(key)
            if s is None or (name == "output.weight" and cfg.tie_embeddings):
                continue  # never stepped, or the last stage's copy of a tied embedding
            step = float(s["step"])
            pieces = local.setdefault((coord["tp"], name), {})
            for m in MOMENTS:
                pieces.setdefault(m, []).append((coord["dp"], s[m]))
    return step


def _local_shape(d: Path, name: str, shapes: dict[str, tuple[int, ...]]) -> tuple[int, ...]:
    """Shape of one TP shard of `name` (the same on every TP rank: slices are equal)."""
    if name in shapes:
        return shapes[name]
    for rank in range(int(ckpt.load_meta(d)["world_size"])):  # a parameter rank 0's stage does not hold
        for sd in ckpt.load_rank(d, rank)["chunks"]:
            if name in sd:
                shapes.update({n: tuple(t.shape) for n, t in sd.items()})
                return shapes[name]
    raise ckpt.CheckpointError(f"checkpoint {d}: optimizer state for {name}, a parameter no rank file holds")


def _check_layout_matches_files(d: Path, p: dict[str, Any], meta: dict[str, Any]) -> None:
    """The saved layout must be the one its rank files were written with: resharding cuts the files by it, so a
    meta.json that claims another (edited, or copied from another run) would silently mis-cut the state."""
    tp, pp, dp = (int(p.get(k, 1)) for k in ("tp", "pp", "dp"))
    world = int(meta.get("world_size", 0))
    if tp * pp * dp != world:
        raise ckpt.CheckpointError(
            f"checkpoint {d}: meta.json says parallel.tp={tp}, pp={pp}, dp={dp} ({tp * pp * dp} ranks) but the "
            f"checkpoint holds {world} rank files; it cannot be resharded (was meta.json edited or copied?)")


def load(trainer: Any, d: Path) -> None:
    """Load checkpoint `d`, saved with another layout, into `trainer` (model, optimizer, RNG, step)."""
    meta = ckpt.load_meta(d)
    saved = meta["config"]
    _check_layout_matches_files(d, saved.get("parallel", {}), meta)
    t_now, t_then = trainer.cfg.train, saved.get("train", {})
    for key in ("global_batch_size", "seq_len"):
        if t_then.get(key) != getattr(t_now, key):
            raise ckpt.CheckpointError(
                f"checkpoint {d} was saved with train.{key}={t_then.get(key)}, this run has {getattr(t_now, key)}; "
                f"a resume on another layout keeps train.{key} (the data position is the step: a step's batch "
                f"is the same samples only if the global batch is)")
    cfg, weights = consolidate(d)
    if cfg != trainer.cfg.model:
        raise ckpt.CheckpointError(f"checkpoint {d} holds another model ({cfg}); this run has {trainer.cfg.model}")
    moments, step = full_optimizer_state(d, cfg)

    def whole(name: str, table: dict[str, Any]) -> Any:
        if name == "output.weight" and cfg.tie_embeddings:
            name = "embedding.word.weight"
        if name not in table:
            raise ckpt.CheckpointError(f"checkpoint {d} has no state for parameter {name}")
        return table[name]

    with torch.no_grad():
        for chunk in trainer.chunks:
            load_unpadded_state_dict(chunk, {n: whole(n, weights) for n, _ in chunk.named_parameters()})
    tp_group = trainer.topo.tp_group
    names = {id(p): n for c in trainer.chunks for n, p in c.named_parameters()}
    opt = trainer.optimizer

    def sliced(p: torch.nn.Parameter) -> dict[str, torch.Tensor]:
        m = whole(names[id(p)], moments)
        return {k: shard(m[k], p, tp_group).to(device=p.device, dtype=torch.float32) for k in MOMENTS}

    if isinstance(opt, DistributedOptimizer):
        adam = isinstance(opt.inner, torch.optim.AdamW)
        for s in opt.segments:
            local = sliced(s.param)
            offset = (s.data.data_ptr() - s.param.data_ptr()) // s.data.element_size()
            n = s.shard.numel()
            opt.inner.state[s.shard] = {"step": torch.tensor(step) if adam else int(step),
                                        **{k: v.reshape(-1)[offset:offset + n].clone() for k, v in local.items()}}
    else:
        adam = isinstance(opt, torch.optim.AdamW)
        for p in trainer.params:
            opt.state[p] = {"step": torch.tensor(step) if adam else int(step),
                            **{k: v.clone() for k, v in sliced(p).items()}}
    ckpt.set_rng_state(ckpt.load_rank(d, 0)["rng"])  # every rank draws alike: rank 0's state is everyone's
    trainer.step = int(meta["step"])
