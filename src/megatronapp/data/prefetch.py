"""Batches built ahead of the step that needs them, by one background thread (MegaScale §3.4).

The batch of a step is a pure function of the step number (`BatchSource.get`), so a worker can build steps
`start, start+1, ...` while the training thread computes and hand them over through a queue. The worker
takes one of `depth` slots before building a batch and the reader frees it on taking the batch, so at most
`depth` batches exist ahead of the step being trained: data time leaves the step, memory grows by `depth`
batches. On CUDA the
worker also pins the batch, so the training thread's host-to-device copy can be `non_blocking`.

The worker only builds tensors; it never communicates. Collectives stay on the training thread in step order
(see `Trainer._batch`), so prefetching cannot change the order of collectives within a group.

Shutdown: `close()` (called by the trainer on normal exit and on an exception) stops the worker and joins it;
an error inside the worker is handed to the training thread, which raises it naming the step; a Prefetcher that
is dropped without `close()` stops its worker when it is garbage-collected (the thread holds no reference to it).
"""
from __future__ import annotations

import queue
import threading
import weakref
from collections.abc import Callable

import torch

Batch = tuple[torch.Tensor, torch.Tensor]

_POLL_S = 0.1  # how often a blocked worker or reader looks at the stop flag / the worker's liveness


class DataWorkerError(RuntimeError):
    """The background data worker failed; the message names the step whose batch it was building."""


def _work(make: Callable[[int], Batch], start: int, out: queue.Queue, slots: threading.Semaphore,
          stop: threading.Event, pin: bool) -> None:
    step = start
    while not stop.is_set():
        if not slots.acquire(timeout=_POLL_S):
            continue
        try:
            ids, labels = make(step)
            if pin:
                ids, labels = ids.pin_memory(), labels.pin_memory()
            item: tuple[int, Batch | None, BaseException | None] = (step, (ids, labels), None)
        except BaseException as e:  # handed over: the training thread raises it, naming the step
            item = (step, None, e)
        out.put(item)
        if item[2] is not None:
            return
        step += 1


class Prefetcher:
    """The batches of steps `start, start+1, ...` from `make(step)`, built up to `depth` steps ahead."""

    def __init__(self, make: Callable[[int], Batch], start: int, depth: int, pin_memory: bool = False):
        if depth < 1:
            raise ValueError(f"prefetch depth {depth} must be >= 1 (0 means: do not prefetch, call make directly)")
        self.next_step = start
        self._queue: queue.Queue = queue.Queue()  # bounded by the slots
        self._slots = threading.Semaphore(depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=_work, args=(make, start, self._queue, self._slots, self._stop,
                                                            pin_memory),
                                        name=f"data-prefetch@{start}", daemon=True)
        self._thread.start()
        self._finalizer = weakref.finalize(self, _shutdown, self._stop, self._queue, self._thread)

    def get(self, step: int) -> Batch:
        """The batch of `step`, which must be the next one in order (the trainer restarts a Prefetcher when it
        jumps, e.g. after loading a checkpoint)."""
        if step != self.next_step:
            raise ValueError(f"prefetcher expected step {self.next_step}, was asked for step {step}")
        while True:
            try:
                got, batch, error = self._queue.get(timeout=_POLL_S)
                break
            except queue.Empty:
                if not self._thread.is_alive() and self._queue.empty():  # (a last item, e.g. its error, is read)
                    raise DataWorkerError(f"the data worker stopped before building the batch of step {step}"
                                          ) from None
        if error is not None:
            self.close()
            raise DataWorkerError(f"the data worker failed building the batch of step {got}: "
                                  f"{type(error).__name__}: {error}") from error
        self._slots.release()
        self.next_step += 1
        return batch

    def close(self) -> None:
        """Stop the worker and wait for it (idempotent)."""
        self._finalizer()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()


def _shutdown(stop: threading.Event, q: queue.Queue, thread: threading.Thread) -> None:
    stop.set()
    try:  # free the queued batches now, not when the Prefetcher is collected
        while True:
            q.get_nowait()
    except queue.Empty:
        pass
    if thread is not threading.current_thread():
        # A worker inside make() finishes that batch first; bounded so a stuck reader cannot hang shutdown.
        thread.join(timeout=10.0)
