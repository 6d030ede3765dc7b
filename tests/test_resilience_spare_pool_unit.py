"""Where a newcomer comes from when no spare is ready (`resilience/spare_pool.py`), in one supervisor process with
its real store: a process forked on demand from the fork server; without a fork server (the launcher's
`MEGATRONAPP_START_METHOD=spawn` opt-out), or when the forked process dies, nobody, and the generation job falls
back to the full restart with a log line that says why."""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from megatronapp.cli import build_parser, config_from_args
from megatronapp.resilience import generation_protocol as gp
from megatronapp.resilience import generations
from megatronapp.resilience.spare_pool import ForkServer, SparePool
from megatronapp.resilience.supervisor import Options
from megatronapp.resilience.watch import Failure

FLAGS = ["--nproc", "8", "--tp", "2", "--pp", "2", "--dp", "2", "--steps", "4", "--layers", "2", "--hidden", "32",
         "--heads", "4", "--global-batch", "4", "--microbatches", "2", "--seq-len", "16", "--no-progress"]


def _cfg(out: Path):
    return config_from_args(build_parser().parse_args(["train", *FLAGS, "--out", str(out)]))


def _settled(server: ForkServer) -> ForkServer:
    deadline = time.monotonic() + 600
    while not server.settled() and time.monotonic() < deadline:
        time.sleep(0.01)
    return server


@pytest.fixture
def store():
    store, listener = generations._store()
    yield store
    listener.detach()  # the store owns the descriptor and closes it when it goes; closing it here too would close
    # whatever reused the number by then (another test's socket or a process's sentinel)


def test_a_missing_newcomer_is_forked_on_demand_and_says_ready_through_the_spare_key(tmp_path, store):
    server = _settled(ForkServer("gloo"))
    assert server.usable(), server.state()
    events: list[dict] = []
    args = (8, _cfg(tmp_path / "run").to_dict(), store.port, str(tmp_path / "result.json"), str(tmp_path), 1, {})
    pool = SparePool(0, store, args, server, lambda _m: None, events.append)
    try:
        taken = pool.take(1, 120.0, time.sleep)
        assert taken is not None, pool.shortfall
        (spare,) = taken
        assert (spare.path, spare.method, spare.reason) == ("fork server", "forkserver", "on demand")
        assert store.check([gp.spare_ready_key(spare.sid)]) and spare.ready_at is not None
        assert spare.process.exitcode is None  # waiting for its assignment, as a spare does
        assert [e["event"] for e in events if e.get("sid") == spare.sid] == ["spare_started", "spare_ready"]
    finally:
        for p in [*pool.close(), *([spare.process] if taken else [])]:
            p.kill()
            p.join()


def _job(tmp_path: Path, store, server: ForkServer, logs: list[str], spare_world: int = 8):
    """A generation job of 8 ranks in generation 0, none of them a real process, with `server` and no spare
    (`spare_world`: the world its spares are told, wrong to make them fail)."""
    cfg = _cfg(tmp_path / "run")
    # A long spare wait on purpose: the pool holds no spare, so the wait ends as soon as nothing may come (no fork
    # server, or the one process forked on demand died); a 1 s wait ended first on a loaded CI host and the line
    # said "not ready in time" for a process still starting up to die.
    job = generations.GenerationJob(cfg, Options(spares=1, spare_wait_s=120.0), logs.append,
                                    tmp_path / "events.jsonl")
    job.store, job.port, job.rundir, job.env = store, store.port, tmp_path, {}
    job.pool = SparePool(0, store, (spare_world, cfg.to_dict(), store.port, str(tmp_path / "result.json"),
                                    str(tmp_path), 1, {}), server, logs.append, job._event)

    class Rank:  # what _recover reads of a rank's process
        def __init__(self, pid: int, exitcode: int | None):
            self.pid, self.exitcode = pid, exitcode
            self.sentinel, _ = os.pipe()  # never ready: the rank neither lives nor dies during the test

    job.ranks = {r: Rank(100000 + r, -9 if r == 5 else None) for r in range(8)}
    return job


@pytest.mark.parametrize("how", ["spawn-opt-out", "forked-process-dies"])
def test_without_a_newcomer_the_job_falls_back_to_the_full_restart_with_a_clear_log_line(tmp_path, store,
                                                                                          monkeypatch, how):
    if how == "spawn-opt-out":
        monkeypatch.setenv("MEGATRONAPP_START_METHOD", "spawn")
        server, world = ForkServer("gloo"), 8
        assert server.settled() and not server.usable()
    else:  # a real fork server, but the process forked from it is told a wrong world size and dies
        server, world = _settled(ForkServer("gloo")), 3
        assert server.usable(), server.state()
    logs: list[str] = []
    job = _job(tmp_path, store, server, logs, world)
    failure = Failure("exit", 5, job.labels[5], "killed by signal SIGKILL", 3, time.time(), noticed_at=time.time(),
                      signal="SIGKILL")
    outcome = job._recover(failure)
    assert outcome is failure, "no newcomer: _recover must hand the failure to the full restart"
    assert job.g == 0 and not store.check([gp.plan_key(1)])  # no generation 1 was published
    line = next(m for m in logs if m.startswith("no in-place recovery"))
    assert line.endswith("restarting every rank"), line
    assert "no newcomer for rank(s) 5: 0 of 1 spares ready" in line, line
    if how == "spawn-opt-out":
        assert "fork server unavailable (MEGATRONAPP_START_METHOD=spawn)" in line, line
    else:
        assert "the process forked on demand died" in line, line
        assert any("died while waiting" in m for m in logs), logs
    events = [json.loads(x) for x in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert events[-1]["event"] == "fallback" and events[-1]["path"] == "restart", events[-1]
    for p in job.pool.close():
        p.kill()
        p.join()


def test_an_nccl_job_has_no_fork_server(monkeypatch):
    """A CUDA process starts from a fresh interpreter, never from a fork: an NCCL job's spares are spawned."""
    monkeypatch.delenv("MEGATRONAPP_START_METHOD", raising=False)
    server = ForkServer("nccl")
    assert server.settled() and not server.usable() and server.ctx is None
    assert "nccl job" in server.state(), server.state()
