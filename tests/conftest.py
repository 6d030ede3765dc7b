"""Test-wide settings, the slow tier, and the fixtures several test files share, each launched at most once per
session.

Shared code lives in plain helper modules (tests/jobs.py, tests/traced_job.py, tests/scope_cases.py, ...), never
in a test module: no test imports another (tests/test_imports.py checks it). `make test-fast` leaves out the tests
marked `slow`: in their file, or listed in tests/tiers.py; `make test` runs everything.
"""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tests import jobs, tiers
from tests import traced_job as traced
from tests.tmpdirs import session_dir

# Tiny models on a 2-core machine shared with spawned ranks: several intra-op threads per process only contend
# (seen here: tiny matmuls up to 100x slower with 2 threads under load).
torch.set_num_threads(1)  # every test module: the model, TP and HF tests rely on it


@pytest.hookimpl(tryfirst=True)  # before -m selects on the marker
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark the tests tests/tiers.py lists, and every test that drives a browser, as slow."""
    for item in items:
        if tiers.is_slow(item.path.name, getattr(item, "originalname", item.name)) \
                or item.get_closest_marker("browser"):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def uninterrupted(tmp_path_factory) -> Callable[[list[str]], Path]:
    """`uninterrupted(flags)`: the run directory of the job of `flags` trained without a fault (tests/jobs.py),
    trained the first time any test asks for that job (saving flags aside) and shared after that."""
    done: dict[tuple[str, ...], Path] = {}

    def run(flags: list[str]) -> Path:
        key = jobs.baseline_key(flags)
        if key not in done:
            done[key] = jobs.train_uninterrupted(flags, tmp_path_factory.mktemp("uninterrupted") / "run")
        return done[key]

    return run


@pytest.fixture(scope="session")
def traced_job() -> tuple[Path, int]:
    """The 4-rank MegaScan job with skewed and drifting clocks (tests/traced_job.py): (trace dir, T0 of the
    drift), launched once for the tracer, aggregate, align and rank-summary tests."""
    out = session_dir("megascan-") / "trace"
    return out, traced.launch(out)
