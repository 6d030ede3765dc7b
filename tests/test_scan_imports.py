"""The scan/ package has no import circle: every import of one scan module by another, at the top, inside a
function or under TYPE_CHECKING, read from the source (ast), forms a graph without a cycle."""
from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = "megatronapp.scan"
SCAN = Path(__file__).resolve().parent.parent / "src" / "megatronapp" / "scan"


def scan_imports(folder: Path, package: str = PACKAGE) -> dict[str, set[str]]:
    """Module name -> the modules of the same package it imports, anywhere in its source."""
    mods = {p.stem for p in folder.glob("*.py") if p.stem != "__init__"}
    graph: dict[str, set[str]] = {}
    for m in sorted(mods):
        deps: set[str] = set()
        for node in ast.walk(ast.parse((folder / f"{m}.py").read_text(), filename=f"{m}.py")):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = package if node.level else (node.module or "")
                if node.level and node.module:
                    base = f"{package}.{node.module}"
                # `from megatronapp.scan import ring` names a module; `from megatronapp.scan.x import y` the module x.
                names = [base] + [f"{base}.{a.name}" for a in node.names]
            for n in names:
                if n.startswith(package + "."):
                    head = n[len(package) + 1:].split(".")[0]
                    if head in mods and head != m:
                        deps.add(head)
        graph[m] = deps
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the graph as a path that starts and ends at the same module, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for d in sorted(graph.get(m, ())):
            if state.get(d) == 1:
                return path[path.index(d):] + [d]
            if d not in state and (c := visit(d)):
                return c
        path.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (c := visit(m)):
            return c
    return None


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
