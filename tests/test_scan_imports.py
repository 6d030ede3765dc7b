"""The scan/ package has no import circle and its roles stack in one order: every import of one scan module by
another, at the top, inside a function or under TYPE_CHECKING, read from the source (ast), forms a graph without a
cycle, and no module imports a role above its own (read/ < detect/ < record/, synth/ < the commands on top)."""
from __future__ import annotations

import ast
from pathlib import Path

from tests.import_graph import file_graph, find_cycle

PACKAGE = "megatronapp.scan"
SCAN = Path(__file__).resolve().parent.parent / "src" / "megatronapp" / "scan"
# Each role's floor; a module may import its own role's modules and those of lower floors only. Top-level files
# (cli, aggregate, heatmap, summary) are the commands, on the top floor.
FLOORS = {"read": 0, "detect": 1, "record": 2, "synth": 2}
COMMANDS = 3


def _key(path: Path, folder: Path) -> str:
    """A module's name inside the package: "cli", "detect.table"."""
    return ".".join(path.relative_to(folder).with_suffix("").parts)


def scan_imports(folder: Path, package: str = PACKAGE) -> dict[str, set[str]]:
    """Module name ("detect.table") -> the modules of the same package it imports, anywhere in its source (the
    walker of tests/import_graph.py, which tests/test_imports.py uses for the whole tree)."""
    files = {f"{package}.{_key(p, folder)}": p for p in folder.rglob("*.py") if p.stem != "__init__"}
    cut = len(package) + 1
    return {m[cut:]: {d[cut:] for d in deps} for m, deps in file_graph(files).items()}


def floor(module: str) -> int:
    """The floor of a module's role (KeyError for a subpackage that FLOORS does not place)."""
    return FLOORS[module.split(".")[0]] if "." in module else COMMANDS


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """Imports of a role above the importer's, or of a sibling role on the same floor (record <-> synth)."""
    role = lambda m: m.split(".")[0] if "." in m else ""  # noqa: E731
    return [f"{m} imports {d}" for m, deps in sorted(graph.items()) for d in sorted(deps)
            if floor(d) > floor(m) or (floor(d) == floor(m) and role(d) != role(m))]


def test_scan_package_has_no_import_cycle():
    graph = scan_imports(SCAN)
    assert {"detect.analysis", "detect.table", "detect.stats", "read.format", "record.tracer", "synth.simulate",
            "cli"} <= graph.keys()
    # the walk sees real edges, within a role and across roles
    assert "detect.table" in graph["detect.analysis"] and "detect.stats" in graph["detect.align"]
    assert "read.format" in graph["record.tracer"] and "detect.ring" in graph["detect.links"]
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle in scan/: " + " -> ".join(cycle or [])
    # The shared types and statistics sit at the bottom: no detector is imported by them.
    assert graph["detect.stats"] == set(), graph["detect.stats"]
    assert graph["detect.findings"] == set(), graph["detect.findings"]
    assert graph["detect.table"] <= {"detect.align", "read.format", "detect.stats"}, graph["detect.table"]


def test_scan_roles_import_only_downward():
    graph = scan_imports(SCAN)
    assert {m.split(".")[0] for m in graph if "." in m} == FLOORS.keys(), "a new role: give it a floor in FLOORS"
    bad = upward_imports(graph)
    assert not bad, "scan/ roles stack read < detect < record, synth < commands:\n" + "\n".join(bad)
    # Importing one module of a role must not load the others: the roles' __init__ files import nothing.
    for role in FLOORS:
        tree = ast.parse((SCAN / role / "__init__.py").read_text())
        assert not [n for n in ast.walk(tree) if isinstance(n, ast.Import | ast.ImportFrom)], role


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


def test_the_walk_sees_subpackages_and_upward_imports(tmp_path):
    """The checker itself: imports into and out of role folders, absolute and relative, and the floors."""
    for role in ("read", "detect", "synth"):
        (tmp_path / role).mkdir()
        (tmp_path / role / "__init__.py").write_text("")
    (tmp_path / "read" / "fmt.py").write_text("def f():\n    from ..detect.view import g\n")  # upward, in a function
    (tmp_path / "detect" / "view.py").write_text("from . import base\nfrom megatronapp.scan.read import fmt\n")
    (tmp_path / "detect" / "base.py").write_text("import megatronapp.scan.read.fmt as f\n")
    (tmp_path / "synth" / "sim.py").write_text("from megatronapp.scan.detect.view import g\n")
    (tmp_path / "cli.py").write_text("from megatronapp.scan.synth import sim\n")
    graph = scan_imports(tmp_path)
    assert graph == {"read.fmt": {"detect.view"}, "detect.view": {"detect.base", "read.fmt"},
                     "detect.base": {"read.fmt"}, "synth.sim": {"detect.view"}, "cli": {"synth.sim"}}
    assert find_cycle(graph) == ["detect.view", "detect.base", "read.fmt", "detect.view"]
    assert upward_imports(graph) == ["read.fmt imports detect.view"]
    graph["synth.sim"].add("cli")
    graph["record.x"] = {"synth.sim"}
    assert upward_imports(graph) == ["read.fmt imports detect.view", "record.x imports synth.sim",
                                     "synth.sim imports cli"]
