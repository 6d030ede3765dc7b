"""No import circle and no import running back up, anywhere in src/ and benchmarks/; no test module imported by
another file of tests/.

Every import of every file (top level, in functions, under TYPE_CHECKING, relative, import_module of a literal)
is read with ast (tests/import_graph.py). Three rules: no circle between files; no circle between packages (a
leaf package, or a file directly in a package that has subpackages, such as megatronapp/config.py); and no
import of a unit on the same floor or a higher one, in the layer order that docs/architecture.md writes down
('Layers'). In tests/, what several tests share lives in helper modules and fixtures: a test module imported by
another file would run its tests' imports and module-level set-up as a side effect, and tie one test's private
helper to its callers. The self-tests plant each kind of fault in a small tree and check that the checker names
it.
"""
from __future__ import annotations

from pathlib import Path

from tests import import_graph as ig

LAYERS = ig.read_layers((ig.REPO / "docs" / "architecture.md").read_text())


def _problems(files: dict[str, Path], layers: list[list[str]]) -> tuple[list[str], list[list[str]], list[str]]:
    """(file circles, package circles, upward imports) of a tree."""
    graph = ig.file_graph(files)
    return ig.describe_cycles(graph), ig.cycles(ig.package_graph(graph, files)), ig.upward_imports(graph, layers)


def test_the_layer_order_names_every_unit_once():
    names = [u for floor in LAYERS for u in floor]
    assert len(names) == len(set(names)), names
    units = {ig.top_unit(m) for m in ig.source_files()}
    assert set(names) == units, (f"in the code, not in docs/architecture.md's Layers: {sorted(units - set(names))}; "
                                 f"in Layers, not in the code: {sorted(set(names) - units)}")
    # the floors the engine relies on: config below parallel, the engine below every module, benchmarks on top
    order = [u for floor in reversed(LAYERS) for u in floor]
    assert order.index("config") < order.index("parallel") < order.index("pipeline") < order.index("train") \
        < min(order.index(m) for m in ("faults", "scan", "dpp", "fbd", "scope", "resilience"))
    assert LAYERS[0] == ["benchmarks"]


def test_no_import_circle_between_files():
    files = ig.source_files()
    graph = ig.file_graph(files)
    assert len(graph) > 150 and "megatronapp.config" in graph["megatronapp.parallel.device_emulation"]  # real edges
    found = ig.describe_cycles(graph)
    assert not found, "import circles between files:\n" + "\n".join(found)


def test_no_import_circle_between_packages():
    files = ig.source_files()
    found = ig.cycles(ig.package_graph(ig.file_graph(files), files))
    assert not found, "import circles between packages:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_no_import_runs_back_up_the_layers():
    found = ig.upward_imports(ig.file_graph(ig.source_files()), LAYERS)
    assert not found, ("imports of a unit on the importer's floor or above it (docs/architecture.md, 'Layers'):\n"
                       + "\n".join(found))


def test_the_checker_finds_planted_circles_and_upward_imports(tmp_path):
    """A tree with a file circle hidden in a function and a TYPE_CHECKING block, a package circle, and an
    upward import through import_module; then the same tree with those lines removed is clean."""
    root = tmp_path / "megatronapp"
    sources = {
        "__init__.py": "",
        "config.py": "HOOK = 'megatronapp.pipeline.c:plugin'  # a string is data, not an import\n",
        "parallel/__init__.py": "",
        "parallel/a.py": "from megatronapp import config\n"
                         "def f():\n"
                         "    from . import b  # PLANTED\n"
                         "    pass\n",
        "parallel/b.py": "import importlib\n"
                         "from typing import TYPE_CHECKING\n"
                         "if TYPE_CHECKING:\n"
                         "    from megatronapp.parallel.a import f  # PLANTED\n"
                         "    pass\n"
                         "def g():\n"
                         "    importlib.import_module('megatronapp.pipeline.c')  # PLANTED\n"
                         "    pass\n",
        "pipeline/__init__.py": "",
        "pipeline/c.py": "from ..parallel import a\nfrom megatronapp.config import HOOK\nimport numpy\n",
    }
    for name, text in sources.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    layers = [["pipeline"], ["parallel"], ["config"], ["__init__"]]
    files = ig.source_files([(tmp_path, "megatronapp")])
    file_circles, package_circles, upward = _problems(files, layers)
    assert file_circles == ["megatronapp.parallel.a (line 3) -> megatronapp.parallel.b (line 4) -> "
                            "megatronapp.parallel.a"]
    assert package_circles == [["megatronapp.parallel", "megatronapp.pipeline"]]
    assert upward == ["megatronapp.parallel.b:7 imports megatronapp.pipeline.c (parallel -> pipeline: up)"]
    # config and parallel on one floor: neither may import the other
    assert _problems(files, [["pipeline"], ["parallel", "config"], ["__init__"]])[2] == [
        "megatronapp.parallel.a:1 imports megatronapp.config (parallel -> config: across a floor)",
        "megatronapp.parallel.b:7 imports megatronapp.pipeline.c (parallel -> pipeline: up)"]
    assert _problems(files, [["pipeline"], ["parallel"], ["__init__"]])[2][0] == "config is not in the layer order"

    for name in ("parallel/a.py", "parallel/b.py"):
        path = root / name
        path.write_text("".join(line for line in path.read_text().splitlines(True) if "PLANTED" not in line))
    assert _problems(ig.source_files([(tmp_path, "megatronapp")]), layers) == ([], [], [])


def test_the_layers_are_read_from_their_section():
    text = "# Doc\n```\nnot this\n```\n## Layers\n\nwords\n```\ncli  # top\n\ndpp fbd\nconfig\n```\n## Next\n"
    assert ig.read_layers(text) == [["cli"], ["dpp", "fbd"], ["config"]]


def test_no_test_module_is_imported_by_another_file():
    files = ig.source_files(ig.TESTS)
    graph = ig.file_graph(files)
    assert "tests.jobs" in graph["tests.test_training"] and "tests.test_imports" in files  # real edges, all files
    found = ig.test_module_imports(graph)
    assert not found, ("test modules imported by another file (move what they share to a helper module such as "
                       "tests/jobs.py, or a fixture in tests/conftest.py):\n" + "\n".join(found))


def test_the_checker_finds_a_test_module_imported_in_a_function_or_by_a_helper(tmp_path):
    sources = {
        "__init__.py": "",
        "conftest.py": "from tests import helper\n",
        "helper.py": "HOOK = 'tests.test_b:plugin'  # a string is data, not an import\n",
        "test_a.py": "from tests.helper import HOOK\n"
                     "def test_x():\n"
                     "    from tests.test_b import _cfg  # PLANTED\n"
                     "    pass\n",
        "test_b.py": "import importlib\n"
                     "def _cfg():\n"
                     "    importlib.import_module('tests.conftest')  # PLANTED\n"
                     "    pass\n",
        "jobs.py": "from . import test_a  # PLANTED\npass\n",
    }
    root = tmp_path / "tests"
    root.mkdir()
    for name, text in sources.items():
        (root / name).write_text(text)
    trees = [(tmp_path, "tests")]
    assert ig.test_module_imports(ig.file_graph(ig.source_files(trees))) == [
        "tests.jobs:1 imports tests.test_a", "tests.test_a:3 imports tests.test_b",
        "tests.test_b:3 imports tests.conftest"]
    for name in ("test_a.py", "test_b.py", "jobs.py"):
        path = root / name
        path.write_text("".join(line for line in path.read_text().splitlines(True) if "PLANTED" not in line))
    assert ig.test_module_imports(ig.file_graph(ig.source_files(trees))) == []
