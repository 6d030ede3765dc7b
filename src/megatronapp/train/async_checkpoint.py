"""Two-stage asynchronous checkpoints (MegaScale, ByteCheckpoint): training stalls only for a host-memory copy.

Stage 1, on the training critical path: `snapshot()` copies every tensor of the rank's state to host memory
(pinned, when it lives on a GPU, so the copy is a DMA). Stage 2, in a background thread: serialise, checksum,
write, fsync into the step's temporary directory (`checkpoint.save_rank`); rank 0's thread then waits for every
rank's durable file (their checksum files, on the shared directory: no process group is touched off the training
thread, so the collective order of the job is untouched) and renames the step into place (`checkpoint.finalize`),
keeping the newest K. At most one save is in flight: the next `save()` first waits for the previous one.
"""
from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import torch

from megatronapp.train import checkpoint as ckpt


def snapshot(obj: Any, reuse: Any = None) -> Any:
    """A host-memory copy of every tensor in a nest of dicts, lists and tuples (other values are shared). Tensors
    of `reuse`, a previous snapshot of the same structure no longer in use, are overwritten instead of allocating
    anew: fresh memory costs a page fault per 4 KiB, which is most of a copy's time."""
    copies: list[tuple[torch.Tensor, torch.Tensor]] = []

    def copy(x: Any, old: Any) -> Any:
        if isinstance(x, torch.Tensor):
            x = x.detach()
            same = isinstance(old, torch.Tensor) and old.shape == x.shape and old.dtype == x.dtype
            if x.device.type == "cpu":
                return old.copy_(x) if same else x.clone()
            host = old if same else torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
            copies.append((host, x))
            return host
        if isinstance(x, dict):
            old = old if isinstance(old, dict) else {}
            return {k: copy(v, old.get(k)) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            old = old if isinstance(old, (list, tuple)) and len(old) == len(x) else [None] * len(x)
            return type(x)(copy(v, o) for v, o in zip(x, old))
        return x

    out = copy(obj, reuse)
    for host, dev in copies:
        host.copy_(dev, non_blocking=True)
    if copies:
        torch.cuda.synchronize()  # the training step may overwrite the originals once we return
    return out


class AsyncSaver:
    """This rank's background checkpoint writer; one save in flight at a time."""

    def __init__(self, root: Path, rank: int, world: int, keep: int = 0, finalize_timeout_s: float = 600.0):
        self.root, self.rank, self.world, self.keep = Path(root), rank, world, keep
        self.finalize_timeout_s = finalize_timeout_s
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._pending: int | None = None
        self._buffers: Any = None  # the previous snapshot: its memory is reused once its save is done

    def save(self, step: int, state: dict[str, Any], meta: dict[str, Any]) -> float:
        """Stage 1 now (returns the seconds it stalled training, waiting for a previous save included);
        stage 2 in the background."""
        t0 = time.perf_counter()
        self.wait()
        snap = self._buffers = snapshot(state, self._buffers)
        self._pending = step
        self._thread = threading.Thread(target=self._write, args=(step, snap, meta), name=f"ckpt-{step}",
                                        daemon=True)  # a crashed run must not wait for its last save
        self._thread.start()
        return time.perf_counter() - t0

    def _write(self, step: int, snap: dict[str, Any], meta: dict[str, Any]) -> None:
        try:
            ckpt.save_rank(self.root, step, self.rank, snap)
            if self.rank == 0:
                self._await_files(step)
                ckpt.finalize(self.root, step, meta, keep=self.keep)
        except BaseException as e:  # noqa: BLE001 - raised on the training thread by wait()
            self._error = e

    def _await_files(self, step: int) -> None:
        tmp = ckpt.temp_dir(self.root, step)
        deadline = time.monotonic() + self.finalize_timeout_s
        while not all((tmp / f"{ckpt.rank_file(r)}.sum").is_file() for r in range(self.world)):
            if time.monotonic() > deadline:
                raise ckpt.CheckpointError(f"checkpoint step {step}: not every rank wrote its file within "
                                           f"{self.finalize_timeout_s:.0f} s; the step stays incomplete")
            time.sleep(0.01)

    def wait(self) -> int | None:
        """Finish the save in flight (on every rank: until its directory is complete); returns its step."""
        if self._thread is None:
            return None
        self._thread.join()
        self._thread = None
        step, self._pending = self._pending, None
        if self._error is not None:
            err, self._error = self._error, None
            raise err
        d = ckpt.step_dir(self.root, step)
        deadline = time.monotonic() + self.finalize_timeout_s
        while not ckpt.is_complete(d):  # rank 0 renames it into place once every rank's file is durable
            if time.monotonic() > deadline:
                raise ckpt.CheckpointError(f"checkpoint {d} was not completed by rank 0 within "
                                           f"{self.finalize_timeout_s:.0f} s")
            time.sleep(0.01)
        return step
