"""The engine imports no module: a static walk of every import in the engine's files (function bodies included;
the walker is tests/import_graph.py, shared with test_imports.py), and a run with every module flag off that
loads no module code at all."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import megatronapp
from tests.import_graph import imported_names, module_of

PKG = Path(megatronapp.__file__).parent
ENGINE_DIRS = ("parallel", "model", "pipeline", "data", "train")
ENGINE_FILES = ("config.py", "launch.py", "tracing.py", "eager_optim.py", "errors.py", "partition.py", "flops.py",
                "device_spec.py", "startup.py")
# the modules, and fault drills (a plug-in of its own, megatronapp/faults.py)
FORBIDDEN = tuple(f"megatronapp.{m}" for m in ("scan", "dpp", "scope", "fbd", "resilience", "faults"))


def engine_files() -> list[Path]:
    files = [PKG / f for f in ENGINE_FILES]
    for d in ENGINE_DIRS:
        files += sorted((PKG / d).rglob("*.py"))
    return files


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
    hits = sorted({n.split(".")[1] for _, n in imported_names(src, module_of(src, tmp_path)) if _forbidden(n)})
    assert hits == ["dpp", "faults", "fbd", "resilience", "scan", "scope"]


def test_engine_imports_no_module():
    files = engine_files()
    assert len(files) > 20 and PKG / "train" / "trainer.py" in files
    bad = [f"{p.relative_to(PKG.parent)}:{line} imports {name}"
           for p in files for line, name in imported_names(p, module_of(p, PKG.parent)) if _forbidden(name)]
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
