"""Two-stage asynchronous checkpoints (MegaScale, ByteCheckpoint): training stalls only for a host-memory copy,
and with `overlap_copy` not even for that.

Stage 1: copy every tensor of the rank's state into host memory (reused buffers; pinned when the state lives on a
GPU, so the copy is a DMA). Stage 2, in a background thread: serialise, checksum, write, fsync into the step's
temporary directory (`checkpoint.save_rank`); rank 0's thread then waits for every rank's durable file (their
checksum files, on the shared directory: no process group is touched off the training thread, so the collective
order of the job is untouched) and renames the step into place (`checkpoint.finalize`), keeping the newest K. At
most one save is in flight: the next `save()` first waits for the previous one.

Where stage 1 runs. The state only changes at the optimizer step, so the copy need not hold up training: with
`overlap_copy` the background thread copies while the next step's forward and backward run, and the trainer calls
`snapshot_barrier()` right before the optimizer mutates the state. The barrier does not wait idle: the training
thread copies whatever pieces the background thread has not taken yet (work is shared piece by piece), then waits
only for the pieces in flight. Without `overlap_copy` (callers that cannot promise the barrier) `save()` copies
everything before it returns.
"""
from __future__ import annotations

import os
import threading
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch

from megatronapp.train import checkpoint as ckpt

PIECE_NUMEL = 1 << 22  # copy work is shared in pieces of 4 Mi elements, so the barrier can take over any part
# Stage 2 (serialise, checksum, write) runs at training's CPU priority: on this shared 2-core machine a writer
# thread at nice +10 left a 256 MiB save 20 s from durable after its cycle (starved) without a stall difference
# the noise could show (benchmarks/results/checkpoint_stall_nice_writer.json).


def pin_budget() -> int:
    """Bytes of page-locked host memory one rank's snapshot may hold: a quarter of the host's memory, shared by the
    node's ranks (LOCAL_WORLD_SIZE). Pinned memory cannot be swapped or reclaimed, and every rank keeps its
    snapshot's buffers for reuse: pinning whole states would lock most of a node's memory. Beyond the budget a
    snapshot uses pageable memory, whose GPU copies block only the thread that makes them."""
    try:
        host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 0
    return host // (4 * max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))


def _on_gpu(x: torch.Tensor) -> bool:
    return x.device.type == "cuda"


def _host_empty(x: torch.Tensor, pin: bool) -> torch.Tensor:
    return torch.empty(x.shape, dtype=x.dtype, pin_memory=pin)


def snapshot_plan(obj: Any, reuse: Any = None, pin_bytes: int | None = None
                  ) -> tuple[Any, list[tuple[torch.Tensor, torch.Tensor]]]:
    """The host-memory structure of a nest of dicts, lists and tuples (other values are shared) and the
    (destination, source) copies that fill it. Tensors of `reuse`, a previous snapshot of the same structure no
    longer in use, are the destinations when shapes and dtypes match: fresh memory costs a page fault per 4 KiB,
    which is most of a copy's time. New buffers for GPU tensors are pinned (their copies are DMAs) while the pinned
    bytes stay within `pin_bytes` (default `pin_budget()`). Nothing is copied yet."""
    copies: list[tuple[torch.Tensor, torch.Tensor]] = []
    pin_left = [pin_budget() if pin_bytes is None else pin_bytes]

    def plan(x: Any, old: Any) -> Any:
        if isinstance(x, torch.Tensor):
            x = x.detach()
            same = isinstance(old, torch.Tensor) and old.shape == x.shape and old.dtype == x.dtype
            if not same:
                nbytes = x.numel() * x.element_size()
                pin = _on_gpu(x) and nbytes <= pin_left[0]
                pin_left[0] -= nbytes if pin else 0
            host = old if same else _host_empty(x, pin)
            if host.is_contiguous() and x.is_contiguous() and x.numel() > PIECE_NUMEL:
                flat_h, flat_x = host.view(-1), x.view(-1)
                copies.extend((flat_h[i:i + PIECE_NUMEL], flat_x[i:i + PIECE_NUMEL])
                              for i in range(0, x.numel(), PIECE_NUMEL))
            else:
                copies.append((host, x))
            return host
        if isinstance(x, dict):
            old = old if isinstance(old, dict) else {}
            return {k: plan(v, old.get(k)) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            old = old if isinstance(old, (list, tuple)) and len(old) == len(x) else [None] * len(x)
            return type(x)(plan(v, o) for v, o in zip(x, old))
        return x

    return plan(obj, reuse), copies


def _device_of(copies: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.device | None:
    """The GPU the state to copy lives on (None for a state in host memory)."""
    return next((src.device for _, src in copies if src.device.type == "cuda"), None)


class _Copier:
    """Runs a snapshot's copies from any number of threads: each takes the next piece not yet taken."""

    def __init__(self, copies: list[tuple[torch.Tensor, torch.Tensor]]):
        self.copies = copies
        self.device = _device_of(copies)
        self.cuda = self.device is not None
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None
        if self.cuda:  # the copies must see the optimizer step that produced the state (on the current stream)
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
        self._next = self._done = 0
        self._cond = threading.Condition()
        self.error: BaseException | None = None

    def run(self) -> None:
        """Copy pieces until none is left to take."""
        if self.cuda:
            # A new thread's current device is 0: leaving `torch.cuda.stream` would make it current (and create a
            # CUDA context there, ~0.5 GB, on every rank of a node) unless the thread is on the state's device.
            torch.cuda.set_device(self.device)
        with torch.cuda.stream(self.stream) if self.cuda else nullcontext():
            while True:
                with self._cond:
                    i = self._next
                    if i >= len(self.copies) or self.error is not None:
                        return
                    self._next += 1
                try:
                    dst, src = self.copies[i]
                    dst.copy_(src, non_blocking=src.device.type == "cuda")
                except BaseException as e:  # noqa: BLE001 - reported by finish()
                    with self._cond:
                        self.error = e
                        self._cond.notify_all()
                    return
                with self._cond:
                    self._done += 1
                    if self._done == len(self.copies):
                        self._cond.notify_all()

    def finish(self) -> None:
        """Help with what is left, then wait for the pieces other threads are copying."""
        self.run()
        with self._cond:
            while self._done < len(self.copies) and self.error is None:
                self._cond.wait()
        if self.error is not None:
            raise ckpt.CheckpointError(f"checkpoint snapshot failed: {type(self.error).__name__}: {self.error}")
        if self.cuda:
            self.stream.synchronize()  # the DMAs are done: the optimizer may overwrite the originals


def snapshot(obj: Any, reuse: Any = None) -> Any:
    """A host-memory copy of every tensor in a nest of dicts, lists and tuples, complete when it returns."""
    out, copies = snapshot_plan(obj, reuse)
    _Copier(copies).finish()
    return out


class AsyncSaver:
    """This rank's background checkpoint writer; one save in flight at a time."""

    def __init__(self, root: Path, rank: int, world: int, keep: int = 0, finalize_timeout_s: float = 600.0,
                 overlap_copy: bool = False):
        self.root, self.rank, self.world, self.keep = Path(root), rank, world, keep
        self.finalize_timeout_s = finalize_timeout_s
        self.overlap_copy = overlap_copy
        self._thread: threading.Thread | None = None
        self._copier: _Copier | None = None  # the snapshot still being copied (overlap_copy)
        self._error: BaseException | None = None
        self._pending: int | None = None
        self._buffers: Any = None  # the previous snapshot: its memory is reused once its save is done
        self._cancel = threading.Event()  # abandon(): stop waiting for other ranks' files

    def save(self, step: int, state: dict[str, Any], meta: dict[str, Any], attempt: str | None = None) -> float:
        """Snapshot `state` and write it in the background; returns the seconds this call held up training
        (waiting for a previous save included). With `overlap_copy` the copy runs in the background too, and the
        caller must call `snapshot_barrier()` before it changes any tensor of `state`. `attempt`: the save attempt
        id every rank agreed on (checkpoint.temp_dir)."""
        t0 = time.perf_counter()
        self.wait()
        snap, copies = snapshot_plan(state, self._buffers)
        self._buffers = snap
        copier = _Copier(copies)
        if self.overlap_copy:
            self._copier = copier
        else:
            copier.finish()
        self._pending = step
        self._thread = threading.Thread(target=self._write, args=(step, snap, meta, copier, attempt),
                                        name=f"ckpt-{step}", daemon=True)  # a crashed run must not wait for it
        self._thread.start()
        return time.perf_counter() - t0

    def snapshot_barrier(self) -> float:
        """Return once the snapshot of the save in flight is complete (the state may then change); the training
        thread copies what the background thread has not reached. Returns the seconds it took."""
        if self._copier is None:
            return 0.0
        t0 = time.perf_counter()
        copier, self._copier = self._copier, None
        copier.finish()
        return time.perf_counter() - t0

    def _write(self, step: int, snap: dict[str, Any], meta: dict[str, Any], copier: _Copier,
               attempt: str | None) -> None:
        try:
            ckpt.save_stage("copy", step, self.rank)
            copier.finish()
            ckpt.save_rank(self.root, step, self.rank, snap, attempt)
            if self.rank == 0:
                self._await_files(step, attempt)
                ckpt.finalize(self.root, step, meta, keep=self.keep, attempt=attempt)
        except BaseException as e:  # noqa: BLE001 - raised on the training thread by wait()
            self._error = e

    def _await_files(self, step: int, attempt: str | None) -> None:
        tmp = ckpt.temp_dir(self.root, step, attempt)
        deadline = time.monotonic() + self.finalize_timeout_s
        while not all((tmp / f"{ckpt.rank_file(r)}.sum").is_file() for r in range(self.world)):
            if self._cancel.is_set():
                raise ckpt.CheckpointError(f"checkpoint step {step}: abandoned (the job's generation failed)")
            if time.monotonic() > deadline:
                raise ckpt.CheckpointError(f"checkpoint step {step}: not every rank wrote its file within "
                                           f"{self.finalize_timeout_s:.0f} s; the step stays incomplete")
            time.sleep(0.01)

    def abandon(self) -> int | None:
        """Give up the save in flight: its job's generation failed, so another rank's file may never come. Rank 0
        stops waiting for the files, this rank's own copy and write end (they touch no process group), and the
        save is forgotten, its error included; the step stays incomplete unless it was already committed. Returns
        the abandoned save's step, or None."""
        if self._thread is None:
            return None
        self._cancel.set()
        self._copier = None  # the background thread finishes the copy before it writes
        self._thread.join()
        self._thread, self._error, self._cancel = None, None, threading.Event()
        step, self._pending = self._pending, None
        return step

    def done(self) -> bool:
        """Whether no save is in flight any more (its background work has ended; `wait()` still reports it)."""
        return self._thread is None or not self._thread.is_alive()

    def wait(self) -> int | None:
        """Finish the save in flight (on every rank: until its directory is complete); returns its step."""
        if self._thread is None:
            return None
        self._copier = None  # the background thread finishes the copy before it writes
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
