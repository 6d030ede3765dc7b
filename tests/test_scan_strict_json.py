"""`scan detect --json` writes strict JSON: no `Infinity` or `NaN`, which strict readers (jq, browsers) refuse."""
import json

import pytest

from megatronapp.scan.detect.analysis import Thresholds, detect
from megatronapp.scan.detect.evidence import floor_findings
from megatronapp.scan.detect.findings import Finding, Report
from megatronapp.scan.detect.table import join, phases
from megatronapp.scan.read.format import RankWriter, read_dir

MS = 1_000_000


def _strict(text: str):
    def refuse(name):
        raise ValueError(f"non-standard JSON constant {name}")
    return json.loads(text, parse_constant=refuse)


def _zero_cost_marker_job(d):
    """4 DP ranks; each microbatch runs a marker op that costs 0 ns on ranks 1-3 and 3 ms on rank 0, whose forward
    is also 1.4x slower: the peers' floor of the marker is 0, which made the floor ratio infinite."""
    for r in range(4):
        with RankWriter(d / f"rank{r:05d}.mst", {"rank": r, "world": 4, "coord": [r, 0, 0],
                                                  "topo": [1, 1, 4]}) as w:
            t = 0
            for it in range(8):
                t0 = t
                for mb in range(4):
                    marker, fwd = (3 * MS, 14 * MS) if r == 0 else (0, 10 * MS)
                    w.write("marker", "compute", t, marker, it, mb=mb)
                    w.write("forward", "compute", t + marker, fwd, it, mb=mb)
                    t += marker + fwd
                w.write("step", "step", t0, t - t0, it)
    traces, problems = read_dir(d)
    assert problems == []
    return traces


def test_an_op_free_on_the_peers_gives_no_infinite_floor_ratio_and_the_report_is_strict_json(tmp_path):
    traces = _zero_cost_marker_job(tmp_path)
    tb = join(traces)
    ph = phases(tb)
    found = floor_findings(tb, ph.excl, ph.iters, Thresholds())
    assert [(f.kind, f.ranks) for f in found] == [("slow-compute", (0,))]
    assert found[0].evidence["floor_ratio_by_op"] == {"forward": pytest.approx(1.4, abs=0.01)}
    report = detect(traces)
    assert report.findings and report.findings[0].ranks == (0,), report.to_text()
    out = _strict(report.to_json())
    assert out["findings"][0]["kind"] == "slow-compute"


def test_a_non_finite_number_anywhere_in_a_report_is_written_as_null():
    f = Finding("slow-compute", (1,), [{"rank": 1, "dp": 0, "pp": 0, "tp": 1}], "x", float("inf"), 1.0, 0.7,
                {"ratio_by_op": {"fwd": float("nan")}, "series": [1.0, float("-inf")]})
    out = _strict(Report([f], 2, 3, float("nan"), [], []).to_json())
    assert out["step_ms"] is None and out["findings"][0]["factor"] is None
    assert out["findings"][0]["evidence"] == {"ratio_by_op": {"fwd": None}, "series": [1.0, None]}
