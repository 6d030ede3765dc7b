"""View 1, self time: slow-compute, late-arrival and transient-pause findings of ranks against their stage peers."""
from __future__ import annotations

import math

import numpy as np

from megatronapp.scan.detect.evidence import excursion_noise
from megatronapp.scan.detect.findings import Finding, Thresholds
from megatronapp.scan.detect.fold import combine
from megatronapp.scan.detect.stats import confidence, robust_excess
from megatronapp.scan.detect.table import COMPUTE, DATA, OPT, Phases, Table, coord


def rank_findings(tb: Table, ph: Phases, th: Thresholds, warm_up: int = 0) -> list[Finding]:
    """Slow-compute, transient-pause and late-arrival findings from self time against stage peers.

    Two views: all self time (compute + data + untraced), and host time alone (data + untraced), whose jitter
    is far smaller than compute's on a busy machine, so a pause or a late arrival stands out there first.
    `warm_up`: the step the traced processes started at (0, or where a resumed run went on): a one-off there is
    start-up."""
    out = _rank_view(tb, ph, th, ph.self_time, host=False, warm_up=warm_up)
    seen = {(f.kind, f.ranks) for f in out}
    # A one-off in host time alone must also clear the jitter of the whole self time: a rank the OS took the CPU
    # from is late in everything it does, and where its compute swings by more than the host-time blip, the blip is
    # that same swing landing between spans, not a pause of its own. A healthy 3-rank Kineto job on 2 cores
    # (self time 15-33 ms an iteration, swinging +-14 ms against its peers) read +4.5 ms of untraced time in 1 of
    # 8 iterations at z 57 and confidence 0.70; its whole self time that iteration was within the run's swing.
    # Measured only against peers in the same iteration (stages of 3+ ranks): a rank's own values swing with its
    # start-up step and its own pauses (pp2dp2 runs: 100+ ms), which would hide every real pause.
    host = _rank_view(tb, ph, th, ph.data + ph.gap, host=True, warm_up=warm_up,
                      one_off_floor=_swing_against_peers(tb, th, ph.self_time))
    # The same finding in both views: the more confident leads, the other is kept as its evidence (fold.combine).
    # A rank spinning 2 x 60 ms an iteration on its input: +120 ms in 8 of 8 iterations of host time (z 86, c 1.00)
    # but in 6 of 8 of its whole self time (its peers' compute swinging by 43 ms), c 0.49: that was the one listed.
    same = [f for f in host if (f.kind, f.ranks) in seen]
    return combine(out, same) + [f for f in host if (f.kind, f.ranks) not in seen]


def _stages(tb: Table) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per rank: its stage (-1 where it has no spans), the size of that stage, and whether it has spans."""
    present = tb.present
    groups = np.where(present, tb.coords[:, 1], -1)
    sizes = np.bincount(groups[groups >= 0], minlength=int(groups.max(initial=0)) + 1)[np.maximum(groups, 0)]
    return groups, np.where(groups >= 0, sizes, 0), present


def _swing_against_peers(tb: Table, th: Thresholds, st: np.ndarray) -> float:
    """The typical upward swing of `st` against the stage peers' median in the same iteration, over the ranks of
    stages with 3+ ranks; 0 where there are none."""
    groups, sizes, present = _stages(tb)
    big = present & (sizes >= 3)
    return excursion_noise(robust_excess(st, groups, th.scale_floor)[1], big) if big.any() else 0.0


def _rank_view(tb: Table, ph: Phases, th: Thresholds, st: np.ndarray, host: bool, warm_up: int = 0,
               one_off_floor: float = 0.0) -> list[Finding]:
    groups, sizes, present = _stages(tb)
    # The run's jitter, measured on what is judged: each rank against its stage peers in the same iteration, so an
    # iteration the whole machine was slow in (every rank and its reference alike) is no noise. Only where a stage
    # has 3+ ranks: the leave-one-out reference of a pair is the other rank, the two residuals mirror each other,
    # and a paused rank's peer would look as noisy as it; there the rank's own values are used, as before.
    _, resid, _ = robust_excess(st, groups, th.scale_floor)
    noise = excursion_noise(np.where((sizes >= 3)[:, None], resid, st), present)
    # A pair's one-off is judged on the DIFFERENCE of two ranks: one's upward swing plus the other's downward
    # swing in the same iteration, two independent jitters that add in quadrature. The own-value noise above
    # holds only the upward half (CI: a healthy 2-rank FSDP run, upward jitter 4.1 ms, read +13.3 ms against
    # its peer in 2 of 8 iterations and passed the 3x bar as a pause). Persistent findings take a median over
    # most iterations, where the peer's swings cancel; they keep the plain noise.
    pair = sizes == 2
    spread = np.where(pair, math.hypot(noise, excursion_noise(-st, present)), noise)[:, None]
    one_off = np.maximum(max(th.transient_abs_ms, one_off_floor), th.transient_noise * spread)
    ref, exc, z = robust_excess(st, groups, th.scale_floor, noise / 2)
    n_it = st.shape[1]
    zmin = th.z_for(th.z, int(present.sum()) * n_it)  # every (rank, iteration) cell is one comparison
    # A one-off's size relative to the iteration's own work: in the host view the reference is the untraced time
    # alone (~0.2-2.5 ms), against which any stall is many times larger. A healthy 3-rank Kineto job read +3.4 ms
    # of untraced time in 2 of 8 iterations of a 40-120 ms step (a GC or the profiler's own work) at z 44 and
    # confidence 1.00; as a share of the rank's self time it is 3-8%, under the bar a one-off must clear.
    whole = robust_excess(ph.self_time, groups, th.scale_floor)[0] if host else ref
    with np.errstate(invalid="ignore", divide="ignore"):  # a rank with no host time: rel is inf, as meant
        rel = exc / ref
        base = (z >= zmin) & (rel >= th.rel) & (exc >= max(th.abs_ms, th.persistent_noise * noise))
        big = (z >= zmin) & (rel >= th.transient_rel) & (exc / whole >= th.transient_rel) & (exc >= one_off)
    out = []
    for r in np.flatnonzero((base | big).any(axis=1)):
        hit = np.flatnonzero(base[r])
        frac = len(hit) / n_it
        peers = np.flatnonzero((groups == groups[r]) & (np.arange(tb.world) != r))
        ev = {"peers": len(peers), "noise_ms": round(noise, 3), "view": "host" if host else "self"}
        hb = np.flatnonzero(big[r])
        calm = np.setdiff1d(np.arange(n_it), hb)
        # Pauses every other iteration reach the persistent fraction with one noisy iteration more; what tells
        # them apart is the iterations in between, which a persistent fault slows too and a pause does not.
        # Only where the calm iterations alone would not make the fault persistent: a rank slow in every iteration
        # and descheduled in one more is slow (a real 13x-slow DDP rank, +180 ms in 7 of 8 iterations and +678 ms
        # in the eighth, was reported as that one pause alone, its slowness nowhere).
        intermittent = len(hb) > 0 and len(calm) >= 2 and \
            np.nanmedian(exc[r, calm]) < np.nanmedian(exc[r, hb]) / 3 and \
            base[r, calm].sum() < th.persistent * n_it
        if frac >= th.persistent and n_it >= 1 and not intermittent:
            parts = _parts(ph, r, peers, hit)
            zr = float(np.nanmedian(z[r, hit]))
            ev.update(iterations=[int(ph.iters[i]) for i in hit], z=round(zr, 1),
                      excess_ms_by_part={k: round(v, 3) for k, v in parts.items()},
                      ops=op_excess(tb, ph, [int(r)])[int(r)])
            excess = float(np.nanmedian(exc[r, hit]))
            conf = confidence(zr, frac, zmin) * (0.85 if len(peers) == 1 else 1.0)
            if not host and parts["compute"] >= parts["data"] + parts["gap"]:
                peer_c = np.nanmedian(ph.compute[peers], axis=0)
                factor = float(np.nanmedian(ph.compute[r, hit] / peer_c[hit]))
                out.append(Finding("slow-compute", (int(r),), [coord(tb, r)], f"{factor:.2f}x compute "
                                   f"(+{excess:.1f} ms per iteration)", round(factor, 3), round(excess, 3),
                                   round(conf, 3), ev))
            else:
                factor = float(np.nanmedian(ph.self_time[r, hit] / np.nanmedian(ph.self_time[peers][:, hit], axis=0)))
                out.append(Finding("late-arrival", (int(r),), [coord(tb, r)], f"+{excess:.1f} ms per iteration "
                                   "before reaching the collectives (data / untraced time)", round(factor, 3),
                                   round(excess, 3), round(conf, 3), ev))
            continue
        if len(hb) == 1 and exc[r, hb[0]] < 2 * one_off[r, 0]:
            continue  # a one-off on a busy machine needs twice the margin of a repeated pattern
        if not len(hb):
            continue  # a small, rare excess: noise
        if len(hb) == 1 and int(ph.iters[hb[0]]) == warm_up:
            # A one-off in the processes' first step (step 0, or the step a resumed run went on from) is start-up
            # (as structure.lone_stage_pauses and the tracer's default window, which leaves step 0 out, take it):
            # communicators made on first use and allocator growth land unevenly on ranks. Healthy 8-rank runs on
            # 2 cores: +165-243 ms of compute in step 0 alone, at confidence 0.52-0.70, in 3 of 5 runs. A pause
            # that recurs is judged with step 0 in it.
            continue
        excess = float(np.nanmedian(exc[r, hb]))
        parts = _parts(ph, r, peers, hb)
        ev.update(iterations=[int(ph.iters[i]) for i in hb], z=round(float(np.nanmedian(z[r, hb])), 1),
                  excess_ms_by_part={k: round(v, 3) for k, v in parts.items()},
                  ops=op_excess(tb, ph, [int(r)])[int(r)])
        factor = float(np.nanmedian(ph.self_time[r, hb] / np.nanmedian(ph.self_time[peers][:, hb], axis=0)))
        # A single iteration on a busy machine could be the machine; a repeated one is a pattern.
        conf = confidence(float(np.nanmedian(z[r, hb])), 1.0, zmin) * (1.0 if len(hb) > 1 else 0.7)
        out.append(Finding("transient-pause", (int(r),), [coord(tb, r)],
                           f"+{excess:.1f} ms in {len(hb)} of {n_it} iterations", round(factor, 3),
                           round(excess, 3), round(conf, 3), ev))
    return out


def _parts(ph: Phases, r: int, peers: np.ndarray, cols: np.ndarray) -> dict[str, float]:
    """Mean excess of each self-time part over the peers' median, in the given iterations."""
    return {name: float(np.nanmean(arr[r, cols] - np.nanmedian(arr[peers][:, cols], axis=0)))
            for name, arr in (("compute", ph.compute), ("data", ph.data), ("gap", ph.gap))}


def op_excess(tb: Table, ph: Phases, ranks: list[int]) -> dict[int, dict[str, float]]:
    """For the given ranks: ratio of each op's mean exclusive time to the same op on stage peers (evidence)."""
    out: dict[int, dict[str, float]] = {}
    work = np.isin(tb.cat, (COMPUTE, OPT, DATA))
    for r in ranks:
        peers = np.flatnonzero(tb.coords[:, 1] == tb.coords[r, 1])
        m = work & np.isin(tb.rank, peers)
        res = {}
        for nid in np.unique(tb.name[m & (tb.rank == r)]):
            mm = m & (tb.name == nid)
            mine = ph.excl[mm & (tb.rank == r)].mean()
            per_peer = np.bincount(tb.rank[mm], ph.excl[mm], tb.world)[peers] / np.maximum(
                np.bincount(tb.rank[mm], minlength=tb.world)[peers], 1)
            res[tb.names[nid]] = round(float(mine / max(np.median(per_peer), 1.0)), 3)
        out[int(r)] = res
    return out


