#!/usr/bin/env bash
# The three short runs that pin "same numbers" across a refactor of the training loop: the quickstart
# (seed 0, short settings), an asynchronous run (train.max_staleness=1) and a DPPO run. Run them once
# on the code before and once on the code after, then compare each pair with same_numbers.py and the
# sha256 of final/adapter_model.safetensors.
#
#   PYTHONPATH=<checkout>/build/pkg benchmarks/same_numbers_runs.sh OUT_DIR
#
# OUT_DIR gets quickstart/, async_k1/ and dppo/ (each a run folder). A few minutes on 2 CPU cores.
set -euo pipefail
out=${1:?usage: same_numbers_runs.sh OUT_DIR}
export OMP_PROC_BIND=true OMP_PLACES=cores
short=(policy.precision=fp32 rollout.backend=hf rollout.seed=0 rollout.prompts_per_step=2 rollout.group_size=4
       rollout.max_new_tokens=48 train.steps=3 train.micro_batch_size=8 sft.steps=4 sft.examples=32
       eval.every=0 eval.before_sft=false eval.at_start=false eval.num_problems=4 eval.n_samples=2
       "eval.k_list=[1,2]" run.checkpoint_every=0 run.out_dir="$out")
python -m veriloop.cli train quickstart "${short[@]}" run.name=quickstart
python -m veriloop.cli train quickstart "${short[@]}" train.max_staleness=1 algo.rollout_is=truncate run.name=async_k1
python -m veriloop.cli train quickstart "${short[@]}" algo.preset=dppo run.name=dppo
for r in quickstart async_k1 dppo; do
  sha256sum "$out/$r/final/"*.safetensors "$out/$r/final/"*.pt 2>/dev/null || true
done
