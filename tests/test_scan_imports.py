"""The scan/ package has no import circle and keeps its shared types and statistics at the bottom: every import of
one scan module by another, at the top, inside a function or under TYPE_CHECKING, read from the source (ast, with
the walker tests/test_imports.py uses for the whole tree), forms a graph without a cycle."""
from __future__ import annotations

from pathlib import Path

from tests.import_graph import file_graph, find_cycle

PACKAGE = "megatronapp.scan"
SCAN = Path(__file__).resolve().parent.parent / "src" / "megatronapp" / "scan"


def scan_imports(folder: Path, package: str = PACKAGE) -> dict[str, set[str]]:
    """Module name -> the modules of the same package it imports, anywhere in its source (tests/import_graph.py)."""
    files = {f"{package}.{p.stem}": p for p in folder.glob("*.py") if p.stem != "__init__"}
    return {m.rpartition(".")[2]: {d.rpartition(".")[2] for d in deps}
            for m, deps in file_graph(files).items()}


def test_scan_package_has_no_import_cycle():
    graph = scan_imports(SCAN)
    assert {"detect", "table", "stats", "format"} <= graph.keys()
    assert "table" in graph["detect"] and "stats" in graph["table"] | graph["align"]  # the walk sees real edges
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle in scan/: " + " -> ".join(cycle or [])
    # The shared types and statistics sit at the bottom: no detector is imported by them.
    assert graph["stats"] == set(), graph["stats"]
    assert graph["table"] <= {"align", "format", "stats"}, graph["table"]


def test_the_walk_finds_a_cycle_hidden_in_a_function_or_type_checking_block(tmp_path):
    (tmp_path / "a.py").write_text("from megatronapp.scan.b import f\n")
    (tmp_path / "b.py").write_text("def f():\n    from megatronapp.scan import c\n")
    (tmp_path / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                   "    from megatronapp.scan.a import X\n")
    (tmp_path / "d.py").write_text("from . import a\n")
    graph = scan_imports(tmp_path)
    assert graph == {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    (tmp_path / "c.py").write_text("import numpy\n")
    assert find_cycle(scan_imports(tmp_path)) is None
