"""Run a snippet in a child process whose address space is capped (RLIMIT_AS): an allocation sized by a file's
claim fails there, with a MemoryError traceback, instead of taking this machine's memory."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SRC = str(Path(__file__).resolve().parents[1] / "src")
GIB = 1 << 30

_PRELUDE = ("import resource, time\n"
            "resource.setrlimit(resource.RLIMIT_AS, ({cap}, {cap}))\n"
            "t0 = time.monotonic()\n")


def run_capped(code: str, cap_bytes: int = GIB, timeout: float = 300.0) -> subprocess.CompletedProcess:
    """Run `code` (Python source) under an address-space cap of `cap_bytes`; it may read `t0`, the monotonic time
    after the cap was set. The result's stdout and stderr are text."""
    return subprocess.run([sys.executable, "-c", _PRELUDE.format(cap=int(cap_bytes)) + code], capture_output=True,
                          text=True, timeout=timeout,
                          env={"PYTHONPATH": SRC, "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1",
                               "OPENBLAS_NUM_THREADS": "1"})
