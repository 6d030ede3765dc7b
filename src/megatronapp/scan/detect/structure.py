"""Evidence from the wait structure: lone pipeline stages, and links inside collective groups.

Lone stages. A stage with a single rank (dp = tp = 1) has no peer doing the same work, so the self-time views
cannot judge it. The wait structure can: in a pipeline every stage waits for the slowest one, and the slowest
one waits for nobody beyond the pipeline's fill. A rank is the bottleneck when, in most iterations, (a) its own
work exceeds the other stages' by a real margin and (b) the other stages wait for it: their waiting exceeds
its own by at least half that margin. Stages may legitimately differ (embedding on the first, LM head and loss
on the last): when the trace headers carry `stage_work` (the expected cost of each stage relative to the
others, from a cost model or a measured healthy run), compute is divided by it first, so only work beyond what
the stage is expected to cost counts, and the comparison stays within the same kind of work.

Links inside collectives. A link that delays every collective two ranks share (a slow cable, a flaky NIC
between two data-parallel peers) stalls both of its ends before they post those collectives, and no other
member; the same collective of the other groups of that kind stalls nobody. Per (group kind, sequence number)
the posting stall of each member is compared with the same position's members in the other groups and with the
other members of its own group; when exactly two members of a group stall consistently, the link is named by
those two ranks, not by the group.
"""
from __future__ import annotations

import numpy as np

from megatronapp.scan.detect.evidence import excursion_noise, group_quantile
from megatronapp.scan.detect.findings import Finding, Thresholds
from megatronapp.scan.detect.table import Phases, Table, Waits, coord
from megatronapp.scan.read.format import CAT_INDEX

MS = 1e6
_COMM = CAT_INDEX["comm"]


def lone_stage_findings(tb: Table, ph: Phases, waits: Waits, th: Thresholds,
                        stage_work: dict[int, float] | None = None) -> list[Finding]:
    """Bottleneck ranks of stages without a peer, named through who waits for whom."""
    stage = tb.coords[:, 1]
    present = tb.present
    sizes = np.bincount(stage[present], minlength=int(stage.max()) + 1)
    lone = [int(r) for r in np.flatnonzero(present) if sizes[stage[r]] == 1]
    if not lone or present.sum() < 3:
        return []  # two ranks: each is the other's only reference, the structure cannot break the tie
    work = np.array([(stage_work or {}).get(int(s), 1.0) for s in stage], float)
    comp = ph.self_time / work[:, None]
    waited = waits.waited
    n_it = comp.shape[1]
    noise = excursion_noise(comp, present)
    out = []
    for r in lone:
        others = np.flatnonzero(present & (np.arange(tb.world) != r))
        with np.errstate(all="ignore"):
            ref = np.nanmedian(comp[others], axis=0)
            exc = comp[r] - ref
            # What the others waited beyond the rank itself: the part of their time the bottleneck costs them.
            held = np.nanmedian(waited[others], axis=0) - waited[r]
        need = np.maximum(np.maximum(th.rel * ref, th.abs_ms), th.persistent_noise * noise)
        hit = (exc >= need) & (held >= 0.5 * exc)
        frac = float(hit.mean()) if n_it else 0.0
        if frac < th.persistent or not hit.any():
            continue
        excess = float(np.nanmedian(exc[hit]))
        factor = float(np.nanmedian(comp[r, hit] / ref[hit]))
        margin = float(np.nanmedian(exc[hit] / need[hit]))
        conf = round(min(1.0, 0.5 + (margin - 1) / 4) * frac * 0.85, 3)  # no peer: weaker than a peer comparison
        ev = {"method": "wait structure", "peers": 0, "iterations": [int(ph.iters[i]) for i in np.flatnonzero(hit)],
              "others_waited_beyond_it_ms": round(float(np.nanmedian(held[hit])), 3),
              "reference": "median of the other stages" + (" (normalised by stage_work)" if stage_work else ""),
              "noise_ms": round(noise, 3)}
        out.append(Finding("slow-compute", (r,), [coord(tb, r)],
                           f"{factor:.2f}x the other stages' work, which wait for it (+{excess:.1f} ms per "
                           "iteration)", round(factor, 3), round(excess, 3), conf, ev))
    return out


def lone_stage_pauses(tb: Table, ph: Phases, th: Thresholds, warm_up: int = 0) -> list[Finding]:
    """Transient pauses of ranks alone in their stage (a pure pipeline), against the other lone stages.

    Stages differ in work (embedding, LM head), so each rank's per-iteration self time is divided by its own
    calm level (the lower quartile of its iterations: calm even when every other iteration is paused) and the
    ratios are compared per iteration with the other lone stages' (leave-one-out median): an iteration the whole
    pipeline was slow in (the first, a busy moment of the host) moves every ratio alike. What remains in ms must
    clear the run's own upward jitter of that residual (transient_noise times it), as a peer comparison must.
    Persistent differences are not judged here: a ratio to the rank's own calm level cannot show them (the
    floors and the wait structure do)."""
    stage = tb.coords[:, 1]
    present = tb.present
    sizes = np.bincount(stage[present], minlength=int(stage.max()) + 1)
    lone = np.array([r for r in np.flatnonzero(present) if sizes[stage[r]] == 1], np.int64)
    n_it = ph.self_time.shape[1]
    if len(lone) < 3 or n_it < 4:
        return []  # two lone stages: each is the other's only reference; few iterations: no calm level
    st = ph.self_time[lone]
    with np.errstate(all="ignore"):
        calm = np.nanquantile(st, 0.25, axis=1)
        x = st / calm[:, None]
        ref = np.stack([np.nanmedian(np.delete(x, i, axis=0), axis=0) for i in range(len(lone))])
        exc = (x - ref) * calm[:, None]  # ms beyond what the other stages' swing says this iteration costs
    noise = excursion_noise(exc, np.ones(len(lone), bool))
    need = max(th.transient_abs_ms, th.transient_noise * noise)
    with np.errstate(invalid="ignore"):
        big = (exc >= need) & (x - ref >= th.transient_rel)
    out = []
    for i, r in enumerate(lone):
        hb = np.flatnonzero(big[i])
        if not len(hb) or len(hb) / n_it >= th.persistent:
            continue
        if len(hb) == 1 and exc[i, hb[0]] < 2 * need:
            continue  # a one-off on a busy machine needs twice the margin of a repeated pattern
        if len(hb) == 1 and int(ph.iters[hb[0]]) == warm_up:
            # A one-off in the processes' first step (warm_up: 0, or where a resumed run went on) is start-up:
            # one-time costs (communicators made on first use, allocator growth, lazy imports) land unevenly on
            # stages (healthy real pp4 runs: +61-77 ms in step 0 while others waited 0-5.5 ms for it). A pause
            # that recurs is still judged with step 0 in it.
            continue
        excess = float(np.nanmedian(exc[i, hb]))
        margin = excess / need
        conf = round(min(1.0, 0.5 + (margin - 1) / 4) * (1.0 if len(hb) > 1 else 0.7) * 0.85, 3)
        ev = {"method": "lone stages against each other", "peers": 0, "view": "self",
              "iterations": [int(ph.iters[k]) for k in hb], "calm_ms": round(float(calm[i]), 3),
              "noise_ms": round(noise, 3), "reference": "other lone stages' swing in the same iteration"}
        factor = float(np.nanmedian(x[i, hb] / ref[i, hb]))
        out.append(Finding("transient-pause", (int(r),), [coord(tb, int(r))],
                           f"+{excess:.1f} ms in {len(hb)} of {n_it} iterations", round(factor, 3),
                           round(excess, 3), conf, ev))
    return out


def collective_stall_findings(tb: Table, stall: np.ndarray, iters: np.ndarray, th: Thresholds) -> list[Finding]:
    """Slow links inside collective groups: the two members that stall before posting the group's collectives."""
    coll = np.flatnonzero((tb.cat == _COMM) & (tb.peer < 0) & (tb.gkey >= 0) & (tb.seq >= 0)
                          & np.isin(tb.it, iters))
    if not len(coll):
        return []
    # The same collective elsewhere: a group of the same name and size on the same pipeline stage (stages do
    # different work: the n-th TP all-reduce of the first stage is not the n-th of the last), same op and
    # sequence number. Its lower quartile is the healthy posting delay: stalls are one-sided, and the two ends
    # of a slow link must not lift their own reference.
    names: dict[tuple, int] = {}
    kind = np.array([names.setdefault((g, len(r), int(tb.coords[min(r), 1]) if r else -1), len(names))
                     for g, r in tb.groups] + [-1], np.int64)
    v = stall[coll].astype(float) / MS
    k = kind[tb.gkey[coll]]
    S, N = int(tb.seq[coll].max()) + 1, len(tb.names) + 1
    inst = (k * S + tb.seq[coll]) * N + tb.name[coll]
    ui, base, _ = group_quantile(inst, v, 0.25)
    excess = v - base[np.searchsorted(ui, inst)]
    # A member of one group, per kind of op it posts there (name and size): a link may delay only some of the
    # group's ops visibly (another op's wait can hide the stall), and each kind must be consistent on its own.
    size_id = np.unique(tb.nbytes[coll], return_inverse=True)[1].ravel()
    op_kind = tb.name[coll] * (int(size_id.max()) + 1) + size_id
    unit = (tb.gkey[coll] * (int(op_kind.max()) + 1) + op_kind) * tb.world + tb.rank[coll]
    uu, med, n = group_quantile(unit, excess, 0.5)
    frac = np.bincount(np.searchsorted(uu, unit), excess >= th.stall_abs_ms, len(uu)) / n
    flagged = (med >= th.stall_abs_ms) & (frac >= th.persistent) & (n >= 2)
    by_group: dict[int, list[int]] = {}
    for j in np.flatnonzero(flagged):
        by_group.setdefault(int(uu[j] // tb.world), []).append(j)
    out = []
    seen: set[tuple[int, int, int]] = set()
    for gk, js in by_group.items():
        g = gk // (int(op_kind.max()) + 1)
        size = len(tb.groups[g][1])
        if len(js) != 2 or size < 2:
            continue  # one member: its own problem (self-time views); three or more: not one link
        a, b = sorted(int(uu[j] % tb.world) for j in js)
        if (g, a, b) in seen:
            continue
        seen.add((g, a, b))
        ex = float(np.mean([med[j] for j in js]))
        conf = round(min(1.0, 0.5 + (ex - th.stall_abs_ms) / (8 * th.stall_abs_ms)) * min(frac[j] for j in js), 3)
        gname = tb.groups[g][0]
        ev = {"what": "collective", "method": "collective stalls", "group": gname, "group_size": size,
              "transfers": int(sum(n[j] for j in js)), "median_ms": round(ex + th.stall_floor_ms, 4),
              "peer_median_ms": th.stall_floor_ms,
              "stall_ms_per_iteration": {r: round(_stall_per_iteration(tb, coll, ex, g, r), 3) for r in (a, b)}}
        out.append(Finding("slow-link", (a, b), [coord(tb, a), coord(tb, b)],
                           f"+{ex:.1f} ms stalled before each {gname} collective on link {a}-{b} (both ends, no "
                           f"other member of the {size}-rank group)", round((ex + th.stall_floor_ms)
                                                                             / th.stall_floor_ms, 3),
                           round(ex, 3), conf, ev))
    return out


def _stall_per_iteration(tb: Table, coll: np.ndarray, ex: float, g: int, r: int) -> float:
    """What a link end loses in one iteration: the stall seen per collective times the group's collectives it
    posts per iteration (median). The link delays every one of them, also those posted inside a compute span
    (a gradient all-reduce issued from backward), whose stall shows as compute rather than a posting stall."""
    m = (tb.gkey[coll] == g) & (tb.rank[coll] == r)
    if not m.any():
        return 0.0
    _, per_it = np.unique(tb.it[coll][m], return_counts=True)
    return ex * float(np.median(per_it))
