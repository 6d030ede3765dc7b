"""Training across hosts, as users run it, on hosts made of network namespaces (megatronapp.testing.cluster).

Each host is a network namespace with its own address on a private switch; every host runs `megatronapp torchrun`
(c10d rendezvous at one address; the wrapper finds is_host, --local-addr and the socket interface itself) with
`train --heartbeat-dir`, and `megatronapp resilience watch` watches the heartbeats. TP stays inside a host, PP
and DP go across hosts (rank = tp + 2 * (dp + dp_size * pp), 2 ranks a host). Runs, each one launch:

- 2 hosts x 2 ranks (tp2 x pp2): losses equal one process; host 1's link flaps (down 2 s, less than the
  rendezvous keep-alive expiry and the hang timeout) mid-run and the job rides through without a restart. This
  uninterrupted run is the reference the fault runs must equal bit for bit;
- 4 hosts x 2 ranks (tp2 x pp2 x dp2), traced, rank 5 computing 3x slower: losses equal one process, the
  traces of the 4 hosts merge into one timeline and MegaScan names rank 5;
- a host lost for good (link cut, then every process killed: a machine that lost power), with the rendezvous
  store on a host of its own and a standby host waiting: the lost host is host 0, the one that usually holds the
  store; torchrun's keep-alive expires, the standby takes its place, the driver names the host (address and
  ranks) as lost, and the run equals the reference bit for bit;
- a partition: host 1's link down for longer than the hang timeout, a standby waiting, the store on host 0: the
  cut-off host's ranks are fenced by the new start (they exit without training on), the driver names the host's
  network, the job resumes from a checkpoint written before the cut and equals the reference bit for bit.

Every cluster is removed at the end (no namespace or process is left; checked). Skipped, naming the missing
capability, where network namespaces cannot be made (not root, no `ip`, not permitted). Timings are the
benchmark's (benchmarks/bench_multihost.py), never asserted here.
"""
from __future__ import annotations

import json
import os
import re
import sys
import time
from pathlib import Path

import pytest
import torch

from megatronapp.cli import build_parser, config_from_args
from megatronapp.testing import jobs
from megatronapp.testing.cluster import Cluster, missing_capability, sweep_stale
from megatronapp.train import checkpoint as ckpt
from megatronapp.train.metrics import read_metrics
from megatronapp.train.trainer import train

MISSING = missing_capability()
pytestmark = pytest.mark.skipif(MISSING is not None, reason=f"hosts as network namespaces: {MISSING}")

REPO = Path(__file__).resolve().parents[1]
STEPS = 6
COMMON = ["--layers", "2", "--hidden", "64", "--global-batch", "8", "--seq-len", "32", "--steps", str(STEPS),
          "--save-interval", "1", "--no-progress", "--peak-tflops", "1"]
TWO_HOSTS = ["--tp", "2", "--pp", "2", "--microbatches", "4"]
FOUR_HOSTS = ["--tp", "2", "--pp", "2", "--dp", "2", "--microbatches", "2"]
HB = ["--heartbeat-interval", "0.3"]
PACED = ["--attach", "tests.plugin_probe:paced_steps"]  # 0.4 s after each step: a fault lands mid-run
HANG_TIMEOUT = 10.0


def _env() -> dict[str, str]:
    return jobs.env(REPO)


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> dict[int, float]:
    """Every step's loss of the same training in one process (the global batch is the same in every layout)."""
    out = tmp_path_factory.mktemp("one") / "run"
    train(config_from_args(build_parser().parse_args(
        ["train", *COMMON, "--tp", "1", "--pp", "1", "--microbatches", "4", "--nproc", "1", "--out", str(out)])))
    return _losses(out)


def _losses(out: Path) -> dict[int, float]:
    """Each step's loss, from its first record (a replayed step is logged again, marked)."""
    return {r["step"]: r["loss"] for r in read_metrics(out / "metrics.jsonl") if not r.get("replayed")}


def _weights(out: Path, world: int) -> list[list[dict[str, torch.Tensor]]]:
    d = ckpt.step_dir(out / "checkpoints", STEPS)
    return [ckpt.load_rank(d, r)["chunks"] for r in range(world)]


def _assert_close(mine: dict[int, float], ref: dict[int, float]) -> None:
    assert sorted(mine) == sorted(ref) == list(range(1, STEPS + 1))
    for step in ref:
        assert mine[step] == pytest.approx(ref[step], rel=1e-5, abs=1e-6), (step, mine[step], ref[step])


def _assert_identical(out: Path, ref: Path, world: int = 4) -> None:
    """Every step's loss and the final weights bit for bit."""
    assert _losses(out) == _losses(ref)
    for mine, theirs in zip(_weights(out, world), _weights(ref, world)):
        for c_mine, c_ref in zip(mine, theirs):
            for name in c_ref:
                assert torch.equal(c_mine[name], c_ref[name]), name


def _closed(cluster: Cluster, job: jobs.Job) -> None:
    """Nothing of the cluster is left: its namespaces, and every process it started."""
    cluster.close()
    assert cluster.leftovers() == []
    procs = [*job.agents.values(), *(p for p in (job.store,) if p is not None)]
    assert all(p.poll() is not None for p in procs)


@pytest.fixture(scope="module")
def two_hosts(tmp_path_factory) -> dict:
    """2 hosts x 2 ranks (tp2 x pp2) with a 2 s flap of host 1's link mid-run; the reference run of the faults."""
    base = tmp_path_factory.mktemp("two-hosts")
    c = Cluster(2, log_dir=base / "logs")
    job = jobs.Job(c, base / "run", base / "hb", base / "logs")
    env = _env()
    try:
        endpoint = f"{c.hosts[0].addr}:{jobs.PORT}"
        for h in range(2):  # a keep-alive expiry (8 s) well beyond the flap
            jobs.start_agent(job, h, endpoint, "2", 2, [*TWO_HOSTS, *COMMON, *HB, *PACED],
                             jobs.rdzv_conf(keep_alive_attempts=8), env)
        jobs.start_driver(job, 4, HANG_TIMEOUT, 0.3, env)
        jobs.wait_for_step(job.hb, 0, 2, 300)
        at_cut = jobs.beat(job.hb, 0).get("step", -1)
        c.cut(1)
        time.sleep(2.0)
        c.restore(1)
        result = jobs.finish(job, 300, [0, 1])
        record = jobs.start_record(job.hb)
        codes = [job.agents[h].returncode for h in range(2)]
        logs = job.agent_logs() + job.log("driver.log")
    finally:
        c.close()
    return {"out": job.out, "result": result, "record": record, "codes": codes, "logs": logs, "at_cut": at_cut,
            "driver": job.log("driver.log"), "leftovers": c.leftovers()}


def test_the_cluster_runs_cuts_kills_and_cleans_up(tmp_path):
    with Cluster(2, log_dir=tmp_path) as c:
        probe = "import socket,sys; socket.create_connection((sys.argv[1], 9), timeout=2)"
        reach = c.run(1, ["python3", "-c", probe, c.hosts[0].addr], log="reach.log")
        assert reach.wait(timeout=30) == 1 and "ConnectionRefusedError" in (tmp_path / "reach.log").read_text()
        c.cut(1)  # dropped, not refused: the connection times out
        cut = c.run(1, ["python3", "-c", probe, c.hosts[0].addr], log="cut.log")
        assert cut.wait(timeout=30) == 1 and "TimeoutError" in (tmp_path / "cut.log").read_text()
        c.restore(1)
        # nothing outside the cluster is reachable: the switch has no way out
        out = c.run(0, ["python3", "-c", "import socket; socket.create_connection(('10.213.1.1', 9), timeout=2)"],
                    log="out.log")
        assert out.wait(timeout=30) == 1 and "unreachable" in (tmp_path / "out.log").read_text()
        sleeper = c.run(1, ["sleep", "600"])
        assert sleeper.pid in c.pids(1)  # `ip netns exec` becomes the sleeper (it execs)
        assert c.kill_host(1) and sleeper.wait(timeout=10) == -9 and c.pids(1) == []
        c.run(0, ["sleep", "600"])
        tag = c.tag
    assert c.leftovers() == [] and not [n for n in _netns() if n.startswith(tag)]
    assert sweep_stale() == []  # nothing stale of a live owner, nothing of ours left


def test_a_killed_runs_namespaces_are_swept_and_only_those():
    """A namespace left by a run whose process is gone is removed; one of a live owner is not."""
    import subprocess

    dead = subprocess.Popen(["true"])
    dead.wait()
    stale, live = f"mah{dead.pid}xdead00-h0", f"mah{os.getpid()}xlive00-h0"
    for name in (stale, live):
        subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        removed = sweep_stale()
        assert stale in removed and live not in removed and live in _netns() and stale not in _netns()
    finally:
        for name in (stale, live):
            subprocess.run(["ip", "netns", "del", name], capture_output=True)


def _netns() -> list[str]:
    import subprocess

    return [line.split()[0] for line in subprocess.run(["ip", "netns", "list"], capture_output=True,
                                                       text=True).stdout.splitlines() if line.strip()]


def test_a_host_whose_store_nobody_hosts_stops_with_the_flag_named(tmp_path):
    """Host 1 started alone, its endpoint on host 0 where nothing runs: within torchrun's read timeout (3 s
    here), a message that names is_host=1 and the address, never torchrun's C++ traceback."""
    with Cluster(2, log_dir=tmp_path) as c:
        p = c.run(1, [sys.executable, "-m", "megatronapp", "torchrun", "--nnodes", "2", "--nproc-per-node", "1",
                      "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{c.hosts[0].addr}:{jobs.PORT}",
                      "--rdzv-conf", "read_timeout=3", "-m", "megatronapp", "train"], env=_env(), log="agent1.log")
        code = p.wait(timeout=120)
    log = (tmp_path / "agent1.log").read_text()
    assert code == 2, log
    assert f"the rendezvous store at 10.213.0.1:{jobs.PORT} did not answer within 3 s" in log
    assert "--rdzv-conf is_host=1" in log and "from 10.213.0.2" in log and "Traceback" not in log


def test_two_hosts_train_like_one_process_and_ride_through_a_flapping_link(two_hosts, one_process):
    r = two_hosts
    assert r["leftovers"] == []
    assert r["codes"] == [0, 0], r["logs"][-4000:]
    # the wrapper found what torchrun cannot in a namespace, and said so
    assert "10.213.0.1 is an address of this host: it hosts the rendezvous store (is_host=1)" in r["logs"]
    assert "--local-addr 10.213.0.2" in r["logs"] and "GLOO_SOCKET_IFNAME=eth0" in r["logs"]
    assert r["at_cut"] < STEPS - 1  # the link flapped mid-run
    # rode through: one start of round 0, no decision, no replayed step
    res = r["result"]
    assert res["completed"] and res["round"] == 0 and res["failures"] == [] and res["hosts_left"] == [], r["driver"]
    assert "restarted by torchrun" not in r["driver"] and r["record"]["round"] == 0
    assert not [x for x in read_metrics(r["out"] / "metrics.jsonl") if x.get("replayed")]
    _assert_close(_losses(r["out"]), one_process)


def test_four_hosts_train_like_one_process_and_megascan_names_the_slow_rank(tmp_path, one_process, capsys):
    from megatronapp.cli import main as cli

    c = Cluster(4, log_dir=tmp_path / "logs")
    job = jobs.Job(c, tmp_path / "run", tmp_path / "hb", tmp_path / "logs")
    env = _env()
    trace = tmp_path / "trace"
    try:
        endpoint = f"{c.hosts[0].addr}:{jobs.PORT}"
        flags = [*FOUR_HOSTS, *COMMON, *HB, "--trace", "--trace-dir", str(trace), "--trace-interval", str(STEPS),
                 "--trace-iterations", str(STEPS), "--inject", "slow-compute=5:3.0"]
        for h in range(4):
            jobs.start_agent(job, h, endpoint, "4", 2, flags, jobs.rdzv_conf(), env)
        jobs.start_driver(job, 8, HANG_TIMEOUT, 0.3, env)
        result = jobs.finish(job, 400, [0, 1, 2, 3])
        codes = [job.agents[h].returncode for h in range(4)]
        record = jobs.start_record(job.hb)
    finally:
        _closed(c, job)
    assert codes == [0, 0, 0, 0], job.agent_logs()[-4000:]
    assert result["completed"] and result["failures"] == [], job.log("driver.log")
    assert record["hosts"] == {str(n): f"10.213.0.{n + 1}" for n in range(4)}  # node n on host n
    _assert_close(_losses(job.out), one_process)
    # one timeline of the 4 hosts' 8 ranks, clocks aligned; the slowed rank named
    assert cli(["scan", "aggregate", str(trace), "-o", str(tmp_path / "t.json")]) == 0
    merged = json.loads((tmp_path / "t.json").read_text())
    assert sorted(merged["otherData"]["megascan"]["ranks"]) == list(range(8))
    capsys.readouterr()
    assert cli(["scan", "detect", str(trace), "--json"]) == 0
    found = json.loads(capsys.readouterr().out)["findings"]
    slow = [f for f in found if f["kind"] == "slow-compute"]
    assert slow and slow[0]["ranks"] == [5], found


def test_a_lost_host_is_replaced_by_a_standby_and_the_run_is_bit_identical(tmp_path, two_hosts):
    """Host 0 loses power at step 2 (link first, then every process); the store runs on a host of its own, a
    standby host waits in torchrun's redundancy list."""
    c = Cluster(4, log_dir=tmp_path / "logs")  # hosts 0, 1 train; 2 waits; 3 holds the store
    job = jobs.Job(c, tmp_path / "run", tmp_path / "hb", tmp_path / "logs")
    env = _env()
    try:
        endpoint = jobs.start_store(job, 3, env)
        conf = jobs.rdzv_conf(is_host=False)
        flags = [*TWO_HOSTS, *COMMON, *HB, *PACED]
        for h in (0, 1):
            jobs.start_agent(job, h, endpoint, "2", 2, flags, conf, env)
        jobs.start_driver(job, 4, HANG_TIMEOUT, 0.3, env)
        first = jobs.wait_until(lambda: jobs.start_record(job.hb).get("start"), 300, "the first start") and \
            jobs.start_record(job.hb)["start"]
        jobs.start_agent(job, 2, endpoint, "2", 2, flags, conf, env)  # the standby, once the job has formed
        jobs.wait_for_step(job.hb, 0, 2, 300)
        c.lose_host(0)
        result = jobs.finish(job, 400, [1, 2])
        codes = {h: job.agents[h].returncode for h in (1, 2)}
        record = jobs.start_record(job.hb)
        driver = job.log("driver.log")
        logs = job.agent_logs()
    finally:
        _closed(c, job)
    assert codes == {1: 0, 2: 0}, logs[-4000:]
    assert record["start"] != first and sorted(record["hosts"].values()) == ["10.213.0.2", "10.213.0.3"]
    assert result["completed"] and result["failures"] == [], driver  # torchrun replaced it: no decision
    [left] = result["hosts_left"]
    assert (left["addr"], left["ranks"], left["verdict"]) == ("10.213.0.1", [0, 1], "lost"), driver
    assert "host 10.213.0.1 (node 0; ranks 0, 1: DP0-PP0-TP0, DP0-PP0-TP1) left the job, replaced by 10.213.0.3" \
        in driver
    assert re.search(r"round 0 \(torchrun restart counts \[0\]\): resuming from step_0000000[2-9]", logs), logs
    _assert_identical(job.out, two_hosts["out"])


@pytest.mark.skipif(os.environ.get("MEGATRONAPP_LONG") != "1",
                    reason="a host lost without a standby, then brought back: ~90 s; set MEGATRONAPP_LONG=1")
def test_without_a_standby_the_job_waits_for_the_lost_host_and_resumes_when_it_returns(tmp_path, two_hosts):
    """Host 1 loses power at step 2 and no standby waits: the driver names the host after the hang timeout and
    decides a restart; the rendezvous waits for a second host until host 1's torchrun is started again (the
    machine rebooted), then the job resumes bit-identically."""
    c = Cluster(2, log_dir=tmp_path / "logs")
    job = jobs.Job(c, tmp_path / "run", tmp_path / "hb", tmp_path / "logs")
    env = _env()
    try:
        endpoint = f"{c.hosts[0].addr}:{jobs.PORT}"
        flags = [*TWO_HOSTS, *COMMON, *HB, *PACED]
        for h in (0, 1):
            jobs.start_agent(job, h, endpoint, "2", 2, flags, jobs.rdzv_conf(), env)
        jobs.start_driver(job, 4, HANG_TIMEOUT, 0.3, env)
        jobs.wait_for_step(job.hb, 0, 2, 300)
        c.lose_host(1)
        jobs.wait_until(lambda: (job.hb / "restart-0.json").is_file(), 120, "the driver's decision")
        c.restore(1)  # the machine is back; its torchrun starts again and joins the waiting rendezvous
        jobs.start_agent(job, 1, endpoint, "2", 2, flags, jobs.rdzv_conf(), env)
        result = jobs.finish(job, 400, [0, 1])
        codes = [job.agents[h].returncode for h in (0, 1)]
        driver = job.log("driver.log")
    finally:
        _closed(c, job)
    assert codes == [0, 0], job.agent_logs()[-4000:]
    assert "every rank of host 10.213.0.2 (node 1; ranks 2, 3: DP0-PP1-TP0, DP0-PP1-TP1) stopped beating: the " \
           "host is lost" in driver
    assert result["completed"] and result["round"] == 1 and len(result["failures"]) == 1, driver
    _assert_identical(job.out, two_hosts["out"])


def test_a_partitioned_host_is_fenced_named_and_replaced_without_split_brain(tmp_path, two_hosts):
    """Host 1's link goes down at step 2 and stays down until the job trains again without it (longer than the
    hang timeout); the store is on host 0, a standby waits."""
    c = Cluster(3, log_dir=tmp_path / "logs")
    job = jobs.Job(c, tmp_path / "run", tmp_path / "hb", tmp_path / "logs")
    env = _env()
    try:
        endpoint = f"{c.hosts[0].addr}:{jobs.PORT}"
        flags = [*TWO_HOSTS, *COMMON, *HB, *PACED]
        for h in (0, 1):
            jobs.start_agent(job, h, endpoint, "2", 2, flags, jobs.rdzv_conf(), env)
        jobs.start_driver(job, 4, HANG_TIMEOUT, 0.3, env)
        jobs.wait_until(lambda: jobs.start_record(job.hb).get("start"), 300, "the first start")
        first = jobs.start_record(job.hb)["start"]
        jobs.start_agent(job, 2, endpoint, "2", 2, flags, jobs.rdzv_conf(), env)
        jobs.wait_for_step(job.hb, 0, 2, 300)
        steps_at_cut = [s for s in range(1, STEPS + 1) if ckpt.is_complete(ckpt.step_dir(job.out / "checkpoints", s))]
        cut_at = time.time()
        c.cut(1)
        # down until the job trains again on the standby: a new start, and a step done by it
        jobs.wait_until(lambda: jobs.start_record(job.hb).get("start") not in (None, first), 300, "a new start")
        new = jobs.start_record(job.hb)["start"]
        jobs.wait_until(lambda: jobs.beat(job.hb, 3).get("start") == new and jobs.beat(job.hb, 3).get("step", -1)
                        > max(steps_at_cut, default=0), 300, "a step of the new start")
        down_s = time.time() - cut_at
        c.restore(1)
        result = jobs.finish(job, 400, [0, 2])
        codes = {h: job.agents[h].returncode for h in (0, 2)}
        driver = job.log("driver.log")
        logs = job.agent_logs()
    finally:
        _closed(c, job)
    assert down_s > HANG_TIMEOUT  # a partition, not a flap
    assert codes == {0: 0, 2: 0}, logs[-4000:]
    assert result["completed"] and result["failures"] == [], driver
    [left] = result["hosts_left"]
    assert (left["addr"], left["ranks"], left["verdict"]) == ("10.213.0.2", [2, 3], "cut off"), driver
    assert "left the job, replaced by 10.213.0.3: its ranks were alive until the new start began" in driver
    assert "the host dropped out of the rendezvous: its network" in driver
    # not split-brained: the cut-off ranks saw the new start and left without training on
    for rank in (2, 3):
        assert re.search(rf"megatronapp heartbeat \(rank {rank}, 10\.213\.0\.2\): this start \({first}\) was "
                         rf"replaced by start {new}", logs), logs[-4000:]
    # the job resumed from a step committed before the cut (the cut-off side committed nothing after it)
    resumed = re.findall(r"resuming from step_(\d+)", logs)
    assert resumed and int(resumed[-1]) <= max(steps_at_cut) + 1, (resumed, steps_at_cut)
    _assert_identical(job.out, two_hosts["out"])
