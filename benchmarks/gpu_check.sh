#!/usr/bin/env bash
# GPU check: bf16 training, MegaScan's CUDA-event tracing and MegaScope serving on one CUDA GPU, in under
# 10 minutes (what each check asserts: benchmarks/gpu_check.py). Prints PASS/FAIL per check and a summary.
# Usage: benchmarks/gpu_check.sh [--out DIR]
# Exit: 0 all passed, or no CUDA GPU (prints "no CUDA GPU: skipped"); 1 a check failed; 124 over 10 minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
[ -x "$PY" ] || PY=python3
exec timeout 600 "$PY" -m benchmarks.gpu_check "$@"
