"""MegaDPP policies: completion on every shape, the memory cap from the view's own accounting (with a split
backward a microbatch's memory is held until its W), no idling while an allowed task (a W included) is ready, the
minimum-cap error, determinism, and a property test over random costs and delays."""
from __future__ import annotations

import itertools

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatronapp.dpp.policies import (
    AdaptivePolicy,
    BFSPolicy,
    DFSPolicy,
    ZBPolicy,
    default_target,
    make_policy,
    min_inflight_cap,
)
from megatronapp.dpp.simulator import SimConfig, simulate
from megatronapp.pipeline.schedules import StaticPolicy
from megatronapp.pipeline.tasks import StageView, Task

DYNAMIC = {"dfs": DFSPolicy, "bfs": BFSPolicy, "adaptive": AdaptivePolicy, "zb": ZBPolicy}


def effective_cap(policy: str, view: StageView) -> int | None:
    """The cap a policy keeps: the user's, or for dpp-zb by default interleaved 1F1B's stage-0 peak (docs)."""
    if view.max_inflight is not None or policy != "zb":
        return view.max_inflight
    first = StageView(stage=0, pp=view.pp, vpp=view.vpp, microbatches=view.microbatches)
    return max(default_target(first), min_inflight_cap(view.vpp))


def cfg_cap(policy: str, cfg: SimConfig) -> int | None:
    view = StageView(stage=0, pp=cfg.pp, vpp=cfg.vpp, microbatches=cfg.microbatches, max_inflight=cfg.max_inflight)
    return effective_cap(policy, view)


def tasks_per_step(policy: str, cfg: SimConfig) -> int:
    return (3 if policy == "zb" else 2) * cfg.pp * cfg.vpp * cfg.microbatches


class Checked:
    """Wraps a dynamic policy and asserts the rules on every decision it makes."""

    def __init__(self, inner):
        self.inner = inner
        self.name = inner.name
        self.policy = next(k for k, cls in DYNAMIC.items() if type(inner) is cls)
        self.split_backward = getattr(inner, "split_backward", False)  # the simulator runs W tasks for it
        self.decisions = 0
        self.views: list[StageView] = []

    def reset(self, view: StageView) -> None:
        self.inner.reset(view)
        self.views.append(view)

    def next_task(self, ready, view):
        cap = effective_cap(self.policy, view)
        assert cap is None or view.inflight <= cap, f"{self.name}: stage {view.stage} holds {view.inflight} > cap {cap}"
        task = self.inner.next_task(ready, view)
        allowed = [t for t in ready if self.inner.allowed(t, view)]
        if task is None:
            assert not allowed, f"{self.name}: stage {view.stage} idles with allowed ready tasks {allowed}"
        else:
            assert task in allowed, f"{self.name}: chose {task}, not allowed (cap {cap}, inflight {view.inflight})"
            if task.kind == "F" and cap is not None:
                assert view.inflight + 1 <= cap
        self.decisions += 1
        return task

    def on_done(self, task, view):
        self.inner.on_done(task, view)


def _run_checked(policy: str, cfg: SimConfig) -> tuple:
    made: list[Checked] = []

    def factory():
        made.append(Checked(DYNAMIC[policy]()))
        return made[-1]

    result = simulate(factory, cfg)
    return result, made


def test_make_policy_maps_schedules():
    for sch in ("gpipe", "1f1b", "interleaved-1f1b"):
        p = make_policy(sch)
        assert isinstance(p, StaticPolicy) and p.name == sch
    assert isinstance(make_policy("dpp", "dfs"), DFSPolicy)
    assert isinstance(make_policy("dpp", "bfs"), BFSPolicy)
    assert isinstance(make_policy("dpp"), AdaptivePolicy)
    assert isinstance(make_policy("dpp", "zb"), ZBPolicy) and make_policy("dpp", "zb").split_backward
    with pytest.raises(ValueError, match="dpp_policy='deep'"):
        make_policy("dpp", "deep")
    with pytest.raises(ValueError, match="schedule='zigzag'"):
        make_policy("zigzag")


@pytest.mark.parametrize("policy", sorted(DYNAMIC))
def test_cap_below_minimum_names_the_field_and_the_minimum(policy):
    view = StageView(stage=0, pp=4, vpp=3, microbatches=8, max_inflight=2)
    with pytest.raises(ValueError, match=r"dpp_max_inflight=2 is below the minimum 3") as e:
        DYNAMIC[policy]().reset(view)
    assert "dpp_max_inflight >= 3" in str(e.value)
    assert min_inflight_cap(3) == 3
    DYNAMIC[policy]().reset(StageView(stage=0, pp=4, vpp=3, microbatches=8, max_inflight=3))  # the minimum is fine


GRID = list(itertools.product((1, 2, 3, 4), (1, 2, 3), (1, 2, 3, 5, 8)))


@pytest.mark.parametrize("policy", sorted(DYNAMIC))
def test_every_shape_completes_within_the_cap(policy):
    for pp, vpp, m in GRID:
        for cap in (None, vpp, vpp + 1, 2 * vpp + 3):
            cfg = SimConfig(pp=pp, vpp=vpp, microbatches=m, fwd=1.0, bwd=2.0, latency=0.3, max_inflight=cap)
            result, made = _run_checked(policy, cfg)
            assert len(result.timeline) == tasks_per_step(policy, cfg)
            limit = cfg_cap(policy, cfg)
            for checked in made:
                view = checked.views[-1]
                assert view.finished() and view.inflight == 0 and view.pending_w == 0
                assert limit is None or view.peak_inflight <= limit, (pp, vpp, m, limit, view.peak_inflight)
            assert result.peak_inflight == [c.views[-1].peak_inflight for c in made]


def test_static_schedules_complete_on_the_grid():
    for pp, vpp, m in GRID:
        names = ["gpipe", "interleaved-1f1b"] + (["1f1b", "zb-h1"] if vpp == 1 else [])
        for name in names:
            r = simulate(name, SimConfig(pp=pp, vpp=vpp, microbatches=m, latency=0.1))
            kinds = 3 if name == "zb-h1" else 2
            assert len(r.timeline) == kinds * pp * vpp * m


def test_tight_cap_on_many_chunks_still_finishes():
    # the smallest cap, many chunks, heavy jitter: the case a greedy cap check deadlocks on
    for policy in DYNAMIC:
        cfg = SimConfig(pp=4, vpp=4, microbatches=16, latency=0.2, max_inflight=4, link_jitter="lognormal:1.0",
                        compute_jitter="lognormal:0.5", seed=3)
        result, _ = _run_checked(policy, cfg)
        assert max(result.peak_inflight) <= 4


def test_views_record_waiting_like_the_executor():
    result, made = _run_checked("adaptive", SimConfig(pp=4, vpp=1, microbatches=8, latency=0.5))
    last = made[-1].views[-1]
    assert last.wait_f > 0  # the last stage waits for its first forward input
    first = made[0].views[-1]
    assert first.wait_b > 0  # the first stage waits for gradients to come back
    assert result.step_time > 0


def test_policies_are_deterministic_functions_of_their_inputs():
    view = StageView(stage=1, pp=4, vpp=2, microbatches=8, max_inflight=6)
    ready = [Task("F", 0, 2), Task("F", 1, 0), Task("B", 1, 0), Task("F", 0, 3)]
    history = [Task("F", 0, 0), Task("F", 0, 1), Task("F", 1, 0)]
    for cls in DYNAMIC.values():
        picks = []
        for _ in range(2):
            p, v = cls(), StageView(**{**view.__dict__, "done": set()})
            p.reset(v)
            for t in history:
                v.inflight += 1
                v.peak_inflight = max(v.peak_inflight, v.inflight)
                v.done.add(t)
                p.on_done(t, v)
            picks.append(p.next_task(list(ready), v))
            picks.append(p.next_task(list(reversed(ready)), v))  # the order of `ready` does not matter
        assert len(set(picks)) == 1, (cls.name, picks)


def test_dfs_and_bfs_orders():
    view = StageView(stage=0, pp=4, vpp=3, microbatches=8)
    ready = [Task("F", 0, 2), Task("F", 1, 1), Task("F", 2, 0)]
    dfs, bfs = DFSPolicy(), BFSPolicy()
    dfs.reset(view), bfs.reset(view)
    assert dfs.next_task(ready, view) == Task("F", 2, 0)
    assert bfs.next_task(ready, view) == Task("F", 0, 2)
    # activations piling up: backward first
    view.inflight = default_target(view)
    ready.append(Task("B", 2, 0))
    assert dfs.next_task(ready, view) == Task("B", 2, 0)
    assert bfs.next_task(ready, view) == Task("B", 2, 0)


def test_adaptive_runs_out_of_order_when_its_plan_is_late():
    view = StageView(stage=0, pp=2, vpp=2, microbatches=4)
    p = AdaptivePolicy()
    p.reset(view)
    # interleaved 1F1B would run F1.0 next after F0.0, F0.1 (not ready yet): run the next ready one instead
    for t in (Task("F", 0, 0), Task("F", 0, 1)):
        view.inflight += 1
        view.done.add(t)
        p.on_done(t, view)
    assert p.next_task([Task("F", 0, 2)], view) == Task("F", 0, 2)
    assert p.next_task([Task("F", 0, 2), Task("F", 1, 0)], view) == Task("F", 1, 0)


def test_adaptive_matches_interleaved_without_jitter():
    for pp, vpp, m in ((4, 2, 8), (4, 2, 16), (8, 2, 32), (4, 4, 16), (8, 1, 16)):
        cfg = SimConfig(pp=pp, vpp=vpp, microbatches=m, fwd=1.0, bwd=2.0, latency=0.25)
        inter = simulate("interleaved-1f1b", cfg)
        capped = SimConfig(**{**cfg.__dict__, "max_inflight": max(inter.peak_inflight)})
        ada = simulate("dpp-adaptive", capped)
        assert ada.step_time <= 1.02 * inter.step_time, (pp, vpp, m, ada.step_time, inter.step_time)
        assert max(ada.peak_inflight) <= max(inter.peak_inflight)


JITTERS = st.sampled_from(["none", "lognormal:0.3", "lognormal:1.0", "uniform:0.5", "spike:0.1:5"])


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pp=st.integers(1, 6), vpp=st.integers(1, 3), m=st.integers(1, 10), policy=st.sampled_from(sorted(DYNAMIC)),
       fwd=st.lists(st.floats(0.05, 5.0), min_size=3, max_size=3), bwd=st.floats(0.05, 5.0),
       factors=st.lists(st.floats(0.5, 3.0), min_size=6, max_size=6), latency=st.floats(0.0, 3.0),
       cj=JITTERS, lj=JITTERS, seed=st.integers(0, 10_000), extra=st.one_of(st.none(), st.integers(0, 6)))
def test_random_costs_and_delays_never_deadlock(pp, vpp, m, policy, fwd, bwd, factors, latency, cj, lj, seed, extra):
    cap = None if extra is None else vpp + extra
    cfg = SimConfig(pp=pp, vpp=vpp, microbatches=m, fwd=fwd[:vpp], bwd=bwd, stage_factors=factors[:pp],
                    latency=latency, compute_jitter=cj, link_jitter=lj, seed=seed, max_inflight=cap,
                    bandwidth=1e3, act_bytes=100.0)
    result, made = _run_checked(policy, cfg)  # simulate raises RuntimeError on a deadlock
    assert all(c.views[-1].finished() for c in made)
    limit = cfg_cap(policy, cfg)
    assert limit is None or max(result.peak_inflight) <= limit
