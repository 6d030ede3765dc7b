"""Scratch directories for jobs launched once per test session (shared through lru_cache, not fixtures)."""
from __future__ import annotations

import atexit
import shutil
import tempfile
from pathlib import Path


def session_dir(prefix: str) -> Path:
    """A fresh directory removed when the test process exits: a launched job's traces run to tens of MB, and
    plain mkdtemp left ~900 MB of them in /tmp after a dozen suite runs."""
    out = Path(tempfile.mkdtemp(prefix=prefix))
    atexit.register(shutil.rmtree, out, ignore_errors=True)
    return out
