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
from megatronapp.parallel.comm_context import CommOp
from megatronapp.parallel.topology import Topology
from megatronapp.scan.read.format import CATS, read_dir, read_rank
from megatronapp.scan.record.tracer import Tracer
from tests.fake_clock import FakeClock


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


def _fake_clock(monkeypatch) -> FakeClock:
    """The injector on virtual time: its clock, its sleeps and its reading of run-queue delay."""
    clock = FakeClock()
    monkeypatch.setattr(faults, "time", clock)
    monkeypatch.setattr(faults, "_cpu_wait_s", clock.cpu_wait_s)
    return clock


def _spans(tmp_path):
    """Rank 0's trace and its spans' names."""
    t = read_rank(tmp_path / "rank00000.mst")
    return t, np.array(t.names)[t.name]


def _traced(tmp_path, specs: list[str], clock: FakeClock, world: int = 1, granularity: str = "coarse"):
    """Rank 0 traced on `clock`, with the faults of `specs` installed."""
    header = {"rank": 0, "world": world, "coord": [0, 0, 0], "topo": [1, 1, world]}
    tr = Tracer(tmp_path / "rank00000.mst", header, granularity=granularity, clock=clock.monotonic_ns)
    tracing.install(tr)  # the trainer's order: tracer first, then faults
    inj = faults.install(specs, Topology(tp=1, pp=1, dp=world, rank=0))
    return tr, inj


# The two tests below run on a fake clock (tests/fake_clock.py): the work is `clock.advance`, the injector's
# sleeps advance it too, so every span lasts exactly what the fault logic makes it last (a stretch counted twice,
# a fault of another rank, a pause in the wrong iteration change these numbers), and no loaded host can move them.
def test_slow_compute_and_pause_act_on_their_rank_only(tmp_path, monkeypatch):
    clock = _fake_clock(monkeypatch)
    tr, inj = _traced(tmp_path, ["slow-compute=0:2.0", "pause=0:80:2", "slow-compute=1:5"], clock, world=2)
    try:
        for it in range(4):
            with tracing.step(it):
                with tracing.span("forward", "compute"):
                    clock.advance(0.05)
                with tracing.span("data", "data"):
                    clock.advance(0.02)
    finally:
        inj.remove()
        tr.close()
    t = read_rank(tmp_path / "rank00000.mst")
    name, cat = np.array(t.names)[t.name], np.array(CATS)[t.cat]
    assert (t.dur[name == "forward"] == 100_000_000).all(), t.dur[name == "forward"]  # 2 x 50 ms, not rank 1's 5x
    assert (t.dur[name == "data"] == 20_000_000).all()  # only compute is slowed
    # The pause sits inside the step, outside its child spans: a gap of 80 ms at iterations 0 and 2 only.
    gaps = []
    for it in range(4):
        sel = t.it == it
        step = sel & (cat == "step")
        gaps.append(int(t.dur[step].sum() - t.dur[sel & ~(cat == "step")].sum()))
    assert gaps == [80_000_000, 0, 80_000_000, 0], gaps


def test_slow_compute_stretches_layers_once_and_the_compute_around_them(tmp_path, monkeypatch):
    # A slow device is slow at every op: per-layer spans are stretched too (MegaScan measures stage work and
    # lone stages by them), and the compute span around them stretches only its time outside layers.
    clock = _fake_clock(monkeypatch)
    tr, inj = _traced(tmp_path, ["slow-compute=0:2.0"], clock, granularity="full")
    try:
        for it in range(3):
            with tracing.step(it):
                with tracing.span("forward", "compute"):
                    clock.advance(0.01)
                    for i in range(2):
                        with tracing.span(f"layers.{i}", "layer"):
                            clock.advance(0.02)
    finally:
        inj.remove()
        tr.close()
    t, name = _spans(tmp_path)
    layer = t.dur[np.char.startswith(name.astype(str), "layers.")]
    fwd = t.dur[name == "forward"]
    assert len(layer) == 6 and (layer == 40_000_000).all(), layer  # 2 x 20 ms
    assert len(fwd) == 3 and (fwd == 100_000_000).all(), fwd  # 2 x (10 + 2 x 20) ms, not 2 x (10 + 2 x 40)


def test_slow_compute_does_not_stretch_time_spent_waiting_for_a_core(tmp_path, monkeypatch):
    # A slow device is slow at its work, not at the host's run queue: of a 50 ms span that waited 20 ms for a core
    # (in a layer, then outside it) only the 30 ms of work is stretched, once.
    clock = _fake_clock(monkeypatch)
    tr, inj = _traced(tmp_path, ["slow-compute=0:2.0"], clock, granularity="full")
    try:
        with tracing.step(0):
            with tracing.span("forward", "compute"):
                clock.advance(0.01)
                clock.wait_for_core(0.005)
                with tracing.span("layers.0", "layer"):
                    clock.advance(0.01)
                    clock.wait_for_core(0.015)
                clock.advance(0.01)
    finally:
        inj.remove()
        tr.close()
    t, name = _spans(tmp_path)
    assert t.dur[name == "layers.0"].tolist() == [35_000_000]  # 25 ms + its 10 ms of work again
    assert t.dur[name == "forward"].tolist() == [80_000_000]  # 50 ms + 10 (the layer's work) + 20 (its own work)


def test_hang_blocks_until_removed(tmp_path):
    inj = faults.install(["hang=0:3"], Topology(tp=1, pp=1, dp=2, rank=0))
    reached = []

    def loop() -> None:
        for it in range(5):
            with tracing.step(it):
                reached.append(it)

    th = threading.Thread(target=loop, daemon=True)
    th.start()
    deadline = time.monotonic() + 60  # a thread on a loaded host may take long to get there; it then stays
    while inj.hung_at is None and th.is_alive() and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.1)  # had the drill not held it, the thread would go on to iterations 3 and 4 meanwhile
    assert reached == [0, 1, 2] and inj.hung_at == 3 and th.is_alive()
    inj.remove()
    th.join(60)
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


def test_slow_link_delays_sends_and_collectives(tmp_path, monkeypatch):
    spawn(_link_job, 3, str(tmp_path))
    traces, problems = read_dir(tmp_path)
    assert problems == []
    t0, t2 = traces[0], traces[2]
    name0, name2 = np.array(t0.names)[t0.name], np.array(t2.names)[t2.name]
    # Rank 0 waits 30 ms before the all-reduce (each step begins with that wait) and before the send to 1. Lower
    # bounds only: a sleep is never shorter, whatever the load (one host clock: CLOCK_MONOTONIC in every rank).
    ar_start, ar_end = t0.ts[name0 == "all_reduce"], t0.end[name0 == "all_reduce"]
    assert np.all((ar_start - t0.ts[name0 == "step"]) / 1e6 > 25)
    send1 = (name0 == "send") & (t0.peer == 1)
    assert np.all((t0.ts[send1] - ar_end) / 1e6 > 25)
    # Rank 2, off the link, is held all the same: its all-reduce ends only after the delayed rank 0 entered it.
    assert np.all(t2.end[name2 == "all_reduce"] >= ar_start)
    # Which ops wait, exactly (a fake clock counts the interceptor's sleeps): a send over the link and a
    # collective holding both ends; not a send to another rank, a receive, or a collective holding one end.
    clock = _fake_clock(monkeypatch)
    inj = faults.install(["slow-link=0-1:30"], Topology(tp=1, pp=1, dp=3, rank=0))
    try:
        ops = [(CommOp("all_reduce", "dp", (0, 1, 2), 0, 16), 0.03),
               (CommOp("send", "dp", (0, 1, 2), 0, 16, peer=1), 0.03),
               (CommOp("send", "dp", (0, 1, 2), 1, 16, peer=2), 0.0),
               (CommOp("recv", "dp", (0, 1, 2), 2, 16, peer=1), 0.0),
               (CommOp("all_reduce", "pp", (0, 2), 0, 16), 0.0)]
        for op, delay in ops:
            before = clock.ns
            assert inj.intercept(op) is None and clock.ns - before == round(delay * 1e9), (op, clock.slept)
    finally:
        inj.remove()


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
