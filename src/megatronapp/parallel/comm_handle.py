"""Handles of asynchronous comm ops, and waiting for them without a busy spin.

A `Handle`'s readiness (`is_completed()`) means the same thing on every backend: on NCCL it is the work's own
`is_completed()` (its CUDA event), because `Work.wait()` there only orders streams and returns at once; gloo's works
report completion only through a blocking `wait()`, so a daemon thread sits in it and signals. A handle whose op is
driven by a thread of its own (the strict mode's streams, a late send's wire) is completed by that thread.
`wait_until()` sleeps on those signals and polls NCCL works with a short back-off. On NCCL the flight recorder
learns an op's completion from its work's `is_completed()`, never from `wait()` returning, which there only means
queued.

The watcher pool and the progress condition are process-wide machinery with nothing to forget between runs; the
state they consult (strict mode, flight recorder) is the context's (`comm_context.CONTEXT`).
"""
from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable

import torch

from megatronapp import tracing
from megatronapp.parallel.comm_context import CONTEXT, CommOp
from megatronapp.parallel.comm_wire import hold

_progress = threading.Condition()  # notified whenever a watched op completes


class _Watchers:
    """Daemon threads that sit in gloo's blocking `wait()` and signal completion (daemon: an op left pending
    by a failed step must not keep the process alive at exit). Grows so no op waits for a free thread."""

    def __init__(self) -> None:
        self.jobs: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self.idle = 0
        self.lock = threading.Lock()

    def submit(self, job: Callable[[], None]) -> None:
        with self.lock:
            if self.idle == 0:
                threading.Thread(target=self._work, name="comm-watcher", daemon=True).start()
            else:
                self.idle -= 1
        self.jobs.put(job)

    def _work(self) -> None:
        while True:
            self.jobs.get()()
            with self.lock:
                self.idle += 1


_watchers = _Watchers()


class Handle:
    """An outstanding async op. `is_completed()` never blocks; `wait()` completes it (on NCCL: orders the current
    stream after it) and closes its span. Safe to use from several threads."""

    __slots__ = ("work", "span", "keep", "error", "desc", "_event", "_driven", "_closed", "_lock", "_nccl", "_op",
                 "_due")

    def __init__(self, work: object, sp: object, keep: torch.Tensor | None = None, driven: bool = False,
                 nccl: bool = False, op: CommOp | None = None, due: float = 0.0):
        self._op = op  # the flight recorder's record, completed with the handle
        self._due = due  # a modelled wire: the op is not complete before this monotonic time (0: no wire)
        self.work, self.span, self.keep = work, sp, keep  # keep: the buffer must live until the op completes
        self._nccl = nccl  # NCCL works answer is_completed() themselves, and wait() does not block the host
        self.error: BaseException | None = None
        self.desc = ""  # what the op is, for the strict mode's reports
        self._event = threading.Event()
        self._driven = driven  # completion is signalled by a thread (strict mode, wire, gloo watcher)
        self._closed = False
        self._lock = threading.Lock()
        if work is None and not driven:
            self._event.set()

    def finish(self, err: BaseException | None = None) -> None:
        """Called by the thread that drives the op (strict stream, wire, watcher) when it completes: close the
        span now (its end is the op's end, not the moment someone looks), then wake whoever waits."""
        self.error = err
        self._close_span()
        self._set_done()
        with _progress:
            _progress.notify_all()

    def _set_done(self) -> None:
        if self._op is not None and self.error is None:
            CONTEXT.flight.done(self._op)
        self._event.set()

    def _close_span(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        tracing.close_span(self.span)

    def _watch(self) -> None:
        with self._lock:
            if self._driven:
                return
            self._driven = True
        work = self.work

        def job() -> None:
            try:
                work.wait()
            except BaseException as e:  # noqa: BLE001 - surfaced to the waiter
                self.finish(e)
                return
            self.finish()

        _watchers.submit(job)

    def is_completed(self) -> bool:
        """Has the op completed? (Starts a watcher on backends whose works cannot tell without blocking.)"""
        if self._due and time.monotonic() < self._due:
            if not self._driven and not self._nccl and self.work is not None:
                self._watch()  # gloo: learn the real completion meanwhile
            return False
        if self._event.is_set():
            return True
        if not self._driven:
            if self._nccl:
                if self.work.is_completed():
                    self._set_done()
                    return True
                return False
            self._watch()
        return self._event.is_set()

    def wait(self) -> None:
        """Block until the op has completed (and its modelled wire has carried it); raise what it failed with."""
        if not self._event.is_set():
            if self._driven:
                self._wait_driven()
            else:
                self.work.wait()
                if self._nccl:  # only queued: the flight recorder hears of completion from the CUDA event
                    self._event.set()
                    if self._op is not None:
                        CONTEXT.flight.done_when(self._op, self.work.is_completed)
                else:
                    self._set_done()
        if self.error is not None:
            raise RuntimeError(f"communication failed: {self.error}") from self.error
        hold(self._due)
        if self.work is not None and self._driven and self._nccl:
            self.work.wait()  # NCCL: order the current stream after the op
        self.keep = None
        self._close_span()

    def _wait_driven(self) -> None:
        """Sleep until the driving thread signals; under a strict mode, raise its first error or a stall."""
        start = time.monotonic()
        while not self._event.wait(0.5):
            strict = CONTEXT.strict
            if strict is None:
                continue
            if strict.error is not None:
                raise RuntimeError(f"communication failed under NCCL semantics: {strict.error}") from strict.error
            # Twice the stall timeout: a stream stall (timed from the op's issue, naming the op it waits behind)
            # is the cause and must report first; this wait started later but on a loaded host the stall's thread
            # can be scheduled later still, and the race named the victim instead.
            if self.desc and time.monotonic() - start > 2 * strict.stall_timeout_s:
                raise TimeoutError(f"{self.desc} did not complete within {2 * strict.stall_timeout_s:.0f} s "
                                   f"under NCCL semantics: its peer never issued the matching op, or is "
                                   f"itself blocked (see that rank's error)")

    @property
    def blocks_host(self) -> bool:
        """True when `wait()` would block this thread on the op itself (gloo, no watcher): cheaper than a
        thread hop when the caller has nothing else to do."""
        return not self._driven and not self._nccl and not self._event.is_set()

    @property
    def orders_stream(self) -> bool:
        """True when `wait()` returns at once and orders the current CUDA stream after the op (an NCCL op issued
        directly): a consumer that knows which op it needs waits on the device, never on the host."""
        return self._nccl and not self._driven

    @property
    def done(self) -> bool:
        return self._event.is_set() and not (self._due and time.monotonic() < self._due)


POLL_MAX_S = 2e-3  # back-off cap when completions are signalled (gloo's watchers wake the waiter at once)
NCCL_POLL_MAX_S = 2e-4  # NCCL works signal nothing: each poll costs a cudaEventQuery (~1 us), a late one a stall


def wait_until(pred: Callable[[], bool], timeout_s: float, what: Callable[[], str],
               max_delay_s: float = POLL_MAX_S) -> None:
    """Sleep until `pred()` (checked whenever an op completes, and by polling with a back-off up to `max_delay_s`:
    pass NCCL_POLL_MAX_S when NCCL works decide `pred`); raise TimeoutError with `what()` after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    delay = min(5e-5, max_delay_s)
    with _progress:
        while not pred():
            strict = CONTEXT.strict
            if strict is not None and strict.error is not None:
                raise RuntimeError(f"communication failed under NCCL semantics: {strict.error}") from strict.error
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"nothing arrived for {timeout_s:.0f} s; {what()}")
            _progress.wait(min(left, delay))
            delay = min(delay * 2, max_delay_s)
