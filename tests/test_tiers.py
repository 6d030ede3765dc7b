"""The slow tier (tests/tiers.py) names tests that exist: a renamed or removed test must leave the list, or the
test it meant would silently run in `make test-fast`'s tier; and the hook in conftest.py marks what it lists."""
from __future__ import annotations

import ast
from pathlib import Path

from tests import tiers

TESTS = Path(__file__).resolve().parent


def _test_functions(path: Path) -> set[str]:
    return {n.name for n in ast.parse(path.read_text()).body
            if isinstance(n, ast.FunctionDef) and n.name.startswith("test_")}


def test_every_listed_test_exists():
    missing = []
    for name, listed in tiers.SLOW.items():
        path = TESTS / name
        if not path.is_file():
            missing.append(f"{name}: no such test file")
        elif listed != tiers.ALL:
            missing += [f"{name}::{f}: no such test" for f in sorted(set(listed) - _test_functions(path))]
    assert not missing, "tests/tiers.py names tests that do not exist:\n" + "\n".join(missing)


def test_listed_tests_are_marked_slow(request):
    assert tiers.is_slow("test_comm_semantics.py", "test_anything") and not tiers.is_slow("test_data.py", "x")
    items = request.session.items
    listed = [i for i in items if tiers.is_slow(i.path.name, getattr(i, "originalname", i.name))]
    assert all(i.get_closest_marker("slow") for i in listed)
    assert all(i.get_closest_marker("slow") for i in items if i.get_closest_marker("browser"))
    me = next(i for i in items if i.nodeid.endswith("::test_listed_tests_are_marked_slow"))
    assert me.get_closest_marker("slow") is None  # a fast test stays fast

