"""MegaScan tracer and instrument(): real gloo processes write trace files that we read back and check.

`traced_job()` (4 ranks, tp=2 x dp=2, skewed and drifting clocks) is shared with the aggregate and align tests.
"""
from __future__ import annotations

import functools
import json
import os
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from megatronapp import tracing
from megatronapp.config import ConfigError, RunConfig
from megatronapp.launch import spawn
from megatronapp.scan.read.format import CATS, read_dir, read_rank
from megatronapp.scan.record.tracer import Tracer
from tests.tmpdirs import session_dir

# Injected clock errors of the traced job: rank r reads true + SKEW[r] + DRIFT[r] * (true - T0).
SKEW_NS = {0: 0, 1: 50_000_000, 2: -50_000_000, 3: 30_000_000}
DRIFT = {0: 0.0, 1: 1e-3, 2: -1.5e-3, 3: 5e-4}
STEPS = 12  # iterations run; traced: the last 3 of every 4 (i % 4 >= 1)
TRACED = [i for i in range(STEPS) if i % 4 >= 1]


def _job(rank: int, world: int, out: str, t0: int) -> None:
    from megatronapp.parallel import comm
    from megatronapp.parallel.topology import build
    from megatronapp.scan.record.tracer import attach

    def clock() -> int:
        true = time.monotonic_ns()
        return true + SKEW_NS[rank] + int(DRIFT[rank] * (true - t0))

    topo = build(tp=2, pp=1, dp=2)
    cfg = RunConfig()
    cfg.trace.enabled, cfg.trace.interval, cfg.trace.iterations, cfg.trace.granularity = True, 4, 3, "full"
    tracer = attach(cfg, topo, out, clock=clock)
    rng = np.random.default_rng(rank)
    x = torch.randn(64, 64)
    peer = topo.rank_at(1 - topo.coord.dp, 0, topo.coord.tp)  # the other DP replica
    for it in [*range(STEPS), 2]:  # iteration 2 again: must not be traced twice
        with tracing.step(it):
            with tracing.span("data", "data"):
                time.sleep(rng.uniform(0.001, 0.01))  # ranks arrive at collectives at different times
            for mb in range(2):
                with tracing.span("forward", "compute", chunk=0, microbatch=mb):
                    for layer in range(2):
                        with tracing.span(f"layers.{layer}", "layer"):
                            x = torch.tanh(x @ x) * 0.5
                    comm.all_reduce(x, topo.tp_group)
                buf = torch.empty_like(x)
                if topo.coord.dp == 0:  # P2P both ways between the replicas
                    comm.send(x, peer, topo.dp_group)
                    comm.recv(buf, peer, topo.dp_group)
                else:
                    comm.recv(buf, peer, topo.dp_group)
                    comm.send(x, peer, topo.dp_group)
                with tracing.span("backward", "compute", chunk=0, microbatch=mb):
                    time.sleep(rng.uniform(0.002, 0.02))
            h = comm.all_reduce_async(x, topo.dp_group)
            h.wait()
            with tracing.span("optimizer", "optimizer"):
                comm.all_reduce(torch.ones(1), topo.groups["world"])
                for k in range(16):  # small syncs (loss, grad norm, found-inf): more clock anchors
                    comm.all_reduce(torch.ones(1), topo.tp_group if k % 2 else topo.dp_group)
        # Outside any step: not in a window, not recorded.
        with tracing.span("forward", "compute"):
            pass
    tracer.close()
    assert not tracing.enabled()


@functools.lru_cache(maxsize=1)
def traced_job() -> tuple[Path, int]:
    """Run the 4-rank traced job once per test session; return (trace dir, T0 of the injected drift)."""
    out = session_dir("megascan-") / "trace"
    t0 = time.monotonic_ns()
    spawn(_job, 4, str(out), t0)
    return out, t0


def test_traced_job_structure():
    out, _ = traced_job()
    traces, problems = read_dir(out)
    assert problems == [] and [t.rank for t in traces] == [0, 1, 2, 3]
    for t in traces:
        name = np.array(t.names)[t.name]
        cat = np.array(CATS)[t.cat]
        assert t.header["footer"]["dropped"] == 0
        assert t.header["footer"]["repeated_iterations"] == [2]
        assert len(t.header["handshake"]["exit"]) == 5
        # Windows: exactly the traced iterations, each with one step span; no duplicates.
        assert sorted(set(t.it.tolist())) == TRACED
        steps = t.it[cat == "step"]
        assert sorted(steps.tolist()) == TRACED
        for it in TRACED:
            sel = t.it == it
            assert (name[sel] == "forward").sum() == 2 and (name[sel] == "layers.1").sum() == 2
            # Nesting: every span of the iteration lies inside its step span.
            s = np.flatnonzero(sel & (cat == "step"))[0]
            assert (t.ts[sel] >= t.ts[s]).all() and (t.end[sel] <= t.end[s]).all()
            fwd = np.flatnonzero(sel & (name == "forward"))
            for f in fwd:  # layers and the TP all-reduce nest inside their forward
                inner = sel & (t.ts >= t.ts[f]) & (t.end <= t.end[f])
                assert set(name[inner]) >= {"layers.0", "layers.1", "all_reduce", "forward"}
        assert (t.mb[name == "forward"] >= 0).all() and (t.chunk[name == "forward"] == 0).all()
        # Sequence numbers: per group, consecutive in trace order (gaps only where windows skip iterations).
        for gid, (gname, ranks) in enumerate(t.groups):
            m = (t.gid == gid) & (t.peer < 0)
            if m.any():
                assert (np.diff(t.seq[m]) > 0).all(), gname
                assert t.rank in ranks
    # Collective instances match across members: same (group, seq) on every member of the group.
    by_key: dict[tuple, set] = {}
    for t in traces:
        for gid, seq, peer in zip(t.gid.tolist(), t.seq.tolist(), t.peer.tolist()):
            if gid >= 0 and peer < 0:
                by_key.setdefault((*t.groups[gid], seq), set()).add(t.rank)
    assert by_key and all(members == set(key[1]) for key, members in by_key.items())
    # P2P: send on a (peer b, seq k) has a recv on b (peer a, seq k).
    sends = {(t.rank, p, s) for t in traces for n, p, s in zip(t.name, t.peer, t.seq) if t.names[n] == "send"}
    recvs = {(p, t.rank, s) for t in traces for n, p, s in zip(t.name, t.peer, t.seq) if t.names[n] == "recv"}
    assert sends and sends == recvs


def test_coarse_granularity_and_window_cost(tmp_path):
    header = {"rank": 0, "world": 1, "coord": [0, 0, 0], "topo": [1, 1, 1]}
    tr = Tracer(tmp_path / "rank00000.mst", header, interval=4, iterations=1, granularity="coarse")
    tracing.install(tr)
    try:
        for it in range(8):
            with tracing.step(it):
                with tracing.span("forward", "compute", chunk=0, microbatch=0), tracing.span("layers.0", "layer"):
                    pass
                assert tr.active == (it % 4 == 3)
    finally:
        tr.close()
    t = read_rank(tmp_path / "rank00000.mst")
    assert t.problems == [] and sorted(set(t.it.tolist())) == [3, 7]
    assert "layers.0" not in t.names and sorted(t.names) == ["forward", "step"]
    assert t.header["trace"] == {"interval": 4, "iterations": 1, "granularity": "coarse"}


def test_bounded_queue_drops_and_counts(tmp_path):
    header = {"rank": 0, "world": 1, "coord": [0, 0, 0], "topo": [1, 1, 1]}
    tr = Tracer(tmp_path / "rank00000.mst", header, queue_limit=10, flush_s=60.0)
    tracing.install(tr)
    with tracing.step(0):
        for _ in range(50):  # the writer sleeps (flush_s=60): the queue fills after 10 spans
            with tracing.span("forward", "compute"):
                pass
    tr.close()
    t = read_rank(tmp_path / "rank00000.mst")
    assert tr.dropped > 0 and t.header["footer"]["dropped"] == tr.dropped
    assert len(t) + tr.dropped == 51 and any("dropped" in p for p in t.problems)


def test_flush_now_races_the_writer_thread_safely(tmp_path):
    """flush_now (a signal handler, a benchmark) and the writer thread drain one queue: no span lost or doubled."""
    header = {"rank": 0, "world": 1, "coord": [0, 0, 0], "topo": [1, 1, 1]}
    tr = Tracer(tmp_path / "rank00000.mst", header, queue_limit=1 << 20, flush_s=0.0005)
    tracing.install(tr)
    with tracing.step(0):
        for i in range(20000):
            with tracing.span("forward", "compute"):
                pass
            if i % 50 == 0:
                tr.flush_now()  # raced with the writer thread, which wakes every 0.5 ms
    tr.close()
    t = read_rank(tmp_path / "rank00000.mst")
    assert tr.dropped == 0 and len(t) == 20001 and t.problems == []


def test_bad_window_settings_are_config_errors(tmp_path):
    header = {"rank": 0, "world": 1, "coord": [0, 0, 0], "topo": [1, 1, 1]}
    with pytest.raises(ConfigError, match="trace.interval"):
        Tracer(tmp_path / "a.mst", header, interval=0)
    with pytest.raises(ConfigError, match="granularity"):
        Tracer(tmp_path / "a.mst", header, granularity="fine")


# ---- instrument(): a hand-written 2-rank loop without the engine ----------------------------------------
def _plain_loop(rank: int, world: int, out: str) -> None:
    import torch.distributed as dist

    from megatronapp import scan

    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    scan.instrument(out, granularity="full", modules={"forward": model})
    other = 1 - rank
    for _ in range(3):
        with scan.step():
            loss = model(torch.randn(8, 16)).square().mean()
            loss.backward()
            for p in model.parameters():
                dist.all_reduce(p.grad)
            w = dist.all_reduce(torch.ones(4), async_op=True)
            w.wait()
            parts = [torch.empty(2) for _ in range(world)]
            dist.all_gather(parts, torch.full((2,), float(rank)))
            assert parts[other][0].item() == other
            dist.broadcast(torch.zeros(3), src=0)
            buf = torch.empty(5)
            if rank == 0:
                dist.send(torch.ones(5), 1)
                dist.recv(buf, 1)
            else:
                dist.recv(buf)  # any source
                dist.send(torch.ones(5), 0)
            reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, torch.ones(3), other),
                                           dist.P2POp(dist.irecv, torch.empty(3), other)])
            for r in reqs:
                r.wait()
            hs = [dist.isend(torch.ones(2), other), dist.irecv(torch.empty(2), other)]
            for h in hs:
                h.wait()
            dist.barrier()
    scan.uninstrument()
    assert dist.all_reduce.__module__.startswith("torch") and not tracing.enabled()
    dist.all_reduce(torch.ones(1))  # plain torch again


def test_instrument_plain_torch_loop(tmp_path):
    spawn(_plain_loop, 2, str(tmp_path))
    traces, problems = read_dir(tmp_path)
    assert problems == [] and len(traces) == 2
    per_rank = []
    for t in traces:
        name = np.array(t.names)[t.name]
        assert sorted(set(t.it.tolist())) == [0, 1, 2]
        counts = {n: int((name == n).sum()) for n in set(name)}
        assert counts["step"] == 3 and counts["forward"] == 3 and counts["0"] == 3  # full: child modules
        assert counts["all_reduce"] == 3 * 5 and counts["all_gather"] == 3 and counts["barrier"] == 3
        assert counts["send"] == counts["recv"] == 3 * 3
        per_rank.append({(t.groups[g][0], s) for g, s, p in zip(t.gid, t.seq, t.peer) if g >= 0 and p < 0})
        assert json.loads(json.dumps(t.header))["instrumented"] is True
    assert per_rank[0] == per_rank[1]  # collective sequence numbers agree across ranks
    sends = {(t.rank, p, s) for t in traces for n, p, s in zip(t.name, t.peer, t.seq) if t.names[n] == "send"}
    recvs = {(p, t.rank, s) for t in traces for n, p, s in zip(t.name, t.peer, t.seq) if t.names[n] == "recv"}
    assert len(sends) == 18 and sends == recvs


# ---- instrument(): real Work objects, user coordinates, DDP through a comm hook ---------------------------
def _ddp_loop(rank: int, world: int, out: str) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from megatronapp import scan

    model = DDP(torch.nn.Linear(8, 8))
    scan.instrument(out, dp=rank, pp=0, tp=0, sizes=(1, 1, world))
    scan.trace_ddp(model)
    for _ in range(3):
        with scan.step():
            model(torch.randn(4, 8)).sum().backward()
            w = dist.all_gather_into_tensor(torch.empty(2 * world), torch.full((2,), float(rank)), async_op=True)
            # FSDP2 waits only on real Work objects: the handle must be the backend's own.
            assert isinstance(w, dist.Work), type(w)
            w.wait()
    scan.uninstrument()


def test_instrument_returns_real_work_and_traces_ddp(tmp_path):
    spawn(_ddp_loop, 2, str(tmp_path))
    traces, problems = read_dir(tmp_path)
    assert problems == [] and len(traces) == 2
    for t in traces:
        assert t.coord == (t.rank, 0, 0) and t.topo == (1, 1, 2)
        name = np.array(t.names)[t.name]
        assert (name == "all_gather_into_tensor").sum() == 3
        # DDP's bucket all-reduces (from C++) are spans now, closed when they completed, with matching numbers.
        ar = name == "all_reduce"
        assert ar.sum() >= 3 and (t.dur[ar] >= 0).all()
    seqs = [sorted(t.seq[np.array(t.names)[t.name] == "all_reduce"].tolist()) for t in traces]
    assert seqs[0] == seqs[1]


def test_open_ops_are_on_disk_after_sigusr1_before_they_close(tmp_path):
    import os
    import signal

    header = {"rank": 0, "world": 1, "coord": [0, 0, 0], "topo": [1, 1, 1]}
    tr = Tracer(tmp_path / "rank00000.mst", header, flush_s=3600)  # the timer never fires during the test
    tracing.install(tr)
    try:
        tr.step(0, True)
        sp = tracing.open_span("all_reduce", "comm", group="dp", group_ranks=[0], seq=7, peer=None, bytes=4)
        os.kill(os.getpid(), signal.SIGUSR1)  # "where are you?": the handler writes what is in flight
        t = read_rank(tmp_path / "rank00000.mst")
        opened = [t.names[n] for n in t.opened["name"]]
        assert "all_reduce" in opened and len(t) == 0  # opened, not finished
        assert int(t.opened["seq"][opened.index("all_reduce")]) == 7
        tracing.close_span(sp)
        tr.step(0, False)
    finally:
        tr.close()
    t = read_rank(tmp_path / "rank00000.mst")
    assert "all_reduce" in [t.names[n] for n in t.name]  # and the finished span follows
    assert signal.getsignal(signal.SIGUSR1) != tr._on_signal  # handlers restored at close


# ---- instrument(): the rest of c10d and the functional collectives ----------------------------------------
def _coverage_loop(rank: int, world: int, out: str) -> None:
    import warnings

    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    from megatronapp import scan

    scan.instrument(out)
    other = 1 - rank
    for _ in range(2):
        with scan.step():
            outs = [torch.empty(2) for _ in range(world)]
            dist.all_to_all(outs, [torch.full((2,), 10.0 * rank + j) for j in range(world)])
            assert outs[other][0].item() == 10.0 * other + rank
            o = torch.empty(world)
            w = dist.all_to_all_single(o, torch.arange(world, dtype=torch.float) + 10 * rank, async_op=True)
            assert isinstance(w, dist.Work), type(w)  # the backend's own handle
            w.wait()
            assert o[other].item() == 10 * other + rank
            t = torch.ones(3)
            dist.reduce(t, dst=0)
            if rank == 0:
                assert t[0].item() == world
            g = [torch.empty(2) for _ in range(world)] if rank == 0 else None
            dist.gather(torch.full((2,), float(rank)), g, dst=0)
            s = torch.empty(2)
            dist.scatter(s, [torch.full((2,), float(j)) for j in range(world)] if rank == 0 else None, src=0)
            assert s[0].item() == rank
            dist.all_gather_single(torch.empty(2 * world), torch.ones(2))
            dist.reduce_scatter_single(torch.empty(2), torch.ones(2 * world))
            # Functional collectives: a span from issue to the wait on the result.
            r = funcol.all_reduce(torch.ones(4), "sum", dist.group.WORLD)
            assert r.sum().item() == 4 * world  # using the result waits on it
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)  # the deprecated name: one span, not two
                ag = funcol.all_gather_tensor(torch.full((2,), float(rank)), 0, dist.group.WORLD)
            assert ag[2 * other].item() == other
            rs = funcol.reduce_scatter_single(torch.ones(2 * world), "sum", 0, list(range(world)))
            assert rs[0].item() == world
            a2a = funcol.all_to_all_single(torch.arange(2.0) + 10 * rank, None, None, dist.group.WORLD)
            assert a2a[other].item() == 10 * other + rank
    scan.uninstrument()
    assert funcol.all_reduce.__module__.startswith("torch")


def test_instrument_covers_all_to_all_rooted_and_functional_collectives(tmp_path):
    spawn(_coverage_loop, 2, str(tmp_path))
    traces, problems = read_dir(tmp_path)
    assert problems == [] and len(traces) == 2
    want = {"all_to_all", "all_to_all_single", "reduce", "gather", "scatter", "all_gather_single",
            "reduce_scatter_single", "all_reduce", "all_gather_tensor"}
    for t in traces:
        name = np.array(t.names)[t.name]
        counts = {n: int((name == n).sum()) for n in set(name.tolist())}
        assert want <= set(counts), counts
        # per step: all_to_all_single and reduce_scatter_single from c10d AND functional, the rest once
        assert counts["all_to_all_single"] == counts["reduce_scatter_single"] == 2 * 2, counts
        assert counts["all_gather_single"] == counts["all_gather_tensor"] == counts["all_reduce"] == 2, counts
        assert (t.dur >= 0).all()  # every span closed: functional ones at the wait on (a view of) the result
    seqs = [[(t.names[n], int(s)) for n, s in zip(t.name, t.seq) if t.names[n] != "step"] for t in traces]
    assert sorted(seqs[0]) == sorted(seqs[1]) and len(seqs[0]) == 2 * 11  # every instance matched


# ---- CUDA-event time: re-anchored at every trace window (no GPU here: a fake device timer) -------------------
class _FakeDevice:
    """A device timer on the host's time, read the way CUDA reads it: float32 milliseconds between two events."""

    def __init__(self) -> None:
        self.now = 0  # ns, the host clock below reads the same time
        self.syncs = 0

    def event(self) -> object:
        dev = self

        class Event:
            def __init__(self) -> None:
                self.t = dev.now

            def query(self) -> bool:
                return True

            def synchronize(self) -> None:
                pass

            def elapsed_time(self, other: Event) -> float:
                return float(np.float32((other.t - self.t) / 1e6))  # cudaEventElapsedTime: float32 ms

        return Event()


class _FakeCudaTracer(Tracer):
    def __init__(self, dev: _FakeDevice, *args, **kwargs):
        self.dev = dev
        super().__init__(*args, cuda=True, clock=lambda: dev.now, **kwargs)

    def _event(self):
        return self.dev.event()

    def _sync(self) -> None:
        self.dev.syncs += 1


def test_cuda_event_times_stay_precise_hours_later_with_one_anchor_per_window(tmp_path):
    dev = _FakeDevice()
    header = {"rank": 0, "world": 1, "coord": [0, 0, 0], "topo": [1, 1, 1]}
    tr = _FakeCudaTracer(dev, tmp_path / "rank00000.mst", header, interval=1000, iterations=2)
    tracing.install(tr)
    truth = []
    try:
        for it in range(4002):  # windows: iterations 998-999, 1998-1999, 2998-2999, 3998-3999
            tr.step(it, True)
            dev.now += 3_000_000_000  # 3 s per iteration: the last window is 3.3 hours after the first
            if tr.active:
                sp = tracing.open_span("forward", "compute")
                dev.now += 1_234_567  # 1.234567 ms of device work
                tracing.close_span(sp)
                truth.append((dev.now - 1_234_567, 1_234_567))
            dev.now += 10_001
            tr.step(it, False)
    finally:
        tr.close()
    assert dev.syncs == 4, dev.syncs  # one anchor (one device sync) per window, none per span
    t = read_rank(tmp_path / "rank00000.mst")
    fwd = np.array(t.names)[t.name] == "forward"
    ts, dur = t.ts[fwd], t.dur[fwd]
    want_ts, want_dur = np.array(truth).T
    # From one anchor per run the last window's times would be float32 ms of ~1.2e7: 1 ms steps.
    assert np.abs(ts - want_ts).max() < 2_000 and np.abs(dur - want_dur).max() < 2_000, (ts - want_ts, dur - want_dur)


@pytest.mark.skipif(not Path("/proc/thread-self/schedstat").exists() or not hasattr(os, "sched_setaffinity"),
                    reason="needs Linux schedstat and CPU affinity")
def test_work_spans_record_the_time_they_waited_for_a_cpu(tmp_path):
    """A compute span that shares its one CPU with a spinning process waits for the CPU about half its time;
    the tracer records that wait (schedstat run-queue delay), a layer span inside it too (per-layer costs are
    measured without it), a sleeping span none, a comm span is not measured."""
    import subprocess
    import sys

    cpu = min(os.sched_getaffinity(0))
    before = os.sched_getaffinity(0)
    hog = subprocess.Popen([sys.executable, "-c", f"import os; os.sched_setaffinity(0, {{{cpu}}})\nwhile True: pass"])
    header = {"rank": 0, "world": 1, "coord": [0, 0, 0], "topo": [1, 1, 1]}
    tr = Tracer(tmp_path / "rank00000.mst", header, granularity="full")
    tracing.install(tr)
    try:
        time.sleep(0.3)  # the hog is pinned and spinning
        os.sched_setaffinity(0, {cpu})
        with tracing.step(0):
            with tracing.span("forward", "compute"), tracing.span("layers.0", "layer"):
                t0 = time.thread_time()
                while time.thread_time() - t0 < 0.15:  # 150 ms of CPU: ~300 ms of wall time beside the hog
                    pass
            with tracing.span("data", "data"):
                time.sleep(0.1)
            with tracing.span("all_reduce", "comm", group="dp", group_ranks=(0,), seq=0):
                pass
    finally:
        os.sched_setaffinity(0, before)
        hog.kill()
        hog.wait()
        tr.close()
    t = read_rank(tmp_path / "rank00000.mst")
    by = {t.names[n]: (int(d), int(w)) for n, d, w in zip(t.name, t.dur, t.cpu_wait)}
    dur, waited = by["forward"]
    assert waited > 0.25 * dur, (dur, waited)  # CFS shares the CPU evenly: about half
    assert waited < dur
    assert by["layers.0"][1] > 0.25 * by["layers.0"][0] and by["layers.0"][1] <= waited
    assert 0 <= by["data"][1] < 0.2 * by["data"][0]  # asleep is not waiting for a CPU
    assert by["all_reduce"][1] == -1


@pytest.mark.skipif(not Path("/proc/thread-self/schedstat").exists(), reason="needs Linux schedstat")
def test_cpu_wait_reader_keeps_no_fd_of_ended_threads_and_rereads_after_fork():
    import threading

    from megatronapp.scan.record.tracer import cpu_wait_ns

    assert cpu_wait_ns() >= 0
    before = len(os.listdir("/proc/self/fd"))
    for _ in range(20):  # spans on short-lived threads: each opens its own schedstat file, closed with it
        t = threading.Thread(target=cpu_wait_ns)
        t.start()
        t.join()
    import gc

    gc.collect()
    assert len(os.listdir("/proc/self/fd")) <= before
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # an inherited fd would read the PARENT's thread: the child opens its own
        ok = cpu_wait_ns() >= 0 and f"/{os.getpid()}/" in os.readlink(f"/proc/self/fd/{cpu_wait_ns._local.f.fd}")
        os.write(w, b"1" if ok else b"0")
        os._exit(0)
    os.waitpid(pid, 0)
    assert os.read(r, 1) == b"1"
