"""`--allow-shrink`: continue a job on fewer DP replicas after evicting the one that failed.

What is kept. The global batch: every step trains on exactly the samples it would have (the batch of a step is
a function of (seed, step) cut into dp contiguous slices, so dp-1 replicas cut the same rows into larger slices),
and the loss is the mean over equal-sized microbatches, so the shrunk job follows the same trajectory up to
floating-point summation order. Per-rank memory: the microbatch size is kept (or lowered) by raising the
microbatches per replica. When no microbatch count keeps `global_batch_size` divisible with a microbatch no
larger than before, the shrink is refused naming the fields.

Why a checkpoint converts. With the plain optimizer (parallel.zero=0) the model and the optimizer state are
replicated over DP, so rank (dp', pp, tp) of the smaller job loads the file of a surviving replica's rank
(dp, pp, tp). The converted step is written as a normal checkpoint (checksums, marker, atomic rename) under
`<out>/resharded/dp<N>/`, so the trainer loads it through its ordinary path with the layout check intact.
ZeRO-1 checkpoints hold each DP rank's slice of the optimizer state: a smaller dp needs a re-slicing this does
not do, and is refused.
"""
from __future__ import annotations

import dataclasses
import secrets
import shutil
from pathlib import Path

from megatronapp.config import ConfigError, RunConfig, micro_batch_size, validate
from megatronapp.parallel.topology import coord_of, rank_of
from megatronapp.train import checkpoint as ckpt


class ShrinkRefused(ConfigError):
    """The job cannot continue on fewer DP replicas; the message names the field and why."""


def shrunk_config(cfg: RunConfig, new_dp: int) -> RunConfig:
    """`cfg` on `new_dp` replicas with the same global batch and a microbatch no larger than before."""
    p, t = cfg.parallel, cfg.train
    if not 1 <= new_dp < p.dp:
        raise ShrinkRefused(f"cannot shrink parallel.dp={p.dp} to {new_dp}: at least one DP replica must remain")
    if p.zero:
        raise ShrinkRefused(f"parallel.zero=1: the checkpoint holds each of the {p.dp} DP ranks' slice of the "
                            f"optimizer state, which does not re-slice onto dp={new_dp}; run with --zero 0 to use "
                            f"--allow-shrink")
    if p.fbd:
        raise ShrinkRefused("parallel.fbd: MegaFBD's forward instances are laid out for the backward dp; "
                            "--allow-shrink does not combine with --fbd")
    mbs = micro_batch_size(cfg)
    g = t.global_batch_size
    # the fewest microbatches (the largest microbatch) that divide the global batch without growing the microbatch
    choices = [m for m in range(1, g // new_dp + 1) if g % (new_dp * m) == 0 and g // (new_dp * m) <= mbs]
    if not choices:
        raise ShrinkRefused(f"train.global_batch_size={g} cannot be split over dp={new_dp} replicas with a "
                            f"microbatch of at most {mbs} samples (parallel.microbatches={p.microbatches} on "
                            f"dp={p.dp}); choose a global batch divisible by {new_dp}")
    problem = None
    for m in choices:  # a schedule may need more (e.g. interleaved: a multiple of pp): the first valid one
        new = dataclasses.replace(cfg, parallel=dataclasses.replace(p, dp=new_dp, microbatches=m))
        try:
            validate(new)
            return new
        except ConfigError as e:
            problem = problem or e
    raise ShrinkRefused(f"the job on dp={new_dp} would be invalid: {problem}")


def survivors(dp: int, evicted: set[int]) -> list[int]:
    """DP indices that remain after evicting `evicted` (in order: new replica i is old replica survivors[i])."""
    return [d for d in range(dp) if d not in evicted]


def reshard(src: Path, dst_root: Path, cfg: RunConfig, replicas: list[int]) -> Path:
    """Write checkpoint `src` (plain optimizer, any dp) as a checkpoint of `cfg`'s smaller layout: rank
    (i, pp, tp) gets the state of old rank (replicas[i], pp, tp). Returns the new complete step directory."""
    meta = ckpt.load_meta(src)
    saved = RunConfig.from_dict(meta["config"])
    old, new = saved.parallel, cfg.parallel
    for key in ("tp", "pp", "vpp"):
        if getattr(old, key) != getattr(new, key):
            raise ShrinkRefused(f"checkpoint {src} has parallel.{key}={getattr(old, key)}, the shrunk job "
                                f"{getattr(new, key)}: only dp may shrink")
    if old.zero:
        raise ShrinkRefused(f"checkpoint {src} was saved with parallel.zero=1 (optimizer state sliced over DP); "
                            f"it cannot be loaded on a different dp")
    if len(replicas) != new.dp or any(not 0 <= d < old.dp for d in replicas):
        raise ValueError(f"replicas {replicas} must name {new.dp} of the checkpoint's {old.dp} DP replicas")
    step = int(meta["step"])
    shutil.rmtree(dst_root, ignore_errors=True)
    # the engine's commit protocol: a temporary directory unique to this attempt, checked and committed by
    # finalize (never a name an earlier, crashed reshard could have used)
    attempt = secrets.token_hex(8)
    for r in range(new.world_size):
        c = coord_of(r, new.tp, new.pp, new.dp)
        source = rank_of(dataclasses.replace(c, dp=replicas[c.dp]), old.tp, old.dp)
        state = ckpt.load_rank(src, source)  # checksum-checked, weights only
        state["coord"] = dataclasses.asdict(c)
        ckpt.save_rank(dst_root, step, r, state, attempt)
    out_meta = {**{k: v for k, v in meta.items() if k != "files"}, "world_size": new.world_size,
                "config": cfg.to_dict(), "resharded_from": {"path": str(src), "dp": old.dp, "replicas": replicas}}
    return ckpt.finalize(dst_root, step, out_meta, attempt=attempt)
