"""The shared heartbeat directory is untrusted: a planted link is never written through, and a heartbeat whose
fields have the wrong types is named and skipped, never a crash of the watcher (`"phase_since": "oops"`)."""
from __future__ import annotations

import json
import os
import time
from types import SimpleNamespace

from megatronapp.config import RunConfig
from megatronapp.parallel.topology import coord_of
from megatronapp.resilience import watch
from megatronapp.resilience.agent import Heartbeat


def _beat(rank: int, **over) -> dict:
    now = time.time()
    return {"rank": rank, "time": now, "step": 3, "phase": "after step", "phase_since": now - 100, "pid": 1,
            "label": f"r{rank}", "flight": {"open": [], "recent": [], "issued": {}, "completed": {}},
            "open_op": None, "last_op": None, **over}


def test_a_planted_link_is_not_written_through(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("precious")
    hb_dir = tmp_path / "hb"
    hb_dir.mkdir()
    for name in ("rank00000.json.tmp", "rank00000.json"):
        os.symlink(victim, hb_dir / name)
    trainer = SimpleNamespace(rank=0, step=0, cfg=RunConfig(), topo=SimpleNamespace(coord=coord_of(0, 1, 1, 1)))
    Heartbeat(hb_dir, trainer, 1.0).write()
    assert victim.read_text() == "precious"
    assert not (hb_dir / "rank00000.json").is_symlink()
    assert json.loads((hb_dir / "rank00000.json").read_text())["rank"] == 0
    assert watch.read_beats(hb_dir, 1)[0]["phase"] == "start"  # a real heartbeat passes the type checks
    assert [p.name for p in hb_dir.iterdir() if p.name.endswith(".tmp") and not p.is_symlink()] == []


def test_a_heartbeat_of_the_wrong_types_is_named_and_skipped(tmp_path, capsys):
    hb_dir = tmp_path / "hb"
    hb_dir.mkdir()
    (hb_dir / "rank00000.json").write_text(json.dumps(_beat(0, phase_since="oops")))
    (hb_dir / "rank00001.json").write_text(json.dumps(_beat(1)))
    (hb_dir / "rank00002.json").write_text(json.dumps(_beat(2, flight={"open": [{"op": 1}], "recent": []})))
    os.symlink(hb_dir / "rank00001.json", hb_dir / "rank00003.json")
    beats = watch.read_beats(hb_dir, 4)
    assert sorted(beats) == [1]
    err = capsys.readouterr().err
    assert "rank00000.json" in err and "phase_since" in err and "rank00002.json" in err and "rank00003.json" in err
    # what the driver does with what is left: judge a hang without a TypeError
    failure = watch.judge_hang(beats, 4, {r: f"r{r}" for r in range(4)}, 50.0, 10.0, 5.0, None)
    assert failure.kind == "hang" and failure.rank == 0


def test_a_rank_behind_its_started_peers_is_judged_by_the_hang_timeout():
    """Rank 1 was stopped during a restarted attempt's start-up (no heartbeat); rank 0 finished start-up and waits
    in step 1. The hang timeout (10 s) applies, not the 300 s start-up allowance."""
    clock = watch.ProgressClock(2, hang_timeout_s=10.0, startup_timeout_s=300.0)
    waiting = _beat(0, step=0, phase="step 1", step_time_s=None)
    clock.update({0: waiting})
    clock.last_progress -= 12.0
    assert clock.overdue({0: waiting}) is not None
    # rank 1 beats but has not begun (stuck after its heartbeat started): still behind
    assert clock.overdue({0: waiting, 1: _beat(1, step=0, phase="start", step_time_s=None)}) is not None
    # every rank in its first step (warm-up), or none begun yet: the start-up allowance still covers it
    both = {0: waiting, 1: _beat(1, step=0, phase="step 1", step_time_s=None)}
    assert clock.overdue(both) is None
    assert clock.overdue({0: _beat(0, step=0, phase="start", step_time_s=None)}) is None


def test_a_rank_silent_during_start_up_is_judged_by_the_hang_timeout_and_named_with_its_phase():
    """Early heartbeats (every rank beats from its first instruction): no rank has finished start-up, ranks 0 and
    2 wait in the process-group rendezvous, rank 1 stopped beating 12 s ago while building its process groups and
    rank 3 never beat. The hang timeout (10 s) applies, not the 300 s allowance, and the stopped rank is named
    with what it was doing."""
    clock = watch.ProgressClock(4, hang_timeout_s=10.0, startup_timeout_s=300.0, early=True)
    now = time.time()
    rendezvous = {"step": -1, "phase": "start-up: process groups", "phase_since": now - 13, "step_time_s": None}
    beats = {0: _beat(0, **rendezvous), 1: _beat(1, **{**rendezvous, "time": now - 12.0}),
             2: _beat(2, **rendezvous)}
    clock.update(beats)
    assert clock.start_step is None  # a start-up heartbeat says nothing of the step the attempt starts from
    clock.last_progress -= 13.0
    clock.first_beat_at -= 13.0
    assert clock.silent(beats, 10.0) == [1, 3]
    assert clock.overdue(beats) is not None
    failure = watch.judge_hang(beats, 4, {r: f"r{r}" for r in range(4)}, 13.0, 10.0, 2.0,
                               lambda r: "T" if r == 1 else None if r == 3 else "S")
    assert failure.rank == 1
    assert "stopped (SIGSTOP?)" in failure.message and "last in phase 'start-up: process groups'" in failure.message
    # every rank beating and none finished: a slow start-up keeps its allowance
    fresh = {r: _beat(r, **rendezvous) for r in range(4)}
    assert clock.silent(fresh, 10.0) == [] and clock.overdue(fresh) is None
    # without early heartbeats (torchrun: a rank beats once its trainer is built; a restart's files still hold
    # the previous start's stale beats) neither a missing nor a stale rank counts as silent
    late = watch.ProgressClock(4, hang_timeout_s=10.0, startup_timeout_s=300.0)
    late.update(fresh)
    late.first_beat_at -= 13.0
    assert late.silent({0: fresh[0]}, 10.0) == [] and late.silent(beats, 10.0) == []
    # where the processes are visible, a silent rank counts only if stopped or dead: a running one is late
    seen = watch.ProgressClock(4, hang_timeout_s=10.0, startup_timeout_s=300.0, early=True,
                               state_of=lambda r: {1: "T", 3: "R"}.get(r, "S"))
    seen.update(beats)
    seen.first_beat_at -= 13.0
    assert seen.silent(beats, 10.0) == [1]
    # a rank whose last heartbeat says it is exiting is not silent
    assert clock.silent({**fresh, 1: _beat(1, phase="shutdown", time=now - 30)}, 10.0) == []
    # once every rank built its trainer, the attempt's start step is known
    built = {r: _beat(r, step=4, phase="start", step_time_s=None) for r in range(4)}
    clock.update(built)
    assert clock.start_step == 4


def test_an_early_heartbeat_tells_each_start_up_phase_then_becomes_the_trainers(tmp_path, monkeypatch):
    from megatronapp import startup
    from megatronapp.resilience import agent

    monkeypatch.setenv(agent.DIR_ENV, str(tmp_path))
    monkeypatch.setenv(agent.PERIOD_ENV, "30")  # the test reads what the phase changes themselves write
    monkeypatch.setattr(agent, "_EARLY", None)
    agent.early_start(0)
    try:
        beat = watch.read_beats(tmp_path, 1)[0]
        assert beat["phase"] == "start-up: spawn" and beat["step"] == -1 and beat["pid"] == os.getpid()
        startup.phase("process groups")
        assert watch.read_beats(tmp_path, 1)[0]["phase"] == "start-up: process groups"
        trainer = SimpleNamespace(rank=0, step=4, cfg=RunConfig(), topo=SimpleNamespace(coord=coord_of(0, 1, 1, 1)),
                                  hooks=SimpleNamespace(on=lambda *a: None))
        agent.plugin(trainer)
        hb = agent._EARLY
        assert hb.state["step"] == 4 and hb.state["phase"] == "start" and hb.state["label"] == "DP0-PP0-TP0"
        hb.start()  # rank_start: the thread already runs
        startup.phase("late")  # no longer listened to
        assert watch.read_beats(tmp_path, 1)[0]["phase"] == "start"
    finally:
        agent._EARLY.stop()


def test_a_broken_start_up_listener_is_said_once_and_does_not_stop_the_rank(capsys):
    from megatronapp import startup

    heard: list[str] = []

    def broken(what: str) -> None:
        raise OSError(f"disk gone at {what}")

    startup.on_phase(broken)
    startup.on_phase(heard.append)
    try:
        startup.phase("imports")
        startup.phase("model build")
    finally:
        startup.off_phase(broken)
        startup.off_phase(heard.append)
    assert heard == ["imports", "model build"]  # the listener after the broken one still hears every phase
    err = capsys.readouterr().err
    assert err.count("start-up phase listener") == 1 and "OSError: disk gone at imports" in err
