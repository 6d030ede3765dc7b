"""The engine imports no module: a static walk of every import in the engine's files (function bodies included),
and a run with every module flag off that loads no module code at all."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import megatronapp

PKG = Path(megatronapp.__file__).parent
ENGINE_DIRS = ("parallel", "model", "pipeline", "data", "train")
ENGINE_FILES = ("config.py", "launch.py", "tracing.py", "eager_optim.py")
# the modules, and fault drills (a plug-in of its own, megatronapp/faults.py)
FORBIDDEN = tuple(f"megatronapp.{m}" for m in ("scan", "dpp", "scope", "fbd", "resilience", "faults"))


def engine_files() -> list[Path]:
    files = [PKG / f for f in ENGINE_FILES]
    for d in ENGINE_DIRS:
        files += sorted((PKG / d).rglob("*.py"))
    return files


def _module_of(path: Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    return ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)


def imported_names(path: Path) -> list[tuple[int, str]]:
    """(line, dotted name) of everything `path` imports: import statements anywhere in the file (relative ones
    resolved), `from a import b` as a.b too (b may be a submodule), and import_module/__import__ of a literal."""
    package = _module_of(path).rsplit(".", 1)[0] if path.name != "__init__.py" else _module_of(path)
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")
                parent = parent[:len(parent) - (node.level - 1)]
                base = ".".join(parent + ([base] if base else []))
            found.append((node.lineno, base))
            found += [(node.lineno, f"{base}.{a.name}") for a in node.names]
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str):
            fn = node.func
            name = fn.attr if isinstance(fn, ast.Attribute) else getattr(fn, "id", "")
            if name in ("import_module", "__import__"):
                found.append((node.lineno, node.args[0].value))
    return found


def _forbidden(name: str) -> bool:
    return any(name == f or name.startswith(f + ".") for f in FORBIDDEN)


def test_the_walk_sees_every_import_form(tmp_path):
    """The checker itself: each way of importing a module is caught (else the real test could never fail)."""
    pkg = tmp_path / "megatronapp" / "train"
    pkg.mkdir(parents=True)
    src = pkg / "probe.py"
    src.write_text("import megatronapp.scan.record.tracer\n"
                   "from megatronapp import faults\n"
                   "from .. import dpp\n"
                   "def f():\n"
                   "    from ..scope.training import TrainingScope\n"
                   "    import importlib\n"
                   "    importlib.import_module('megatronapp.fbd')\n"
                   "    __import__('megatronapp.resilience.heartbeat')\n"
                   "from megatronapp.parallel import comm\n"
                   "HOOK = 'megatronapp.scan.record.tracer:plugin'  # a string is data, not an import\n")
    global PKG
    saved, PKG = PKG, tmp_path / "megatronapp"
    try:
        hits = sorted({n.split(".")[1] for _, n in imported_names(src) if _forbidden(n)})
    finally:
        PKG = saved
    assert hits == ["dpp", "faults", "fbd", "resilience", "scan", "scope"]


def test_engine_imports_no_module():
    files = engine_files()
    assert len(files) > 20 and PKG / "train" / "trainer.py" in files
    bad = [f"{p.relative_to(PKG.parent)}:{line} imports {name}"
           for p in files for line, name in imported_names(p) if _forbidden(name)]
    assert not bad, "the engine must reach modules through plug-ins (train/plugins.py), not imports:\n" + \
        "\n".join(bad)


def test_a_run_with_modules_off_loads_no_module_code(tmp_path):
    """Train one step (checkpoint included) in a fresh interpreter, then list the module code it loaded."""
    code = f"""
import sys
from megatronapp.train.trainer import run_rank
from tests.engine_cases import base_case
d = base_case("gpt2", **{{"model.num_layers": 2, "train.steps": 1, "train.out": {str(tmp_path)!r},
                          "train.peak_tflops": 1.0}})
run_rank(0, 1, d)
# tensorboard too: the writer is imported only with --tensorboard (start-up time)
print(sorted(m for m in sys.modules if m.startswith({FORBIDDEN!r} + ("tensorboard", "torch.utils.tensorboard"))))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         cwd=Path(__file__).parent.parent)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]"
