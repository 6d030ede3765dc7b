"""Start ranks: a local launcher that spawns N processes, or join a job started by torchrun.

`spawn(fn, nproc, *args)` runs `fn(rank, world_size, *args)` in each process after initialising
torch.distributed (gloo on CPU, NCCL when every rank has a GPU) and raises `RankFailed` naming the first rank
that failed: with its error, or with the signal that killed it. `start()` does the same without waiting, for a
driver that watches the ranks itself (the resilience supervisor).

Local runs rendezvous through a TCP store whose listening socket rank 0 binds to 127.0.0.1, and bind gloo to
the loopback interface, so a local job opens no port on the machine's other interfaces. A rank reports its error
through a file, not a pipe: an error longer than a pipe buffer cannot block the rank, and so cannot hang the
launcher.

How ranks start: a gloo job's ranks are forked from a fork server (multiprocessing's "forkserver") that imported
torch and the engine once, so a rank starts in tens of milliseconds instead of importing torch again (1.5-2 CPU-s
a rank here: an 8-rank job paid 15 CPU-s before its first step, and a test suite that launches hundreds of ranks
paid most of its time so). The server imports modules and runs no torch op, so no thread pool exists to be
broken by the fork. A rank still gets the launching process's environment of the moment it is started, as a
spawned one does, and its stdout and stderr of that moment (`_Stdio`). NCCL jobs, jobs with a prelude (which must
run before anything heavy is imported) and `MEGATRONAPP_START_METHOD=spawn` start ranks with "spawn" as before.
"""
from __future__ import annotations

import atexit
import inspect
import json
import multiprocessing.connection
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megatronapp import startup


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pick_backend(requested: str = "auto") -> str:
    if requested != "auto":
        return requested
    return "nccl" if torch.cuda.is_available() else "gloo"


_LISTENERS: list[socket.socket] = []


def _loopback_store(rank: int, world: int, port: int, timeout: Any) -> dist.TCPStore:
    """The job's key-value store on 127.0.0.1 only: rank 0 binds the listening socket itself (TCPStore alone
    would listen on every interface) and hands it to the store."""
    if rank == 0:
        sock = socket.socket()
        sock.bind(("127.0.0.1", port))
        sock.listen(1024)
        store = dist.TCPStore("127.0.0.1", port, world, True, timeout=timeout, master_listen_fd=sock.fileno(),
                              use_libuv=True)
        _LISTENERS.append(sock)  # the store uses the descriptor: the socket object must outlive it
        return store
    return dist.TCPStore("127.0.0.1", port, world, False, timeout=timeout)


def external_launch() -> bool:
    """Whether this process is one rank of a job another launcher started (torchrun, or any that sets
    RANK/WORLD_SIZE), rather than the parent of local ranks."""
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ)


def init_distributed(backend: str = "auto", timeout_s: float = 300.0, local_port: int | None = None
                     ) -> tuple[int, int]:
    """Initialise torch.distributed from RANK/WORLD_SIZE (torchrun's variables) and MASTER_ADDR/MASTER_PORT,
    or, for a local job (`local_port`), through a store that listens on loopback only."""
    import datetime

    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    backend = pick_backend(backend)
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank % max(1, torch.cuda.device_count()))))
    if not dist.is_initialized():
        timeout = datetime.timedelta(seconds=timeout_s)
        extra: dict[str, Any] = {}
        if backend == "nccl" and "device_id" in inspect.signature(dist.init_process_group).parameters:
            # eager init, as torchtitan does: communicators made at new_group (errors at start-up, not step 0);
            # the pipeline's 2-rank links stay correct whether P2P then uses them or lazy pair communicators
            extra["device_id"] = torch.device("cuda", torch.cuda.current_device())
        if local_port is not None:
            dist.init_process_group(backend, store=_loopback_store(rank, world, local_port, timeout), rank=rank,
                                    world_size=world, timeout=timeout, **extra)
        else:
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", "29500")
            dist.init_process_group(backend, rank=rank, world_size=world, timeout=timeout, **extra)
        if backend == "gloo":
            # Gloo's group is made when this rank's side of every pair is connected, not the peer's: a rank whose
            # work needs no collective could exit while a peer still read its side of their pair, and that peer's
            # group then failed to form ("Gloo connectFullMesh failed ... Connection closed by peer",
            # ProcessGroupGloo.cpp:67; seen in a full suite run). A barrier holds every rank until all are formed.
            dist.barrier()
    return rank, world


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj))
    os.replace(tmp, path)


class _Stdio:
    """The launcher's stdout and stderr as they are when a rank is started, for a rank forked from the fork server.

    A forked rank inherits the fork server's file descriptors 1 and 2, which are the launcher's of the moment the
    server started: a launcher that redirects its output later (a log file per attempt, pytest's capture, a
    notebook) would lose its ranks' output to the old target. Pickled while multiprocessing starts the process,
    this passes both descriptors along with the process (`reduction.DupFd`, which the fork server sends over its
    socket); unpickled in the rank, they become `_ChildStdio`, which `_entry` installs as 1 and 2 first thing."""

    def __reduce__(self) -> tuple:
        from multiprocessing import reduction
        return (_ChildStdio, (reduction.DupFd(1), reduction.DupFd(2)))


class _ChildStdio:
    def __init__(self, out: Any, err: Any) -> None:
        self.fds = (out.detach(), err.detach())

    def install(self) -> None:
        for target, fd in zip((1, 2), self.fds):
            os.dup2(fd, target)
            os.close(fd)


def _entry(rank: int, world: int, rundir: str, port: int, backend: str, threads: int, fn: Callable | str,
           args: tuple, env: dict[str, str], stdio: _ChildStdio | None = None) -> None:
    if stdio is not None:
        stdio.install()
    if env.get(_FULL_ENV):  # a forked rank: the launcher's environment now, not the fork server's at its start
        os.environ.clear()
    os.environ.update(env)
    os.environ.pop(_FULL_ENV, None)
    if isinstance(fn, str):  # started through startup.entry: the rank's function by import path
        fn = startup.resolve(fn)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    # Many ranks on few cores: one intra-op thread each avoids oversubscription.
    torch.set_num_threads(threads)
    code = 0
    try:
        startup.phase("process groups")  # a rendezvous: it waits for every rank of the job
        init_distributed(backend, local_port=port)
        fn(rank, world, *args)
    except BaseException as e:  # report which rank failed (through a file), then let the launcher stop the rest
        _write_json(Path(rundir, f"error{rank}.json"),
                    {"rank": rank, "message": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc(),
                     "time": time.time()})
        code = 1
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # a peer may already be gone; nothing left to release
                pass
    exit_rank(code)


def exit_rank(code: int) -> None:
    """End a rank process without the interpreter's finalization.

    Python 3.11 ends a daemon thread that wakes during finalization with pthread_exit; if that thread was in
    torch's C++ with the GIL released (a comm watcher in gloo's wait(), a stream thread of the NCCL rules)
    the forced unwind meets a noexcept destructor and the process aborts ('terminate called without an active
    exception', SIGABRT) after all its work succeeded: CI reported two MegaScope serving ranks killed so. So
    do what finalization does that matters (join the non-daemon threads, run atexit hooks, flush) and leave
    with os._exit, as multiprocessing's fork children always do."""
    # threading._shutdown is the interpreter's own first step: it stops executors' workers, then joins every
    # non-daemon thread (a checkpoint writer finishes its file)
    threading._shutdown()  # type: ignore[attr-defined]
    try:
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001, S110 - a closed stream has nothing left to lose
                pass
        os._exit(code)


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


class RankFailed(RuntimeError):
    """A rank raised (`tb` holds its traceback), was killed by a signal (`signum`), or exited non-zero."""

    def __init__(self, rank: int, message: str, tb: str = "", signum: int | None = None):
        super().__init__(f"rank {rank} failed: {message}")
        self.rank, self.message, self.tb, self.signum = rank, message, tb, signum


@dataclass
class RankExit:
    rank: int
    exitcode: int
    message: str
    tb: str = ""
    signum: int | None = None
    time: float = 0.0

    def error(self) -> RankFailed:
        return RankFailed(self.rank, self.message, self.tb, self.signum)


def loopback_env() -> dict[str, str]:
    """The environment that keeps a local job's gloo on the loopback interface."""
    # gloo binds to the interface its host name resolves to; a local job needs loopback only.
    if "GLOO_SOCKET_IFNAME" not in os.environ and Path("/sys/class/net/lo").exists():
        return {"GLOO_SOCKET_IFNAME": "lo"}
    return {}


class LocalJob:
    """`nproc` rank processes on this machine. `poll()` never blocks; `stop()` ends whatever still runs."""

    def __init__(self, procs: list[Any], rundir: Path):
        self.procs, self.rundir = procs, rundir

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def exits(self) -> list[RankExit]:
        """The ranks that have exited non-zero so far, with their error or signal."""
        out = []
        for rank, p in enumerate(self.procs):
            code = p.exitcode
            if code is None or code == 0:
                continue
            err = Path(self.rundir, f"error{rank}.json")
            if code < 0:
                out.append(RankExit(rank, code, f"killed by signal {signal_name(-code)}", signum=-code,
                                    time=time.time()))
            elif err.is_file():
                e = json.loads(err.read_text())
                out.append(RankExit(rank, code, e["message"], e["traceback"], time=e["time"]))
            else:
                out.append(RankExit(rank, code, f"exited with code {code} without reporting an error",
                                    time=time.time()))
        return out

    def running(self) -> bool:
        return any(p.exitcode is None for p in self.procs)

    def wait(self, timeout_s: float) -> None:
        """Block until some rank exits or `timeout_s` passes."""
        live = [p.sentinel for p in self.procs if p.exitcode is None]
        if live:
            multiprocessing.connection.wait(live, timeout_s)

    def stop(self, grace_s: float = 3.0) -> None:
        """SIGTERM every live rank, SIGKILL those still alive after `grace_s` (a stopped or hung rank)."""
        for p in self.procs:
            if p.exitcode is None:
                p.terminate()
        deadline = time.monotonic() + grace_s
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in self.procs:
            if p.exitcode is None:
                p.kill()  # SIGKILL also ends a SIGSTOPped process
                p.join()

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.rundir, ignore_errors=True)


_FULL_ENV = "MEGATRONAPP_FULL_ENV"  # marks an env dict that is the whole environment (forked ranks)
# What the fork server imports once: torch, and the engine a training rank runs (no module: plug-ins are imported
# by the ranks that attach them). An import that fails here is only skipped by multiprocessing; the rank imports
# it again and reports the error itself.
FORKSERVER_PRELOAD = ["torch", "torch.distributed", "megatronapp.train.trainer"]


def start_method(backend: str, prelude: str | None = None) -> str:
    """How `start` creates rank processes: "forkserver" for gloo jobs where the platform has it, else "spawn"
    (NCCL: CUDA must be initialised by the rank itself; a prelude must run before torch is imported)."""
    chosen = os.environ.get("MEGATRONAPP_START_METHOD", "")
    if chosen:
        if chosen not in ("spawn", "forkserver"):
            raise ValueError(f"MEGATRONAPP_START_METHOD={chosen!r}: choose spawn or forkserver")
        return chosen
    if backend == "gloo" and prelude is None and "forkserver" in mp.get_all_start_methods():
        return "forkserver"
    return "spawn"


def start(fn: Callable, nproc: int, *args: Any, backend: str = "gloo", threads: int = 1,
          env: dict[str, str] | None = None, prelude: str | None = None) -> LocalJob:
    """Start `fn(rank, world_size, *args)` on `nproc` local processes and return at once. With `prelude` (an
    import path, e.g. the resilience heartbeat's `early_start`), each rank runs `prelude(rank)` first thing,
    before it imports torch or `fn`'s module (`startup.entry`), so a watcher sees its whole start-up."""
    method = start_method(backend, prelude)
    ctx = mp.get_context(method)
    rundir = Path(tempfile.mkdtemp(prefix="megatronapp-job-"))
    full_env = {"MEGATRONAPP_RUN_ID": uuid.uuid4().hex[:12], **loopback_env(), **(env or {})}
    if method == "forkserver":
        ctx.set_forkserver_preload(FORKSERVER_PRELOAD)  # read when the server first starts; later calls no-ops
        full_env = {**os.environ, **full_env, _FULL_ENV: "1"}
    port = free_port()
    procs = []
    for rank in range(nproc):
        common = (nproc, str(rundir), port, backend, threads)
        if prelude is None:
            stdio = (_Stdio(),) if method == "forkserver" else ()  # spawned ranks inherit the launcher's own
            p = ctx.Process(target=_entry, args=(rank, *common, fn, args, full_env, *stdio), name=f"rank{rank}")
        else:  # only strings and plain data to unpickle: nothing heavy is imported before the prelude
            p = ctx.Process(target=startup.entry, name=f"rank{rank}", args=(
                prelude, rank, full_env, startup.ref_of(_entry), *common, startup.ref_of(fn), args, full_env))
        p.start()
        procs.append(p)
    return LocalJob(procs, rundir)


def first_failure(exits: list[RankExit]) -> RankExit:
    """The rank to blame among several failed ones: one killed by a signal (the others then fail on their
    broken connections), else the earliest error."""
    killed = [e for e in exits if e.signum is not None]
    return min(killed or exits, key=lambda e: e.time)


def spawn(fn: Callable, nproc: int, *args: Any, backend: str = "gloo", threads: int = 1) -> None:
    """Run `fn(rank, world_size, *args)` on `nproc` local processes; raise RankFailed naming the failed rank
    (its error, or the signal that killed it)."""
    job = start(fn, nproc, *args, backend=backend, threads=threads)
    try:
        while job.running() and not job.exits():
            job.wait(1.0)
        if job.exits():
            time.sleep(0.5)  # let the peers of a dead rank report too, so the cause is told from its victims
            exits = job.exits()
            job.stop()
            raise first_failure(exits).error()
    finally:
        job.close()
