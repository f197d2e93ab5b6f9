#!/usr/bin/env bash
# The three short runs that pin "same numbers" across a refactor of the training loop, on the tiny
# test model (seconds a step on 2 CPU cores):
#   quickstart  the quickstart's settings, shortened: SFT warm-up then GRPO on level-1 math, seed 0
#   async_k1    asynchronous training, train.max_staleness=1, on the long-tail test environment with
#               one turn per episode (single-turn groups make the worker's schedule deterministic:
#               every group starts right after a hand-over, under the newest weights)
#   dppo        algo.preset=dppo on the long-tail environment (multi-turn; its rewards are the
#               parity of the reply's length, so groups differ and the weights move)
# Run them once on the code before and once on the code after, then compare each pair with
# same_numbers.py and the sha256 of final/ (the adapter or model weights):
#
#   PYTHONPATH=<checkout>/build/pkg benchmarks/same_numbers_runs.sh OUT_DIR
set -euo pipefail
out=${1:?usage: same_numbers_runs.sh OUT_DIR}
here=$(cd "$(dirname "$0")/.." && pwd)
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$here/tests/algos/loop"  # long_tail_env
export OMP_NUM_THREADS=1
common=(policy.model=tiny rollout.backend=hf rollout.seed=0 rollout.prompts_per_step=2 rollout.group_size=4
        rollout.max_new_tokens=8 rollout.max_context=256 train.steps=3 train.micro_batch_size=4 train.lr=1e-2
        eval.every=0 eval.before_sft=false eval.at_start=false eval.num_problems=2 eval.n_samples=2
        "eval.k_list=[1,2]" eval.greedy=false run.checkpoint_every=0 run.tensorboard=false run.out_dir="$out"
        train.max_uninformative_steps=0)
tail_env=(env.id=long_tail_env:test/LongTail-v0 "env.kwargs={}" sft.steps=0)
python -m veriloop.cli train quickstart "${common[@]}" sft.steps=2 sft.examples=8 run.name=quickstart
python -m veriloop.cli train quickstart "${common[@]}" "${tail_env[@]}" rollout.max_turns=1 train.max_staleness=1 \
  algo.rollout_is=truncate run.name=async_k1
python -m veriloop.cli train quickstart "${common[@]}" "${tail_env[@]}" rollout.max_turns=4 algo.preset=dppo run.name=dppo
for r in quickstart async_k1 dppo; do
  (cd "$out/$r/final" && find . -type f \( -name '*.safetensors' -o -name '*.pt' \) -exec sha256sum {} + | sed "s|\./|$r/final/|")
done
