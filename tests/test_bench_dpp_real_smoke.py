"""The real-rank MegaDPP benchmark's code path on a tiny model (2 ranks, 1 step per case): it produces finite step
times, ratios and simulator predictions for every case and schedule, and its calibration sees the injected delay.
No timing is asserted beyond that (a figure is a benchmark, never a timed test)."""
from __future__ import annotations

import math

import pytest
from benchmarks.bench_dpp_real import PAIRS, QUICK_CASES, SCHEDULES, docs_block, pair_name, run, table

from megatronapp.dpp.calibrate import StepTimings, TaskTiming, calibrate, replay


def test_quick_run_produces_numbers():
    result = run(quick=True)
    assert [r["case"] for r in result["cases"]] == list(QUICK_CASES)
    for r in result["cases"]:
        for key in ("ratio", "paired_ratio", "paired_pipeline_ratio", "predicted_ratio"):
            assert set(r[key]) == {pair_name(a, b) for a, b in PAIRS}, (r["case"], key)
            for pair, x in r[key].items():
                assert math.isfinite(x) and x > 0, (r["case"], key, pair, x)
        for s in SCHEDULES:
            assert r["median_step_s"][s] > r["median_pipeline_s"][s] > 0, (r["case"], s)
            for key in ("own_config_err", "replay_median_err", "step_err_own_config"):
                assert math.isfinite(r["sim"][s][key]), (r["case"], s, key)
            cal = r["calibration"][s]
            assert all(x > 0 for row in cal["fwd"] + cal["bwd"] for x in row)
            # the split-backward schedules reported their W spans ("weight_grad"), the others none
            assert (cal["wgrad"] is not None) == (s in ("dpp-zb", "zb-h1")), (s, cal["wgrad"])
        # the dynamic policies keep to interleaved 1F1B's memory; ZB-H1 (one chunk a stage) to 1F1B's
        peak = r["peak_activation"]
        assert peak["dpp-zb"] <= peak["interleaved-1f1b"] and peak["dpp-adaptive"] <= peak["interleaved-1f1b"]
    # slow-link 0-1 20ms: on pp=2 most sends cross the link; each sleeps 20 ms on the sender before it is issued
    # (stage 0: every forward, and the chunk-1 backward; so the median forward of stage 0 is blocked)
    slow = next(r for r in result["cases"] if r["case"].startswith("slow-link"))
    base = result["cases"][0]
    # (a lower bound, which load cannot break: a sleep is never shorter; the unslowed cases are compared with it,
    # not with a bound of their own: a loaded host lengthens every case's send issue alike)
    wire = next(r for r in result["cases"] if r["case"].startswith("slow-wire"))
    for s in SCHEDULES:
        blocked = slow["blocked_s"][s][0]["F"]
        assert blocked >= 0.02, (s, slow["blocked_s"][s])
        assert base["blocked_s"][s][0]["F"] < blocked, (s, base["blocked_s"][s], blocked)
        # a slow wire delivers late without blocking the sender, and reaches the simulator as link latency
        assert wire["blocked_s"][s][0]["F"] < blocked, (s, wire["blocked_s"][s], blocked)
    assert wire["sim_links"]["link_latency"][0] > 0 and base["sim_links"] == {}
    assert "| none |" in table(result)
    # one paired sample a pair on the quick run: degenerate intervals, but every pair has one and it renders
    for r in result["cases"]:
        assert set(r["intervals"]) == {pair_name(a, b) for a, b in PAIRS}
    assert "interval within one run (blocks: 1)" in docs_block(result)


def _two_stage_step(f: float, b: float, send_block: float) -> StepTimings:
    """A hand-made 1F1B-like step of pp=2, vpp=1, 2 microbatches, stage 0 blocked `send_block` after each F."""
    t = [TaskTiming(0, "F", 0, 0, 0.0, f, send_block), TaskTiming(0, "F", 0, 1, f + send_block, 2 * f + send_block,
                                                                   send_block),
         TaskTiming(1, "F", 0, 0, f + send_block, 2 * f + send_block, 0.0),
         TaskTiming(1, "B", 0, 0, 2 * f + send_block, 2 * f + send_block + b, 0.0)]
    t1 = 2 * f + send_block + b
    t += [TaskTiming(1, "F", 0, 1, t1, t1 + f, 0.0), TaskTiming(1, "B", 0, 1, t1 + f, t1 + f + b, 0.0),
          TaskTiming(0, "B", 0, 0, t1, t1 + b, 0.0), TaskTiming(0, "B", 0, 1, t1 + f + b, t1 + f + 2 * b, 0.0)]
    span = t1 + f + 2 * b
    return StepTimings(2, 1, 2, t, executor_s=[span, span], wait_s=[span - 2 * (f + b) - 2 * send_block,
                                                                   span - 2 * (f + b)])


def test_calibration_folds_blocked_time_into_the_sender_and_replays_exactly():
    st = _two_stage_step(1.0, 2.0, 0.5)
    assert st.overhead() == pytest.approx(0.0, abs=1e-9)
    assert st.latency(0.0) == pytest.approx(0.0, abs=1e-9)
    cal = calibrate([st])
    assert cal.fwd == [[1.5], [1.0]] and cal.bwd == [[2.0], [2.0]]
    # this hand-made step is exactly 1F1B with these costs, so the replay must reproduce its makespan
    assert replay("1f1b", st, cal.overhead, cal.latency).step_time == pytest.approx(st.makespan())
    cfg = cal.sim_config()
    assert cfg.stage_factors[0] > cfg.stage_factors[1]  # the blocked sender is the slower stage
    with pytest.raises(ValueError, match="stage 0 reported 3 distinct tasks, expected 4"):
        StepTimings(2, 1, 2, st.tasks[:-1], st.executor_s, st.wait_s).validate()  # lost B0.1
