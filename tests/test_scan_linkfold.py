"""Slow links and the findings they explain (scan/detect/linkfold.py), and the direction of a wrap-around transfer
(links._activation_links): each rule on stored real recordings (benchmarks/data), re-timed where a fault is needed
(scan/synth/perturb.py), or on a hand-made table. No process launch: each test takes about a second."""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np

from megatronapp.scan.detect.analysis import analyse
from megatronapp.scan.detect.evidence import posting_stall
from megatronapp.scan.detect.findings import Finding
from megatronapp.scan.detect.linkfold import ends_explained_by_link_cost, link_end_costs, links_behind_slow_groups
from megatronapp.scan.detect.links import _activation_links
from megatronapp.scan.detect.table import join
from megatronapp.scan.read.format import CAT_INDEX, read_dir
from megatronapp.scan.synth.perturb import Perturbation, perturb

DATA = Path(__file__).resolve().parent.parent / "benchmarks" / "data"


def _traces(recording: str, layout: str):
    traces, problems = read_dir(DATA / recording / layout)
    assert problems == [] and traces
    return traces


def _finding(kind: str, ranks: tuple[int, ...], excess: float, **evidence) -> Finding:
    return Finding(kind, ranks, [], "", 1.0, excess, 0.9, dict(evidence))


def test_a_link_ends_stalls_fold_its_ends_late_arrivals_into_it():
    """pp2dp2 (rank = dp + 2 * pp): link 0-2 joins stages 0 and 1 of column 0. Every send between its ends is
    posted 20 ms late (a slow link's stall); the cost per end is measured against the end's own other posts."""
    tb = join(_traces("scan_real_quiet", "pp2dp2"))
    iters = np.unique(tb.it[tb.cat == CAT_INDEX["step"]])
    send, coll = posting_stall(tb), posting_stall(tb, comm_ends=True)
    nid = {n: i for i, n in enumerate(tb.names)}
    on_link = (tb.cat == CAT_INDEX["comm"]) & (tb.name == nid["send"]) & (
        ((tb.rank == 0) & (tb.peer == 2)) | ((tb.rank == 2) & (tb.peer == 0)))
    sends_per_it = on_link[(tb.rank == 2) & np.isin(tb.it, iters)].sum() / len(iters)
    assert sends_per_it >= 4  # 4 microbatches: activations up from 0, gradients down from 2
    healthy = link_end_costs(tb, send, coll, iters, 0, 2)
    send = send + np.where(on_link, 20_000_000, 0)
    cost = link_end_costs(tb, send, coll, iters, 0, 2)
    for r in (0, 2):
        assert abs(cost[r] - healthy[r] - 20 * sends_per_it) < 0.5 * 20 * sends_per_it, (cost, healthy)
    link = _finding("slow-link", (0, 2), 20.0, method="send stalls")
    explained = _finding("late-arrival", (2,), cost[2])  # within what the link costs rank 2
    too_big = _finding("transient-pause", (0,), 3 * cost[0])  # more than the link can cost rank 0: its own
    floors = _finding("slow-compute", (2,), 1.0, method="op floors")  # compute spans: no stall enters them
    lone = _finding("slow-compute", (0,), cost[0], method="wait structure")  # a lone stage's self time does
    bystander = _finding("late-arrival", (1,), 1.0)  # not an end of the link
    kept = ends_explained_by_link_cost([link, explained, too_big, floors, lone, bystander], tb, send, coll, iters)
    assert kept == [link, too_big, floors, bystander]
    assert [(e["kind"], e["ranks"]) for e in link.evidence["explains"]] == [("late-arrival", [2]),
                                                                             ("slow-compute", [0])]
    assert link.evidence["cost_ms_per_iteration"] == cost
    # Without the stall the same findings stay: nothing the link costs explains them.
    link2 = _finding("slow-link", (0, 2), 20.0, method="send stalls")
    late = _finding("late-arrival", (2,), 10.0)
    tb_send = posting_stall(tb)
    assert ends_explained_by_link_cost([link2, late], tb, tb_send, coll, iters) == [link2, late]


def test_a_link_the_ends_cpu_waits_can_explain_ranks_after_the_causes():
    """The stored loaded recording (10 CPU spinners beside 4 ranks on 2 cores): before rank 0's hang, transfers
    0-2 read 11x their peers' fastest (+9 ms) while both ends waited 12-14 ms for a CPU per work span. It stays
    in the list, under confidence 0.5 and after the hang, and the report says why."""
    rep = analyse(perturb(_traces("scan_real_loaded", "pp2dp2"),
                          [Perturbation("hang", (0,), at_iteration=4)])).report
    assert rep.findings[0].kind == "hang" and rep.findings[0].ranks == (0,)
    # Listed after the causes below 0.5, or (4 finished iterations: fold_kinds.beside_a_short_hang) kept in the
    # hang's evidence; either way with the CPU waits that can explain it.
    links = [(f.confidence, f.excess_ms, f.evidence) for f in rep.findings if f.kind == "slow-link"] + \
        [(x["confidence"], None, x) for x in rep.findings[0].evidence.get("beside_the_hang", [])
         if x["kind"] == "slow-link"]
    assert links and all(c < 0.5 and "cpu_wait_ms_per_span" in ev for c, _, ev in links), links
    assert all(ev["cpu_wait_ms_per_span"] >= ms for _, ms, ev in links if ms is not None)
    assert any("waited for a CPU per work span" in n for n in rep.notes), rep.notes
    # A real +10 ms link on the quiet recording of the same layout: ends off the CPU less than half the time.
    rep = analyse(perturb(_traces("scan_real_quiet", "pp2dp2"), [Perturbation("slow-link", (0, 2), ms=10)])).report
    top = rep.findings[0]
    assert top.kind == "slow-link" and set(top.ranks) == {0, 2} and top.confidence >= 0.5
    assert "cpu_wait_ms_per_span" not in top.evidence


def test_a_wrap_around_link_carries_activations_by_its_channel_name():
    """pp 4, vpp 2: stage 3 sends the boundary of chunk 0 to stage 0 (activations, against the stage order), and
    stage 0 sends its gradients back. The channel names decide; unnamed channels fall back to the stage order."""
    groups = [("pp.act.up", (0, 1)), ("pp.grad.down", (0, 1)), ("pp.act.down", (0, 3)), ("pp.grad.up", (0, 3)),
              ("user", (2, 3))]
    # transfers (sender, receiver, group index)
    rows = [(0, 1, 0), (0, 1, 0), (1, 0, 1), (3, 0, 2), (3, 0, 2), (0, 3, 3), (2, 3, 4), (3, 2, 4)]
    src = np.array([r[0] for r in rows])
    tb = SimpleNamespace(world=4, coords=np.array([[0, s, 0] for s in range(4)]), groups=groups,
                         gkey=np.array([r[2] for r in rows]), rank=src)
    pair = src * 4 + np.array([r[1] for r in rows])
    uu, ui = np.unique(pair, return_inverse=True)
    act = dict(zip(((int(p) // 4, int(p) % 4) for p in uu), _activation_links(tb, np.arange(len(rows)), uu, ui)))
    assert act == {(0, 1): True, (1, 0): False, (3, 0): True, (0, 3): False, (2, 3): True, (3, 2): False}


def test_a_collective_one_step_from_a_slow_rank_folds_into_it():
    """tp2pp2dp2: slow rank 5's DP pair 5-7 is already its evidence (fold.links_of_slow_ranks); the tied-embedding
    pair 3-7 is slow through rank 7 and folds too. A collective link of ranks no slowed group holds, and a link
    found by the stalls of its ends, stay."""
    slow = _finding("slow-compute", (5,), 150.0, method="op floors",
                    links_also_slow=[{"kind": "slow-link", "ranks": [5, 7], "what": "collective"}])
    behind = _finding("slow-link", (3, 7), 4.8, what="collective")
    elsewhere = _finding("slow-link", (0, 2), 4.8, what="collective")
    stalled = _finding("slow-link", (3, 7), 20.0, what="collective", method="collective stalls")
    p2p = _finding("slow-link", (6, 7), 4.8, what="P2P")
    kept = links_behind_slow_groups([slow, behind, elsewhere, stalled, p2p])
    assert kept == [slow, elsewhere, stalled, p2p]
    assert slow.evidence["links_also_slow"][-1]["ranks"] == [3, 7] and behind.evidence["via_rank"] == 7
