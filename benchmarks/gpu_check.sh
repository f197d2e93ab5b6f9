#!/usr/bin/env bash
# The one prepared check for a lent GPU, so its minutes go to measuring (about 6-9 minutes on one
# H200 without vLLM; the vLLM suites add theirs where vLLM's CUDA build is installed):
#   1. tests/gpu (`make test-gpu`'s suite), at most 6 minutes;
#   2. benchmarks/bench_gpu.py: weight-sync seconds and generated tokens/s, K = 0 and K = 1, for the
#      default model (where its package is installed) and a Qwen3-shaped tiny model, at most 4 minutes;
#      it writes benchmarks/results/gpu_<gpu name>.json.
# The tests' outcome goes to benchmarks/results/gpu_tests_<gpu name>.txt. Without CUDA it says so and
# exits 0, having run nothing. Run from anywhere: `bash benchmarks/gpu_check.sh` (PY=python3 to pick
# the interpreter; it needs torch with CUDA, transformers and peft, and imports veriloop from this
# checkout, without installing it).
set -u
cd "$(dirname "$0")/.."
PY=${PY:-python}
if ! $PY -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    echo "gpu_check: skipped: torch sees no CUDA GPU here ($($PY -c 'import torch; print("torch", torch.__version__)' 2>&1 | tail -1))"
    exit 0
fi
# veriloop from this checkout: the package's folders under their import names (pyproject's package-dir)
mkdir -p build/pkg/veriloop
for d in envs agents algos configs cli interop; do ln -sfn ../../../$d build/pkg/veriloop/$d; done
export PYTHONPATH=$PWD/build/pkg${PYTHONPATH:+:$PYTHONPATH}
export VLLM_LOGGING_LEVEL=WARNING
gpu=$($PY -c "import re, torch; print(re.sub(r'[^a-z0-9]+', '_', torch.cuda.get_device_name(0).lower()).strip('_'))")
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true
$PY -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__)"
log=benchmarks/results/gpu_tests_$gpu.txt
timeout 360 $PY -m pytest -q -p no:cacheprovider -rs -m cuda tests/gpu 2>&1 | tee "$log" | tail -25
tests_rc=${PIPESTATUS[0]}
timeout 240 $PY benchmarks/bench_gpu.py --steps 4
bench_rc=$?
echo "gpu_check: tests/gpu exit $tests_rc (124 = cut at 6 min), bench_gpu exit $bench_rc; results in benchmarks/results/gpu_*$gpu*"
