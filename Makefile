# The two commands: `make demo` and `make test`. Both create .venv on first use.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test bench lint clean browser gpu-wheels

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch pinned to the CPU build that is on disk; see docs/install-gpu.md for CUDA.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/megatronapp demo

# Chromium for the MegaScope browser test (Debian package; never `playwright install`).
browser:
	@command -v chromium >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ]; then (apt-get update -qq && apt-get install -y -qq chromium >/dev/null) || \
	    echo "warning: could not install chromium; the browser test will be skipped"; \
	  else echo "warning: chromium missing and not root; the browser test will be skipped"; fi; }

test: $(STAMP) browser
	$(BIN)/python -m pytest tests -ra --durations=25

bench: $(STAMP)
	$(BIN)/python -m benchmarks.run_all

# Wheels of MegaScope's server packages for a GPU machine without a package registry (docs/install-gpu.md):
# the versions of this .venv, built for CPython $(GPU_PY) on x86-64 Linux, into the git-ignored .whl/.
GPU_PY ?= 3.12
GPU_WHEELS := fastapi starlette uvicorn pydantic pydantic-core annotated-types annotated-doc typing-inspection \
	typing-extensions websockets
gpu-wheels: $(STAMP)
	$(BIN)/pip download -q --no-deps --only-binary=:all: --python-version $(GPU_PY) --implementation cp \
	  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
	  --platform manylinux1_x86_64 -d .whl \
	  $$(for p in $(GPU_WHEELS); do echo "$$p==$$($(BIN)/pip show $$p | sed -n 's/^Version: //p')"; done)

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks

clean:
	rm -rf $(VENV) runs .pytest_cache
