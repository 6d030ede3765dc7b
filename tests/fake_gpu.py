"""A CPU stand-in for a GPU's host-to-device copy rule, for tests that count copies that would block the host.

The "meta" device plays the GPU (tensors with shapes and no storage; every op runs). `BlockingCopies` patches
`Tensor.copy_`, `Tensor.to`, `Tensor.pin_memory` and `Tensor.is_pinned` and counts each copy from the host to the
meta device that CUDA would make the host wait for: every one, unless the source is pinned and the copy is
`non_blocking` (PyTorch's `copy_kernel_cuda` in aten/src/ATen/native/cuda/Copy.cu: `memcpy_and_sync` otherwise,
and CUDA stages a pageable source synchronously). `pin_memory()` returns a host copy remembered as pinned.
"""
from __future__ import annotations

import traceback
from typing import Any

import torch

FAKE_GPU = torch.device("meta")


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


class BlockingCopies:
    """Context manager: `.blocking` lists (where, what) for each host-to-GPU copy that would block the host."""

    def __init__(self) -> None:
        self.blocking: list[tuple[str, str]] = []
        self.copies = 0  # every host-to-GPU copy, blocking or not
        self._pinned: list[torch.Tensor] = []  # kept alive so their storages stay theirs
        self._saved: dict[str, Any] = {}

    def _is_pinned(self, t: torch.Tensor) -> bool:
        return t.device.type == "cpu" and any(_storage(p) == _storage(t) for p in self._pinned)

    def _note(self, src: torch.Tensor, dst_device: torch.device, non_blocking: bool, how: str) -> None:
        if src.device.type != "cpu" or dst_device.type != FAKE_GPU.type:
            return
        self.copies += 1
        if not (non_blocking and self._is_pinned(src)):
            where = traceback.extract_stack(limit=3)[0]
            self.blocking.append((f"{where.filename.rsplit('/', 1)[-1]}:{where.lineno}", how))

    def __enter__(self) -> BlockingCopies:
        cls = torch.Tensor
        self._saved = {n: getattr(cls, n) for n in ("copy_", "to", "pin_memory", "is_pinned")}
        orig = self._saved
        counter = self

        def copy_(dst: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
            counter._note(src, dst.device, non_blocking, "copy_")
            return orig["copy_"](dst, src, non_blocking)

        def to(t: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            out = orig["to"](t, *args, **kwargs)
            if out is not t:
                nb = kwargs.get("non_blocking", any(a is True for a in args))
                counter._note(t, out.device, nb, "to")
            return out

        def pin_memory(t: torch.Tensor, *args: Any) -> torch.Tensor:
            p = t.clone()
            counter._pinned.append(p)
            return p

        def is_pinned(t: torch.Tensor, *args: Any) -> bool:
            return counter._is_pinned(t)

        cls.copy_, cls.to, cls.pin_memory, cls.is_pinned = copy_, to, pin_memory, is_pinned
        return self

    def __exit__(self, *exc: Any) -> None:
        for name, fn in self._saved.items():
            setattr(torch.Tensor, name, fn)
