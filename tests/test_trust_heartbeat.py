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
