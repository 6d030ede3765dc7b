"""Fault injection: every spec parses (or fails clearly) and every fault measurably acts."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from megatronapp import faults, tracing
from megatronapp.config import ConfigError
from megatronapp.launch import spawn
from megatronapp.parallel import comm
from megatronapp.parallel.topology import Topology
from megatronapp.scan.read.format import CATS, read_dir, read_rank
from megatronapp.scan.record.tracer import Tracer


def test_parse_every_kind():
    assert faults.parse("slow-compute=5:1.3") == faults.Fault("slow-compute", (5,), factor=1.3,
                                                              spec="slow-compute=5:1.3")
    f = faults.parse("slow-link=0-4:20")
    assert (f.kind, f.ranks, f.delay_ms) == ("slow-link", (0, 4), 20.0)
    f = faults.parse("pause=3:200:5")
    assert (f.kind, f.ranks, f.ms, f.every) == ("pause", (3,), 200.0, 5)
    f = faults.parse("hang=2:10")
    assert (f.kind, f.ranks, f.step) == ("hang", (2,), 10)


@pytest.mark.parametrize("spec, message", [
    ("slow=1:2", "unknown fault 'slow'"),
    ("slow-compute=1", "expected slow-compute=RANK:FACTOR"),
    ("slow-compute=x:2", "RANK must be an integer"),
    ("slow-compute=1:0.5", "FACTOR=0.5 must be >= 1"),
    ("slow-link=0:3", "expected slow-link=A-B:DELAY_MS"),
    ("slow-link=0_1:3", "two ranks joined by '-'"),
    ("slow-link=2-2:3", "two different ranks"),
    ("pause=1:100", "expected pause=RANK:MS:EVERY"),
    ("pause=1:100:0", "EVERY=0 must be >= 1"),
    ("hang=1:", "expected hang=RANK:STEP"),
    ("hang=-1:3", "RANK=-1 must be >= 0"),
])
def test_bad_specs_say_what_is_wrong(spec, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        faults.parse(spec)


def test_install_checks_ranks_against_world():
    with pytest.raises(ConfigError, match="rank 9 does not exist in a world of 4"):
        faults.install(["slow-link=1-9:5"], Topology(tp=1, pp=1, dp=4, rank=0))


def _traced(tmp_path, specs: list[str], rank: int = 0, world: int = 1):
    header = {"rank": rank, "world": world, "coord": [rank, 0, 0], "topo": [1, 1, world]}
    tr = Tracer(tmp_path / f"rank{rank:05d}.mst", header)
    tracing.install(tr)  # the trainer's order: tracer first, then faults
    inj = faults.install(specs, Topology(tp=1, pp=1, dp=world, rank=rank))
    return tr, inj


def test_slow_compute_and_pause_act_on_their_rank_only(tmp_path):
    tr, inj = _traced(tmp_path, ["slow-compute=0:2.0", "pause=0:80:2", "slow-compute=1:5"], world=2)
    inner = []
    try:
        for it in range(4):
            with tracing.step(it):
                with tracing.span("forward", "compute"):
                    t0 = time.perf_counter()
                    time.sleep(0.05)
                    inner.append(time.perf_counter() - t0)
                with tracing.span("data", "data"):
                    time.sleep(0.02)
    finally:
        inj.remove()
        tr.close()
    t = read_rank(tmp_path / "rank00000.mst")
    name, cat = np.array(t.names)[t.name], np.array(CATS)[t.cat]
    ratio = t.dur[name == "forward"] / 1e9 / np.array(inner)
    # Factor 2 (sleeps on a loaded machine only overshoot), and not rank 1's factor 5.
    assert np.all(ratio > 1.95) and np.median(ratio) < 3.0, ratio
    assert np.median(t.dur[name == "data"]) / 1e6 < 35  # only compute is slowed
    # The pause sits inside the step, outside its child spans: the gap is >= 80 ms at iterations 0 and 2 only.
    gaps = []
    for it in range(4):
        sel = t.it == it
        step = sel & (cat == "step")
        gaps.append((t.dur[step].sum() - t.dur[sel & ~(cat == "step")].sum()) / 1e6)
    assert gaps[0] >= 79 and gaps[2] >= 79 and gaps[1] < 40 and gaps[3] < 40, gaps


def test_slow_compute_stretches_layers_once_and_the_compute_around_them(tmp_path):
    # A slow device is slow at every op: per-layer spans are stretched too (MegaScan measures stage work and
    # lone stages by them), and the compute span around them stretches only its time outside layers.
    tr = Tracer(tmp_path / "rank00000.mst", {"rank": 0, "world": 1, "coord": [0, 0, 0], "topo": [1, 1, 1]},
                granularity="full")
    tracing.install(tr)
    inj = faults.install(["slow-compute=0:2.0"], Topology(tp=1, pp=1, dp=1, rank=0))
    try:
        for it in range(3):
            with tracing.step(it):
                with tracing.span("forward", "compute"):
                    time.sleep(0.01)
                    for i in range(2):
                        with tracing.span(f"layers.{i}", "layer"):
                            time.sleep(0.02)
    finally:
        inj.remove()
        tr.close()
    t = read_rank(tmp_path / "rank00000.mst")
    name = np.array(t.names)[t.name]
    layer = t.dur[np.char.startswith(name.astype(str), "layers.")] / 1e6
    fwd = t.dur[name == "forward"] / 1e6
    assert np.all(layer > 39) and np.median(layer) < 60, layer  # 2 x 20 ms
    assert np.all(fwd > 99) and np.median(fwd) < 140, fwd  # 2 x (10 + 2 x 20) ms, not 2 x (10 + 2 x 40)


def test_hang_blocks_until_removed(tmp_path):
    inj = faults.install(["hang=0:3"], Topology(tp=1, pp=1, dp=2, rank=0))
    reached = []

    def loop() -> None:
        for it in range(5):
            with tracing.step(it):
                reached.append(it)

    th = threading.Thread(target=loop, daemon=True)
    th.start()
    time.sleep(0.3)
    assert reached == [0, 1, 2] and inj.hung_at == 3 and th.is_alive()
    inj.remove()
    th.join(5)
    assert reached == [0, 1, 2, 3, 4] and not tracing.enabled()


def _link_job(rank: int, world: int, out: str) -> None:
    from megatronapp.parallel.topology import build
    from megatronapp.scan.record.tracer import Tracer

    topo = build(tp=1, pp=1, dp=3)
    header = {"rank": rank, "world": world, "coord": [rank, 0, 0], "topo": [1, 1, world]}
    tr = Tracer(f"{out}/rank{rank:05d}.mst", header)
    tracing.install(tr)
    inj = faults.install(["slow-link=0-1:30"], topo)
    x = torch.ones(4)
    for it in range(3):
        with tracing.step(it):
            comm.all_reduce(x, topo.dp_group)  # holds 0 and 1: delayed
            if rank == 0:
                comm.send(x, 1, topo.dp_group)  # over the slow link
                comm.send(x, 2, topo.dp_group)  # not
            elif rank == 1:
                comm.recv(x, 0, topo.dp_group)
            else:
                comm.recv(x, 0, topo.dp_group)
    inj.remove()
    tr.close()
    assert not comm.CONTEXT.interceptors


def test_slow_link_delays_sends_and_collectives(tmp_path):
    spawn(_link_job, 3, str(tmp_path))
    traces, problems = read_dir(tmp_path)
    assert problems == []
    t0, t2 = traces[0], traces[2]
    name0 = np.array(t0.names)[t0.name]
    ar = t2.dur[np.array(t2.names)[t2.name] == "all_reduce"] / 1e6  # rank 2 waits for the delayed members
    assert np.all(ar > 25)
    # Rank 0 waits 30 ms before the all-reduce and before the send to 1, not before the send to 2.
    steps = t0.dur[name0 == "step"] / 1e6
    assert np.all(steps > 55)
    ar_end = t0.end[name0 == "all_reduce"]
    send1, send2 = (name0 == "send") & (t0.peer == 1), (name0 == "send") & (t0.peer == 2)
    assert np.all((t0.ts[send1] - ar_end) / 1e6 > 25)
    assert np.all((t0.ts[send2] - t0.end[send1]) / 1e6 < 15)


def test_parse_wire_faults():
    f = faults.parse("slow-wire=1-2:4")
    assert (f.kind, f.ranks, f.factor) == ("slow-wire", (1, 2), 4.0)
    f = faults.parse("jitter=0-3:lognormal:0.5")
    assert (f.kind, f.ranks, f.sigma) == ("jitter", (0, 3), 0.5)
    with pytest.raises(ConfigError, match="only jitter law is lognormal"):
        faults.parse("jitter=0-3:uniform:0.5")
    with pytest.raises(ConfigError, match="expected slow-wire=A-B:FACTOR"):
        faults.parse("slow-wire=1-2")


def _wire_job(rank: int, world: int, out: str) -> None:
    import json
    from pathlib import Path

    from megatronapp.parallel import topology as topology_mod

    comm.reset()
    topo = topology_mod.build(1, 2, 1, rank)
    inj = faults.install(["slow-wire=0-1:500"], topo)  # 4 MB at the nominal 1 GB/s: ~2 s late each
    g = topo.pp_group
    if rank == 0:
        hs, pending_after_issue = [], []
        for i in range(2):
            hs.append(comm.isend(torch.full((1 << 20,), float(i)), 1, g))
            pending_after_issue.append(not hs[-1].is_completed())  # the sender went on: nothing delivered yet
        for h in hs:
            h.wait()
        result = {"pending_after_issue": pending_after_issue}
    else:
        bufs = [torch.empty(1 << 20) for _ in range(2)]
        t0 = time.monotonic()
        for b in bufs:
            comm.irecv(b, 0, g).wait()
        result = {"got": [float(b[0]) for b in bufs], "late_s": time.monotonic() - t0}
    inj.remove()
    Path(out, f"wire{rank}.json").write_text(json.dumps(result))


def test_slow_wire_delivers_late_in_order_without_stalling_the_sender(tmp_path):
    import json

    spawn(_wire_job, 2, str(tmp_path))
    sender = json.loads((tmp_path / "wire0.json").read_text())
    receiver = json.loads((tmp_path / "wire1.json").read_text())
    assert sender["pending_after_issue"] == [True, True]
    assert receiver["got"] == [0.0, 1.0]  # in order
    assert receiver["late_s"] > 2.0  # two messages, each ~2 s late, one after the other on the wire
