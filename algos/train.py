"""The RL training loop, top to bottom.

rollout (with dynamic sampling when on) -> shaping and advantages -> epochs x mini-batches of
updates -> metrics -> periodic evaluation -> checkpoint. Every algorithm runs through this one
loop; which parts it uses was decided by ``cfg.algo`` before the loop starts.
"""

from __future__ import annotations

import math
import os
import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch
import yaml

import veriloop.envs  # noqa: F401  (registers the environments)
from veriloop.agents.atomic import write_text_atomic
from veriloop.agents.backends import Backend, make_backend
from veriloop.agents.drift import drift_rate
from veriloop.agents.engine import EpisodeSpec, RolloutLimits, rollout
from veriloop.agents.loading import LoraSettings, load_policy, save_policy
from veriloop.agents.policy import Policy
from veriloop.agents.sampling_params import SamplingParams
from veriloop.agents.trajectory import Trajectory
from veriloop.algos.batch import TokenBatch, minibatches
from veriloop.algos.checkpoint import check_finite, latest_checkpoint, load_checkpoint, save_checkpoint
from veriloop.algos.critic import ValueModel
from veriloop.algos.distributed import DistContext, init_distributed, shutdown_distributed
from veriloop.algos.evaluate import final_sample, run_summary
from veriloop.algos.mixture import assign_envs, per_env_metrics
from veriloop.algos.progress import Progress, say
from veriloop.algos.run_log import RunLog
from veriloop.algos.sampling import dynamic_sampling, is_informative, verifier_failed
from veriloop.algos.update import METRIC_NAMES, learning_signal, loss_normalisers, prepare_batch, update_step
from veriloop.configs.loader import config_to_yaml, dump_config
from veriloop.configs.schema import ConfigError, ExperimentConfig

SINGLE_PROCESS = DistContext()


class NonFiniteTrainingError(RuntimeError):
    """Too many consecutive steps had a NaN/inf loss or gradient."""


@dataclass
class TrainerState:
    """Everything besides weights/optimizer that a resumed run needs to continue exactly."""

    step: int = 0
    next_seed: int = 0
    consecutive_nonfinite: int = 0
    skipped_steps: int = 0
    sft_done: bool = False
    history: dict[str, Any] = field(default_factory=dict)


# ----------------------------------------------------------------------------------------- setup


def _modules(names: str | list[str]) -> str | tuple[str, ...]:
    """``policy.target_modules`` as ``LoraSettings`` stores it (a list from YAML becomes a tuple)."""
    return names if isinstance(names, str) else tuple(names)


def build_policy(cfg: ExperimentConfig) -> Policy:
    """The policy as ``cfg.policy`` describes it: LoRA or full, reference only if KL needs it."""
    p = cfg.policy
    if p.model == "tiny":  # a tiny random model with the real tokenizer: for tests and smoke runs
        from veriloop.agents.testing import tiny_policy

        return tiny_policy(
            lora=p.lora, seed=cfg.rollout.seed, keep_reference=cfg.keep_reference and not p.lora
        )
    lora = LoraSettings(r=p.lora_r, alpha=p.lora_alpha, dropout=p.lora_dropout,
                        target_modules=_modules(p.target_modules)) if p.lora else None  # fmt: skip
    return load_policy(p.model, lora=lora, dtype=p.dtype, keep_reference=cfg.keep_reference and not p.lora)


def build_critic(cfg: ExperimentConfig, policy: Policy) -> ValueModel | None:
    if not cfg.algo.needs_critic:
        return None
    if cfg.algo.critic == "separate":
        return ValueModel.separate(policy.model)  # the policy's pretrained weights + a fresh head
    return ValueModel(policy.model)  # value head on the policy's own backbone


def build_optimizer(
    cfg: ExperimentConfig, policy: Policy, critic: ValueModel | None
) -> torch.optim.Optimizer:
    params = {id(p): p for p in policy.trainable_parameters()}
    if critic is not None:  # the shared backbone's parameters are already in; add the head (or model)
        params.update({id(p): p for p in critic.parameters() if p.requires_grad})
    return torch.optim.AdamW(list(params.values()), lr=cfg.train.lr, weight_decay=cfg.train.weight_decay)


def lr_lambda(cfg: ExperimentConfig) -> Any:
    """Linear warm-up, then constant / linear decay / cosine, as a multiplier of ``train.lr``."""
    warm, total, shape = cfg.train.warmup_steps, max(cfg.train.steps, 1), cfg.train.schedule

    def factor(step: int) -> float:
        if step < warm:
            return (step + 1) / warm
        progress = (step - warm) / max(total - warm, 1)
        if shape == "linear":
            return max(0.0, 1.0 - progress)
        if shape == "cosine":
            return 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))
        return 1.0

    return factor


def _trainable_state(policy: Policy, critic: ValueModel | None) -> dict[str, torch.Tensor]:
    """Only what training changes (LoRA adapters, or all weights), plus a critic's head/model."""
    state = {f"policy.{n}": p.detach() for n, p in policy.model.named_parameters() if p.requires_grad}
    if critic is not None:
        state.update({f"critic.{n}": p.detach() for n, p in critic.named_parameters()
                      if p.requires_grad and not n.startswith("backbone.")})  # fmt: skip
        if critic.backbone is not policy.model:
            state.update({f"critic.{n}": p.detach() for n, p in critic.backbone.named_parameters()})
    return state


def _load_trainable_state(policy: Policy, critic: ValueModel | None, state: dict[str, torch.Tensor]) -> None:
    targets = dict(policy.model.named_parameters())
    heads = dict(critic.named_parameters()) if critic is not None else {}
    with torch.no_grad():
        for key, value in state.items():
            scope, name = key.split(".", 1)
            table = targets if scope == "policy" else heads
            if name not in table:
                raise KeyError(
                    f"checkpoint holds {key!r}, which this model does not have: wrong config for resume?"
                )
            table[name].copy_(value)


# ---------------------------------------------------------------------------------------- rollout


def _sampling(cfg: ExperimentConfig, stream: int) -> SamplingParams:
    r = cfg.rollout
    return SamplingParams(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                          max_new_tokens=r.max_new_tokens, seed=r.seed * 100_003 + stream)  # fmt: skip


def _limits(cfg: ExperimentConfig) -> RolloutLimits:
    r = cfg.rollout
    return RolloutLimits(max_new_tokens=r.max_new_tokens, max_context=r.max_context, max_turns=r.max_turns)


def collect(
    cfg: ExperimentConfig,
    policy: Policy,
    state: TrainerState,
    dist: DistContext = SINGLE_PROCESS,
    backend: Backend | None = None,
) -> tuple[list[Trajectory], list[Trajectory], dict[str, float]]:
    """One step's experience: ``prompts_per_step`` groups of ``group_size`` episodes.

    Each group is one env seed (same problem); seeds advance monotonically so training never
    repeats a problem and a resumed run continues where it stopped. With dynamic sampling,
    all-equal-reward groups are dropped and more are sampled (DAPO). With several processes each
    rank plays its share of the groups and every rank ends up with all of them, in seed order.

    Returns:
        the episodes to train on, every episode sampled (for metrics: verifier failures that
        dynamic sampling removed still count), and the sampling metrics.
    """
    rounds = 0
    sampled: list[Trajectory] = []
    g = cfg.rollout.group_size
    envs = cfg.env.training_envs

    def sample_groups(n: int) -> list[list[Trajectory]]:
        nonlocal rounds
        seeds = dist.shard(range(state.next_seed, state.next_seed + n))  # this rank's problems
        state.next_seed += n
        # each problem from one environment (a mixture draws it by weight, from the seed alone)
        names = assign_envs(cfg.env.mixture_weights, seeds, cfg.rollout.seed)
        specs = [EpisodeSpec(envs[e].id or cfg.env.id, dict(envs[e].kwargs), s, s)
                 for s, e in zip(seeds, names) for _ in range(g)]  # fmt: skip
        # one sampling stream per (step, round, rank): reproducible, and distinct across ranks
        stream = (state.step * 16 + rounds) * 64 + dist.rank
        mine = rollout(policy, specs, sampling=_sampling(cfg, stream), limits=_limits(cfg), backend=backend,
                       system_prompt=cfg.env.system_prompt) if specs else []  # fmt: skip
        rounds += 1
        groups = dist.gather_shards([mine[i : i + g] for i in range(0, len(mine), g)])
        sampled.extend(t for group in groups for t in group)
        return groups

    n = cfg.rollout.prompts_per_step
    if cfg.algo.dynamic_sampling:
        groups, stats = dynamic_sampling(sample_groups, num_groups=n, max_rounds=cfg.algo.max_sampling_rounds,
                                         reward_fn=partial(learning_signal, cfg=cfg.algo))  # fmt: skip
        metrics = {"sampling/rounds": stats["rounds"], "sampling/kept_fraction": stats["kept_fraction"],
                   "sampling/informative_fraction": stats["informative_fraction"],
                   "sampling/short_batch": stats["short_batch"]}  # fmt: skip
    else:
        groups = sample_groups(n)
        useful = [is_informative([learning_signal(t, cfg.algo) for t in grp]) for grp in groups]
        informative = sum(useful) / max(len(useful), 1)
        metrics = {"sampling/rounds": 1.0, "sampling/kept_fraction": 1.0,
                   "sampling/informative_fraction": informative, "sampling/short_batch": 0.0}  # fmt: skip
    return [t for group in groups for t in group], sampled, metrics


def rollout_metrics(trajs: Sequence[Trajectory], tokenizer: Any) -> dict[str, float]:
    """The same names for every algorithm (reward, success, length, truncation, verifier, drift).

    Verifier errors and timeouts count episodes with a failed verification on any turn.
    """
    rewards = torch.tensor([t.total_reward for t in trajs], dtype=torch.float64)
    lengths = torch.tensor([t.num_generated_tokens for t in trajs], dtype=torch.float64)
    final = [final_sample(t) for t in trajs]  # the last judged response (verify turns have none)
    errors = [{tr.verdict.error if tr.verdict is not None else None for tr in t.turns} for t in trajs]
    drift_sample = trajs[: min(8, len(trajs))]
    return {
        "reward/mean": float(rewards.mean()),
        "reward/std": float(rewards.std()) if len(trajs) > 1 else 0.0,
        "success_rate": sum(f.correct for f in final) / len(trajs),
        "response_length/mean": float(lengths.mean()),
        "response_length/max": float(lengths.max()),
        "truncation_rate": sum(any(tr.hit_token_limit for tr in t.turns) for t in trajs) / len(trajs),
        "turns/mean": sum(t.num_turns for t in trajs) / len(trajs),
        "verifier/errors": float(sum(verifier_failed(t) for t in trajs)),
        "verifier/timeouts": float(sum("timeout" in e for e in errors)),
        "drift_rate": sum(drift_rate(tokenizer, t) for t in drift_sample) / max(len(drift_sample), 1),
    }


# ------------------------------------------------------------------------------------------ update


def _reference(cfg: ExperimentConfig, policy: Policy) -> dict[str, Any]:
    """Where reference log-probs come from: the frozen copy (full fine-tuning) or the same model
    with its adapter disabled (LoRA); nothing when the algorithm has no KL term."""
    if not cfg.algo.needs_reference:
        return {}
    if policy.is_lora:
        return {"ref_model_ctx": policy.model.disable_adapter}
    if policy.frozen_reference is None:
        raise RuntimeError(
            "algo.kl_coef > 0 with full fine-tuning needs policy.keep_reference (a frozen copy)"
        )
    return {"ref_model": policy.frozen_reference}


def kl_to_reference(batch: TokenBatch) -> float | None:
    """Approximate KL(pi_old || pi_ref) over the sampled tokens (k3 estimator, Schulman 2020):
    mean over loss-mask tokens of exp(d) - d - 1 with d = log pi_ref - log pi_old. None without a
    reference (the metric is then written as null, never as a made-up 0)."""
    if batch.ref_logprobs is None:
        return None
    m = batch.loss_mask.bool()  # [B, T]
    d = (batch.ref_logprobs - batch.old_logprobs).double()[m]
    return float((d.exp() - d - 1).mean()) if d.numel() else 0.0


def train_on_batch(cfg: ExperimentConfig, policy: Policy, critic: ValueModel | None, optimizer: torch.optim.Optimizer,
                   trajs: list[Trajectory], generator: torch.Generator,
                   dist: DistContext = SINGLE_PROCESS) -> dict[str, float]:  # fmt: skip
    """Advantages once per rollout, then ``algo.epochs`` passes of mini-batch updates.

    Every rank holds the whole batch (same advantages, same mini-batch order); with several
    ranks each trains rows ``rank::world`` of a mini-batch and the gradients are summed.
    """
    pad = policy.tokenizer.pad_token_id or 0
    ref = _reference(cfg, policy)
    policy.model.eval()  # reference / old values without dropout
    r = cfg.rollout
    # top-k / top-p: the recorded log-probs are of the filtered distribution; take the model's own
    truncated = r.top_k > 0 or r.top_p < 1.0
    batch, adv_metrics = prepare_batch(trajs, cfg.algo, model=policy.model, critic=critic, pad_id=pad,
                                       temperature=r.temperature, recompute_old_logprobs=truncated, **ref)  # fmt: skip
    policy.model.train()
    sums: dict[str, float] = {}
    updates = 0
    for _ in range(cfg.algo.epochs):
        for mb in minibatches(batch, cfg.mini_batch_size, shuffle=generator):
            part = mb.select(torch.arange(dist.rank, mb.size, dist.world_size)) if dist.enabled else mb
            # every rank's loss is normalised by the whole mini-batch's counts: gradients just add up
            sync: dict[str, Any] = (
                {"on_before_step": dist.grad_sync(1.0), **loss_normalisers(mb)} if dist.enabled else {}
            )
            m = update_step(policy.model, optimizer, part, cfg.algo, micro_batch_size=cfg.train.micro_batch_size,
                            micro_batch_tokens=cfg.train.micro_batch_tokens, max_grad_norm=cfg.train.max_grad_norm or float("inf"),
                            ref_model_ctx=ref.get("ref_model_ctx"), critic=critic,
                            max_new_tokens=r.max_new_tokens, temperature=r.temperature, **sync)  # fmt: skip
            for k, v in m.items():
                sums[k] = sums.get(k, 0.0) + v
            updates += 1
    policy.model.eval()
    out = {k: v / max(updates, 1) for k, v in sums.items()}
    out["skipped"] = sums.get("skipped", 0.0)  # count, not mean
    out["updates"] = float(updates)
    out["train_tokens"] = float(batch.loss_mask.sum())
    out["kl_ref"] = kl_to_reference(batch)  # type: ignore[assignment]
    return {**out, **adv_metrics}


# -------------------------------------------------------------------------------------- run folder

#: Settings a resumed run may change from the saved config (how long, how often, how it is measured).
RESUMABLE_CHANGES = ("train.steps", "eval.", "run.checkpoint_every", "run.keep_last", "run.tensorboard",
                     "run.wandb", "train.log_every")  # fmt: skip


def claim_run_dir(run_dir: Path, cfg: ExperimentConfig, *, resume: bool, overwrite: bool) -> None:
    """Make ``run_dir`` this run's own, or stop before anything is written or loaded.

    A new or empty folder is used as is. An existing run is continued only with ``resume`` (and
    a config that matches its ``config.yaml`` but for :data:`RESUMABLE_CHANGES`), replaced only
    with ``overwrite``; otherwise :class:`ConfigError` says so and nothing in it changes.
    """
    existing = run_dir.is_dir() and any(run_dir.iterdir())
    if existing and resume and overwrite:
        raise ConfigError("--resume continues a run and --overwrite deletes it: give only one")
    if existing and not resume and not overwrite:
        raise ConfigError(
            f"run folder {run_dir} already holds a run; nothing was changed. Continue it with --resume, "
            f"replace it with --overwrite, or choose another name (run.name=...)"
        )
    if existing and resume:
        _check_resume_config(run_dir, cfg)
    if existing and overwrite:
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    write_text_atomic(run_dir / "config.yaml", config_to_yaml(cfg))


def _check_resume_config(run_dir: Path, cfg: ExperimentConfig) -> None:
    saved_file = run_dir / "config.yaml"
    if not saved_file.is_file():
        return
    saved = _flatten(yaml.safe_load(saved_file.read_text()) or {})
    now = _flatten(dump_config(cfg))
    changed = sorted(k for k in saved.keys() | now.keys()
                     if saved.get(k) != now.get(k) and not k.startswith(RESUMABLE_CHANGES))  # fmt: skip
    if changed:
        diff = "; ".join(f"{k}: {saved.get(k)!r} -> {now.get(k)!r}" for k in changed[:6])
        raise ConfigError(
            f"--resume: the config differs from the one {run_dir} was trained with ({diff}); resume with "
            "the saved config (`veriloop train RUN/config.yaml --resume`), or start a new run.name"
        )


def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, dict):
        return {k: v for key, sub in tree.items() for k, v in _flatten(sub, f"{prefix}{key}.").items()}
    return {prefix.rstrip("."): tree}


# -------------------------------------------------------------------------------------------- loop


def train(
    cfg: ExperimentConfig, *, resume: bool = False, overwrite: bool = False, quiet: bool = False
) -> Path:
    """Run ``cfg`` and return the run folder (metrics.jsonl, config.yaml, checkpoints/, final/).

    An existing run folder is never written into unless asked: ``resume`` continues it (the
    config must match the saved one but for the settings in :data:`RESUMABLE_CHANGES`),
    ``overwrite`` deletes it first; otherwise :class:`ConfigError` names both, before any model
    loads (see :func:`claim_run_dir`).

    Under ``accelerate launch`` / ``torchrun`` with several processes this is data-parallel (see
    :mod:`veriloop.algos.distributed`); only rank 0 writes anything.
    """
    cfg.validate()
    cfg.env.resolve()  # the environments exist (users' modules imported) before anything slow
    if cfg.sft.steps > 0:
        from veriloop.algos.sft_data import check_source

        check_source(cfg.sft.source, cfg.env.id, cfg.env.kwargs)
    dist = init_distributed()
    quiet = quiet or not dist.is_main
    run_dir = Path(cfg.run.out_dir) / cfg.run_name
    if dist.is_main:
        claim_run_dir(run_dir, cfg, resume=resume, overwrite=overwrite)
    torch.manual_seed(cfg.rollout.seed)
    policy = build_policy(cfg)
    critic = build_critic(cfg, policy)
    optimizer = build_optimizer(cfg, policy, critic)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg))
    # SFT demonstrations use env seeds seed .. seed + examples - 1; RL problems come after them
    sft_seeds = cfg.sft.examples if cfg.sft.steps > 0 else 0
    state = TrainerState(next_seed=cfg.rollout.seed + sft_seeds)
    generator = torch.Generator().manual_seed(cfg.rollout.seed)

    ckpt = dist.broadcast_object(latest_checkpoint(run_dir) if resume and dist.is_main else None)
    if ckpt is not None:  # every rank reads the same folder (shared file system)
        loaded = load_checkpoint(ckpt)  # also restores the python/numpy/torch RNG states
        _load_trainable_state(policy, critic, loaded["model_state"])
        optimizer.load_state_dict(loaded["optimizer"])
        scheduler.load_state_dict(loaded["scheduler"])
        state = TrainerState(**loaded["trainer_state"]["state"])
        generator.set_state(torch.tensor(loaded["trainer_state"]["generator"], dtype=torch.uint8))
        _say(quiet, f"resumed from {ckpt} at step {state.step}")
    elif resume:
        _say(quiet, f"--resume: no complete checkpoint in {run_dir}/checkpoints, starting fresh")

    if cfg.sft.steps > 0 and not state.sft_done:
        from veriloop.algos.sft_train import warmup_from_config

        if dist.is_main and cfg.eval.before_sft:  # the base model, logged with step 0 as eval_base/...
            state.history["eval_base"] = _evaluate(cfg, policy, 0, quiet, tag="base", prefix="eval_base")

        # every rank runs the same warm-up; only rank 0 saves it, and its weights are broadcast below
        sft_metrics = warmup_from_config(cfg, policy, run_dir=run_dir / "sft" if dist.is_main else None)
        state.sft_done = True
        state.history["sft"] = sft_metrics
        _say(quiet, f"SFT warm-up done: {sft_metrics}")

    dist.broadcast_params(list(_trainable_state(policy, critic).values()))  # all ranks: rank 0's weights
    # a resumed run keeps the rows up to its checkpoint's step; a fresh run starts an empty file
    log = RunLog(run_dir, tensorboard=cfg.run.tensorboard, resume_from_step=state.step + 1 if ckpt else 0,
                 wandb_project="veriloop" if cfg.run.wandb else None) if dist.is_main else None  # fmt: skip
    try:
        if state.step == 0 and log is not None:  # the base policy's numbers, for comparison
            start = _evaluate(cfg, policy, 0, quiet) if cfg.eval.at_start or cfg.train.steps == 0 else {}
            base = {**state.history.get("eval_base", {}), **start}
            if base:
                log.log(0, base)
        _loop(cfg, policy, critic, optimizer, scheduler, state, generator, log, run_dir, quiet, dist)
        if dist.is_main:
            if any((run_dir / "eval").glob("*.json")):
                (run_dir / "summary.md").write_text(run_summary(run_dir / "eval"))
            save_policy(policy, run_dir / "final", card=_model_card(cfg, run_dir, state))
    finally:
        if log is not None:
            log.close()
        dist.barrier()
        shutdown_distributed(dist)
    return run_dir


def _loop(cfg, policy, critic, optimizer, scheduler, state, generator, log, run_dir, quiet, dist) -> None:  # type: ignore[no-untyped-def]
    # vLLM: one engine for the run, updated in place after every optimizer step
    backend = (
        make_backend("vllm", policy, **cfg.rollout.vllm_kwargs) if cfg.rollout.backend == "vllm" else None
    )
    bar = Progress(cfg.train.steps, "train", "steps", initial=state.step, quiet=quiet)
    _say(quiet, f"RL: {cfg.train.steps - state.step} steps of {cfg.rollout.batch_size} episodes "
                f"({cfg.rollout.prompts_per_step} problems x {cfg.rollout.group_size}), algorithm {cfg.algo.name}")  # fmt: skip
    for step in range(state.step, cfg.train.steps):
        t0 = time.perf_counter()
        trajs, sampled, sampling = collect(cfg, policy, state, dist, backend)
        metrics: dict[str, Any] = dict(sampling)
        t_rollout = time.perf_counter() - t0
        metrics.update(rollout_metrics(sampled, policy.tokenizer))
        if cfg.env.mixture:
            envs = {n: (str(e.id), e.kwargs) for n, e in cfg.env.training_envs.items()}
            metrics.update(per_env_metrics(sampled, envs))
        t1 = time.perf_counter()
        # dynamic sampling may keep no group at all (every group had equal rewards): nothing to learn
        if trajs:
            metrics.update(train_on_batch(cfg, policy, critic, optimizer, trajs, generator, dist))
            if backend is not None:
                backend.sync()  # type: ignore[attr-defined]
        else:
            metrics.update(_no_update())
        t_train = time.perf_counter() - t1
        scheduler.step()
        gen_tokens = sum(t.num_generated_tokens for t in sampled)
        metrics.update({
            "lr": scheduler.get_last_lr()[0],
            "time/rollout_s": t_rollout, "time/train_s": t_train,
            "time/rollout_fraction": t_rollout / max(t_rollout + t_train, 1e-9),
            "throughput/rollout_tokens_per_s": gen_tokens / max(t_rollout, 1e-9),
            "throughput/train_tokens_per_s": metrics["train_tokens"] / max(t_train, 1e-9),
        })  # fmt: skip
        _guard_nonfinite(cfg, state, metrics)
        state.step = step + 1
        every_eval = cfg.eval.every
        if dist.is_main and ((every_eval and state.step % every_eval == 0) or state.step == cfg.train.steps):
            metrics.update(_evaluate(cfg, policy, state.step, quiet))
        if log is not None and (state.step % cfg.train.log_every == 0 or state.step == cfg.train.steps):
            log.log(state.step, metrics)
        bar.set_postfix(_summary(metrics))
        _say(quiet, f"step {state.step:4d}/{cfg.train.steps} | {_summary(metrics)}")
        bar.update()
        every = cfg.run.checkpoint_every
        if dist.is_main and ((every and state.step % every == 0) or state.step == cfg.train.steps):
            _checkpoint(cfg, policy, critic, optimizer, scheduler, state, generator, run_dir)
    bar.close()


def _no_update() -> dict[str, float | None]:
    """Update metrics of a step without a batch: the same keys, null values, zero updates."""
    return {
        **dict.fromkeys(METRIC_NAMES),
        "kl_ref": None,
        "skipped": 0.0,
        "updates": 0.0,
        "train_tokens": 0.0,
    }


def _guard_nonfinite(cfg: ExperimentConfig, state: TrainerState, metrics: dict[str, float]) -> None:
    """A skipped (non-finite) step is counted; several in a row stop the run."""
    if metrics.get("skipped", 0.0) > 0:
        state.skipped_steps += 1
        state.consecutive_nonfinite += 1
    else:
        state.consecutive_nonfinite = 0
    metrics["nonfinite_skipped_total"] = float(state.skipped_steps)
    if state.consecutive_nonfinite >= cfg.train.max_consecutive_nonfinite:
        raise NonFiniteTrainingError(
            f"{state.consecutive_nonfinite} consecutive steps had a non-finite loss or gradient and were skipped; "
            "lower train.lr, set train.max_grad_norm, or resume from the last checkpoint (non-finite weights "
            "are never checkpointed)"
        )


#: Test hook: seconds to sleep inside a checkpoint save, after the weights are written and before
#: the rest, so a test can ``kill -9`` the process mid-save (tests/algos/test_train_resume.py).
SAVE_DELAY_ENV = "VERILOOP_TEST_SAVE_DELAY"


def _checkpoint(cfg, policy, critic, optimizer, scheduler, state, generator, run_dir) -> None:  # type: ignore[no-untyped-def]
    """Atomic save (see ``algos/checkpoint.py``); refuses non-finite weights, keeps the last K."""
    trainer_state = {"state": dict(state.__dict__), "generator": generator.get_state().tolist()}
    weights = _trainable_state(policy, critic)
    check_finite(weights.items())  # the critic too; save_checkpoint checks the policy model again
    delay = float(os.environ.get(SAVE_DELAY_ENV, "0") or 0)

    def save_model(folder: Path) -> None:
        torch.save(weights, folder / "model.pt")
        if delay > 0:
            time.sleep(delay)

    save_checkpoint(run_dir, state.step, model=policy.model, save_model=save_model, optimizer=optimizer,
                    scheduler=scheduler, trainer_state=trainer_state, keep_last=cfg.run.keep_last)  # fmt: skip


def _evaluate(cfg: ExperimentConfig, policy: Policy, step: int, quiet: bool, *, tag: str | None = None,
              prefix: str = "eval") -> dict[str, float]:  # fmt: skip
    from veriloop.algos.evaluate import evaluate_config, write_report

    splits = cfg.env.resolved_eval_splits
    _say(quiet, f"evaluating {_checkpoint_label(cfg, step, tag)}: {len(splits)} split(s) ({', '.join(splits)}) x "
                f"{cfg.eval.num_problems} problems x {cfg.eval.n_samples} samples")  # fmt: skip
    report = evaluate_config(cfg, policy, step=step)
    report["meta"]["checkpoint"] = _checkpoint_label(cfg, step, tag)
    write_report(report, Path(cfg.run.out_dir) / cfg.run_name / "eval", tag or f"step-{step:06d}")
    flat = {f"{prefix}/{split}/{k}": float(v) for split, m in report["splits"].items()
            for k, v in m.items() if isinstance(v, int | float) and not isinstance(v, bool)}  # fmt: skip
    shown = ", ".join(f"{k}={v:.3f}" for k, v in flat.items() if k.endswith("avg@n"))
    _say(quiet, f"{prefix} @{step}: {shown}")
    return flat


def _checkpoint_label(cfg: ExperimentConfig, step: int, tag: str | None) -> str:
    """What was evaluated, in words: the tables name it instead of the model's file name."""
    if tag == "base":
        return "base model (before SFT)"
    if step == 0:
        return "start (after SFT)" if cfg.sft.steps > 0 else "base model (step 0)"
    return f"RL step {step}"


def _model_card(cfg: ExperimentConfig, run_dir: Path, state: TrainerState) -> str:
    """README.md of ``final/``: what trained this policy, and how it evaluated."""
    summary = (
        (run_dir / "summary.md").read_text() if (run_dir / "summary.md").is_file() else "(no evaluation)\n"
    )
    base = cfg.policy.model
    return (
        f"# {cfg.run_name}: a veriloop policy\n\n"
        f"Base model `{base}`{' with a LoRA adapter (r=' + str(cfg.policy.lora_r) + ')' if cfg.policy.lora else ''}, "
        f"trained by veriloop: {cfg.sft.steps} SFT steps ({cfg.sft.source}), then {state.step} RL steps of "
        f"`{cfg.algo.name}` on `{cfg.env.id}` ({cfg.rollout.prompts_per_step} problems x {cfg.rollout.group_size} "
        f"samples per step, lr {cfg.train.lr}). The full config is `../config.yaml`; load with "
        "`veriloop.agents.load_policy(<this folder>)`.\n\n## Evaluation (held-out seeds)\n\n" + summary
    )


def _summary(m: dict[str, float]) -> str:
    keys = [("reward/mean", "R"), ("success_rate", "acc"), ("response_length/mean", "len"),
            ("entropy", "H"), ("clip_frac_high", "clip+"), ("grad_norm", "|g|"), ("time/rollout_s", "t_roll"),
            ("time/train_s", "t_train")]  # fmt: skip
    return " ".join(f"{short}={m[k]:.3g}" for k, short in keys if m.get(k) is not None)


def _say(quiet: bool, text: str) -> None:
    say(text, quiet)
