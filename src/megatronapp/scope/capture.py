"""Observer side of the model's named capture points: record chosen points, whole, on every rank's behalf.

A `Recorder` registers one hook per selected point on a model's `Capture`. Under tensor parallelism every TP
rank's hook fires at the same point in the same order, so the hook gathers the shards along `info["tp_dim"]`
through `megatronapp.parallel.comm` and the value it stores is the full tensor. Under pipeline parallelism each
stage records its own layers and `collect_pipeline` hands every stage's records to the serving process.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Self

import torch

from megatronapp.model.capture import Capture, HookHandle
from megatronapp.parallel import comm
from megatronapp.parallel.topology import Group

LAYER_POINTS = ("in", "attn.q", "attn.k", "attn.v", "attn.probs", "attn.out", "mlp.out", "out")
MODEL_POINTS = ("embed", "final_norm", "logits")


def point_names(points: Iterable[str], layers: Iterable[int] | None, num_layers: int) -> list[str]:
    """Full capture-point names for per-layer `points` on `layers` (None: all) plus whole-model points."""
    layer_list = list(range(num_layers)) if layers is None else sorted(set(layers))
    bad = [L for L in layer_list if not 0 <= L < num_layers]
    if bad:
        raise ValueError(f"layers {bad} do not exist; the model has layers 0..{num_layers - 1}")
    names: list[str] = []
    for p in points:
        if p in MODEL_POINTS:
            names.append(p)
        elif p in LAYER_POINTS:
            names.extend(f"layers.{L}.{p}" for L in layer_list)
        else:
            raise ValueError(f"unknown capture point {p!r}; per layer: {', '.join(LAYER_POINTS)}; "
                             f"whole model: {', '.join(MODEL_POINTS)}")
    return names


class Recorder:
    """Records the values offered at named points (detached, full across TP, on the CPU)."""

    def __init__(self, capture: Capture, names: Iterable[str], tp_group: Group | None = None,
                 first_only: bool = False, to_cpu: bool = True):
        self.capture, self.names = capture, list(dict.fromkeys(names))
        self.tp_group, self.first_only, self.to_cpu = tp_group, first_only, to_cpu
        self.records: dict[str, list[torch.Tensor]] = {}
        self._handles: list[HookHandle] = []

    def attach(self) -> Recorder:
        """Start recording (one exact-name hook per point)."""
        for name in self.names:
            self._handles.append(self.capture.add(_glob_escape(name), self._hook))
        return self

    def detach(self) -> None:
        """Stop recording; records are kept."""
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def __enter__(self) -> Self:
        return self.attach()

    def __exit__(self, *exc: object) -> None:
        self.detach()

    def _hook(self, name: str, x: torch.Tensor, info: dict[str, Any]) -> None:
        if self.first_only and name in self.records:
            return
        t = x.detach()
        tp_dim = info.get("tp_dim")
        if tp_dim is not None and self.tp_group is not None and self.tp_group.size > 1:
            t = comm.all_gather(t, self.tp_group, dim=tp_dim)
        if info.get("vocab_size") is not None:
            t = t[..., :info["vocab_size"]]  # logits: drop the TP padding columns, which are not tokens
        t = t.float().cpu() if self.to_cpu else t.clone()
        self.records.setdefault(name, []).append(t)
        return

    def take(self) -> dict[str, torch.Tensor]:
        """Records so far (several calls of one point joined along the batch dim), then forget them."""
        out = {k: v[0] if len(v) == 1 else torch.cat(v, dim=0) for k, v in self.records.items()}
        self.records = {}
        return out


def _glob_escape(name: str) -> str:
    # point names hold only [A-Za-z0-9_.]; escape glob characters anyway so a name matches only itself
    return "".join(f"[{c}]" if c in "*?[]" else c for c in name)


def collect_pipeline(records: dict[str, torch.Tensor], pp_group: Group, dst: int,
                     me: int) -> dict[str, torch.Tensor] | None:
    """Every stage's records, merged on global rank `dst` (None elsewhere); `me` is this rank. All stages must
    call this, in the same order as their other collectives on `pp_group`."""
    if pp_group.size == 1:
        return records
    merged: dict[str, torch.Tensor] = {}
    for src in pp_group.ranks:
        # broadcast_object is the only object collective in comm; each stage takes its turn as the source
        got = comm.broadcast_object(records if me == src else None, src, pp_group)
        if me == dst:
            merged.update(got)  # type: ignore[arg-type]
    return merged if me == dst else None
