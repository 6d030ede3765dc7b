#!/usr/bin/env bash
# GPU check (docs/install-gpu.md): the CUDA paths CPU tests cannot reach, on the machine as it is. One line per
# check (PASS, FAIL or SKIP with the reason), the results as JSON in $OUT (else in the --out directory).
#   benchmarks/gpu_check.sh                      one GPU, within 8 minutes
#   benchmarks/gpu_check.sh --gpus 8             a machine with 8 GPUs
#   benchmarks/gpu_check.sh --rehearse-on-cpu    the same script on the CPU (gloo for NCCL); --quick: make test's
# Python: $PYTHON, else python3 (the machine's own torch: nothing is installed). The project runs from src/. When
# MegaScope's server packages are missing, the wheels carried in .whl/ (pure Python, or built for this Python) are
# installed into a temporary directory for this run only.
# Exit: 0 nothing failed; 1 a check failed; 2 nvidia-smi lists a GPU that torch cannot use; 124 past the limit.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
export PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}"
if ! "$PY" -c "import fastapi, uvicorn, pydantic, websockets" 2>/dev/null && compgen -G ".whl/*.whl" >/dev/null; then
  SITE="$(mktemp -d)"
  trap 'rm -rf "$SITE"' EXIT
  if "$PY" -m pip install -q --no-index --no-deps --no-compile --disable-pip-version-check --target "$SITE" \
      .whl/*.whl; then
    export PYTHONPATH="$PYTHONPATH:$SITE"
  else
    echo "gpu_check: could not install the wheels in .whl/ for $("$PY" -V 2>&1); the scope check will say so" >&2
  fi
fi
timeout 900 "$PY" -m benchmarks.gpu_check "$@"
