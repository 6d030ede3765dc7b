"""`megatronapp diagnose`: on real ranks an injected slow link is the P2P latency outlier and every memory check
passes; the outlier statistics name a slow rank (not its healthy peers) from per-rank results."""
from __future__ import annotations

import json

import pytest

from megatronapp.cli import main
from megatronapp.resilience.diagnose import analyse, report


def test_diagnose_names_the_injected_slow_link_on_real_ranks(tmp_path, capsys):
    out = tmp_path / "diag.json"
    code = main(["diagnose", "--nproc", "3", "--inject", "slow-link=0-1:20", "--json", str(out)])
    assert code == 0
    result = json.loads(out.read_text())
    assert [o["who"] for o in result["p2p_latency"]] == ["0-1"]
    assert result["memory_errors"] == [] and len(result["raw"]) == 3
    assert all(r["gemm_tflops"] > 0 and r["groups"] for r in result["raw"])
    assert "link 0-1: P2P latency" in capsys.readouterr().out


def _rank(r: int, tflops: float, mem_ok: bool = True) -> dict:
    return {"rank": r, "label": f"DP{r}-PP0-TP0", "gemm_tflops": tflops, "memory": {"gib_s": 5.0, "ok": mem_ok},
            "pairs": {}, "groups": {}}


def test_outlier_statistics_name_the_slow_rank_only():
    results = [_rank(0, 1.00), _rank(1, 1.08), _rank(2, 0.25), _rank(3, 0.95, mem_ok=False)]
    a = analyse(results)
    assert [o["who"] for o in a["gemm"]] == [2] and a["memory_errors"] == [3]
    text = report(a)
    assert "rank 2 (DP2-PP0-TP0): GEMM" in text and "rank 3 (DP3-PP0-TP0): memory check FAILED" in text
    assert analyse([_rank(0, 1.0), _rank(1, 1.1), _rank(2, 0.9)])["gemm"] == []  # noise is not an outlier


def test_group_probe_names_the_slow_ring_link_on_real_ranks(tmp_path, capsys):
    # The probe MegaScan's slow-link finding suggests: only the ring-neighbour links of one DP group.
    out = tmp_path / "ring.json"
    code = main(["diagnose", "--nproc", "4", "--group", "dp:2", "--inject", "slow-link=1-2:20", "--json", str(out)])
    assert code == 0
    result = json.loads(out.read_text())
    assert result["ring"] == {"group": "dp[0, 1, 2, 3]", "links": ["0-1", "1-2", "2-3", "3-0"]}
    assert sorted(k for r in result["raw"] for k in r["pairs"]) == ["0-1", "1-2", "2-3", "3-0"]  # no other pair
    assert [o["who"] for o in result["p2p_latency"]] == ["1-2"]
    assert "ring links of dp[0, 1, 2, 3] probed: 0-1, 1-2, 2-3, 3-0; slow: 1-2" in capsys.readouterr().out


@pytest.mark.parametrize("bad", ["ep:1", "dp:x", "dp:9"])
def test_group_probe_rejects_a_bad_group(bad, capsys):
    assert main(["diagnose", "--nproc", "4", "--group", bad]) != 0  # refused before any rank starts
    assert f"--group '{bad}'" in capsys.readouterr().err


def test_diagnostics_over_their_budget_are_stopped_and_name_the_ranks_without_results():
    # a 3 s delay on every send over link 0-1: the pair test needs > 30 s, the budget is 4 s
    from megatronapp.resilience.diagnose import DiagnoseTimeout, run_within

    with pytest.raises(DiagnoseTimeout, match=r"did not finish within 4 s; ranks without results: 0, 1"):
        run_within(2, (1, 1, 2), ["slow-link=0-1:3000"], budget_s=4.0)
