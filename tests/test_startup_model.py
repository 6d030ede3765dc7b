"""Start-up model: its counts equal the store operations of a real launch, and it scales as the schemes do."""
from __future__ import annotations

import copy
from collections import Counter

import pytest

from megatronapp.parallel import startup_model as model


def test_gloo_member_rendezvous_and_round_trips():
    ops = model.rendezvous_ops("gloo", 4, 2)
    assert ops.ops == Counter(set=1, wait=4, get=4)
    assert ops.requests == 1 + 4 + 2 * 4  # a get waits for its key, then reads it
    assert ops.round_trips == 4 + 2 * 4  # a set is not answered
    assert model.rendezvous_ops("nccl", 4, 0).ops == Counter(set=1)
    assert model.rendezvous_ops("nccl", 4, 3).round_trips == 2


@pytest.mark.parametrize("layout", [(2, 2, 2), (1, 4, 2), (2, 1, 4), (4, 3, 1)])
def test_layout_groups_partition_the_world_per_kind(layout):
    tp, pp, dp = layout
    groups = model.layout_groups(tp, pp, dp)
    for kind in model.group_kinds(tp, pp, dp):
        members = [g for name, g in groups if name == kind.name]
        assert len(members) == kind.count and all(len(g) == kind.size for g in members)
        world = range(tp * pp * dp)
        if kind.name == "embd":  # first and last stages only: middle stages share no embedding
            world = [r for r in world if r // (tp * dp) in (0, pp - 1)]
        assert sorted(r for g in members for r in g) == sorted(list(world) * kind.per_rank)


def test_pipeline_links_add_four_two_rank_communicators_per_rank_at_12288():
    """The 2-rank pipeline links (issue 22) at MegaScale's scale (tp 8, pp 8, dp 192)."""
    tp, pp, dp = 8, 8, 192
    assert model.communicators_per_rank(tp, pp, dp) == {"tp": 1, "pp": 1, "dp": 1, "embd": 1, "pp.link": 4}
    links = next(k for k in model.group_kinds(tp, pp, dp) if k.name == "pp.link")
    assert (links.count, links.size, links.per_rank) == (2 * 12288, 2, 4)
    assert [len(g) for g in model.engine_groups(5, tp, pp, dp)[-4:]] == [2, 2, 2, 2]
    t = model.startup_time("ordered", "nccl", tp, pp, dp, 50e-6, 10e-6)
    assert t["world"] == 12288 and t["total_s"] < 30  # still MegaScale's "seconds", not minutes


def test_naive_store_work_is_quadratic_ordered_linear():
    def requests(scheme, dp):
        return model.startup_time(scheme, "nccl", 8, 8, dp, 50e-6, 10e-6)["server_requests"]

    assert 3.9 < requests("naive", 64) / requests("naive", 32) < 4.1
    assert 1.9 < requests("ordered", 64) / requests("ordered", 32) < 2.1
    # per rank: the naive rank takes part in every group's barrier; the ordered one only in its own groups
    assert model.rank_ops("ordered", "nccl", 5, 8, 8, 32)["groups"].total == \
        model.rank_ops("ordered", "nccl", 5, 8, 8, 64)["groups"].total


def test_time_model_is_latency_or_server_bound():
    slow_server = model.startup_time("ordered", "nccl", 8, 8, 32, 1e-6, 1e-3)
    assert slow_server["total_s"] == pytest.approx(slow_server["server_requests"] * 1e-3)
    fast_server = model.startup_time("ordered", "nccl", 1, 2, 1, 1e-3, 1e-9)
    assert fast_server["total_s"] < 0.1
    naive = model.startup_time("naive", "nccl", 8, 8, 32, 50e-6, 10e-6)
    ordered = model.startup_time("ordered", "nccl", 8, 8, 32, 50e-6, 10e-6)
    assert naive["total_s"] > 100 * ordered["total_s"]


def test_bad_scheme_or_backend_is_named():
    with pytest.raises(ValueError, match="scheme"):
        model.rank_ops("fast", "gloo", 0, 1, 2, 1)
    with pytest.raises(ValueError, match="backend"):
        model.startup_time("naive", "mpi", 1, 2, 1, 1e-5, 1e-5)


def test_measured_store_ops_equal_the_model():
    """One real launch at world 4: the engine's groups for two layouts, then the naive scheme's."""
    bench = pytest.importorskip("benchmarks.bench_startup")
    recs = bench.launch(4, [("ordered", 2, 2, 1), ("ordered", 1, 4, 1), ("naive", 1, 2, 2)])
    assert bench.check_counts(recs) == []
    assert all(sum(r["builds"][2]["ops"].values()) > sum(r["builds"][0]["ops"].values()) for r in recs)
    # the check can fail: one op more than the model on one rank is reported
    bad = copy.deepcopy(recs)
    bad[1]["builds"][0]["ops"]["get"] += 1
    assert any("rank 1 ordered" in p for p in bench.check_counts(bad))
    slow = copy.deepcopy(recs)  # a barrier that waited past torch's 10 s interval: one more add and wait
    slow[2]["builds"][2]["ops"]["add"] += 1
    slow[2]["builds"][2]["ops"]["wait"] += 1
    assert bench.check_counts(slow) == []
    slow[2]["builds"][2]["ops"]["wait"] -= 2
    assert any("rank 2 naive" in p for p in bench.check_counts(slow))
    bad = copy.deepcopy(recs)
    for r in bad:  # no rank released the naive scheme's barriers: impossible, so reported
        r["builds"][2]["ops"]["set"] = model.rank_ops("naive", "gloo", r["rank"], 1, 2, 2)["groups"].ops["set"]
    assert any("last-worker" in p for p in bench.check_counts(bad))


@pytest.mark.parametrize("scheme", model.SCHEMES)
@pytest.mark.parametrize("backend", model.BACKENDS)
@pytest.mark.parametrize("layout", [(2, 2, 2), (1, 4, 2), (2, 3, 1)])
def test_server_total_is_the_sum_over_ranks(scheme, backend, layout):
    """The aggregate model (cheap at scale) equals the per-rank model summed; one last-worker set per barrier."""
    w = layout[0] * layout[1] * layout[2]
    per_rank = [model.rank_ops(scheme, backend, r, *layout) for r in range(w)]
    total = sum(o["init"].requests + o["groups"].requests for o in per_rank)
    barriers = per_rank[0]["init"].barriers + per_rank[0]["groups"].barriers
    assert total + barriers == model.startup_time(scheme, backend, *layout, 1e-5, 1e-5)["server_requests"]
