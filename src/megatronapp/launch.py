"""Start ranks: a local launcher that spawns N processes, or join a job started by torchrun.

`spawn(fn, nproc, *args)` runs `fn(rank, world_size, *args)` in each process after initialising
torch.distributed (gloo on CPU, NCCL when every rank has a GPU). A rank that raises makes the launcher
stop the others and re-raise with the failing rank named.
"""
from __future__ import annotations

import os
import socket
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pick_backend(requested: str = "auto") -> str:
    if requested != "auto":
        return requested
    return "nccl" if torch.cuda.is_available() else "gloo"


def init_distributed(backend: str = "auto", timeout_s: float = 300.0) -> tuple[int, int]:
    """Initialise torch.distributed from RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT (torchrun's variables)."""
    import datetime

    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    backend = pick_backend(backend)
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank % max(1, torch.cuda.device_count()))))
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29500")
        dist.init_process_group(backend, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=timeout_s))
    return rank, world


def _entry(rank: int, world: int, port: int, backend: str, threads: int, fn: Callable, args: tuple,
           errq: Any) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    # Many ranks on few cores: one intra-op thread each avoids oversubscription.
    torch.set_num_threads(threads)
    try:
        init_distributed(backend)
        fn(rank, world, *args)
    except BaseException as e:  # report which rank failed, then let the launcher stop the rest
        errq.put((rank, f"{type(e).__name__}: {e}", traceback.format_exc()))
        raise SystemExit(1) from None
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # a peer may already be gone; nothing left to release
                pass


class RankFailed(RuntimeError):
    def __init__(self, rank: int, message: str, tb: str):
        super().__init__(f"rank {rank} failed: {message}")
        self.rank, self.tb = rank, tb


def spawn(fn: Callable, nproc: int, *args: Any, backend: str = "gloo", threads: int = 1) -> None:
    """Run `fn(rank, world_size, *args)` on `nproc` local processes; raise RankFailed naming the first failure."""
    ctx = mp.get_context("spawn")
    errq = ctx.SimpleQueue()
    port = free_port()
    try:
        mp.start_processes(_entry, args=(nproc, port, backend, threads, fn, args, errq), nprocs=nproc,
                           join=True, start_method="spawn")
    except mp.ProcessRaisedException:
        pass
    except mp.ProcessExitedException:
        pass
    if not errq.empty():
        rank, msg, tb = errq.get()
        raise RankFailed(rank, msg, tb)
