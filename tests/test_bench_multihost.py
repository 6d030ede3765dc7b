"""benchmarks/bench_multihost.py without a cluster: it reads torchrun's log time stamps as torchrun writes them, and
its docs table renders from the stored result (the drills themselves need root: `python -m
benchmarks.bench_multihost --quick`)."""
from __future__ import annotations

import datetime

from benchmarks import bench_multihost as bench
from benchmarks import harness


def test_torchrun_reactions_are_read_from_its_log_lines():
    log = "\n".join([
        "I1207 06:19:00.824000 30648 .../api.py:962] [default] Detected 1 new nodes from group_rank=0; will restart",
        "W1207 06:19:00.833000 30648 .../api.py:1028] Sending process 30973 closing signal SIGTERM",
        "E1207 06:24:29.601000 7007 .../api.py:1002] failed (exitcode: 75) local_rank: 0 (pid: 7140)",
        "I1207 06:19:02.502000 30648 .../api.py:553] [default] Rendezvous complete for workers. Result:",
    ])
    got = bench._agent_reactions(log, 2026)
    want = [datetime.datetime(2026, 12, 7, 6, 19, 0, 824000).timestamp(),
            datetime.datetime(2026, 12, 7, 6, 19, 0, 833000).timestamp(),
            datetime.datetime(2026, 12, 7, 6, 24, 29, 601000).timestamp()]
    assert got == want  # the rendezvous line is no reaction


def test_the_docs_table_renders_from_the_stored_result():
    res = harness.read_result(bench.RESULTS)
    body = bench.docs_body(res)
    for kind in res["summary"]:
        assert f"| {kind}" in body
    assert "8/8/8 of 8" in body and "recovery_emulated.json" in body
