"""Heat-maps, the summary table and the `scan` CLI on a small simulated job."""
import argparse
import json
import os
import re

import numpy as np
import pytest

from megatronapp.scan import cli, heatmap
from megatronapp.scan.detect.analysis import analyse
from megatronapp.scan.read.format import read_dir
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


def test_rows_past_the_limit_are_binned_keeping_flagged_and_worst_ranks(job, tmp_path):
    """16 ranks, tp 2, pp 2: 8 rows (stage x replica); at most 4 rows, each stage's 4 replicas go in bins of 2, a
    cell showing its bin's flagged rank, else its highest self vs stage."""
    _, an = job
    full, rank_full, _ = heatmap.grids(an)
    g, rank_at, labels = heatmap.grids(an, max_rows=4)
    assert rank_at.shape == (4, 2) and labels == ["PP0 DP0-1", "PP0 DP2-3", "PP1 DP0-1", "PP1 DP2-3"]
    flagged = {r for f in an.report.findings for r in f.ranks}
    score = {int(r): full["self vs stage"][i, j] for (i, j), r in np.ndenumerate(rank_full)}
    for (i, j), r in np.ndenumerate(rank_at):
        bin_ranks = [int(x) for x in rank_full[2 * i:2 * i + 2, j]]
        assert r in bin_ranks
        want = [x for x in bin_ranks if x in flagged] or [max(bin_ranks, key=lambda x: score[x])]
        assert r in want
        assert g["self vs stage"][i, j] == score[int(r)]
    assert flagged <= set(rank_at.ravel().tolist())


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


CHROMIUM = "/usr/bin/chromium"


@pytest.mark.browser
@pytest.mark.skipif(not os.path.exists(CHROMIUM), reason=f"{CHROMIUM} is not installed")
@pytest.mark.parametrize("max_rows", [None, 4])
def test_html_heatmap_in_chromium_draws_and_reads_out_the_flagged_rank(job, tmp_path, monkeypatch, max_rows):
    """The page as a user opens it: no script error, a canvas of the grid, and hovering the slow rank's cell (binned
    or not) reads out that rank."""
    from playwright.sync_api import sync_playwright

    _, an = job
    if max_rows:
        monkeypatch.setattr(heatmap, "MAX_ROWS_HTML", max_rows)
    page_file = heatmap.write(an, tmp_path / "heat.html")
    data = json.loads(re.search(r"const D = (\{.*?\});\n", page_file.read_text()).group(1))
    assert data["rows"] == (max_rows or 8)
    i, j = divmod(data["rank"].index(5), data["cols"])
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=["--headless", "--no-sandbox", "--disable-gpu"])
        page = browser.new_page(viewport={"width": 900, "height": 900})
        errors: list[str] = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.goto(page_file.as_uri())
        box = page.locator("#c").bounding_box()
        assert box["width"] > 20 and box["height"] > 20
        cw, ch = box["width"] / data["cols"], box["height"] / data["rows"]
        page.mouse.move(box["x"] + (j + 0.5) * cw, box["y"] + (i + 0.5) * ch)
        tip = page.inner_text("#tip")
        browser.close()
    assert errors == []
    assert tip.startswith(f"rank 5 {data['labels'][i]} TP{j}") and "self vs stage" in tip


def test_two_level_heatmap_of_a_directory_mixing_two_jobs(tmp_path):
    """Half the files of a 64-rank job overwritten by a 32-rank job's: the triage's world (64) is larger than that
    of the ranks read in full; the page is written (it raised IndexError before the second review)."""
    import shutil

    big, small = tmp_path / "big", tmp_path / "small"
    for d, n in ((big, "64"), (small, "32")):
        assert _main(["scan", "simulate", "--ranks", n, "--tp", "2", "--pp", "2", "--iterations", "3",
                      "--fault", "slow-compute=5:1.4", "-o", str(d)]) == 0
    for f in small.glob("rank*.mst"):
        shutil.copy(f, big / f.name)
    out = tmp_path / "heat.html"
    assert _main(["scan", "heatmap", str(big), "--two-level", "on", "-o", str(out)]) == 0
    data = json.loads(re.search(r"const D = (\{.*?\});\n", out.read_text()).group(1))
    drawn = [r for r in data["rank"] if r >= 0]  # two jobs' coordinates overlap: a cell shows one of its ranks
    assert data["rows"] * data["cols"] == 64 and len(drawn) >= 32 and set(drawn) <= set(range(64))
