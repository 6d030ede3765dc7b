"""benchmarks/bench_recovery --emulated without a job: the draws, the summaries, the claims against the issue's
targets and the docs tables, from synthetic drills. No timing is asserted; the drills themselves run in the
benchmark (they launch 8-17 processes)."""
from __future__ import annotations

import json
import random
import threading
import time

import pytest
from benchmarks import recovery_emulated as emu
from benchmarks import recovery_inplace, recovery_overhead, recovery_scale, recovery_zero


def _inplace(kind: str, total: float, victim: int = 3, named: int = 3, replayed: int = 0) -> dict:
    parts = {k: total * (i + 1) / len(recovery_inplace.PARTS) for i, k in enumerate(recovery_inplace.PARTS)}
    return {"kind": kind, "victim": victim, "step": 3, "delay_s": 0.5, **parts, "total": total,
            "replayed_steps": replayed, "step_time_s": 1.5, "phase_at_fault": "step 4", "named_rank": named,
            "failures": 1, "restarts": 0, "source": "peer", "host_share": 0.05, "load_avg": 2.0}


def _restart(total: float) -> dict:
    parts = {k: total / len(emu.PARTS) for k in emu.PARTS}
    return {"kind": "kill", "victim": 3, "step": 3, "delay_s": 0.5, **parts, "total": total, "replayed_steps": 1,
            "step_time_s": 1.5, "named_rank": 3, "host_share": 0.04, "load_avg": 2.5}


def test_draws_are_seeded_and_inside_their_ranges():
    a = [emu.draw(random.Random(7), k, 8) for k in ("kill", "stop", "hang")]
    assert a == [emu.draw(random.Random(7), k, 8) for k in ("kill", "stop", "hang")]
    rng = random.Random(1)
    for _ in range(200):
        f = emu.draw(rng, "kill", 16)
        assert 0 <= f["victim"] < 16 and emu.DRAWN_STEPS[0] <= f["step"] <= emu.DRAWN_STEPS[1]
        assert 0.0 <= f["delay_s"] <= emu.MAX_DELAY_S
        assert f["step"] + 3 <= emu.STEPS  # room left to recover and commit before the job ends
    hang = emu.draw(rng, "hang", 8, 2.5)
    assert hang["delay_s"] == 0.0 and hang["hang_timeout_s"] == 2.5


def test_every_layout_keeps_a_dp_peer_and_the_same_work_per_rank():
    for world, (tp, pp, dp) in emu.LAYOUTS.items():
        f = emu.flags(world)
        assert tp * pp * dp == world and dp >= 2
        assert f[f.index("--nproc") + 1] == str(world) and f[f.index("--global-batch") + 1] == str(2 * dp)
        tflops = float(f[f.index("--emulate-device") + 1].split("=")[1])
        assert abs(tflops * tp - 2e-5) < 1e-12


def test_invalid_drills_stay_out_of_the_medians_and_steps_again_are_claimed():
    good = [_inplace("kill", t) for t in (2.0, 2.4, 2.6)]
    misnamed = _inplace("kill", 99.0, named=1)
    failed = {"kind": "kill", "victim": 2, "step": 3, "delay_s": 0.1, "error": "RuntimeError: boom"}
    s = emu.summarize([*good, misnamed, failed], recovery_inplace.PARTS)
    assert s["total"]["median_s"] == 2.4 and s["total"]["n"] == 3
    res = {"inplace_summary": s, "stop_summary": emu.summarize([_inplace("stop", 3.5)], recovery_inplace.PARTS),
           "hang_summary": emu.summarize([_inplace("hang", 6.0)], recovery_inplace.PARTS),
           "inplace_drills": [*good, misnamed, failed], "stop_drills": [_inplace("stop", 3.5)],
           "hang_drills": [_inplace("hang", 6.0)]}
    c = emu.claims(res)
    assert c["kill"]["claim"] == "met" and c["stop"]["claim"] == "met" and c["hang"]["claim"] == "missed"
    assert c["steps_again"] == {"values": [0], "claim": "met"}
    res["hang_drills"] = [_inplace("hang", 6.0, replayed=2)]
    assert emu.claims(res)["steps_again"]["claim"] == "missed"


def test_the_docs_block_renders_every_kind_and_the_restart_table():
    kills, stops, hangs = ([_inplace(k, t) for t in ts] for k, ts in
                           (("kill", (2.0, 2.5)), ("stop", (3.4, 3.6)), ("hang", (5.5, 6.1))))
    restarts = [_restart(9.5), _restart(10.5)]
    res = {"spec": emu.SPEC, "seed": 41, "drawn_steps": list(emu.DRAWN_STEPS), "max_delay_s": emu.MAX_DELAY_S,
           "hang_timeout_s": 3.0, "drills": restarts, "summary": emu.summarize(restarts, emu.PARTS),
           "inplace_drills": kills, "inplace_summary": emu.summarize(kills, recovery_inplace.PARTS),
           "stop_drills": stops, "stop_summary": emu.summarize(stops, recovery_inplace.PARTS),
           "hang_drills": hangs, "hang_summary": emu.summarize(hangs, recovery_inplace.PARTS),
           "wall_s": 100.0, "timestamp": "2026-12-07T11:00:00+0000"}
    res["claims"] = emu.claims(res)
    body = emu.docs_body(json.loads(json.dumps(res)))  # as read back from the stored JSON
    assert "| first commit | 2.25 [" in body and "hang (timeout 3 s)" in body and "| restart |" in body
    assert "kill -9: 2.25 s" in body and "**missed**" in body  # the hang against 5 s
    assert "Failed drills (not recovered, or another rank named first; recorded with their reason): 0" in body


def test_flatness_is_the_largest_over_the_smallest_median():
    drills = {4: [_inplace("kill", t) for t in (2.0, 2.1, 2.2)], 8: [_inplace("kill", t) for t in (2.4, 2.5, 2.6)],
              16: [_inplace("kill", t) for t in (3.0, 3.1, 3.2)]}
    f = recovery_scale.flatness(drills)
    assert abs(f["ratio"] - 3.1 / 2.1) < 1e-9 and f["ci95"][0] <= f["ratio"] <= f["ci95"][1]
    assert f["claim"] == "missed"  # 1.48 wholly above 1.30
    drills[16] = [_inplace("kill", t) for t in (2.2, 2.3, 2.4)]
    assert recovery_scale.flatness(drills)["claim"] == "met"
    res = {"layouts": {str(w): emu.LAYOUTS[w] for w in drills}, "seed": 41,
           "drills": {str(w): d for w, d in drills.items()},
           "summary": {str(w): {**emu.summarize(d, recovery_inplace.PARTS), "host_share": 0.1}
                       for w, d in drills.items()},
           "flatness": recovery_scale.flatness(drills), "wall_s": 60.0, "timestamp": "t"}
    body = recovery_scale.docs_body(res)
    assert "| 16 (tp2 x pp2 x dp4) | 3/3 |" in body and "**met**" in body


def test_the_overhead_block_states_ratio_difference_and_claim():
    pairs = [{"plain": {"step_time_s": 1.50, "host_share": 0.05, "load_avg": 2.0},
              "inplace": {"step_time_s": 1.51, "host_share": 0.05, "load_avg": 2.0}} for _ in range(3)]
    from benchmarks import stats

    ratios = [p["inplace"]["step_time_s"] / p["plain"]["step_time_s"] for p in pairs]
    s = stats.summarize_ratios(ratios)
    res = {"ratio": s, "pairs": pairs, "difference_ms": {"median": 10.0, "ci95": [10.0, 10.0]},
           "plain_step_s": 1.5, "claim": stats.claim(*s["ci95"], recovery_overhead.TARGET), "timestamp": "t"}
    body = recovery_overhead.docs_body(res)
    assert "**1.0067**" in body and "10.0 ms" in body and "**met**" in body


def test_the_zero_block_states_the_copys_share_the_paired_ratio_and_each_sides_recovery():
    from benchmarks import stats

    s = stats.summarize_ratios([1.01, 1.0, 1.02])
    pairs = [{side: {"wall_per_step_s": 2.0, "step_time_s": 1.9, "load_avg": 3.0} for side in recovery_zero.SIDES}] * 3
    buddy = [{**_inplace("kill", t), "source": "peer+buddy"} for t in (2.4, 2.5)]
    disk = [{**_inplace("kill", t, replayed=1), "source": "disk"} for t in (4.0, 4.4)]
    res = {"copy": {"copy_ms_per_rank": [2.0, 4.5], "copy_ms_max": 4.5, "step_s": 1.92, "steps": 6,
                    "share_worst_rank": {"median": 0.0024, "max": 0.003}, "slice_bytes": [134044, 166300],
                    "timestamp": "t1"},
           "overhead": {"ratio": s, "pairs": pairs, "difference_ms": {"median": 20.0, "ci95": [0.0, 40.0]},
                        "nobuddy_wall_per_step_s": 2.0, "claim": stats.claim(*s["ci95"], recovery_zero.TARGET)},
           "drills": {"seed": 41, "drills": {"buddy": buddy, "nobuddy": disk},
                      "summary": {"buddy": {"total": emu.median_ci([2.4, 2.5]), "sources": ["peer+buddy"],
                                            "replayed_steps": [0, 0], "valid": 2, "drills": 2},
                                  "nobuddy": {"total": emu.median_ci([4.0, 4.4]), "sources": ["disk"],
                                              "replayed_steps": [1, 1], "valid": 2, "drills": 2}}},
           "timestamp": "t0"}
    body = recovery_zero.docs_body(res)
    assert "**2.0-4.5 ms**" in body and "**0.24%**" in body and "130-162 KiB" in body
    assert f"**{s['ratio']:.4f}**" in body and "20.0 ms" in body and "up to 0.0% at load 3.0-3.0" in body
    assert "**2.45 s**" in body and "from peer+buddy" in body and "**4.20 s**" in body and "from disk" in body
    assert "Recorded t0, t1" in body


def test_run_stats_counts_replays_and_takes_the_steady_state(tmp_path):
    recs = [{"step": s, "step_time": t} for s, t in ((1, 9.0), (2, 5.0), (3, 1.0), (4, 1.2), (5, 1.1))]
    recs.append({"step": 5, "step_time": 7.0, "replayed": True})
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    assert recovery_inplace.run_stats(tmp_path) == {"replayed_steps": 1, "step_time_s": 1.1}


class _Running:
    """A job that never ends by itself (the drill's view of a Popen)."""

    log = None

    def poll(self):
        return None


def _beat(hb, rank: int, **fields) -> None:
    (hb / f"rank{rank}.json").write_text(json.dumps({"rank": rank, "time": 0.0, **fields}))


def test_a_kill_strikes_after_every_rank_finished_the_drawn_step_and_the_delay(tmp_path, monkeypatch):
    sent = []
    monkeypatch.setattr(recovery_inplace.os, "kill", lambda pid, sig: sent.append((pid, sig)))
    for r in range(4):
        _beat(tmp_path, r, pid=100 + r, step=3 if r else 2, phase="step 4")
    fault = {"kind": "stop", "victim": 2, "step": 3, "delay_s": 0.05}
    threading.Timer(0.2, _beat, (tmp_path, 0), {"pid": 100, "step": 3, "phase": "after step"}).start()
    t0 = time.time()
    struck, phase, pid = recovery_inplace._strike(_Running(), tmp_path, 4, fault, t0 + 30)
    assert struck - t0 >= 0.2 + 0.05 - 0.03  # not before rank 0 finished step 3, then the delay
    assert sent == [(102, recovery_inplace.signal.SIGSTOP)] and pid == 102 and phase == "step 4"


def test_a_hang_is_timed_from_the_hung_ranks_last_phase_change(tmp_path, monkeypatch):
    monkeypatch.setattr(recovery_inplace.os, "kill", lambda *a: pytest.fail("a hang sends no signal"))
    # what the drill reads at each look (scripted, not timed: a loaded host must not skip one): the rank's beat of
    # step 3; the hung process beating on in step 4; its newcomer (another pid) taking the file over
    looks = iter([{1: {"pid": 7, "step": 2, "phase": "step 3", "phase_since": 50.0}},
                  {1: {"pid": 7, "step": 3, "phase": "step 4", "phase_since": 60.0}},
                  {1: {"pid": 7, "step": 3, "phase": "step 4", "phase_since": 60.0}},
                  {1: {"pid": 9, "step": -1, "phase": "start-up: spawn", "phase_since": 70.0}}])
    monkeypatch.setattr(recovery_inplace, "beats", lambda _hb: next(looks))
    fault = {"kind": "hang", "victim": 1, "step": 3, "delay_s": 0.0, "hang_timeout_s": 3.0}
    assert recovery_inplace._strike(_Running(), tmp_path, 2, fault, time.time() + 30) == \
        (60.0, "step 4", 7)
