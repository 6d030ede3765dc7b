"""The benchmark harness: ranks report and are collected in rank order, the fenced step times the slowest rank,
one machine record, the --quick skeleton, and run_all lists every benchmark that has a main. No timing asserted
beyond order (a figure is a benchmark, never a timed test)."""
from __future__ import annotations

import re
import time
from pathlib import Path

import pytest
from benchmarks import harness, run_all

BENCH = Path(harness.__file__).resolve().parent


def _worker(rank: int, world: int, nap_s: float, outdir: str) -> None:
    def step() -> tuple[int, float]:
        time.sleep(nap_s * rank)  # the last rank is the slowest
        return rank, time.monotonic()  # the system-wide clock: comparable across the ranks

    wall, (out, napped) = harness.fenced(step)
    fence_end = time.monotonic()
    wall_cpu, cpu, (out2, _) = harness.fenced_cpu(step)
    if rank != 1:  # a rank may report nothing (rank 0 alone often does)
        harness.report(outdir, rank, {"rank": out, "again": out2, "wall": wall, "wall_cpu": wall_cpu, "cpu": cpu,
                                      "world": world, "napped": napped, "fence_end": fence_end})


def test_launch_collects_reports_in_rank_order_and_the_fence_spans_the_slowest_rank(tmp_path):
    recs = harness.launch(_worker, 3, 0.2, outdir=tmp_path)
    assert [r["rank"] for r in recs] == [0, 2] and [r["again"] for r in recs] == [0, 2]
    assert all(r["world"] == 3 for r in recs)
    # rank 0 leaves the fence only after rank 2 has finished its step (an order, whatever the machine's load)
    assert recs[0]["fence_end"] >= recs[1]["napped"]
    assert recs[1]["wall"] >= 0.4 and recs[1]["wall_cpu"] >= 0.4  # rank 2's own nap is inside its fence
    assert recs[0]["cpu"] == recs[1]["cpu"] >= 0  # summed over ranks: the same on every rank
    assert harness.collect(tmp_path) == recs


def test_machine_record_has_one_key_set_and_reads_older_results():
    clock = harness.Clock()
    m = harness.machine(clock, emulated=True, host_share=0.3, ranks=4)
    assert {"platform", "processor", "cpus", "python", "torch", "load_avg_at_start", "load_avg_at_end", "emulated",
            "host_share"} <= set(m)
    assert m["emulated"] and m["host_share"] == 0.3 and m["ranks"] == 4 and len(m["load_avg_at_end"]) == 3
    assert harness.machine()["load_avg_at_start"] is None and not harness.machine()["emulated"]
    old = {"machine": "Linux-x86_64", "cpus": 2, "load_avg_at_end": [1.0, 2.0, 3.0], "torch": "2.13.0"}
    assert harness.machine_of(old) == {"cpus": 2, "load_avg_at_end": [1.0, 2.0, 3.0], "torch": "2.13.0"}
    assert harness.machine_of({"load_avg": [4.0, 5.0, 6.0]})["load_avg_at_end"] == [4.0, 5.0, 6.0]
    assert harness.machine_of({"machine": m}) == m


def test_parser_skeleton_and_rotation():
    ap = harness.parser("First line.\n\nmore", "tiny", from_json=True, blocks=2)
    assert ap.description == "First line."
    args = ap.parse_args(["--quick"])
    assert args.quick and not args.from_json and args.blocks == 2
    with pytest.raises(SystemExit):
        ap.parse_args(["--blocks", "0"])
    assert not hasattr(harness.parser(None).parse_args([]), "blocks")
    assert [harness.rotation(["a", "b", "c"], k) for k in range(4)] == [
        ["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"], ["a", "b", "c"]]


def test_results_and_docs_writers(tmp_path, capsys):
    doc = tmp_path / "b.md"
    doc.write_text("# B\n\n## S\n\nold\n\n## T\n\n<!-- x -->\nold\n<!-- /x -->\n")
    path = tmp_path / "r.json"
    harness.save({"a": 1}, path, "new s", section="## S", docs=doc)
    harness.save({"a": 2}, path, "new x", block="x", docs=doc)
    assert harness.read_result(path) == {"a": 2} and "wrote" in capsys.readouterr().out
    assert doc.read_text() == "# B\n\n## S\n\nnew s\n\n## T\n\n<!-- x -->\nnew x\n<!-- /x -->\n"
    with pytest.raises(SystemExit, match="no stored result"):
        harness.read_result(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(SystemExit, match="bad.json: not valid JSON"):
        harness.read_result(tmp_path / "bad.json")


def test_run_all_lists_every_benchmark_with_a_main():
    with_main = {p.stem for p in BENCH.glob("*.py")
                 if re.search(r'^if __name__ == "__main__":', p.read_text(), re.MULTILINE)}
    listed = {b[0] for b in run_all.BENCHMARKS}
    assert listed | set(run_all.EXCLUDED) == with_main, "benchmarks/run_all.py must list or exclude every main"
    assert not listed & set(run_all.EXCLUDED)
    for name in run_all.EXCLUDED:
        assert name in run_all.__doc__  # each exclusion is explained where a reader looks
