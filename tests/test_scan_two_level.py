"""Two-level detection (scan/detect/triage.py) and the simulator's stage-by-stage writer, on real rank files.

The two-level path reads every rank cheaply and the selected ranks in full; it is checked against the full detector
on the same files, fault kind by fault kind, with a budget that leaves most of the job unread."""
from __future__ import annotations

import json
import re
import subprocess
import sys

import numpy as np
import pytest

from megatronapp.scan.detect import features, triage
from megatronapp.scan.detect.analysis import detect
from megatronapp.scan.read.format import RECORD, RankWriter, read_dir, write_rank_file
from megatronapp.scan.synth.simulate import _time_order, simulate

TP, PP, DP = 4, 4, 32  # 512 ranks


def rank(d: int, s: int, t: int) -> int:
    return t + TP * (d + DP * s)


def test_write_rank_file_writes_what_rank_writer_writes(tmp_path):
    rng = np.random.default_rng(1)
    rec = np.zeros(300, RECORD)
    for k in ("ts", "dur", "seq", "nbytes"):
        rec[k] = rng.integers(0, 1 << 40, len(rec))
    rec["name"] = rng.integers(0, 3, len(rec))
    rec["gid"] = rng.integers(-1, 3, len(rec))
    header = {"rank": 5, "world": 16, "coord": [1, 1, 1], "topo": [2, 2, 4], "host": "n0"}
    groups = [("tp", range(4, 6)), ("pp", [1, 5, 9]), ("dp", range(1, 16, 4))]
    with RankWriter(tmp_path / "a.mst", header) as w:
        w.write_columns(["forward", "send", "recv"], groups, rec)
    write_rank_file(tmp_path / "b.mst", header, ["forward", "send", "recv"], groups, rec)
    assert (tmp_path / "a.mst").read_bytes() == (tmp_path / "b.mst").read_bytes()
    with pytest.raises(ValueError, match="header needs 'rank'"):
        write_rank_file(tmp_path / "c.mst", {"world": 1}, [], [], rec)


def test_time_order_is_a_stable_sort_of_every_row():
    rng = np.random.default_rng(2)
    ts = np.sort(rng.integers(0, 50, (40, 30)).astype(float), axis=1)  # ties, one shared order mostly
    ts[:, [3, 4]] = ts[:, [4, 3]]  # every row out of slot order the same way
    ts[7] = rng.permutation(ts[7])  # rows whose order differs from the first row's
    ts[19, 10] = ts[19, 11] = ts[19, 12]
    ts[23] = rng.integers(0, 5, 30)
    o, idx = _time_order(ts)
    got = np.broadcast_to(o, ts.shape) if idx is None else idx
    want = np.array([np.lexsort((row,)) for row in ts])  # lexsort is stable: ties keep slot order
    assert np.array_equal(got, want)
    same = np.tile(np.arange(30.0), (5, 1))
    o, idx = _time_order(same)
    assert idx is None and np.array_equal(o, np.arange(30))


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    """Simulated 512-rank jobs, one per fault kind (and a healthy one), 6 iterations."""
    root = tmp_path_factory.mktemp("two_level")
    cases = {
        "healthy": [],
        "slow-compute": [f"slow-compute={rank(9, 2, 1)}:1.3"],
        "pause": [f"pause={rank(20, 3, 2)}:40:2"],
        "late-arrival": [f"late-arrival={rank(5, 1, 3)}:15"],
        "slow-p2p": [f"slow-link={rank(14, 1, 0)}-{rank(14, 2, 0)}:3"],
        "slow-dp-link": [f"slow-link={rank(11, 3, 2)}-{rank(12, 3, 2)}:2"],
    }
    out = {}
    for name, faults in cases.items():
        simulate(root / name, TP * PP * DP, TP, PP, iterations=6, faults=faults, seed=4)
        out[name] = root / name
    return out


@pytest.mark.parametrize("case", ["healthy", "slow-compute", "pause", "late-arrival", "slow-p2p", "slow-dp-link"])
def test_two_level_finds_what_the_full_detector_finds(jobs, case):
    full = detect(read_dir(jobs[case])[0])
    an, problems = triage.analyse_two_level(jobs[case], workers=1, budget=200)
    assert not problems
    got = [(f.kind, f.ranks) for f in an.report.findings]
    assert got == [(f.kind, f.ranks) for f in full.findings]
    truth = json.loads((jobs[case] / "ground_truth.json").read_text())["faults"]
    if truth:
        assert an.report.findings and set(an.report.findings[0].ranks) == set(truth[0]["ranks"])
    else:
        assert not got
    assert an.report.notes[0].startswith("two-level analysis of 512 ranks")
    assert an.report.world == 512


def test_triage_scores_the_faulty_rank_on_the_right_feature(jobs):
    for case, want in (("slow-compute", "work"), ("late-arrival", "host"), ("slow-p2p", "p2p")):
        sel = triage.select(features.features(jobs[case], workers=2), budget=200)
        truth = json.loads((jobs[case] / "ground_truth.json").read_text())["faults"][0]["ranks"]
        first = [r for r, view, _ in sel.suspects if view == want][:len(truth)]
        assert set(first) == set(truth), (case, sel.suspects[:6])  # the view's first suspects
        assert set(truth) & {r for r, _, _ in sel.suspects[:4]}, (case, sel.suspects[:6])  # and in the first turn
        assert len(sel.ranks) <= 200 and all(r in sel.ranks for r in truth)
    sel = triage.select(features.features(jobs["slow-dp-link"], workers=1), budget=1000)
    assert any(g.startswith(f"dp group of rank {rank(0, 3, 2)} ") for g in sel.groups), sel.groups


def test_cli_two_level(jobs, tmp_path):
    out = subprocess.run([sys.executable, "-m", "megatronapp", "scan", "detect", str(jobs["slow-compute"]),
                          "--two-level", "on", "--json"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    rep = json.loads(out.stdout)
    assert rep["findings"][0]["kind"] == "slow-compute" and rep["findings"][0]["ranks"] == [rank(9, 2, 1)]
    assert any(n.startswith("two-level analysis") for n in rep["notes"])
    missing = subprocess.run([sys.executable, "-m", "megatronapp", "scan", "detect", str(tmp_path / "nope"),
                              "--two-level", "on"], capture_output=True, text=True, timeout=60)
    assert missing.returncode != 0 and "does not exist" in missing.stderr


def test_aggregate_only_flagged_two_level_writes_the_flagged_ranks(jobs, tmp_path):
    from megatronapp.scan.aggregate import aggregate

    out = tmp_path / "flagged.json"
    two = aggregate(jobs["slow-p2p"], out, only_flagged=True, two_level=True)
    one = aggregate(jobs["slow-p2p"], tmp_path / "one.json", only_flagged=True)
    # The same findings (their factors are measured against the peers read: 2.96x against 2.94x), the same ranks.
    assert [x.split(":")[0] for x in two["findings"]] == [x.split(":")[0] for x in one["findings"]]
    assert two["written_ranks"] == one["written_ranks"]
    assert len(two["ranks"]) == TP * PP * DP and two["two_level"].startswith("two-level analysis")
    events = json.loads(out.read_text())["traceEvents"]
    assert {e["pid"] for e in events if e.get("ph") == "X"} == set(two["written_ranks"])
    assert any(e.get("ph") == "s" for e in events)  # flows between the written ranks


@pytest.mark.parametrize("victim", [rank(1, 0, 1), rank(11, 2, 0)])
def test_two_level_names_the_rank_a_hung_job_waits_for(jobs, tmp_path, victim):
    """A hang injected into the healthy job's traces (scan/synth/perturb.py, the tracer's open records re-written): the
    triage reads a few of the stuck ranks, and ranks it did not read are never blamed."""
    from megatronapp.scan.read.format import COLUMNS, RankWriter, rank_file
    from megatronapp.scan.synth.perturb import Perturbation, perturb

    hung = perturb(read_dir(jobs["healthy"])[0], [Perturbation("hang", (victim,), at_iteration=3)])
    for t in hung:
        with RankWriter(rank_file(tmp_path, t.rank), {k: v for k, v in t.header.items() if k != "footer"}) as w:
            w.write_columns(t.names, t.groups, {c: getattr(t, c) for c in COLUMNS})
            w.write_columns(t.names, t.groups, {c: t.opened[c] for c in COLUMNS})
    full = detect(read_dir(tmp_path)[0])
    an, _ = triage.analyse_two_level(tmp_path, workers=1, budget=200)
    assert [(f.kind, f.ranks) for f in an.report.findings] == [(f.kind, f.ranks) for f in full.findings] \
        == [("hang", (victim,))]


def test_a_second_file_claiming_a_rank_is_ignored_as_read_dir_does(jobs, tmp_path):
    import shutil

    d = tmp_path / "job"
    shutil.copytree(jobs["healthy"], d)
    slow = rank(9, 2, 1)
    shutil.copy(jobs["slow-compute"] / f"rank{slow:05d}.mst", d / "rank99999.mst")  # claims rank `slow`, sorts last
    f = features.features(d, workers=2)
    assert any(f"rank99999.mst claims rank {slow}" in p for p in f.problems)
    assert f.paths[slow].endswith(f"rank{slow:05d}.mst")
    healthy = features.features(jobs["healthy"], workers=1)
    assert np.allclose(f.work[slow], healthy.work[slow]) and np.allclose(f.host, healthy.host, equal_nan=True)
    an, problems = triage.analyse_two_level(d, workers=1, budget=200)
    assert not an.report.findings and any("claims rank" in p for p in problems)


def test_span_estimate_counts_spans_not_bytes(jobs, tmp_path):
    """`--two-level auto` decides on spans: format 3's files are 2.6x smaller than rows for as many spans."""
    traces, _ = read_dir(jobs["healthy"])
    true = sum(len(t) for t in traces)
    assert abs(triage.estimated_spans(jobs["healthy"]) - true) < 0.02 * true
    for t in traces[:16]:  # the same spans as rows (format 2's layout, as a tracer's small blocks are written)
        rec = np.zeros(len(t), RECORD)
        for c in ("ts", "dur", "name", "it", "gid", "peer", "cat", "seq", "nbytes", "mb", "chunk", "cpu_wait"):
            rec[c] = getattr(t, c)
        with RankWriter(tmp_path / f"rank{t.rank:05d}.mst", t.header) as w:
            w.write_columns(t.names, t.groups, rec[:63])  # below COLS_MIN: a row block
    assert abs(triage.estimated_spans(tmp_path) - 16 * 63) < 16
    assert triage.estimated_spans(tmp_path / "empty" if (tmp_path / "empty").mkdir() is None else "") == 0


@pytest.mark.parametrize("case", ["healthy", "slow-compute", "pause", "slow-p2p", "slow-dp-link"])
def test_batches_by_slot_reduce_as_span_by_span(jobs, case):
    """The triage's fast path for ranks that share their spans' order gives the general path's numbers."""
    traces, _ = read_dir(jobs[case])
    stages: dict = {}
    for t in traces:
        stages.setdefault(t.coord[1], []).append(t)
    uniform = 0
    for members in stages.values():
        for lo in range(0, len(members), 48):
            batch = members[lo:lo + 48]
            same = features._uniform(batch)
            if same is None:
                continue
            uniform += 1
            fast, slow = features._batch_uniform(batch, *same), features._batch_spans(batch)
            assert fast.keys() == slow.keys()
            for k, v in slow.items():
                if isinstance(v, np.ndarray):
                    assert np.array_equal(fast[k], v, equal_nan=v.dtype.kind == "f"), (case, k)  # exactly
                else:
                    assert fast[k] == v, (case, k)
    assert uniform >= len(traces) // 48 // 2  # most batches of a stage share one order
    mixed = [t for members in stages.values() for t in members[:2]]  # two stages: different spans
    assert features._uniform(mixed) is None


def test_summary_and_heatmap_two_level_show_the_ranks_read(jobs, tmp_path):
    """Past what one table holds, `scan summary` and `scan heatmap` show the two-level analysis: the flagged rank
    first among the ranks read in full, and a line saying only those are shown."""
    run = [sys.executable, "-m", "megatronapp", "scan"]
    summ = subprocess.run(run + ["summary", str(jobs["slow-compute"]), "--two-level", "on"], capture_output=True,
                          text=True, timeout=300)
    assert summ.returncode == 0, summ.stderr
    assert "only the ranks analysed in full are shown" in summ.stderr and "Mean of empty slice" not in summ.stderr
    flagged = [line for line in summ.stdout.splitlines() if line.rstrip().endswith("slow-compute")]
    assert len(flagged) == 1 and flagged[0].split()[0] == str(rank(9, 2, 1))
    html = tmp_path / "heat.html"
    heat = subprocess.run(run + ["heatmap", str(jobs["slow-compute"]), "--two-level", "on", "-o", str(html)],
                          capture_output=True, text=True, timeout=300)
    assert heat.returncode == 0, heat.stderr
    assert "every rank's triage numbers are drawn" in heat.stderr and "Mean of empty slice" not in heat.stderr
    data = json.loads(re.search(r"const D = (\{.*?\});\n", html.read_text()).group(1))
    assert data["rows"] * data["cols"] == TP * PP * DP and sorted(data["rank"]) == list(range(TP * PP * DP))
    self_vs = np.array(data["metrics"]["self vs stage"], float)
    waited = np.array([np.nan if x is None else x for x in data["metrics"]["waited ms"]], float)
    assert np.isfinite(self_vs).all()  # every rank drawn from the triage, read in full or not
    assert 0 < np.isfinite(waited).sum() < len(waited)  # the waits: only the ranks read in full
    slow = data["rank"].index(rank(9, 2, 1))
    assert self_vs[slow] == self_vs.max() and data["flag"][slow] == 1
    assert data["desc"]["self vs stage"].startswith("every rank (triage)")
