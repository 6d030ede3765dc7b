"""A job that hangs and is killed: its traces name the hung rank and the op everyone waits in (real gloo ranks)."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from megatronapp.scan.detect.analysis import detect
from megatronapp.scan.read.format import read_dir

WORKER = r"""
import os, sys, time, torch, torch.distributed as dist
from megatronapp import scan
rank, world, out, hang_rank = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
dist.init_process_group("gloo", rank=rank, world_size=world)
scan.instrument(out)
t = torch.ones(1024)
for i in range(1000):
    with scan.step():
        if rank == hang_rank and i == 3:
            open(os.path.join(out, "hanging"), "w").close()
            time.sleep(600)  # hung in its own work: the others block in the next all-reduce
        dist.all_reduce(t)
"""


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_hung_and_killed_job_names_the_hung_rank_and_the_op(tmp_path):
    world, hang = 3, 1
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_port()), "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, str(r), str(world), str(tmp_path), str(hang)], env=env)
             for r in range(world)]
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "hanging").exists():
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs), "workers did not start"
            time.sleep(0.2)
        time.sleep(2.0)  # the others reach the all-reduce; their writers flush on their timer (0.5 s)
    finally:
        for p in procs:  # a launcher's kill of a hung job
            p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
    traces, problems = read_dir(Path(tmp_path))
    assert len(traces) == world
    report = detect(traces)
    top = report.findings[0]
    assert (top.kind, top.ranks) == ("hang", (hang,)), report.to_text()
    op = top.evidence["op"]
    assert op["name"] == "all_reduce" and op["seq"] == 3 and top.evidence["waiting_ranks"] == [0, 2]
    assert "not in any communication" in top.slowdown
    # The same trace in the flight recorder's format: the resilience supervisor's attribution agrees.
    from megatronapp.resilience.attribution import culprits
    from megatronapp.scan.detect.hang import flight_snapshots

    assert culprits(flight_snapshots(traces)) == [hang]
