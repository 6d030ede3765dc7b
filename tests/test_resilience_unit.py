"""Hang attribution and the flight recorder, without processes: wait edges from recorder snapshots, the cause
(not its victims) named, the wait tree printed, and the recorder's open/completed bookkeeping."""
from __future__ import annotations

from megatronapp.parallel.comm import CommOp
from megatronapp.parallel.flight_recorder import FlightRecorder, stream_key
from megatronapp.resilience.attribution import culprits, wait_edges, wait_tree
from megatronapp.resilience.supervisor import default_hang_timeout


def _op(op, key, seq, ranks, peer=None):
    return {"op": op, "key": key, "seq": seq, "ranks": ranks, "peer": peer, "group": key.split()[0]}


def _tp2_pp2_hang() -> dict[int, dict]:
    """Rank 2 (stage 1, tp 0) hung at the start of a step: rank 3 waits in their TP all-reduce, stage 0 waits for
    gradients. Rank 3 also has a receive posted for an activation rank 1 has not sent yet (a receive window)."""
    return {
        0: {"open": [_op("recv", "pp.grad.down 2->0", 6, [0, 2], peer=2)],
            "issued": {"pp.act.up 0->2": 7, "pp.grad.down 2->0": 6}},
        1: {"open": [_op("recv", "pp.grad.down 3->1", 6, [1, 3], peer=3)],
            "issued": {"pp.act.up 1->3": 7, "pp.grad.down 3->1": 6}},
        2: {"open": [], "issued": {"tp[2, 3]": 50, "pp.grad.down 2->0": 5, "pp.act.up 0->2": 5}},
        3: {"open": [_op("all_reduce", "tp[2, 3]", 51, [2, 3]), _op("recv", "pp.act.up 1->3", 8, [1, 3], peer=1)],
            "issued": {"tp[2, 3]": 51, "pp.grad.down 3->1": 5, "pp.act.up 1->3": 8}},
    }


def test_the_rank_everyone_waits_for_is_named_not_its_victims():
    flights = _tp2_pp2_hang()
    edges = {(e.waiter, e.target): e for e in wait_edges(flights)}
    assert set(edges) == {(0, 2), (1, 3), (3, 2), (3, 1)}
    assert edges[(3, 2)].why == "rank 2 never entered it"
    assert edges[(0, 2)].why == "rank 2 never sent it"
    assert culprits(flights) == [2]  # 1 and 3 wait for each other's later messages, but both wait for 2
    tree = wait_tree([2], flights, {r: f"R{r}" for r in range(4)}, {2: "not in a communication op"})
    lines = tree.splitlines()
    assert lines[0] == "rank 2 (R2): not in a communication op   <- the cause"
    assert any("rank 3 (R3) waits in all_reduce tp[2, 3] #51 (rank 2 never entered it)" in ln for ln in lines)
    assert any("rank 0 (R0) waits in recv pp.grad.down 2->0 #6 (rank 2 never sent it)" in ln for ln in lines)
    assert len(lines) == 4  # every rank once


def test_a_member_that_issued_the_op_is_not_waited_for():
    flights = {0: {"open": [_op("all_reduce", "dp[0, 1]", 3, [0, 1])], "issued": {"dp[0, 1]": 3}},
               1: {"open": [_op("all_reduce", "dp[0, 1]", 3, [0, 1])], "issued": {"dp[0, 1]": 3}}}
    assert wait_edges(flights) == []  # both entered: the collective is slow, nobody is missing
    assert culprits(flights, steps={0: 4, 1: 4}) == [0, 1]


def test_unresponsive_rank_is_the_cause_whatever_its_frozen_recorder_says():
    flights = _tp2_pp2_hang()
    assert culprits(flights, unresponsive=[1]) == [1]


def test_cycles_only_fall_back_to_the_rank_furthest_behind():
    flights = {0: {"open": [_op("recv", "x 1->0", 0, [0, 1], peer=1)], "issued": {"x 1->0": 0}},
               1: {"open": [_op("recv", "x 0->1", 0, [0, 1], peer=0)], "issued": {"x 0->1": 0}}}
    assert {(e.waiter, e.target) for e in wait_edges(flights)} == {(0, 1), (1, 0)}
    assert culprits(flights, steps={0: 5, 1: 4}) == [1]


def test_flight_recorder_tracks_open_and_completed_ops():
    fr = FlightRecorder(capacity=2)
    ops = [CommOp("all_reduce", "tp", (0, 1), s, 16) for s in range(3)]
    send = CommOp("send", "pp.act.up", (0, 1), 0, 64, peer=1)
    for op in [*ops, send]:
        fr.issue(op)
    for op in ops:
        fr.done(op)
    snap = fr.snapshot()
    assert [r["key"] for r in snap["open"]] == ["pp.act.up 0->1"]
    assert [r["seq"] for r in snap["recent"]] == [1, 2]  # capacity 2: the oldest completed op dropped
    assert snap["issued"] == {"tp[0, 1]": 2, "pp.act.up 0->1": 0} and snap["completed"] == {"tp[0, 1]": 2}
    assert snap["open"][0]["t_done"] is None and snap["recent"][0]["t_done"] >= snap["recent"][0]["t_issue"]
    assert stream_key("recv", "pp.act.up", (0, 1), 0, me=1) == "pp.act.up 0->1"  # both ends name one stream


def test_default_hang_timeout_is_sized_from_step_time():
    assert default_hang_timeout([]) == 30.0
    assert default_hang_timeout([0.1, 0.2]) == 30.0
    assert default_hang_timeout([2.0, 7.5]) == 75.0


def test_simulated_best_interval_agrees_with_young_daly_and_failures_cost_time():
    from megatronapp.resilience.simulate import Job, default_intervals, simulate, sweep, young_daly

    job = Job(gpus=12288, days=14, failures_per_gpu_hour=2e-5, detect_s=300, restart_s=600, stall_s=60)
    result = sweep(job, default_intervals(job), seeds=3)
    assert abs(result["best"]["interval_s"] - young_daly(job)) <= 0.5 * young_daly(job)
    assert 0.5 < result["best"]["effective"] < 1.0
    # no failures and no stall: everything but the unfinished last interval is useful
    perfect = Job(gpus=1, days=1, failures_per_gpu_hour=1e-12, stall_s=1e-9)
    assert simulate(perfect, 3600)["effective"] > 0.95
    # slower recovery, lower effective time, same failures (same seed)
    slow = Job(**{**result["job"], "restart_s": 3600})
    assert simulate(slow, 1200)["effective"] < simulate(job, 1200)["effective"]


def test_a_failure_after_the_final_checkpoint_is_not_restarted(tmp_path):
    import json

    import torch

    from megatronapp.config import RunConfig
    from megatronapp.resilience.supervisor import _already_finished
    from megatronapp.train import checkpoint as ckpt

    cfg = RunConfig.from_dict({"train": {"steps": 4, "out": str(tmp_path)}})
    root = tmp_path / "checkpoints"
    for step in (2, 4):
        ckpt.save_rank(root, step, 0, {"w": torch.ones(1)})
        if step == 2:
            ckpt.finalize(root, step, {"step": step, "world_size": 1})
    assert _already_finished(cfg) is None  # step 4 never completed: there is work to redo
    ckpt.finalize(root, 4, {"step": 4, "world_size": 1})
    (tmp_path / "summary.json").write_text(json.dumps({"steps": 4, "final_loss": 1.5}))
    assert _already_finished(cfg) == {"steps": 4, "final_loss": 1.5}


def _settle(att, beats: dict, job) -> dict:
    """What the supervisor's hang confirmation (`watch.confirm_hang`) settles with: its heartbeats, its process view."""
    from megatronapp.resilience import watch

    return watch.settle(beats, att.beats, lambda r: watch.process_state(job.pids[r]), 2.0, att.opts.heartbeat_s)


def test_a_running_rank_with_a_late_heartbeat_gets_time_to_beat_before_it_is_judged(tmp_path, monkeypatch):
    """A stale heartbeat from a process that still runs is waited out (the host may be overloaded); one from a
    stopped process is not."""
    import os
    import signal
    import subprocess
    import sys
    import time
    from types import SimpleNamespace

    from megatronapp.config import RunConfig
    from megatronapp.resilience.supervisor import Attempt, Options

    cfg = RunConfig()
    cfg.train.out = str(tmp_path)
    att = Attempt(cfg, 0, Options(heartbeat_s=0.05), lambda m: None)
    stale = {0: {"time": time.time() - 10.0}}
    fresh = {0: {"time": time.time() + 1.0}}
    calls = []
    att.beats = lambda: calls.append(1) or fresh
    job = SimpleNamespace(pids={0: os.getpid()})  # this process: running
    assert _settle(att, stale, job) is fresh and calls == [1]
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        child.send_signal(signal.SIGSTOP)
        deadline = time.time() + 60  # until it is stopped: a loaded host may take a while
        while time.time() < deadline and "T" not in open(f"/proc/{child.pid}/stat").read().split()[2]:
            time.sleep(0.01)
        calls.clear()
        from megatronapp.resilience import watch

        slept: list[float] = []  # not waited for at all: no poll, not a wait that a fast host made short
        monkeypatch.setattr(watch, "time", SimpleNamespace(time=time.time, sleep=slept.append))
        job = SimpleNamespace(pids={0: child.pid})  # stopped: its heartbeat will not come back
        assert _settle(att, stale, job) is stale and calls == [] and slept == []
    finally:
        child.kill()
        child.wait()


def test_flight_recorder_probes_per_op_do_not_grow_with_ops_in_flight():
    """NCCL ops waited on but still running are confirmed by probing their CUDA events; a stream's ops complete in
    order, so only each stream's oldest is probed: the probes per issued op stay flat as the host runs ahead."""
    fr = FlightRecorder()
    fr._rank = 0
    calls = [0]
    fired: set[int] = set()

    def probe_of(op_id: int):
        def probe() -> bool:
            calls[0] += 1
            return op_id in fired
        return probe

    ops = []
    per_op = []
    for s in range(200):  # a host far ahead of its GPU: every op queued, none completed
        op = CommOp("all_reduce", "tp", (0, 1), s, 16)
        before = calls[0]
        fr.issue(op)
        fr.done_when(op, probe_of(s))
        per_op.append(calls[0] - before)
        ops.append(op)
    assert max(per_op[100:]) <= 2, per_op[-5:]  # one sweep of one stream's head, plus the new op's own probe
    assert len(fr.snapshot()["open"]) == 200
    fired.update(range(150))  # the stream drains in order: one sweep confirms them all
    snap = fr.snapshot()
    assert len(snap["open"]) == 50 and snap["completed"] == {"tp[0, 1]": 149}
