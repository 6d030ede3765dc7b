"""The MegaScan tracer: a `SpanSink` that records spans of traced iterations to this rank's trace file.

Hot path cost: outside a trace window `open` is one attribute test; inside it is a clock read (or a CUDA
event record) and a tuple. Closed spans go into a bounded deque; a background thread turns what it drains at once
into one columnar record block and appends it to the file, so the training thread never waits for disk and never
synchronizes a device.
When the deque is full new spans are dropped and counted (the footer says how many) rather than growing memory.
No barrier anywhere: clock alignment uses a start-up handshake plus the collectives the job does anyway.
"""
from __future__ import annotations

import collections
import contextlib
import os
import signal
import socket
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from megatronapp import tracing
from megatronapp.config import ConfigError
from megatronapp.scan.read.format import CAT_INDEX, OPENED, RECORD, RankWriter, rank_file

_FINISH = object()  # `close()` without a token ends the tracer (SpanSink.close(token) ends one span)
_SKIP_ON_COARSE = frozenset({"layer"})
_HOST_TIMED_ON_CUDA = frozenset({"data"})  # CPU-side work: a host clock is the truth, not the stream
_OTHER = CAT_INDEX["other"]
_WORK = frozenset({"compute", "data", "optimizer", "layer"})  # spans whose CPU wait is measured (format.py: cpu_wait)


class _SchedstatFd:
    """This thread's /proc schedstat file, open; closed when the thread (and so its thread-local) goes away."""

    def __init__(self) -> None:
        try:
            self.fd = os.open("/proc/thread-self/schedstat", os.O_RDONLY)
        except OSError:
            self.fd = -1

    def __del__(self) -> None:
        if self.fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self.fd)


class _CpuWait:
    """Nanoseconds this thread has spent runnable but waiting for a CPU, from Linux schedstat (its 2nd field,
    the run-queue delay); -1 where the kernel does not say. One pread of an fd opened once per thread (~1 us):
    /proc/thread-self names the thread that opens it, so a forked child forgets every fd it inherited (they
    would read the parent's threads) and opens its own."""

    def __init__(self) -> None:
        self._local = threading.local()
        os.register_at_fork(after_in_child=self._forget)

    def _forget(self) -> None:
        self._local = threading.local()  # the inherited fds are closed as their holders go

    def __call__(self) -> int:
        f = getattr(self._local, "f", None)
        if f is None:
            f = self._local.f = _SchedstatFd()
        if f.fd < 0:
            return -1
        try:
            return int(os.pread(f.fd, 128, 0).split()[1])
        except (OSError, IndexError, ValueError):
            return -1


cpu_wait_ns = _CpuWait()


class Tracer:
    """Records spans of iterations `i` with `i % interval >= interval - iterations`, once each, to one rank file.

    The window is the *end* of each interval, so with interval > iterations the warm-up step 0 is never
    traced (its one-off costs would look like a straggler) and a run of `interval` steps traces its last ones. A
    resumed run warms up in its checkpoint's step, which may fall in a window: the engine's `first_step` header
    tells the detector which step that is."""

    def __init__(self, path: str | Path, header: dict, *, interval: int = 1, iterations: int = 1,
                 granularity: str = "coarse", cuda: bool = False, queue_limit: int = 1 << 16,
                 clock: Callable[[], int] = time.monotonic_ns, flush_s: float = 0.5):
        if interval < 1 or iterations < 1:
            raise ConfigError(f"trace.interval={interval} and trace.iterations={iterations} must both be >= 1")
        if granularity not in ("coarse", "full"):
            raise ConfigError(f"trace.granularity={granularity!r}: choose coarse or full")
        self.interval, self.iterations = interval, iterations
        self._skip = _SKIP_ON_COARSE if granularity == "coarse" else frozenset()
        self._clock = clock
        self._cuda = cuda
        self._device = None  # the rank's GPU: spans closed on helper threads are timed on its stream too
        if cuda:
            import torch

            self._device = torch.cuda.current_device()
        self._limit = queue_limit
        self._q: collections.deque = collections.deque()
        self.dropped = 0
        self.active = False
        self._it = -1
        self._step_t0: Any = None
        self._seen: set[int] = set()
        self.repeated: list[int] = []
        self._anchors: dict[int, tuple[Any, int]] = {}  # per traced iteration: (CUDA event, host ns at it)
        header = {**header, "clock": "cuda_event" if cuda else "monotonic_ns",
                  "trace": {"interval": interval, "iterations": iterations, "granularity": granularity}}
        self._writer = RankWriter(path, header)
        self._pending: list = []  # CUDA spans whose end event has not completed yet
        self._wake = threading.Event()
        self._stop = False
        self._flush_s = flush_s
        self._error: BaseException | None = None
        self._flush_lock = threading.RLock()  # the writer thread and a signal handler both flush
        self._thread = threading.Thread(target=self._drain_loop, name="megascan-writer", daemon=True)
        self._thread.start()
        self._previous: dict[int, Any] = {}
        self._install_signal_flush()

    # ---- SpanSink ---------------------------------------------------------------------------------------
    def open(self, name: str, cat: str, meta: dict[str, Any]) -> Any:
        """Start a span (None when outside a trace window or filtered by granularity)."""
        if not self.active or cat in self._skip:
            return None
        if (cat == "comm" or cat == "step") and len(self._q) < self._limit:
            # Written as soon as the writer wakes (every flush_s): if this op never completes, the file says so.
            self._q.append(((name, cat, meta, self._it, None, -1), self._clock(), -1))
        if self._cuda and cat not in _HOST_TIMED_ON_CUDA:
            return (name, cat, meta, self._it, self._event(), -1)
        return (name, cat, meta, self._it, self._clock(), cpu_wait_ns() if cat in _WORK else -1)

    def close(self, token: Any = _FINISH) -> None:
        """End span `token`; called with no argument, flush everything, close the file and uninstall."""
        if token is None:
            return
        if token is _FINISH:
            self._shutdown()
            return
        end = self._event() if self._cuda and token[1] not in _HOST_TIMED_ON_CUDA else self._clock()
        if len(self._q) >= self._limit:
            self.dropped += 1
            return
        waited = cpu_wait_ns() - token[5] if token[5] >= 0 else -1
        self._q.append((token, end, waited if waited >= 0 else -1))

    def step(self, iteration: int, begin: bool) -> None:
        """Open or close a trace window at an iteration boundary; a repeated iteration is not traced twice."""
        if begin:
            in_window = iteration % self.interval >= self.interval - self.iterations
            if in_window and iteration in self._seen:
                self.repeated.append(iteration)
                in_window = False
            self.active = in_window
            if in_window:
                self._seen.add(iteration)
                self._it = iteration
                if self._cuda:  # a new anchor where a window starts; its later iterations share it
                    prev = self._anchors.get(iteration - 1)
                    self._anchors[iteration] = prev if prev is not None else self._new_anchor()
                    while len(self._anchors) > 64:  # the writer resolves spans within seconds: recent ones do
                        del self._anchors[next(iter(self._anchors))]
                self._step_t0 = self.open("step", "step", {})
            return
        if self.active and iteration == self._it:
            self.close(self._step_t0)
            self.active = False
            self._wake.set()  # write the finished iteration now: a crash later keeps it on disk

    # ---- flushing on demand ------------------------------------------------------------------------------
    def flush_now(self) -> None:
        """Write everything recorded so far (opened ops included) to the file now."""
        with self._flush_lock:  # the writer thread may be draining the same queue
            self._drain(final=False)
            self._writer.flush()

    def _install_signal_flush(self) -> None:
        # SIGUSR1: dump now and go on (an operator asking a stuck job "where are you?"); SIGTERM: dump, then do
        # what the process did before (a launcher killing a hung job). A rank blocked inside a C++ collective
        # runs no Python handler; the writer thread's periodic flush (flush_s) covers it.
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in (signal.SIGUSR1, signal.SIGTERM):
            try:
                self._previous[sig] = signal.signal(sig, self._on_signal)
            except (ValueError, OSError):
                pass

    def _on_signal(self, signum: int, frame: Any) -> None:
        try:
            self.flush_now()
        except Exception:  # noqa: BLE001 (a dump must never turn a signal into a crash of its own)
            pass
        prev = self._previous.get(signum)
        if signum == signal.SIGTERM:
            if callable(prev):
                prev(signum, frame)
            else:
                signal.signal(signum, signal.SIG_DFL)
                os.kill(os.getpid(), signum)

    def _restore_signals(self) -> None:
        for sig, prev in self._previous.items():
            with contextlib.suppress(ValueError, OSError, TypeError):
                if signal.getsignal(sig) == self._on_signal:
                    signal.signal(sig, prev)
        self._previous = {}

    # ---- timing -----------------------------------------------------------------------------------------
    def _event(self) -> Any:
        import torch

        ev = torch.cuda.Event(enable_timing=True)
        ev.record(torch.cuda.current_stream(self._device))  # a helper thread's own current device would be 0
        return ev

    def _sync(self) -> None:
        import torch

        torch.cuda.synchronize()

    def _new_anchor(self) -> tuple[Any, int]:
        # Once per trace WINDOW (one device sync at its first step, none per span): an event whose host time is
        # known ties stream times to the host clock. Event times are float32 ms apart (cudaEventElapsedTime):
        # from one anchor per run they keep ~1 ms precision after 3 hours; from the window's own, ~1 us.
        self._sync()
        host = self._clock()
        ev = self._event()
        ev.synchronize()
        return ev, host

    def _resolve(self, token: tuple, end: Any) -> tuple[int, int] | None:
        """(ts, dur) in ns for a closed span; None if its CUDA end event has not completed."""
        start = token[4]
        if start is None:
            return end, OPENED  # an op-opened marker: host time of the opening
        if isinstance(start, int):
            return start, end - start
        if not end.query():
            return None
        anchor, host = self._anchors.get(token[3]) or self._anchors[next(reversed(self._anchors))]
        ts = host + int(anchor.elapsed_time(start) * 1e6)
        return ts, int(start.elapsed_time(end) * 1e6)

    # ---- background writer ------------------------------------------------------------------------------
    def _drain_loop(self) -> None:
        try:
            while True:
                self._wake.wait(self._flush_s)
                self._wake.clear()
                stopping = self._stop
                with self._flush_lock:
                    self._drain(final=stopping)
                    self._writer.flush()
                if stopping:
                    return
        except Exception as e:  # noqa: BLE001 (keep the job alive; close() reports it)
            self._error = e

    def _drain(self, final: bool) -> None:
        q = self._q
        pending, self._pending = self._pending, []
        while q:
            pending.append(q.popleft())
        if not self._cuda:  # host clock: every span is resolved already (what _resolve does, per batch)
            self._write_batch([(t, (end, OPENED) if t[4] is None else (t[4], end - t[4]), w)
                               for t, end, w in pending])
            return
        done = []
        for i, (token, end, waited) in enumerate(pending):
            if final and not isinstance(end, int):
                end.synchronize()  # only at shutdown: wait for the stream to finish the last spans
            te = self._resolve(token, end)
            if te is None:
                self._pending = pending[i:]  # stream order: later spans are not done either
                break
            done.append((token, te, waited))
        self._write_batch(done)

    def _write_batch(self, done: list[tuple[tuple, tuple[int, int], int]]) -> None:
        """One columnar block for everything drained at once (RankWriter.write_columns): each field is pulled out
        of the spans by one comprehension and converted by numpy once, not packed span by span."""
        if not done:
            return
        names: dict[str, int] = {}
        groups: dict[tuple, int] = {}

        def gid(meta: dict) -> int:
            group = meta.get("group")
            if group is None:
                return -1
            ranks = meta.get("group_ranks")
            return groups.setdefault((group, ranks if isinstance(ranks, tuple) else tuple(ranks or ())),
                                     len(groups))

        tokens = [t for t, _, _ in done]
        metas = [t[2] for t in tokens]
        rec = np.zeros(len(done), RECORD)
        rec["ts"] = [te[0] for _, te, _ in done]
        rec["dur"] = [te[1] for _, te, _ in done]
        rec["cpu_wait"] = [w for _, _, w in done]
        rec["name"] = [names.setdefault(t[0], len(names)) for t in tokens]
        rec["cat"] = [CAT_INDEX.get(t[1], _OTHER) for t in tokens]
        rec["it"] = [t[3] for t in tokens]
        rec["gid"] = [-1 if m.get("group") is None else gid(m) for m in metas]
        rec["nbytes"] = [m.get("bytes", 0) or 0 for m in metas]
        for field, key in (("seq", "seq"), ("peer", "peer"), ("chunk", "chunk"), ("mb", "microbatch")):
            vals = [m.get(key, -1) for m in metas] if key != "microbatch" else \
                [m.get("microbatch", m.get("mb", -1)) for m in metas]
            try:
                rec[field] = vals
            except TypeError:  # a None among them: "none" is -1 in the file
                rec[field] = [-1 if v is None else v for v in vals]
        self._writer.write_columns(list(names), list(groups), rec)

    def _shutdown(self) -> None:
        if self._stop:
            return
        tracing.uninstall(self)
        self._restore_signals()
        self.active = False
        self._stop = True
        self._wake.set()
        self._thread.join()
        self._writer.close(footer={"dropped": self.dropped, "iterations": sorted(self._seen),
                                   "repeated_iterations": self.repeated,
                                   "writer_error": repr(self._error) if self._error else None})
        if self._error is None:
            self._summarise()
        if self._error is not None:
            raise RuntimeError(f"MegaScan writer for {self._writer.path} failed: {self._error!r}")

    def _summarise(self) -> None:
        """Leave the rank's summary block at the end of its file (rank_summary.py): the triage of a large job then
        reads a page per rank, not its spans. Best effort: without it the file is read in full, so a failure here
        is a warning, never the job's end."""
        from megatronapp.scan.detect.features import write_summary  # (the triage's code: loaded only at the end)

        try:
            write_summary(self._writer.path)
        except Exception as e:  # noqa: BLE001 (the trace is written and whole; only the shortcut is missing)
            warnings.warn(f"MegaScan: no summary block for {self._writer.path}: {e!r}", RuntimeWarning,
                          stacklevel=2)


def handshake(group: Any, rounds: int = 5, cuda: bool = False,
              clock: Callable[[], int] = time.monotonic_ns) -> dict:
    """Run `rounds` tiny all-reduces over `group`, recording local send and exit times (clock alignment)."""
    import torch

    from megatronapp.parallel import comm

    send, exit_ = [], []
    t = torch.zeros(1, device="cuda" if cuda else "cpu")
    for _ in range(rounds):
        if cuda:
            torch.cuda.synchronize()
        send.append(clock())
        comm.all_reduce(t, group)
        if cuda:
            torch.cuda.synchronize()
        exit_.append(clock())
    return {"group_ranks": list(group.ranks), "send": send, "exit": exit_}


def base_header(rank: int, world: int, coord: tuple[int, int, int], topo: tuple[int, int, int],
                clock: Callable[[], int] = time.monotonic_ns) -> dict:
    """Identity and clock reference of one rank (wall/monotonic pair for a coarse cross-host guess)."""
    return {"rank": rank, "world": world, "coord": list(coord), "topo": list(topo), "host": socket.gethostname(),
            "boot_id": _boot_id(), "pid": os.getpid(), "wall_ns": time.time_ns(), "mono_ns": clock()}


def _boot_id() -> str | None:
    """This boot of this host (Linux): ranks with equal host and boot id read one CLOCK_MONOTONIC."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip() or None
    except OSError:
        return None


def attach(cfg: Any, topo: Any, trace_dir: str | Path, *, clock: Callable[[], int] = time.monotonic_ns,
           handshake_rounds: int = 5, extra_header: dict | None = None) -> Tracer:
    """Create this rank's tracer from `cfg.trace`, run the clock handshake and install it as a span sink.
    `extra_header`: what the host says about this rank beyond its coordinates (e.g. a MegaFBD role and its
    `process_name` in the merged timeline)."""
    import torch.distributed as dist

    from megatronapp.launch import pick_backend

    tc = cfg.trace
    cuda = pick_backend(cfg.parallel.backend) == "nccl"
    c = topo.coord
    header = {**(extra_header or {}),
              **base_header(topo.rank, topo.world_size, (c.dp, c.pp, c.tp), (topo.tp, topo.pp, topo.dp), clock)}
    world = topo.groups.get("world")
    if world is not None and world.size > 1 and dist.is_initialized():
        # Before install: the handshake's own all-reduces are not spans of the job.
        header["handshake"] = handshake(world, handshake_rounds, cuda, clock)
    tracer = Tracer(rank_file(trace_dir, topo.rank), header, interval=tc.interval, iterations=tc.iterations,
                    granularity=tc.granularity, cuda=cuda, clock=clock)
    tracing.install(tracer)
    return tracer


def plugin(trainer: Any) -> None:
    """Plug-in entry for `--trace`: attach this rank's tracer to the run and close it at shutdown."""
    cfg = trainer.cfg
    from megatronapp.scan.record.costmodel import stage_work

    # What each pipeline stage should cost (FLOPs of its chunks): a stage without peers is judged against it.
    cost = {"stage_work": stage_work(cfg.model, cfg.parallel.pp, cfg.parallel.vpp, cfg.train.seq_len)} \
        if cfg.parallel.pp > 1 else {}
    # first_step: where this process starts (a resumed run goes on from its checkpoint): its one-off start-up
    # costs land in that step, which the detector does not take for a pause.
    tracer = attach(cfg, trainer.topo, cfg.trace.dir or str(trainer.out / "trace"),
                    extra_header={**cost, "first_step": int(getattr(trainer, "step", 0)),
                                  **(getattr(trainer, "trace_header", None) or {})})  # MegaFBD: its role
    trainer.hooks.on("shutdown", tracer.close)
