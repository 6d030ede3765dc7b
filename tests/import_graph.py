"""The import graph of our code, read from the source with ast (nothing is imported or run).

Every way a file can import is seen: import statements at the top, inside functions and under TYPE_CHECKING,
relative forms (resolved against the file's package), and `importlib.import_module` / `__import__` of a literal
string. A string that merely looks like a module path ("pkg.mod:fn" plug-in entries) is data, not an import.
Shared by tests/test_imports.py (cycles and layers of src/ and benchmarks/; no test module imported by another
file of tests/), test_engine_imports.py (the engine imports no module) and test_scan_imports.py (scan/'s own
graph).
"""
from __future__ import annotations

import ast
from collections.abc import Iterable, Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# (directory that holds the top package, top package): src/megatronapp and benchmarks
TREES = ((REPO / "src", "megatronapp"), (REPO, "benchmarks"))
TESTS = ((REPO, "tests"),)


def module_of(path: Path, root: Path) -> str:
    """Dotted module name of `path` under `root` (a package's __init__.py is the package)."""
    rel = path.relative_to(root).with_suffix("")
    return ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)


def _statements(path: Path, module: str) -> Iterator[tuple[int, str, list[str]]]:
    """(line, base module, names taken from it) of every import in `path`, the file of `module` (relative imports
    resolve against it); `import a.b` is (line, 'a.b', [])."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield node.lineno, a.name, []
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")
                parent = parent[:len(parent) - (node.level - 1)]
                base = ".".join(parent + ([base] if base else []))
            yield node.lineno, base, [a.name for a in node.names]
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str):
            fn = node.func
            name = fn.attr if isinstance(fn, ast.Attribute) else getattr(fn, "id", "")
            if name in ("import_module", "__import__"):
                yield node.lineno, node.args[0].value, []


def imported_names(path: Path, module: str) -> list[tuple[int, str]]:
    """(line, dotted name) of everything `path` (the file of `module`) imports; `from a import b` gives a and a.b
    (b may be a module)."""
    found: list[tuple[int, str]] = []
    for line, base, names in _statements(path, module):
        found.append((line, base))
        found += [(line, f"{base}.{n}") for n in names]
    return found


def source_files(trees: Iterable[tuple[Path, str]] = TREES) -> dict[str, Path]:
    """Module name -> file, for every .py file of the given (root, top package) trees."""
    return {module_of(p, root): p for root, top in trees for p in sorted((root / top).rglob("*.py"))}


def _resolve(name: str, known: dict[str, Path]) -> str | None:
    """The module of ours that importing `name` runs: its longest prefix that is one of ours."""
    while name:
        if name in known:
            return name
        name = name.rpartition(".")[0]
    return None


def file_graph(files: dict[str, Path]) -> dict[str, dict[str, int]]:
    """Module -> {module of `files` it imports: first line}. `from pkg import x` is an edge to pkg.x when x is a
    module, else to pkg (a name from its __init__); imports of anything else (torch, numpy) are left out."""
    graph: dict[str, dict[str, int]] = {}
    for mod, path in files.items():
        edges: dict[str, int] = {}
        for line, base, names in _statements(path, mod):
            targets = [f"{base}.{n}" if f"{base}.{n}" in files else base for n in names] or [base]
            for t in targets:
                r = _resolve(t, files)
                if r is not None and r != mod:
                    edges.setdefault(r, line)
        graph[mod] = edges
    return graph


def find_cycle(graph: dict[str, Iterable[str]]) -> list[str] | None:
    """One cycle of the graph as a path that starts and ends at the same node, or None."""
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


def cycles(graph: dict[str, Iterable[str]]) -> list[list[str]]:
    """Every strongly connected component of more than one node (each an import circle), sorted; Tarjan's."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return sorted(out)


def unit_of(module: str, files: dict[str, Path]) -> str:
    """The package a module belongs to for package-level cycles: its package, if that package is a leaf (no
    subpackages); a file directly in a package that has subpackages (megatronapp/config.py) is a unit of its own."""
    package = module if files[module].name == "__init__.py" else module.rpartition(".")[0]
    has_sub = any(m.startswith(package + ".") and files[m].name == "__init__.py" for m in files)
    return module if has_sub else package


def package_graph(graph: dict[str, dict[str, int]], files: dict[str, Path]) -> dict[str, set[str]]:
    """The file graph with each module replaced by its unit (`unit_of`), edges inside a unit dropped."""
    unit = {m: unit_of(m, files) for m in files}
    out: dict[str, set[str]] = {u: set() for u in unit.values()}
    for m, edges in graph.items():
        out[unit[m]] |= {unit[d] for d in edges if unit[d] != unit[m]}
    return out


def top_unit(module: str) -> str:
    """The unit a module has in the layer order: the top-level file or package of megatronapp it is in
    (megatronapp.parallel.comm -> parallel, megatronapp.config -> config, megatronapp -> __init__), or the
    top package itself for any other tree (benchmarks)."""
    parts = module.split(".")
    if parts[0] != "megatronapp":
        return parts[0]
    return parts[1] if len(parts) > 1 else "__init__"


def read_layers(text: str) -> list[list[str]]:
    """The layer order written in docs/architecture.md: the first fenced block after the '## Layers' heading, one
    floor per line, top floor first; names on one line are one floor; '#' starts a comment."""
    section = text.split("\n## Layers", 1)[1]
    block = section.split("```", 2)[1]
    floors = [line.split("#", 1)[0].split() for line in block.splitlines()[1:]]
    return [f for f in floors if f]


def upward_imports(graph: dict[str, dict[str, int]], layers: list[list[str]]) -> list[str]:
    """Every import of a unit on the same floor or one above the importer's (as 'a:line imports b (x -> y)'), and
    every unit missing from the layers."""
    floor = {u: len(layers) - i for i, names in enumerate(layers) for u in names}  # higher number: higher floor
    out = sorted({f"{top_unit(m)} is not in the layer order" for m in graph if top_unit(m) not in floor})
    for m, edges in sorted(graph.items()):
        a = top_unit(m)
        for d, line in sorted(edges.items()):
            b = top_unit(d)
            if a != b and a in floor and b in floor and floor[b] >= floor[a]:
                how = "up" if floor[b] > floor[a] else "across a floor"
                out.append(f"{m}:{line} imports {d} ({a} -> {b}: {how})")
    return out


def describe_cycles(graph: dict[str, dict[str, int]]) -> list[str]:
    """Each import circle of the graph as one path with the line of every import on it."""
    out = []
    for comp in cycles(graph):
        inside = {m: [d for d in graph[m] if d in comp] for m in comp}
        path = find_cycle(inside) or comp
        out.append(" -> ".join(f"{a} (line {graph[a][b]})" for a, b in zip(path, path[1:])) + f" -> {path[-1]}")
    return out


def is_test_module(module: str) -> bool:
    """A module pytest collects or loads by itself (test_*.py, conftest.py): never imported by name."""
    name = module.rpartition(".")[2]
    return name.startswith("test_") or name == "conftest"


def test_module_imports(graph: dict[str, dict[str, int]]) -> list[str]:
    """Every import of a test module by another file, as 'a:line imports b': what several tests share belongs
    in a helper module (tests/jobs.py, tests/conftest.py's fixtures), not in one of the tests."""
    return [f"{m}:{line} imports {d}" for m, edges in sorted(graph.items())
            for d, line in sorted(edges.items()) if is_test_module(d)]
