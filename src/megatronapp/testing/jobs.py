"""A training job across the hosts of a `Cluster`, started as users start one: `megatronapp torchrun` on every host
(c10d rendezvous at one address), `megatronapp resilience watch` beside it, and optionally the rendezvous store on
a host of its own (`megatronapp resilience store`). For the multi-host tests and `benchmarks/bench_multihost.py`.

Every process runs inside a host of the cluster (the watcher, which only reads files, runs where the caller runs),
writes its output to a log file, and is ended by `Cluster.close()` whatever happens.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megatronapp.testing.cluster import Cluster

PORT = 29400  # every host has its own network stack: a fixed port meets no other job


@dataclass
class Job:
    cluster: Cluster
    out: Path  # the run directory (on the shared file system)
    hb: Path  # the heartbeat directory
    logs: Path
    agents: dict[int, subprocess.Popen] = field(default_factory=dict)  # host index -> its torchrun
    driver: subprocess.Popen | None = None
    store: subprocess.Popen | None = None

    def log(self, name: str) -> str:
        p = self.logs / name
        return p.read_text(errors="replace") if p.is_file() else ""

    def agent_logs(self) -> str:
        return "\n".join(f"--- agent on host {i}\n{self.log(f'agent{i}.log')}" for i in sorted(self.agents))


def env(repo: Path | None = None, **extra: str) -> dict[str, str]:
    """The environment of every process: this checkout on the path, one intra-op thread per rank."""
    paths = [str(Path(__file__).resolve().parents[2])]  # src/, for `python -m megatronapp`
    if repo is not None:
        paths.append(str(repo))  # a test's plug-ins (tests.plugin_probe)
    return {**os.environ, "PYTHONPATH": os.pathsep.join([*paths, os.environ.get("PYTHONPATH", "")]),
            "OMP_NUM_THREADS": "1", **extra}


def rdzv_conf(is_host: bool | None = None, keep_alive_s: int = 1, keep_alive_attempts: int = 5,
              join_timeout_s: int = 120) -> str:
    """torchrun's --rdzv-conf for these jobs: a host's keep-alive expires after keep_alive_s x attempts (the time
    a lost host takes to be noticed), a round completes 1 s after its minimum joined, and nothing waits for a
    rendezvous longer than `join_timeout_s` (torchrun's default is 600 s)."""
    conf = [f"keep_alive_interval={keep_alive_s}", f"keep_alive_max_attempt={keep_alive_attempts}",
            "last_call_timeout=1", f"join_timeout={join_timeout_s}"]
    if is_host is not None:
        conf.insert(0, f"is_host={int(is_host)}")
    return ",".join(conf)


def start_agent(job: Job, host: int, endpoint: str, nnodes: str, nproc: int, train: list[str], conf: str,
                environ: dict[str, str], max_restarts: int = 3) -> subprocess.Popen:
    """`megatronapp torchrun ... -m megatronapp train ...` on one host."""
    argv = [sys.executable, "-m", "megatronapp", "torchrun", "--nnodes", nnodes, "--nproc-per-node", str(nproc),
            "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-conf", conf,
            "--max-restarts", str(max_restarts), "--monitor-interval", "0.5",
            "-m", "megatronapp", "train", *train, "--out", str(job.out), "--heartbeat-dir", str(job.hb)]
    job.agents[host] = job.cluster.run(host, argv, env=environ, log=f"agent{host}.log")
    return job.agents[host]


def start_store(job: Job, host: int, environ: dict[str, str]) -> str:
    """The rendezvous store on host `host` (a host that does not train); its endpoint."""
    addr = job.cluster.hosts[host].addr
    job.store = job.cluster.run(host, [sys.executable, "-m", "megatronapp", "resilience", "store", "--addr", addr,
                                       "--port", str(PORT)], env=environ, log="store.log")
    return f"{addr}:{PORT}"


def start_driver(job: Job, world: int, hang_timeout_s: float, heartbeat_s: float, environ: dict[str, str],
                 give_up_after_s: float = 180.0) -> subprocess.Popen:
    """`megatronapp resilience watch` on the job's heartbeat directory (it reads files only)."""
    job.logs.mkdir(parents=True, exist_ok=True)
    job.driver = subprocess.Popen(
        [sys.executable, "-m", "megatronapp", "resilience", "watch", "--heartbeat-dir", str(job.hb),
         "--world", str(world), "--hang-timeout", str(hang_timeout_s), "--heartbeat-interval", str(heartbeat_s),
         "--give-up-after", str(give_up_after_s), "--json", str(job.logs / "driver.json")],
        env=environ, stdout=(job.logs / "driver.out").open("w"), stderr=(job.logs / "driver.log").open("w"))
    return job.driver


def beat(hb: Path, rank: int) -> dict[str, Any]:
    """Rank `rank`'s newest heartbeat ({} while it has none, or it is being replaced)."""
    try:
        return json.loads((hb / f"rank{rank:05d}.json").read_text())
    except (OSError, ValueError):
        return {}


def start_record(hb: Path) -> dict[str, Any]:
    try:
        return json.loads((hb / "start.json").read_text())
    except (OSError, ValueError):
        return {}


def wait_until(predicate: Any, timeout_s: float, what: str, poll_s: float = 0.05) -> float:
    """Poll `predicate()` until true; the time it became true. TimeoutError naming `what` otherwise."""
    end = time.time() + timeout_s
    while time.time() < end:
        if predicate():
            return time.time()
        time.sleep(poll_s)
    raise TimeoutError(f"{what}: not within {timeout_s:.0f} s")


def wait_for_step(hb: Path, rank: int, step: int, timeout_s: float) -> float:
    """Until rank `rank` reports step >= `step`."""
    return wait_until(lambda: beat(hb, rank).get("step", -1) >= step, timeout_s, f"rank {rank} at step {step}")


def finish(job: Job, timeout_s: float, hosts: list[int]) -> dict[str, Any]:
    """Wait for the driver and for the agents of `hosts`; the driver's result (its --json)."""
    assert job.driver is not None
    job.driver.wait(timeout=timeout_s)
    for h in hosts:
        job.agents[h].wait(timeout=timeout_s)
    path = job.logs / "driver.json"
    return json.loads(path.read_text()) if path.is_file() else {}
