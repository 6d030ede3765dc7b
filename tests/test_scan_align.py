"""Clock alignment: recover injected skews (+/-50 ms) and drift from real gloo trace files within 1 ms."""
from __future__ import annotations

import numpy as np

from megatronapp.scan.detect.align import estimate_offsets, to_reference
from megatronapp.scan.read.format import RankWriter, rank_file, read_dir
from tests.test_scan_tracer import DRIFT, SKEW_NS, traced_job

TOL_NS = 1_000_000


def _check_recovered(traces, offsets, report, t0_drift):
    ref = next(t for t in traces if t.rank == 0)
    span = np.linspace(ref.ts.min(), ref.end.max(), 7).astype(np.int64)  # true times (rank 0's clock is true)
    for t in traces:
        local = span + SKEW_NS[t.rank] + (DRIFT[t.rank] * (span - t0_drift)).astype(np.int64)
        err = to_reference(t.rank, local, offsets, report) - span
        assert np.abs(err).max() < TOL_NS, (t.rank, err)


def test_recovers_skew_and_drift_from_collectives_and_handshake():
    out, t0 = traced_job()
    traces, _ = read_dir(out)
    offsets, residual, report = estimate_offsets(traces)
    assert report["unaligned"] == [] and report["anchors"] > 40
    assert residual < 5_000_000  # anchor noise (late clock reads on a loaded machine), far below the skews
    assert abs(report["slope"][2] - DRIFT[2]) < 1e-3, report["slope"]  # the largest drift is seen
    _check_recovered(traces, offsets, report, t0)
    assert offsets[0] == 0


def test_transitive_alignment_without_handshake():
    # Rank 3 shares no group with rank 0 (tp={2,3}, dp={1,3}) except the world all-reduce: drop that and the
    # handshake, and it must still be aligned through rank 1 or 2.
    out, t0 = traced_job()
    traces, _ = read_dir(out)
    for t in traces:
        t.header.pop("handshake")
        world = [i for i, (name, _) in enumerate(t.groups) if name == "world"]
        keep = ~np.isin(t.gid, world)
        for col in ("name", "cat", "ts", "dur", "it", "gid", "seq", "peer", "nbytes", "chunk", "mb"):
            setattr(t, col, getattr(t, col)[keep])
    offsets, _, report = estimate_offsets(traces)
    assert report["unaligned"] == []
    _check_recovered(traces, offsets, report, t0)


def test_outlier_anchors_do_not_move_the_estimate(tmp_path):
    # Synthetic: two ranks, 40 all-reduces; rank 1 is 7 ms ahead; 30% of its exits are late by up to 50 ms
    # (a descheduled process). The median-based fit must ignore them.
    rng = np.random.default_rng(0)
    for r in (0, 1):
        w = RankWriter(rank_file(tmp_path, r), {"rank": r, "world": 2, "coord": [r, 0, 0], "topo": [1, 1, 2]})
        for k in range(40):
            start = 10**9 + k * 10**7 + (7_000_000 if r else 0) - 1000
            late = int(rng.uniform(1e6, 5e7)) if r and rng.random() < 0.3 else 0  # read late after the exit
            w.write("all_reduce", "comm", start, 1000 + late, k, group="dp", group_ranks=(0, 1), seq=k)
        w.close()
    traces, problems = read_dir(tmp_path)
    offsets, _, report = estimate_offsets(traces)
    assert problems == [] and abs(offsets[1] - 7_000_000) < 50_000 and abs(report["slope"][1]) < 1e-3


def test_unconnected_rank_is_reported(tmp_path):
    for r, ranks in ((0, (0, 1)), (1, (0, 1)), (2, (2,))):
        w = RankWriter(rank_file(tmp_path, r), {"rank": r, "world": 3, "coord": [r, 0, 0], "topo": [1, 1, 3]})
        w.write("all_reduce", "comm", 100, 10, 0, group="g", group_ranks=ranks, seq=0)
        w.close()
    traces, _ = read_dir(tmp_path)
    offsets, _, report = estimate_offsets(traces)
    assert report["unaligned"] == [2] and offsets[2] == 0


def test_clocks_days_apart_with_drift_align_from_the_simulator(tmp_path):
    # Hosts booted days apart whose clocks run tens of ppm fast or slow (the simulator's default clocks).
    from megatronapp.scan.synth.simulate import simulate

    res = simulate(tmp_path, 32, 2, 2, iterations=4, seed=3, clock_ppm=50.0)
    off, ppm = np.array(res.offsets_ns), np.array(res.drift_ppm) * 1e-6
    assert np.ptp(off) > 86_400 * 10**9 and np.abs(ppm).max() > 20e-6  # really days apart, tens of ppm
    traces, _ = read_dir(tmp_path)
    offsets, residual, report = estimate_offsets(traces)
    assert report["unaligned"] == [] and set(report["residual_by_rank"]) == set(range(32))
    errs = []
    for t in traces:
        true = (t.ts - off[t.rank]) / (1 + ppm[t.rank])  # invert local = offset + (1 + drift) * true
        errs.append(to_reference(t.rank, t.ts, offsets, report) - true)
    shift = np.median(errs[0])  # aligned time is rank 0's clock: one constant away from true time
    worst = max(float(np.abs(e - shift).max()) for e in errs)
    assert worst < 200_000, worst  # 0.2 ms: the anchors' own jitter (exits 0-50 us apart), not the skew


def test_detect_align_uses_drift_so_arrivals_hours_apart_keep_their_order(tmp_path):
    # Trace windows spread over 50 minutes (a window every 10 min, as `trace.interval` does) on hosts days apart
    # whose clocks drift tens of ppm: offsets alone are off by 100+ ms at the far end of the run, far more than
    # the gaps between arrivals at a collective; offsets + drift put every arrival within 0.2 ms.
    from megatronapp.scan.detect.align import row_offsets
    from megatronapp.scan.detect.analysis import detect
    from megatronapp.scan.detect.table import join
    from megatronapp.scan.synth.simulate import simulate

    res = simulate(tmp_path, 32, 2, 2, iterations=6, seed=3, clock_ppm=50.0, faults=["late-arrival=5:8"])
    off, ppm = np.array(res.offsets_ns), np.array(res.drift_ppm) * 1e-6
    traces, _ = read_dir(tmp_path)
    gap_ns = 600 * 10**9
    for t in traces:  # move iteration k 10*k minutes later in true time, read on the rank's own drifting clock
        true = (t.ts - off[t.rank]) / (1 + ppm[t.rank]) + (t.it - t.it.min()).astype(np.float64) * gap_ns
        t.ts[:] = np.round(off[t.rank] + (1 + ppm[t.rank]) * true).astype(np.int64)
    offsets, _, clock = estimate_offsets(traces)
    tb = join(traces)
    true = (tb.ts - off[tb.rank]) / (1 + ppm[tb.rank])
    coll = np.flatnonzero((tb.peer < 0) & (tb.seq >= 0) & (tb.gkey >= 0))
    inst = tb.gkey[coll].astype(np.int64) * 10**6 + tb.seq[coll]
    a, b = np.triu_indices(len(coll), 1)
    same = inst[a] == inst[b]
    a, b = coll[a[same]], coll[b[same]]
    clear = np.abs(true[a] - true[b]) > 1e6  # pairs of arrivals at one collective more than 1 ms apart
    assert clear.sum() > 100

    def misordered(clk: dict | None) -> int:
        al = tb.ts - row_offsets(tb.rank, tb.ts, offsets, clk)
        return int((np.sign(al[a] - al[b]) != np.sign(true[a] - true[b]))[clear].sum())

    assert misordered(None) > 10  # offsets only: the clocks' drift reorders arrivals
    assert misordered(clock) == 0
    # detect --align: with drift, "who everyone waits for" is the late rank (the only fault) by far; with the
    # offsets alone it was ranks of another host, charged seconds of waits that never happened.
    waited = detect(traces, offsets, clock=clock).waited_for
    assert waited[0]["rank"] == 5 and waited[0]["ms"] > 10 * waited[1]["ms"], waited
    assert detect(traces, offsets).waited_for[0]["rank"] != 5


def test_all_pairs_fitted_at_once_equal_each_pair_fitted_alone():
    # _fit_edges (every pair of ranks in one pass of sorts) replaced a Python loop over pairs calling _fit_edge:
    # same line for every pair, including pairs with start-up samples, bounds that reject the median slope (the
    # clipped case), too few samples for a slope and no bounds at all.
    from megatronapp.scan.detect.align import _fit_edge, _fit_edges

    rng = np.random.default_rng(7)
    gids, xs, ys, los, his, sus = [], [], [], [], [], []
    for e in range(40):
        n = int(rng.integers(3, 30))
        x = np.sort(rng.uniform(0, 4e9, n)) if e % 5 else rng.uniform(0, 1e6, n)  # some spans too short
        true_b = rng.uniform(-5e-5, 5e-5)
        y = 3e6 * e + true_b * x + rng.exponential(2e4, n)
        lo, hi = y - rng.uniform(0, 5e4, n), y + rng.uniform(0, 5e4, n)
        if e % 7 == 3:  # bounds that reject the median slope: the clipping search runs
            hi = y + 10.0
            lo = y - 10.0 + 1e-4 * x
        su = np.zeros(n, bool)
        su[: min(3, n)] = e % 4 == 0
        gids.append(np.full(n, e))
        xs.append(x)
        ys.append(y)
        los.append(lo)
        his.append(hi)
        sus.append(su)
    g, x, y = np.concatenate(gids), np.concatenate(xs), np.concatenate(ys)
    lo, hi, su = np.concatenate(los), np.concatenate(his), np.concatenate(sus)
    for bounded in (True, False):
        for drift in (True, False):
            a, b, mad, has = _fit_edges(g, 40, x, y, lo if bounded else None, hi if bounded else None,
                                        su if bounded else None, drift)
            for e in range(40):
                m = g == e
                ref = _fit_edge(x[m], y[m], 0, lo[m] if bounded else None,
                                hi[m] if bounded else None, su[m] if bounded else None, drift=drift)
                assert np.allclose([a[e], b[e], mad[e]], ref[:3], rtol=1e-9, atol=1e-6), (e, bounded, drift)
                assert has[e] == ref[3]


def test_handshake_reads_move_with_a_shifted_clock():
    # perturb.shift_clocks puts a rank on another host's clock (days apart, drifting); its handshake reads are
    # clock reads too. Left on the old clock they broke alignment (median residual 30 hours, now as unshifted).
    from pathlib import Path

    from megatronapp.scan.synth.perturb import shift_clocks

    real = Path(__file__).resolve().parent.parent / "benchmarks" / "data" / "scan_real_quiet" / "dp4"
    traces, _ = read_dir(real)
    _, plain, _ = estimate_offsets(traces)
    shifted = shift_clocks(traces, {1: 2.5 * 86_400, 2: -1.2 * 86_400, 3: 4 * 86_400}, {1: 30.0, 2: -25.0})
    _, moved, report = estimate_offsets(shifted)
    assert report["unaligned"] == [] and moved < 2 * plain + 100_000, (plain, moved)
