"""Host-to-device copies that never make the host wait for the GPU.

A copy from ordinary (pageable) host memory to a GPU blocks the host until every kernel queued before it has run:
PyTorch's `copy_kernel_cuda` (aten/src/ATen/native/cuda/Copy.cu) issues `cudaMemcpyAsync` and then, unless the
copy is `non_blocking`, synchronises the stream (`at::cuda::memcpy_and_sync`); and CUDA stages a `non_blocking`
copy from pageable memory synchronously as well. Only a pinned source copied with `non_blocking=True` leaves the
host free. The engine's small copies that happen per message or per microbatch (pipeline and MegaFBD headers, the
RoPE frequencies, batches) go through here: the host tensor is pinned and copied with `non_blocking=True`. Freeing
that pinned tensor at once is safe: the caching host allocator records an event on the copy's stream
(`CachingHostAllocator_recordEvent`, called by `copy_kernel_cuda`) and reuses the block only after it fired.
On the CPU these are plain copies.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch


def _pinned(t: torch.Tensor) -> torch.Tensor:
    return t if t.is_pinned() else t.pin_memory()


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`t` on `device`; a host tensor is copied from pinned memory without blocking the host."""
    device = torch.device(device)
    if t.device == device or device.type == "cpu" or t.device.type != "cpu":
        return t.to(device, non_blocking=device.type != "cpu")  # already there, to the host, or stream-ordered
    return _pinned(t).to(device, non_blocking=True)


def copy_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    """`dst.copy_(src)`; from the host to a device from pinned memory, without blocking the host."""
    if dst.device.type == "cpu" or src.device.type != "cpu":
        dst.copy_(src, non_blocking=dst.device.type != "cpu")
    else:
        dst.copy_(_pinned(src), non_blocking=True)


def write_ints(dst: torch.Tensor, values: Sequence[int]) -> None:
    """Write the small ints `values` into the int32 tensor `dst` (a message header) without blocking the host."""
    copy_into(dst, torch.tensor(values, dtype=torch.int32))


def microbatches_to(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], device: torch.device
                    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(ids, labels) microbatches on `device`, each copy without blocking the host."""
    return [(to_device(a, device), to_device(b, device)) for a, b in pairs]
