"""The parts of multi-host training that need no cluster: `megatronapp torchrun`'s pre-flight (what it finds, what
it keeps, the error when the store never answers, torch's standby-exit bug), the start record and the fence (a rank
of a replaced start leaves without another beat), naming a host that left (lost or cut off), the driver not racing
torchrun, and the rendezvous store outside the training hosts."""
from __future__ import annotations

import datetime
import json
import socket
import threading
import time

import pytest
import torch.distributed as dist

from megatronapp import multihost
from megatronapp.config import ConfigError
from megatronapp.launch import free_port
from megatronapp.resilience import agent, decision, driver, elastic, fence, hosts
from megatronapp.resilience.store import serve


def test_the_preflight_finds_is_host_the_local_address_and_the_interface():
    p = multihost.plan("127.0.0.1:29400", "", None, "c10d", ["train", "--heartbeat-dir", "hb"], {})
    assert p.is_host and p.conf == {"is_host": "1"} and p.local_addr == "127.0.0.1"
    assert p.env == {"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    assert any("is_host=1" in n for n in p.notes) and any("--local-addr 127.0.0.1" in n for n in p.notes)


def test_the_preflight_keeps_what_the_user_gave():
    p = multihost.plan("127.0.0.1:29400", "is_host=0,read_timeout=5", "127.0.0.1", "c10d", ["train"],
                       {"GLOO_SOCKET_IFNAME": "eth7", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "0"})
    assert not p.is_host and p.conf == {"is_host": "0", "read_timeout": "5"} and p.local_addr == "127.0.0.1"
    assert p.env == {"NCCL_SOCKET_IFNAME": "lo"}  # only what was unset
    assert not multihost.plan("192.0.2.1:29400", "", None, "c10d", [], {}).is_host  # TEST-NET: never ours
    assert multihost.plan("127.0.0.1:1", "", None, "static", [], {}).notes[0].startswith("not a c10d")
    with pytest.raises(ValueError, match="must have a value"):
        multihost.plan("127.0.0.1:1", "is_host", None, "c10d", [], {})


def test_a_store_that_never_answers_is_a_clear_error_naming_the_flag(capsys):
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen(1)
        assert multihost.store_answers("127.0.0.1", listening.getsockname()[1], 0.5)
    port = free_port()
    t0 = time.monotonic()
    code = multihost.main(["--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
                           "--rdzv-conf", "is_host=0,read_timeout=1", "-m", "megatronapp", "train"])
    err = capsys.readouterr().err
    # read_timeout=1 was honoured: the default wait is 60 s, so half of it tells them apart on any host
    assert code == 2 and time.monotonic() - t0 < 30
    assert f"the rendezvous store at 127.0.0.1:{port} did not answer within 1 s" in err
    assert "--rdzv-conf is_host=1" in err and "megatronapp resilience store" in err
    assert "Traceback" not in err


def test_torchs_standby_exit_bug_is_recognised_and_nothing_else():
    def launch_agent():
        result = None
        return result.is_failed()  # what torch's launch_agent does with a graceful exit's missing result

    with pytest.raises(AttributeError) as bug:
        launch_agent()
    assert multihost._standby_closed(bug.value)
    with pytest.raises(AttributeError) as other:
        None.something  # noqa: B018
    assert not multihost._standby_closed(other.value)


def test_start_record_round_trip_and_bad_files(tmp_path):
    assert fence.read(tmp_path) is None
    rec = fence.Start(2, "abc", 123.5, "job", {0: "10.0.0.1", 1: "10.0.0.3"})
    assert fence.write(tmp_path, rec).name == "start.json" and fence.read(tmp_path) == rec
    for content, says in [("{", "not valid JSON"), ("[]", "expected a JSON object"),
                          ('{"round": "2", "start": "a", "time": 1, "run_id": "", "hosts": {}}', "'round'"),
                          ('{"round": 2, "start": "a", "time": true, "run_id": "", "hosts": {}}', "'time'"),
                          ('{"round": 2, "start": "a", "time": 1, "run_id": "", "hosts": {"x": "a"}}', "'hosts'")]:
        (tmp_path / "start.json").write_text(content)
        with pytest.raises(fence.StartError, match=says) as e:
            fence.read(tmp_path)
        assert "start.json" in str(e.value)
    (tmp_path / "start.json").write_bytes(b" " * (fence.MAX_BYTES + 2))
    with pytest.raises(fence.StartError, match="over"):
        fence.read(tmp_path)


def test_the_fence_names_only_a_newer_start(tmp_path, capsys):
    f = fence.Fence(tmp_path, 1, "mine")
    assert f.check() is None  # nothing recorded
    fence.write(tmp_path, fence.Start(1, "mine", time.time()))
    assert f.check() is None
    fence.write(tmp_path, fence.Start(0, "older", time.time()))  # an older round's record is no replacement
    assert f.check() is None
    newer = fence.Start(1, "newer", time.time(), hosts={0: "10.0.0.1", 1: "10.0.0.3"})
    fence.write(tmp_path, newer)
    assert f.check() == newer and "on node 0: 10.0.0.1, node 1: 10.0.0.3" in fence.describe(newer)
    (tmp_path / "start.json").write_text("{torn")
    assert f.check() is None and f.check() is None  # a bad record never stops a rank; said once
    assert capsys.readouterr().err.count("ignoring the start record") == 1


def test_a_rank_of_a_replaced_start_leaves_without_another_beat(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from megatronapp.config import RunConfig
    from megatronapp.parallel.topology import coord_of

    monkeypatch.setenv(agent.START_ENV, "mine")
    monkeypatch.setenv(agent.ADDR_ENV, "10.0.0.2")
    monkeypatch.setenv(agent.NODE_ENV, "1")
    cfg = RunConfig()
    cfg.parallel.tp, cfg.parallel.pp = 1, 2
    tr = SimpleNamespace(rank=1, step=0, topo=SimpleNamespace(coord=coord_of(1, 1, 2, 1)), cfg=cfg)
    exits: list[int] = []
    fence.write(tmp_path, fence.Start(0, "mine", time.time()))
    hb = agent.Heartbeat(tmp_path, tr, 0.02, round_=0, exit_fn=exits.append)
    hb.start()
    time.sleep(0.2)
    beat = json.loads(hb.path.read_text())
    assert exits == [] and (beat["addr"], beat["node"], beat["start"]) == ("10.0.0.2", 1, "mine")
    fence.write(tmp_path, fence.Start(0, "theirs", time.time()))  # a standby took this host's place
    hb._thread.join(2.0)
    assert exits == [decision.RESTART_EXIT_CODE] and not hb._thread.is_alive()
    hb.path.unlink()
    time.sleep(0.1)
    assert not hb.path.exists()  # it wrote no beat over the rank that now holds its number


def _beat(rank: int, addr: str, t: float, start: str = "a", node: int | None = None) -> dict:
    return {"rank": rank, "addr": addr, "node": node, "time": t, "start": start, "round": 0, "step": 3,
            "phase": "step 4", "phase_since": t}


def test_a_host_that_left_is_named_lost_or_cut_off():
    now = 1000.0
    labels = {r: f"L{r}" for r in range(4)}
    old = {0: _beat(0, "10.0.0.1", now, node=0), 1: _beat(1, "10.0.0.1", now, node=0),
           2: _beat(2, "10.0.0.2", now - 0.3, node=1), 3: _beat(3, "10.0.0.2", now - 0.5, node=1)}
    new = {0: _beat(0, "10.0.0.1", now + 9, "b"), 1: _beat(1, "10.0.0.1", now + 9, "b"),
           2: _beat(2, "10.0.0.3", now + 9, "b"), 3: _beat(3, "10.0.0.3", now + 9, "b")}
    [cut], joined = hosts.departures(old, new, now, 2.0, labels)
    assert joined == ["10.0.0.3"] and (cut.addr, cut.node, cut.ranks, cut.verdict) == ("10.0.0.2", 1, [2, 3], "cut off")
    assert cut.message.startswith("host 10.0.0.2 (node 1; ranks 2, 3: L2, L3) left the job, replaced by 10.0.0.3")
    [lost], _ = hosts.departures(old, new, now + 8, 2.0, labels)
    assert lost.verdict == "lost" and "stopped beating 8.3 s before the new start" in lost.message
    assert hosts.departures(old, old, now, 2.0, labels) == ([], [])
    assert hosts.whole_hosts([2, 3, 0], old, labels) == ["host 10.0.0.2 (node 1; ranks 2, 3: L2, L3)"]
    assert hosts.whole_hosts([2], old, labels) == []


def test_the_driver_waits_for_torchrun_instead_of_blaming_ranks_it_stopped(tmp_path):
    now = time.time()
    stalled_at = now - 12
    beats = {0: _beat(0, "a", now - 5), 1: _beat(1, "a", now - 5),  # stopped 7 s after the stall: by torchrun
             2: _beat(2, "b", now), 3: _beat(3, "b", now)}
    assert driver.stopped_after_stall(beats, stalled_at, 2.0) == [0, 1]
    beats[0]["time"] = beats[1]["time"] = stalled_at  # silent since the stall: a cause, judged as a hang
    assert driver.stopped_after_stall(beats, stalled_at, 2.0) == []
    # the recorded start decides which beats are current, not the freshest file
    for r in range(2):
        (tmp_path / f"rank{r:05d}.json").write_text(json.dumps({**_beat(r, "a", now + r, "old"), "round": 0}))
    fence.write(tmp_path, fence.Start(0, "new", now))
    assert driver.round_beats(tmp_path, 2, 0) == {}
    (tmp_path / "rank00000.json").write_text(json.dumps({**_beat(0, "c", now, "new"), "round": 0}))
    assert set(driver.round_beats(tmp_path, 2, 0)) == {0}


def test_an_earlier_start_makes_a_restart(tmp_path):
    assert elastic.plan_round([0, 0], 0, tmp_path, None, earlier_start=True)[:2] == (0, True)
    assert elastic.plan_round([0, 0], 0, tmp_path, None, earlier_start=False)[:2] == (0, False)
    assert not elastic._earlier_start(tmp_path)
    (tmp_path / "start.json").write_text("[")
    assert elastic._earlier_start(tmp_path)  # something started here; its record is unreadable


def test_the_store_outside_the_training_hosts_serves_a_rendezvous(tmp_path):
    port = free_port()
    stop = threading.Event()
    t = threading.Thread(target=serve, args=("127.0.0.1", port, stop), daemon=True)
    t.start()
    client = dist.TCPStore("127.0.0.1", port, None, False, timeout=datetime.timedelta(seconds=20))
    client.set("k", "v")
    assert client.get("k") == b"v"
    del client
    stop.set()
    t.join(10)
    assert not t.is_alive()
    with pytest.raises(ConfigError, match="cannot listen there"):
        serve("192.0.2.1", port)


def test_the_cluster_names_what_is_missing(monkeypatch):
    from megatronapp.testing import cluster

    monkeypatch.setattr(cluster.os, "geteuid", lambda: 1000)
    assert cluster.missing_capability().startswith("not root")
    monkeypatch.setattr(cluster.os, "geteuid", lambda: 0)
    monkeypatch.setattr(cluster.shutil, "which", lambda name: None)
    assert cluster.missing_capability() == "no `ip` command (iproute2) on PATH"
