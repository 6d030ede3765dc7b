"""Schedule pictures from simulations and from MegaScan trace directories, and the `dpp` CLI."""
from __future__ import annotations

from pathlib import Path

import pytest

from megatronapp.cli import main
from megatronapp.dpp.plot import Timeline, plot_html, plot_png, save, timeline_from_trace
from megatronapp.dpp.simulator import SimConfig, simulate
from megatronapp.pipeline.schedules import stage_orders
from megatronapp.scan.read.format import RankWriter, rank_file

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _write_trace(d: Path, pp: int = 2, m: int = 3, iterations: int = 2) -> None:
    """A synthetic traced 1F1B run: forward 1 ms, backward 2 ms, one stage hop per task."""
    orders = stage_orders("1f1b", pp, 1, m)
    for s in range(pp):
        with RankWriter(rank_file(d, s), {"rank": s, "world": pp, "coord": [0, s, 0], "topo": [1, pp, 1]}) as w:
            for it in range(iterations):
                t = it * 100_000_000 + s * 1_000_000
                for task in orders[s]:
                    dur = 1_000_000 if task.kind == "F" else 2_000_000
                    w.write("forward" if task.kind == "F" else "backward", "compute", t, dur, it,
                            chunk=task.chunk, mb=task.microbatch)
                    t += dur + 500_000


def test_png_and_html_from_a_simulation(tmp_path):
    results = [simulate(n, SimConfig(pp=4, vpp=2, microbatches=8, latency=0.1))
               for n in ("interleaved-1f1b", "zb-h1", "dpp-adaptive")]
    tls = [Timeline.from_result(r) for r in results]
    png = plot_png(tls, tmp_path / "s.png")
    assert png.read_bytes()[:8] == PNG_MAGIC and png.stat().st_size > 10_000
    page = plot_html(tls, tmp_path / "s.html").read_text()
    n_tasks = sum(len(r.timeline) for r in results)
    assert page.count("<rect class='F'") == sum(s.kind == "F" for r in results for s in r.timeline)
    assert page.count("<title>") == n_tasks + 1  # one per bar, plus the page title
    assert "<script" not in page and "http" not in page.replace("http://www.w3.org/2000/svg", "")
    assert "zb-h1" in page and "class='W'" in page
    assert save(tls, tmp_path / "x.htm").suffix == ".htm"


def test_timeline_from_a_trace_directory(tmp_path):
    _write_trace(tmp_path, pp=2, m=3)
    tl, problems = timeline_from_trace(tmp_path)
    assert tl.pp == 2 and "iteration 1" in tl.title  # the last complete iteration by default
    assert len(tl.spans) == 2 * 2 * 3
    assert min(s.start for s in tl.spans) == 0.0
    first = next(s for s in tl.spans if s.stage == 0)
    assert (first.kind, first.microbatch) == ("F", 0) and first.end - first.start == pytest.approx(1e-3)
    tl0, _ = timeline_from_trace(tmp_path, iteration=0)
    assert "iteration 0" in tl0.title
    with pytest.raises(ValueError, match="no forward/backward spans in iteration 7"):
        timeline_from_trace(tmp_path, iteration=7)
    assert isinstance(problems, list)


def test_cli_simulate_prints_a_table_and_draws(tmp_path, capsys):
    out = tmp_path / "cmp.png"
    code = main(["dpp", "simulate", "--pp", "4", "--vpp", "2", "--microbatches", "8", "--jitter", "lognormal:0.3",
                 "--latency", "0.2", "--compare", "1f1b,interleaved-1f1b,zb-h1,dpp-dfs,dpp-bfs,dpp-adaptive",
                 "-o", str(out)])
    text = capsys.readouterr().out
    assert code == 0
    for name in ("1f1b", "interleaved-1f1b", "zb-h1", "dpp-dfs", "dpp-bfs", "dpp-adaptive"):
        assert f"\n{name} " in text
    assert "vs interleaved-1f1b" in text and out.read_bytes()[:8] == PNG_MAGIC


def test_cli_errors_are_clear(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["dpp", "simulate", "--compare", "1f1b,pipedream"])
    assert "unknown schedule(s) ['pipedream']" in capsys.readouterr().err
    assert main(["dpp", "simulate", "--pp", "2", "--vpp", "2", "--max-inflight", "1",
                 "--compare", "dpp-adaptive"]) == 2
    assert "dpp_max_inflight=1 is below the minimum 2" in capsys.readouterr().err
    assert main(["dpp", "plot", str(tmp_path / "missing"), "-o", str(tmp_path / "x.png")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_cli_plot_from_trace(tmp_path, capsys):
    _write_trace(tmp_path / "trace")
    assert main(["dpp", "plot", str(tmp_path / "trace"), "-o", str(tmp_path / "t.html")]) == 0
    assert "wrote" in capsys.readouterr().out
    assert "<svg" in (tmp_path / "t.html").read_text()
