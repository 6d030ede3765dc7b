"""Heat-maps, the summary table and the `scan` CLI on a small simulated job."""
import argparse
import json
import re

import pytest

from megatronapp.scan import cli, heatmap
from megatronapp.scan.detect import analyse
from megatronapp.scan.format import read_dir
from megatronapp.scan.summary import rank_rows, summary_table


def _main(argv):
    parser = argparse.ArgumentParser()
    cli.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(argv)
    return args.func(args)


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    d = tmp_path_factory.mktemp("job")
    assert _main(["scan", "simulate", "--ranks", "16", "--tp", "2", "--pp", "2", "--iterations", "3",
                  "--fault", "slow-compute=5:1.4", "--fault", "slow-link=0-8:2", "-o", str(d)]) == 0
    traces, _ = read_dir(d)
    return d, analyse(traces)


def test_png_is_a_png(job, tmp_path):
    _, an = job
    p = heatmap.write(an, tmp_path / "heat.png")
    data = p.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


def test_html_is_self_contained_and_carries_the_grid(job, tmp_path):
    _, an = job
    html = heatmap.write(an, tmp_path / "heat.html").read_text()
    assert "<canvas" in html and "<script>" in html
    assert not re.search(r"(src|href)=[\"']https?:", html)  # nothing fetched from the network
    data = json.loads(re.search(r"const D = (\{.*?\});\n", html).group(1))
    assert data["rows"] * data["cols"] == 16 and sorted(r for r in data["rank"]) == list(range(16))
    flagged = {r for r, f in zip(data["rank"], data["flag"]) if f}
    assert flagged == {5, 0, 8}
    assert any("slow-compute" in f for f in data["findings"])
    with pytest.raises(ValueError, match=".png or .html"):
        heatmap.write(an, tmp_path / "heat.jpg")


def test_summary_rows_and_table(job):
    _, an = job
    rows = {r["rank"]: r for r in rank_rows(an)}
    assert rows[5]["finding"] == "slow-compute"
    assert rows[5]["compute"] > 1.25 * rows[4]["compute"]
    assert rows[4]["waited"] > rows[5]["waited"]  # its TP peer waits for it
    text = summary_table(an, limit=5)
    assert "slow-compute" in text and "more ranks not shown" in text


def test_cli_detect_json_summary_heatmap(job, tmp_path, capsys):
    d, _ = job
    assert _main(["scan", "detect", str(d), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert {f["kind"] for f in doc["findings"]} == {"slow-compute", "slow-link"}
    assert _main(["scan", "detect", str(d), "--fail-on-finding"]) == 1
    assert _main(["scan", "summary", str(d)]) == 0
    assert "others waited" in capsys.readouterr().out
    assert _main(["scan", "heatmap", str(d), "-o", str(tmp_path / "h.html")]) == 0
    assert (tmp_path / "h.html").exists()
    assert _main(["scan", "simulate", "--ranks", "10", "--tp", "4", "--pp", "2", "-o", str(tmp_path)]) == 2
    assert "not a multiple" in capsys.readouterr().err
