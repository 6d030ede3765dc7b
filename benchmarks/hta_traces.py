"""The public GPU profiler traces of Holistic Trace Analysis' test data (facebookresearch/HolisticTraceAnalysis,
`tests/data/`, MIT licence), used by tests/test_scan_gpu_traces.py and benchmarks/bench_scan_hta.py.

They are not shipped with this repository: `python -m benchmarks.hta_traces` downloads them (about 6 MB) into
`benchmarks/data/hta/` (git-ignored), each file checked against the SHA-256 prefix below; or point
MEGATRONAPP_HTA_DATA at a directory laid out as HTA's `tests/data/` (a clone of that repository). Tests that need
them skip, saying how to get them.
"""
from __future__ import annotations

import hashlib
import os
import sys
import urllib.request
from pathlib import Path

COMMIT = "f4d0062c382f42bd8a74838bcdad1916c7d5d2da"
URL = "https://raw.githubusercontent.com/facebookresearch/HolisticTraceAnalysis/{commit}/tests/data/{path}"
DEFAULT = Path(__file__).resolve().parent / "data" / "hta"
# (directory of a job's traces, file, sha256 prefix): what each one is in docs/megascan.md
FILES = [
    ("trace_filter", "sampled_rank-0.json.gz", "71b98c30a2751cc5"),  # 2 ranks sampled from a 128-rank job
    ("trace_filter", "sampled_rank-1.json.gz", "2f9a65fd5f319ec8"),
    ("nccl_parser_config", "nccl_data.json.gz", "c1cf9c575fdcd7bd"),  # rank 0 of 2, record_param_comms args
    ("negative_queue_length_values_check", "rank0.json.gz", "b8ce7a1a143b55dd"),  # rank 0 of 16
    ("trace_diff/control", "control.json.gz", "43ed872e4c5dc2e8"),  # rank 3 of 8
    ("trace_diff/test", "test.json.gz", "5e69e04ed19b2dbf"),  # rank 1 of 2
    ("cpu_only", "rank-34.Jul_15_10_52_41.1074.pt.trace.json.gz", "b2ff87b29bd604b0"),  # rank 34 of 300, gloo
]
JOBS = sorted({d for d, _, _ in FILES})
GPU_JOBS = [d for d in JOBS if d != "cpu_only"]


def data_dir() -> Path:
    """Where the traces are: MEGATRONAPP_HTA_DATA, else benchmarks/data/hta."""
    return Path(os.environ.get("MEGATRONAPP_HTA_DATA") or DEFAULT)


def missing(root: Path | None = None) -> list[str]:
    """The files not there (or not as published), as paths under the data directory."""
    root = root or data_dir()
    out = []
    for d, f, digest in FILES:
        p = root / d / f
        if not p.is_file() or not hashlib.sha256(p.read_bytes()).hexdigest().startswith(digest):
            out.append(f"{d}/{f}")
    return out


def fetch(root: Path = DEFAULT) -> None:
    """Download every file not yet there, checking each against its digest."""
    for d, f, digest in FILES:
        p = root / d / f
        if f"{d}/{f}" not in missing(root):
            continue
        p.parent.mkdir(parents=True, exist_ok=True)
        with urllib.request.urlopen(URL.format(commit=COMMIT, path=f"{d}/{f}"), timeout=60) as r:  # noqa: S310
            data = r.read()
        if not hashlib.sha256(data).hexdigest().startswith(digest):
            raise SystemExit(f"{d}/{f}: downloaded bytes do not match the published file; not written")
        p.write_bytes(data)
        print(f"wrote {p} ({len(data)} bytes)")


if __name__ == "__main__":
    fetch(Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT)
