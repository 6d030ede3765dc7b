"""The multi-host restart protocol without processes: decision files (written whole, read strictly: a bad or
partial file is a clear error and a healthy rank ignores it), the heartbeat thread obeying only its round's
decision, the round plan, the refusals of `train --heartbeat-dir`, and the driver naming a rank whose heartbeat
stopped and writing the decision."""
from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from megatronapp.config import ConfigError, RunConfig
from megatronapp.parallel.topology import coord_of
from megatronapp.resilience import decision, driver, elastic
from megatronapp.resilience.agent import Heartbeat


def _trainer(rank: int = 1) -> SimpleNamespace:
    cfg = RunConfig()
    cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.dp = 1, 2, 1
    return SimpleNamespace(rank=rank, step=0, topo=SimpleNamespace(coord=coord_of(rank, 1, 2, 1)), cfg=cfg)


def test_decision_round_trip_and_missing(tmp_path):
    assert decision.read(tmp_path, 0) is None and decision.rounds_decided(tmp_path) == 0
    d = decision.Decision(0, 2, "DP0-PP1-TP0", "hang: no step progress for 4.0 s")
    assert decision.write(tmp_path, d).name == "restart-0.json"
    assert decision.read(tmp_path, 0) == d and decision.read(tmp_path, 1) is None
    assert decision.rounds_decided(tmp_path) == 1 and not list(tmp_path.glob("*.tmp"))


@pytest.mark.parametrize("content, says", [
    ('{"round": 0, "culprit": 2, "rea', "not valid JSON"),  # a partial copy
    ("", "not valid JSON"),
    ("[1, 2]", "expected a JSON object"),
    ('{"round": 0, "culprit": "2", "reason": "x"}', "field 'culprit' must be int"),
    ('{"round": 0, "culprit": 2}', "field 'reason' must be str"),
    ('{"round": true, "culprit": 2, "reason": "x"}', "field 'round' must be int"),
    ('{"round": 3, "culprit": 2, "reason": "x"}', "holds round 3, not 0"),
])
def test_bad_decision_files_are_clear_errors(tmp_path, content, says):
    (tmp_path / "restart-0.json").write_text(content)
    with pytest.raises(decision.DecisionError, match=says) as e:
        decision.read(tmp_path, 0)
    assert "restart-0.json" in str(e.value)


def test_a_healthy_rank_ignores_a_bad_decision_once_and_obeys_its_rounds_valid_one(tmp_path, capsys):
    exits: list[int] = []
    hb = Heartbeat(tmp_path, _trainer(), 0.02, round_=1, exit_fn=exits.append)
    decision.write(tmp_path, decision.Decision(0, 0, "x", "an old round's decision"))  # not this round's
    (tmp_path / "restart-1.json").write_text('{"round": 1, "cul')  # half-copied
    hb.start()
    time.sleep(0.3)
    assert exits == [] and hb._thread.is_alive()  # still beating
    assert capsys.readouterr().err.count("ignoring a restart decision") == 1  # said once, not every beat
    assert json.loads(hb.path.read_text())["round"] == 1
    decision.write(tmp_path, decision.Decision(1, 3, "DP0-PP1-TP0", "hang: no step progress for 4.0 s"))
    hb._thread.join(2.0)
    assert exits == [decision.RESTART_EXIT_CODE] and not hb._thread.is_alive()
    assert "the driver restarts round 1" in capsys.readouterr().err
    hb.stop()


def test_a_locally_supervised_rank_polls_no_decision(tmp_path):
    hb = Heartbeat(tmp_path, _trainer(), 0.02, round_=None, exit_fn=lambda c: pytest.fail("exited"))
    decision.write(tmp_path, decision.Decision(0, 0, "x", "y"))
    assert hb.poll_decision() is None


def test_round_plan(tmp_path):
    # no restart anywhere: round 0 from scratch (or the user's --resume)
    assert elastic.plan_round([0, 0], 0, tmp_path, None) == (0, False, None, [])
    assert elastic.plan_round([0, 0], 0, tmp_path, "ck") == (0, False, "ck", [])
    # one host counted a restart, the other (restarted for the membership change) did not: still a restart
    assert elastic.plan_round([0, 1], 0, tmp_path, None)[:2] == (0, True)
    assert elastic.plan_round([0, 0], 2, tmp_path, None)[:2] == (2, True)  # decisions alone also make one


def test_heartbeat_dir_refusals(monkeypatch, tmp_path):
    for var in ("TORCHELASTIC_RUN_ID", "GROUP_RANK", "TORCHELASTIC_USE_AGENT_STORE"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(ConfigError, match="for ranks started by torchrun"):
        elastic.prepare(RunConfig(), str(tmp_path), 1.0)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    with pytest.raises(ConfigError, match="TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"):
        elastic.prepare(RunConfig(), str(tmp_path), 1.0)


def _beat(rank: int, round_: int, t: float, step: int = 3) -> dict:
    return {"rank": rank, "round": round_, "layout": [1, 2, 1], "step": step, "phase": "step 4", "time": t,
            "phase_since": t - 5, "step_time_s": 0.1, "open_op": None, "failed": False,
            "flight": {"open": [], "recent": [], "issued": {}, "completed": {}}}


def _write_beat(path, beat: dict) -> None:
    """Atomically, as the agent writes it: a reader that caught a half-written file would not see the rank at
    all (CI once named the beating rank 0 'never beat' so)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(beat))
    os.replace(tmp, path)


def test_driver_names_the_rank_whose_heartbeat_stopped_and_decides(tmp_path):
    stop = threading.Event()

    def beat_rank0() -> None:  # rank 0 keeps beating (stuck, waiting); rank 1's heartbeat stopped long ago
        while not stop.is_set():
            _write_beat(tmp_path / "rank00000.json", _beat(0, 0, time.time()))
            time.sleep(0.05)

    (tmp_path / "rank00001.json").write_text(json.dumps(_beat(1, 0, time.time() - 30)))
    (tmp_path / "rank00002.json").write_text("{torn")  # beyond --world and torn: ignored
    t = threading.Thread(target=beat_rank0, daemon=True)
    t.start()
    logs: list[str] = []
    try:
        result = driver.watch(tmp_path, driver.DriverOptions(world=2, hang_timeout_s=0.5, heartbeat_s=0.05,
                                                             startup_timeout_s=0.5, give_up_after_s=1.0),
                              log=logs.append)
    finally:
        stop.set()
        t.join()
    text = "\n".join(logs)
    assert "the job waits for rank 1 (DP0-PP1-TP0): heartbeat stopped (the process is stopped or dead)" in text
    d = decision.read(tmp_path, 0)
    assert d is not None and d.culprit == 1 and d.reason.startswith("hang: no progress")
    # round 1 never beats (the beats left over are round 0's): the driver stops watching, not completed
    assert result["completed"] is False and result["round"] == 1 and len(result["failures"]) == 1


def test_driver_sees_a_completed_round(tmp_path):
    for r in range(2):
        (tmp_path / f"rank{r:05d}.json").write_text(json.dumps({**_beat(r, 0, time.time(), 6), "phase": "shutdown"}))
    result = driver.watch(Path(tmp_path), driver.DriverOptions(world=2, hang_timeout_s=5), log=lambda m: None)
    assert result == {"completed": True, "round": 0, "steps": 6, "failures": [], "hosts_left": []}


def test_the_driver_reads_the_newest_start_of_a_round(tmp_path):
    """torchrun restarts crashed workers within a round (no decision): their old heartbeat files are not theirs."""
    now = time.time()
    old, new = {**_beat(0, 0, now - 5), "start": "a"}, {**_beat(1, 0, now), "start": "b"}
    (tmp_path / "rank00000.json").write_text(json.dumps(old))
    (tmp_path / "rank00001.json").write_text(json.dumps(new))
    (tmp_path / "rank00002.json").write_text(json.dumps({**_beat(2, 1, now), "start": "c"}))  # a later round
    assert set(driver.round_beats(tmp_path, 3, 0)) == {1}
    assert set(driver.round_beats(tmp_path, 3, 1)) == {2}


@pytest.mark.parametrize("case", ["all stale", "a rank failed"])
def test_the_driver_decides_nothing_while_torchrun_restarts_the_workers(tmp_path, case):
    """Every heartbeat stale (the workers are gone) or a rank that failed by itself: torchrun restarts them; a
    decision would reach no one, or stop the next start for nothing."""
    now = time.time()
    for r in range(2):
        b = _beat(r, 0, now - 10 if case == "all stale" else now + 60)
        if case == "a rank failed" and r == 1:
            b.update(failed=True, phase="shutdown")
        (tmp_path / f"rank{r:05d}.json").write_text(json.dumps(b))
    result = driver.watch(tmp_path, driver.DriverOptions(world=2, hang_timeout_s=0.3, heartbeat_s=0.05,
                                                         startup_timeout_s=0.3,
                                                         give_up_after_s=1.0 if case == "all stale" else 70),
                          log=lambda m: None) if case == "all stale" else None
    if case == "all stale":
        assert result["completed"] is False and result["failures"] == [] and decision.read(tmp_path, 0) is None
    else:
        assert driver._hang_possible(driver.round_beats(tmp_path, 2, 0), 2.0) is False


def test_foreign_heartbeat_files_are_no_heartbeats(tmp_path):
    from megatronapp.resilience.watch import read_beats

    now = time.time()
    (tmp_path / "rank00000.json").write_text(json.dumps(_beat(0, 0, now)))
    (tmp_path / "rank00001.json").write_text(json.dumps({**_beat(1, 0, now), "step": "3"}))  # mistyped
    (tmp_path / "rank00002.json").write_text(json.dumps([1, 2]))
    assert set(read_beats(tmp_path, 3)) == {0}
    assert driver.labels_of({0: {**_beat(0, 0, now), "layout": ["1", 2, 1]}}, 2) == {0: "?", 1: "?"}
    assert driver.labels_of({0: _beat(0, 0, now)}, 2) == {0: "DP0-PP0-TP0", 1: "DP0-PP1-TP0"}
