"""Named capture points: stable names for a model's internal tensors, where observers read or replace them.

Layers call `capture.point("layers.3.attn.qkv", x)`; with no hook registered this is one attribute test.
A hook is `fn(name, tensor, info) -> tensor | None`: returning a tensor replaces the value downstream
(perturbation), returning None only observes. `info` says how the tensor is laid out and sharded, so that
an observer on a tensor-parallel rank can gather the full value:
  info = {"tp_dim": int | None,  # dimension split across TP ranks (None: replicated)
          "layer": int | None, "kind": "q" | "k" | "v" | "probs" | ...}

Names (L is the global layer index, the same whatever the tp/pp split):
  embed                      token (+ position) embedding output          [b, s, h]
  layers.L.in                hidden state entering layer L                [b, s, h]
  layers.L.attn.q / .k / .v  per-head projections after RoPE             [b, heads, s, d] (k, v: kv heads)
  layers.L.attn.probs        attention probabilities (computed only when a hook wants them)  [b, heads, s, s]
  layers.L.attn.out          attention block output (before residual)     [b, s, h]
  layers.L.mlp.out           MLP output (before residual)                 [b, s, h]
  layers.L.out               hidden state leaving layer L                 [b, s, h]
  final_norm                 after the last norm                          [b, s, h]
  logits                     output logits                                [b, s, padded vocab] (tp_dim=2 when
                             sharded; info["vocab_size"] columns are real, the rest is padding for TP)
"""
from __future__ import annotations

import fnmatch
from collections.abc import Callable
from typing import Any

import torch

Hook = Callable[[str, torch.Tensor, dict[str, Any]], "torch.Tensor | None"]


class HookHandle:
    def __init__(self, owner: Capture, key: int):
        self.owner, self.key = owner, key

    def remove(self) -> None:
        self.owner._hooks.pop(self.key, None)
        self.owner._refresh()


class Capture:
    """Registry of hooks on named points, shared by all layers of one model instance."""

    def __init__(self) -> None:
        self._hooks: dict[int, tuple[str, Hook]] = {}
        self._next = 0
        self.active = False  # fast path: layers skip everything when False
        self.names_seen: set[str] = set()

    def add(self, pattern: str, fn: Hook) -> HookHandle:
        """Register `fn` on every point whose name matches the glob `pattern` (e.g. 'layers.*.attn.probs')."""
        key = self._next
        self._next += 1
        self._hooks[key] = (pattern, fn)
        self._refresh()
        return HookHandle(self, key)

    def clear(self) -> None:
        self._hooks.clear()
        self._refresh()

    def _refresh(self) -> None:
        self.active = bool(self._hooks)

    def wants(self, name: str) -> bool:
        """True when some hook matches `name` (lets a layer skip computing an optional tensor)."""
        return self.active and any(fnmatch.fnmatchcase(name, pat) for pat, _ in self._hooks.values())

    def point(self, name: str, x: torch.Tensor, **info: Any) -> torch.Tensor:
        """Offer `x` at point `name`; returns `x` or a hook's replacement."""
        if not self.active:
            return x
        self.names_seen.add(name)
        for pat, fn in list(self._hooks.values()):
            if fnmatch.fnmatchcase(name, pat):
                out = fn(name, x, info)
                if out is not None:
                    x = out
        return x
