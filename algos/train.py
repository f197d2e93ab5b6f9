"""The RL training loop, top to bottom.

rollout (with dynamic sampling when on) -> shaping and advantages -> epochs x mini-batches of
updates -> metrics -> periodic evaluation -> checkpoint. Every algorithm runs through this one
loop; which parts it uses was decided by ``cfg.algo`` before the loop starts (``algorithm.resolve``
builds the ``Algorithm`` record once, in ``train``).

Reading order: ``train`` (set up, restore, SFT warm-up) -> ``_loop`` (one step: ``collect`` ->
``train_on_batch`` -> metrics -> guard -> eval / log / checkpoint). Everything a step needs is
one :class:`RunParts`; the step schedule, the non-finite guard and the log / checkpoint cadence
are ``steps.StepLoop``, the same machinery the SFT warm-up (``sft_train.py``) runs on.
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any, Protocol, cast

import torch
import yaml

import veriloop.envs  # noqa: F401  (registers the environments)
from veriloop.agents.atomic import write_text_atomic
from veriloop.agents.backends import Backend, make_backend, resolve_backend
from veriloop.agents.compaction import make_compactor
from veriloop.agents.drift import drift_rate
from veriloop.agents.engine import EpisodeSpec, RolloutLimits, rollout
from veriloop.agents.loading import LoraSettings, load_policy, save_policy
from veriloop.agents.policy import Policy
from veriloop.agents.precision import apply_precision
from veriloop.agents.sampling_params import SamplingParams
from veriloop.agents.teacher import score_with_teacher
from veriloop.agents.trajectory import Trajectory
from veriloop.algos.algorithm import Algorithm, resolve
from veriloop.algos.batch import TokenBatch, minibatches, with_teacher
from veriloop.algos.run.checkpoint import (
    check_finite,
    complete_checkpoints,
    load_checkpoint,
    resume_latest,
    save_checkpoint,
)
from veriloop.algos.critic import ValueModel
from veriloop.algos.run.distributed import DistContext, init_distributed, shutdown_distributed
from veriloop.algos.eval.loop import final_sample, run_summary
from veriloop.algos.maths.mismatch import NAMES as MISMATCH_NAMES
from veriloop.algos.maths.mismatch import MismatchStats
from veriloop.algos.curriculum import curriculum_step
from veriloop.algos.mixture import assign_envs, per_env_metrics
from veriloop.algos.run.nonfinite import NonFiniteGuard
from veriloop.algos.run.progress import say
from veriloop.algos.run.lock import LOCK_FILE, acquire, release
from veriloop.algos.run.log import RunLog
from veriloop.algos.sampling import dynamic_sampling, is_informative, verifier_failed
from veriloop.algos.run.steps import StepLoop
from veriloop.algos.update import METRIC_NAMES, learning_signal, prepare_batch, select_tokens, update_step
from veriloop.configs.loader import config_to_yaml, dump_config
from veriloop.configs.schema import ConfigError, ExperimentConfig

SINGLE_PROCESS = DistContext()


@dataclass
class TrainerState:
    """Everything besides weights/optimizer that a resumed run needs to continue exactly."""

    step: int = 0
    next_seed: int = 0
    consecutive_nonfinite: int = 0
    skipped_steps: int = 0
    sft_done: bool = False
    history: dict[str, Any] = field(default_factory=dict)


@dataclass
class RunParts:
    """Everything one run's loop reads and updates, built once by ``train``."""

    cfg: ExperimentConfig
    algo: Algorithm  # cfg.algo's parts, looked up once (algorithm.resolve)
    policy: Policy
    critic: ValueModel | None
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    state: TrainerState
    generator: torch.Generator  # mini-batch shuffling; checkpointed with the state
    run_dir: Path
    dist: DistContext
    quiet: bool
    log: RunLog | None = None  # rank 0 only
    backend: _LiveBackend | None = None  # vLLM (in-process or servers); None = the HF engine
    sharded: Any = None  # fsdp.Sharded under train.parallel=fsdp with several ranks, else None


# ----------------------------------------------------------------------------------------- setup


def _modules(names: str | list[str]) -> str | tuple[str, ...]:
    """``policy.target_modules`` as ``LoraSettings`` stores it (a list from YAML becomes a tuple)."""
    return names if isinstance(names, str) else tuple(names)


def build_policy(cfg: ExperimentConfig) -> Policy:
    """The policy as ``cfg.policy`` describes it: LoRA or full, reference only if KL needs it."""
    p = cfg.policy
    if p.model == "tiny":  # a tiny random model with the real tokenizer: for tests and smoke runs
        from veriloop.agents.testing import tiny_policy

        tiny = tiny_policy(
            lora=p.lora, seed=cfg.rollout.seed, keep_reference=cfg.keep_reference and not p.lora
        )
        return apply_precision(tiny, p.precision)
    lora = LoraSettings(r=p.lora_r, alpha=p.lora_alpha, dropout=p.lora_dropout,
                        target_modules=_modules(p.target_modules)) if p.lora else None  # fmt: skip
    policy = load_policy(p.model, lora=lora, dtype=p.dtype, keep_reference=cfg.keep_reference and not p.lora)
    return apply_precision(policy, p.precision)  # bf16: frozen weights bf16, trained ones fp32


def build_critic(cfg: ExperimentConfig, policy: Policy) -> ValueModel | None:
    if not cfg.algo.needs_critic:
        return None
    if cfg.algo.critic == "separate":  # the policy's pretrained weights + a fresh head, trained in fp32
        critic = ValueModel.separate(policy.model)
        return critic.float() if policy.precision == "bf16" else critic  # not the bf16 of a frozen base
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


#: Rounds of dynamic sampling one step may run, and data-parallel ranks, that ``sampling_stream``
#: keeps apart (``max_sampling_rounds`` <= 16 and <= 64 processes give every draw its own stream).
ROUNDS_PER_STEP = 16
MAX_RANKS = 64


def sampling_stream(step: int, round_: int, rank: int) -> int:
    """The sampling stream of one rollout call: ``(step * 16 + round) * 64 + rank``.

    Reproducible (a resumed run draws the same numbers at the same step) and distinct across
    steps, dynamic-sampling rounds within a step and data-parallel ranks; ``_sampling`` turns it
    into the sampler's seed."""
    return (step * ROUNDS_PER_STEP + round_) * MAX_RANKS + rank


@dataclass
class GroupSampler:
    """``n -> groups`` for ``dynamic_sampling``: each call plays ``n`` new problems (env seeds from
    ``state.next_seed`` on, this rank's share of them) and gathers every rank's groups.

    Attributes:
        rounds: calls so far this step (the round number of ``sampling_stream``).
        sampled: every episode played this step, for metrics (dropped groups included).
        choose: ``(first seed, n) -> (seeds, next seed)``, the curriculum's draw by difficulty
            (``curriculum.curriculum_step``); None = the next ``n`` seeds.
    """

    cfg: ExperimentConfig
    policy: Policy
    state: TrainerState
    dist: DistContext
    backend: Backend | None
    rounds: int = 0
    sampled: list[Trajectory] = field(default_factory=list)
    choose: Callable[[int, int], tuple[Sequence[int], int]] | None = None

    def __call__(self, n: int) -> list[list[Trajectory]]:
        cfg, g, first = self.cfg, self.cfg.rollout.group_size, self.state.next_seed
        chosen, nxt = self.choose(first, n) if self.choose else (range(first, first + n), first + n)
        seeds = self.dist.shard(chosen)  # this rank's problems
        self.state.next_seed = nxt  # seeds only move forward: training never repeats a problem
        # each problem from one environment (a mixture draws it by weight, from the seed alone)
        names = assign_envs(cfg.env.mixture_weights, seeds, cfg.rollout.seed)
        envs = cfg.env.training_envs
        specs = [EpisodeSpec(envs[e].id or cfg.env.id, dict(envs[e].kwargs), s, s)
                 for s, e in zip(seeds, names) for _ in range(g)]  # fmt: skip
        stream = sampling_stream(self.state.step, self.rounds, self.dist.rank)
        mine = rollout(self.policy, specs, sampling=_sampling(cfg, stream), limits=_limits(cfg), backend=self.backend,
                       system_prompt=cfg.env.system_prompt,
                       compactor=make_compactor(cfg.rollout.compaction, cfg.rollout.compaction_keep)) if specs else []  # fmt: skip
        self.rounds += 1
        groups = self.dist.gather_shards(
            [mine[i : i + g] for i in range(0, len(mine), g)]
        )  # all ranks' groups
        self.sampled.extend(t for group in groups for t in group)
        return groups


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
    sampler = GroupSampler(cfg, policy, state, dist, backend)
    n = cfg.rollout.prompts_per_step
    if cfg.curriculum.enabled:  # problems drawn by difficulty pool, groups gated and refilled
        groups, metrics = curriculum_step(cfg, sampler, state.history, partial(learning_signal, cfg=cfg.algo))
    elif cfg.algo.dynamic_sampling:
        groups, stats = dynamic_sampling(sampler, num_groups=n, max_rounds=cfg.algo.max_sampling_rounds,
                                         reward_fn=partial(learning_signal, cfg=cfg.algo))  # fmt: skip
        metrics = {"sampling/rounds": stats["rounds"], "sampling/kept_fraction": stats["kept_fraction"],
                   "sampling/informative_fraction": stats["informative_fraction"],
                   "sampling/short_batch": stats["short_batch"]}  # fmt: skip
    else:
        groups = sampler(n)
        # how many groups would have taught something (logged, not acted on, without dynamic sampling)
        useful = [is_informative([learning_signal(t, cfg.algo) for t in grp]) for grp in groups]
        informative = sum(useful) / max(len(useful), 1)
        metrics = {"sampling/rounds": 1.0, "sampling/kept_fraction": 1.0,
                   "sampling/informative_fraction": informative, "sampling/short_batch": 0.0}  # fmt: skip
    return [t for group in groups for t in group], sampler.sampled, metrics


def rollout_metrics(trajs: Sequence[Trajectory], tokenizer: Any) -> dict[str, float]:
    """The same names for every algorithm (reward, success, length, truncation, verifier, drift).

    Verifier errors and timeouts count episodes with a failed verification on any turn.
    """
    rewards = torch.tensor([t.total_reward for t in trajs], dtype=torch.float64)
    lengths = torch.tensor([t.num_generated_tokens for t in trajs], dtype=torch.float64)
    final = [final_sample(t) for t in trajs]  # the last judged response (verify turns have none)
    errors = [{tr.verdict.error if tr.verdict is not None else None for tr in t.turns} for t in trajs]
    # drift re-renders the whole transcript: defined for one-sample episodes only (a split one was
    # re-rendered on purpose, where its template rewrote history or a compactor shortened it)
    drift_sample = [t for t in trajs if t.num_samples == 1][:8]
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
        "samples/split_rate": sum(t.num_samples > 1 for t in trajs) / len(trajs),
        "samples/per_episode": sum(t.num_samples for t in trajs) / len(trajs),
    }


# ------------------------------------------------------------------------------------------ update


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
                   dist: DistContext = SINGLE_PROCESS, algo: Algorithm | None = None) -> dict[str, float | None]:  # fmt: skip
    """Advantages once per rollout, then ``algo.epochs`` passes of mini-batch updates.

    Every rank holds the whole batch (same advantages, same mini-batch order); with several
    ranks each trains rows ``rank::world`` of a mini-batch and the gradients are summed.
    ``algo``: ``cfg.algo`` already resolved (``train`` does it once); None = resolve it here.
    """
    algo = resolve(cfg.algo) if algo is None else algo
    pad = policy.tokenizer.pad_token_id or 0
    # the one reference path: Policy.reference (frozen copy, or LoRA with the adapter disabled)
    ref_ctx = policy.reference if cfg.algo.needs_reference else None
    policy.model.eval()  # reference / old values without dropout
    r = cfg.rollout
    # top-k / top-p: the recorded log-probs are of the filtered distribution; take the model's own
    truncated = r.top_k > 0 or r.top_p < 1.0
    # collated once: every tensor of the batch is [N, T] (N episodes, T the longest), see TokenBatch
    batch, adv_metrics = prepare_batch(trajs, algo, model=policy.model, critic=critic, pad_id=pad,
                                       ref_model_ctx=ref_ctx, temperature=r.temperature,
                                       recompute_old_logprobs=truncated)  # fmt: skip
    if cfg.algo.distill_coef > 0:  # on-policy distillation: a teacher scores the student's own tokens
        batch = with_teacher(batch, score_with_teacher(policy, trajs, teacher=cfg.algo.distill_teacher,
                             teacher_model=cfg.algo.distill_teacher_model, temperature=r.temperature))  # fmt: skip
    policy.model.train()
    sums: dict[str, float] = {}
    updates = 0
    # sampler vs trainer, measured in the first update's forward passes, unless prepare_batch did
    # (pi_old recomputed for the rollout correction) or it cannot be measured (top-k / top-p)
    measure = not truncated and not cfg.algo.needs_old_recompute
    mismatch: list[MismatchStats] = []
    per_mb = -(-cfg.mini_batch_size * batch.size // len(trajs))  # rows: a split episode is several
    for _ in range(cfg.algo.epochs):
        for mb in minibatches(batch, per_mb, shuffle=generator):
            mb = select_tokens(mb, algo)  # Clip-Cov / KL-Cov: chosen over the mini-batch, all ranks alike
            part = mb.select(torch.arange(dist.rank, mb.size, dist.world_size)) if dist.enabled else mb
            # every rank's loss is normalised by the whole mini-batch's counts: gradients just add up
            sync = dist.update_kwargs(mb, algo)  # several ranks: normalisers and gradient summing
            m = update_step(policy.model, optimizer, part, algo, micro_batch_size=cfg.train.micro_batch_size,
                            micro_batch_tokens=cfg.train.micro_batch_tokens, max_grad_norm=cfg.train.max_grad_norm or float("inf"),
                            ref_model_ctx=ref_ctx, critic=critic,
                            max_new_tokens=r.max_new_tokens, temperature=r.temperature,
                            mismatch=mismatch if updates == 0 and measure else None, **sync)  # fmt: skip
            for k, v in m.items():
                sums[k] = sums.get(k, 0.0) + v
            updates += 1
    policy.model.eval()
    out: dict[str, float | None] = {k: v / max(updates, 1) for k, v in sums.items()}  # means over updates
    out["skipped"] = sums.get("skipped", 0.0)  # count, not mean
    out["updates"] = float(updates)
    out["train_tokens"] = float(batch.loss_mask.sum())
    out["kl_ref"] = kl_to_reference(batch)  # None without a reference: logged as null
    return merge_metrics(out, adv_metrics, _mismatch_metrics(mismatch, measure, truncated))


def _mismatch_metrics(parts: list[MismatchStats], measured: bool, truncated: bool) -> dict[str, float | None]:
    """``mismatch/*`` from the update's forward passes when it measured them; null under top-k /
    top-p (the sampler recorded the filtered distribution's log-probs, which the trainer's
    unfiltered pass cannot be compared with: a number there would be the nucleus mass, or the
    trainer against itself); none here when ``prepare_batch`` measured them (rollout correction)."""
    if truncated:
        return dict.fromkeys(MISMATCH_NAMES, None)
    measured_now: dict[str, float | None] = {**sum(parts, MismatchStats()).metrics()} if measured else {}
    return measured_now


def merge_metrics(*parts: dict[str, Any]) -> dict[str, Any]:
    """One dict from metric dicts that must not share a key: each logged key has one source, so
    a key computed twice (two formulas, or two token sets) is an error, never a silent overwrite."""
    out: dict[str, Any] = {}
    for part in parts:
        twice = sorted(out.keys() & part.keys())
        if twice:
            raise ValueError(f"metric keys computed in two places: {twice}")
        out.update(part)
    return out


# -------------------------------------------------------------------------------------- run folder

#: Settings a resumed run may change from the saved config (how long, how often, how it is measured).
RESUMABLE_CHANGES = ("train.steps", "eval.", "run.checkpoint_every", "run.keep_last", "run.tensorboard",
                     "run.wandb", "train.log_every", "rollout.server.")  # fmt: skip


def claim_run_dir(run_dir: Path, cfg: ExperimentConfig, *, resume: bool, overwrite: bool) -> None:
    """Make ``run_dir`` this run's own, or stop before anything is written or loaded.

    A new or empty folder is used as is. An existing run is continued only with ``resume`` (and
    a config that matches its ``config.yaml`` but for :data:`RESUMABLE_CHANGES`, and enough
    ``train.steps`` to reach its newest checkpoint), replaced only with ``overwrite``; otherwise
    :class:`ConfigError` says so and nothing in it changes. The caller holds the folder's lock
    (``run_lock``), so leftovers of killed saves found here are stale and are removed.
    """
    existing = run_dir.is_dir() and any(p.name != LOCK_FILE for p in run_dir.iterdir())
    if existing and resume and overwrite:
        raise ConfigError("--resume continues a run and --overwrite deletes it: give only one")
    if existing and not resume and not overwrite:
        raise ConfigError(
            f"run folder {run_dir} already holds a run; nothing was changed. Continue it with --resume, "
            f"replace it with --overwrite, or choose another name (run.name=...)"
        )
    if existing and resume:
        _check_resume_config(run_dir, cfg)
        _check_resume_steps(run_dir, cfg)
    if existing and overwrite:
        for child in run_dir.iterdir():  # all but the lock, which this process holds
            if child.name != LOCK_FILE:
                shutil.rmtree(child) if child.is_dir() and not child.is_symlink() else child.unlink()
    run_dir.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(run_dir)
    write_text_atomic(run_dir / "config.yaml", config_to_yaml(cfg))


def remove_stale_temporaries(run_dir: Path) -> list[Path]:
    """Delete the ``.tmp-*`` / ``.old-*`` leftovers of folder and file replacements (``final/``,
    ``config.yaml``...) that a killed process left in ``run_dir`` and ``run_dir/sft``. Call it only
    while holding the run's lock: then no live process is writing them. Returns what was removed."""
    removed = []
    for folder in (run_dir, run_dir / "sft"):
        for p in folder.glob(".*") if folder.is_dir() else []:
            if p.name.startswith((".tmp-", ".old-")):
                shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
                removed.append(p)
    return removed


def _check_resume_steps(run_dir: Path, cfg: ExperimentConfig) -> None:
    """A resumed run may train longer, never shorter than its newest checkpoint."""
    done = [int(p.name.split("-")[1]) for p in complete_checkpoints(run_dir)]
    if done and max(done) > cfg.train.steps:
        raise ConfigError(
            f"--resume: {run_dir} already has a checkpoint at step {max(done)}, past train.steps="
            f"{cfg.train.steps}; nothing was changed. Resume with train.steps >= {max(done)} (its final/ "
            "policy is the one to evaluate if the run is finished)"
        )


def _check_resume_config(run_dir: Path, cfg: ExperimentConfig) -> None:
    saved_file = run_dir / "config.yaml"
    if not saved_file.is_file():
        return
    saved = _flatten(yaml.safe_load(saved_file.read_text()) or {})
    now = _flatten(dump_config(cfg))
    # run.out_dir / run.name only say where the folder is: a moved or copied run resumes where it is now
    changed = sorted(k for k in saved.keys() | now.keys() if saved.get(k) != now.get(k)
                     and not k.startswith(RESUMABLE_CHANGES) and k not in ("run.out_dir", "run.name"))  # fmt: skip
    if changed:
        diff = "; ".join(f"{k}: {_short(saved.get(k))} -> {_short(now.get(k))}" for k in changed[:6])
        raise ConfigError(
            f"--resume: the config differs from the one {run_dir} was trained with ({diff}); resume with "
            f"the saved config (`veriloop train {run_dir / 'config.yaml'} --resume`), or start a new run.name"
        )


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


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
    :mod:`veriloop.algos.run.distributed`); only rank 0 writes anything.
    """
    _check_before_loading(cfg)
    dist = init_distributed()
    dist = replace(dist, sharded=dist.enabled and cfg.train.parallel == "fsdp")
    run_dir = Path(cfg.run.out_dir) / cfg.run_name
    lock = acquire(run_dir) if dist.is_main else None  # one writer per run folder (run_lock.py)
    try:
        if dist.is_main:
            claim_run_dir(run_dir, cfg, resume=resume, overwrite=overwrite)
        return _train_claimed(cfg, run_dir, dist, resume=resume, quiet=quiet)
    finally:
        if lock is not None:
            release(lock)


def _train_claimed(
    cfg: ExperimentConfig, run_dir: Path, dist: DistContext, *, resume: bool, quiet: bool
) -> Path:
    """``train`` once the run folder is this process's: build, restore, warm up, loop, save."""
    run = _build_run(cfg, run_dir, dist, quiet=quiet or not dist.is_main)
    ckpt = _restore(run, resume)
    with _whole_weights(run):  # sharded: the engine is handed the whole (restored) weights
        run.backend = _rollout_backend(cfg, run.policy, dist)  # holds the (restored) weights from here on
    if cfg.sft.steps > 0 and not run.state.sft_done:
        _sft_warmup(run)
        if dist.is_main and cfg.run.checkpoint_every > 0:
            _checkpoint(run)  # step 0: a run cut before its first RL checkpoint keeps its warm-up
    if not dist.sharded:  # sharded: broadcast before sharding (_build_run)
        dist.broadcast_params(list(_trainable_state(run.policy, run.critic).values()))  # rank 0's weights
    if run.backend is not None and run.state.step == 0 and cfg.sft.steps > 0:
        run.backend.sync()  # the warm-up's weights (and on every rank rank 0's, just broadcast)
    # a resumed run keeps the rows up to its checkpoint's step; a fresh run, or one resumed from the
    # warm-up's step-0 checkpoint (which evaluates step 0 again), starts an empty file
    run.log = RunLog(run_dir, tensorboard=cfg.run.tensorboard, resume_from_step=run.state.step + 1 if ckpt and run.state.step > 0 else 0,
                     wandb_project="veriloop" if cfg.run.wandb else None) if dist.is_main else None  # fmt: skip
    try:
        at_start = run.state.step == 0 and (cfg.eval.at_start or cfg.train.steps == 0)
        with _whole_weights(run, at_start):  # sharded: all ranks gather, rank 0 evaluates
            start = (
                _evaluate(cfg, run.policy, 0, run.quiet, backend=_eval_backend(run))
                if at_start and run.log is not None
                else {}
            )
        if run.state.step == 0 and run.log is not None:  # the base policy's numbers, for comparison
            base = {**run.state.history.get("eval_base", {}), **start}
            if base:
                run.log.log(0, base)
        _loop(run)
        if dist.is_main and any((run_dir / "eval").glob("*.json")):
            (run_dir / "summary.md").write_text(run_summary(run_dir / "eval"))
        card = _model_card(cfg, run_dir, run.state) if dist.is_main else ""
        if dist.sharded:  # all ranks gather the weights; rank 0 saves them in the ordinary format
            from veriloop.algos.run.fsdp import save_final

            save_final(
                run.policy,
                run.critic,
                run_dir / "final",
                dist=dist,
                card=card,
                rebuild=partial(build_policy, cfg),
            )
        elif dist.is_main:
            save_policy(run.policy, run_dir / "final", card=card)
    finally:
        if run.log is not None:
            run.log.close()
        if run.backend is not None:
            run.backend.close()
        dist.barrier()
        shutdown_distributed(dist)
    return run_dir


def _check_before_loading(cfg: ExperimentConfig) -> None:
    """Everything that can be wrong with ``cfg`` fails here, before any model loads."""
    cfg.validate()
    cfg.env.resolve()  # the environments exist (users' modules imported) before anything slow
    check_model(cfg.policy.model)
    if cfg.rollout.backend == "vllm_server":  # an unreachable server fails now, not after loading
        _check_servers(cfg)
    if cfg.sft.steps > 0:
        from veriloop.algos.sft.data import check_source

        check_source(cfg.sft.source, cfg.env.id, cfg.env.kwargs)


def check_model(model: str) -> None:
    """``policy.model`` names a loadable model: 'tiny', 'default', 'default-vision' or a folder with
    config.json / adapter_config.json (nothing is loaded here)."""
    if model in ("tiny", "default", "default-vision"):
        return
    from veriloop.agents.loading import _resolve

    try:
        _resolve(model)
    except FileNotFoundError as e:
        raise ConfigError(f"policy.model: {e}") from None


def _build_run(cfg: ExperimentConfig, run_dir: Path, dist: DistContext, *, quiet: bool) -> RunParts:
    """Seed, then policy, critic, optimizer, schedule, a fresh state and the algorithm's parts."""
    torch.manual_seed(cfg.rollout.seed)  # before the model: a tiny/random init is reproducible
    policy = build_policy(cfg)
    critic = build_critic(cfg, policy)
    sharded = None
    if dist.sharded:  # every rank starts from rank 0's weights, then keeps its rows (before the optimizer)
        from veriloop.algos.run.fsdp import shard

        dist.broadcast_params(list(_trainable_state(policy, critic).values()))
        sharded = shard(policy, critic)
    optimizer = build_optimizer(cfg, policy, critic)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg))
    # SFT demonstrations use env seeds seed .. seed + examples - 1; RL problems come after them
    sft_seeds = cfg.sft.examples if cfg.sft.steps > 0 else 0
    return RunParts(cfg=cfg, algo=resolve(cfg.algo), policy=policy, critic=critic, optimizer=optimizer,
                    scheduler=scheduler, state=TrainerState(next_seed=cfg.rollout.seed + sft_seeds),
                    generator=torch.Generator().manual_seed(cfg.rollout.seed), run_dir=run_dir, dist=dist,
                    quiet=quiet, sharded=sharded)  # fmt: skip


def _restore(run: RunParts, resume: bool) -> Path | None:
    """With ``resume``: load the newest checkpoint that verifies and fits into ``run`` (weights,
    optimizer, schedule, state, shuffling generator; the RNG states too); a damaged newest one is
    reported and the previous one used (``checkpoint.resume_latest``). Returns its folder, or None."""
    if run.dist.sharded:
        return _restore_sharded(run, resume)
    apply = partial(_apply_checkpoint, run)
    found = None
    if resume and run.dist.is_main:
        warn = partial(print, file=sys.stderr)
        found = resume_latest(run.run_dir, apply, warn=lambda m: warn(f"veriloop: {m}"))
    ckpt = run.dist.broadcast_object(found[0] if found else None)
    if ckpt is not None and not run.dist.is_main:  # every rank reads the same folder (shared file system)
        apply(load_checkpoint(ckpt))  # also restores the python/numpy/torch RNG states
    if ckpt is not None:
        _say(run.quiet, f"resumed from {ckpt} at step {run.state.step}")
    elif resume:
        _say(run.quiet, f"--resume: no complete checkpoint in {run.run_dir}/checkpoints, starting fresh")
    return ckpt


def _apply_checkpoint(run: RunParts, loaded: dict[str, Any]) -> None:
    """Put a loaded checkpoint into ``run``; raises (KeyError, ValueError...) when it does not fit."""
    _load_trainable_state(run.policy, run.critic, loaded["model_state"])
    run.optimizer.load_state_dict(loaded["optimizer"])
    _apply_loop_state(run, loaded)


def _apply_loop_state(run: RunParts, loaded: dict[str, Any]) -> None:
    """The schedule, trainer state and shuffling generator of a loaded checkpoint."""
    run.scheduler.load_state_dict(loaded["scheduler"])
    run.state = TrainerState(**loaded["trainer_state"]["state"])
    run.generator.set_state(torch.tensor(loaded["trainer_state"]["generator"], dtype=torch.uint8))


def _restore_sharded(run: RunParts, resume: bool) -> Path | None:
    """``_restore`` of a sharded run: every rank reads its rows of the newest checkpoint that
    verifies (``sharded_checkpoint.load_sharded``)."""
    from veriloop.algos.run.fsdp import state_modules
    from veriloop.algos.run.sharded_checkpoint import load_sharded

    found = None
    if resume:
        found = load_sharded(run.run_dir, dist=run.dist, modules=state_modules(run.policy, run.critic),
                             optimizer=run.optimizer)  # fmt: skip
    if found is not None:
        _apply_loop_state(run, found[1])
        _say(run.quiet, f"resumed from {found[0]} (sharded) at step {run.state.step}")
    elif resume:
        _say(run.quiet, f"--resume: no complete checkpoint in {run.run_dir}/checkpoints, starting fresh")
    return found[0] if found else None


def _whole_weights(run: RunParts, needed: bool = True) -> contextlib.AbstractContextManager[None]:
    """Sharded runs: every rank holds the policy's whole weights inside (``fsdp.Sharded.gathered``),
    so a rank may generate, evaluate or send weights alone. Otherwise (or not ``needed``): nothing."""
    return run.sharded.gathered() if run.sharded is not None and needed else contextlib.nullcontext()


def _sft_warmup(run: RunParts) -> None:
    """The SFT warm-up (``cfg.sft``) before RL, once per run (a resumed run does not redo it)."""
    from veriloop.algos.sft.train import warmup_from_config

    cfg, state, main = run.cfg, run.state, run.dist.is_main
    if main and cfg.eval.before_sft:  # the base model, logged with step 0 as eval_base/...
        state.history["eval_base"] = _evaluate(cfg, run.policy, 0, run.quiet, tag="base", prefix="eval_base",
                                               backend=_eval_backend(run))  # fmt: skip
    # every rank runs the same warm-up; only rank 0 saves it, and its weights are broadcast after it
    sft_metrics = warmup_from_config(cfg, run.policy, run_dir=run.run_dir / "sft" if main else None)
    state.sft_done = True
    state.history["sft"] = sft_metrics
    _say(run.quiet, f"SFT warm-up done: {sft_metrics}")


def _loop(run: RunParts) -> None:
    """RL steps ``state.step .. train.steps - 1``: collect -> update -> metrics -> eval / log / save."""
    if run.cfg.train.max_staleness > 0:  # generation beside the update, at most K steps stale
        from veriloop.algos.async_loop import async_loop

        return async_loop(run)
    cfg, state, backend = run.cfg, run.state, run.backend
    loop = _step_loop(run)
    _say(run.quiet, f"RL: {cfg.train.steps - state.step} steps of {cfg.rollout.batch_size} episodes "
                    f"({cfg.rollout.prompts_per_step} problems x {cfg.rollout.group_size}), algorithm {cfg.algo.name}")  # fmt: skip
    for step in loop.steps(state.step):
        t0 = time.perf_counter()
        with _whole_weights(run, backend is None):  # the HF engine generates with the policy itself
            trajs, sampled, sampling = collect(cfg, run.policy, state, run.dist, backend)
        metrics: dict[str, Any] = dict(sampling)
        t_rollout = time.perf_counter() - t0
        metrics.update(rollout_metrics(sampled, run.policy.tokenizer))  # every episode played, kept or not
        if cfg.env.mixture:
            envs = {n: (str(e.id), e.kwargs) for n, e in cfg.env.training_envs.items()}
            metrics.update(per_env_metrics(sampled, envs))
        t1 = time.perf_counter()
        # dynamic sampling may keep no group at all (every group had equal rewards): nothing to learn
        if trajs:
            metrics.update(train_on_batch(cfg, run.policy, run.critic, run.optimizer, trajs, run.generator,
                                          run.dist, run.algo))  # fmt: skip
            if backend is not None:
                t_sync = time.perf_counter()
                with _whole_weights(run):
                    backend.sync()  # the engine samples the next step with the weights just trained
                metrics["time/weight_sync_s"] = time.perf_counter() - t_sync
        else:
            metrics.update(_no_update())
        t_train = time.perf_counter() - t1
        run.scheduler.step()  # once per RL step, whatever the number of optimizer steps in it
        metrics.update(_timing(metrics, run.scheduler.get_last_lr()[0], sampled, t_rollout, t_train))
        _guard_nonfinite(loop, state, metrics)  # a skipped step is counted; too many in a row stop the run
        state.step = step + 1
        _evaluate_and_log(run, loop, metrics)
        loop.show(_summary(metrics))
        _say(run.quiet, f"step {state.step:4d}/{cfg.train.steps} | {_summary(metrics)}")
        if (run.dist.is_main or run.dist.sharded) and loop.checkpoint_due(state.step):
            _checkpoint(run)  # sharded: every rank writes its shards


def _step_loop(run: RunParts) -> StepLoop:
    """The RL phase's ``StepLoop``: ``train.steps``, the guard's counts as ``run.state`` holds them
    (a resumed run keeps them), ``train.log_every`` and ``run.checkpoint_every``."""
    cfg, state = run.cfg, run.state
    guard = NonFiniteGuard(
        cfg.train.max_consecutive_nonfinite, state.consecutive_nonfinite, state.skipped_steps
    )
    advice = ("lower train.lr, set train.max_grad_norm, or resume from the last checkpoint (non-finite weights "
              "are never checkpointed)")  # fmt: skip
    return StepLoop(cfg.train.steps, "train", guard, log_every=cfg.train.log_every,
                    checkpoint_every=cfg.run.checkpoint_every, log=run.log, advice=advice, quiet=run.quiet)  # fmt: skip


class _LiveBackend(Backend, Protocol):
    """A backend with its own copy of the weights (vLLM): ``sync`` loads the trained ones into it."""

    def sync(self) -> None: ...

    def close(self) -> None: ...


def _rollout_backend(cfg: ExperimentConfig, policy: Policy, dist: DistContext) -> _LiveBackend | None:
    """vLLM: one engine for the run, updated in place after every optimizer step; vllm_server: the
    same through HTTP (rank 0 pushes, every rank waits); None: each rollout call uses
    ``engine.default_backend`` (the HF backend). ``auto`` is resolved here (``resolve_backend``)."""
    name = resolve_backend(cfg.rollout.backend, policy)
    if name == "vllm_server":
        server = asdict(cfg.rollout.server)
        return cast(_LiveBackend, make_backend("vllm_server", policy, dist=dist, **server))
    if name != "vllm":
        return None
    return cast(_LiveBackend, make_backend("vllm", policy, **cfg.rollout.vllm_kwargs))


def _eval_backend(run: RunParts) -> _LiveBackend | None:
    """The engine evaluations sample with: the rollouts' (``eval.backend: rollout``) or HF (None)."""
    return run.backend if run.cfg.eval.backend == "rollout" else None


def _check_servers(cfg: ExperimentConfig) -> None:
    from veriloop.agents.backends.http_client import RetryPolicy, check_servers

    server = cfg.rollout.server
    check_servers(server.urls, RetryPolicy(server.retries, server.backoff_s, server.timeout_s))


def _timing(
    metrics: dict[str, Any],
    lr: float | torch.Tensor,
    sampled: list[Trajectory],
    t_rollout: float,
    t_train: float,
) -> dict[str, Any]:
    """The step's learning rate, wall-clock split and throughputs."""
    gen_tokens = sum(t.num_generated_tokens for t in sampled)
    return {
        "lr": lr,
        "time/rollout_s": t_rollout, "time/train_s": t_train,
        "time/rollout_fraction": t_rollout / max(t_rollout + t_train, 1e-9),
        "throughput/rollout_tokens_per_s": gen_tokens / max(t_rollout, 1e-9),
        "throughput/train_tokens_per_s": metrics["train_tokens"] / max(t_train, 1e-9),
    }  # fmt: skip


def _evaluate_and_log(run: RunParts, loop: StepLoop, metrics: dict[str, Any]) -> None:
    """Evaluate (rank 0) every ``eval.every`` steps and log as ``loop`` says; both after the last step."""
    cfg, step, main = run.cfg, run.state.step, run.dist.is_main
    last = step == cfg.train.steps
    every_eval = cfg.eval.every
    due = bool(every_eval and step % every_eval == 0) or last
    with _whole_weights(run, due):  # sharded: all ranks gather, rank 0 evaluates
        if main and due:
            metrics.update(_evaluate(cfg, run.policy, step, run.quiet, backend=_eval_backend(run)))
    loop.log_metrics(step, metrics)  # rank 0 only: the others have no log


def _no_update() -> dict[str, float | None]:
    """Update metrics of a step without a batch: the same keys, null values, zero updates."""
    return {
        **dict.fromkeys(METRIC_NAMES),
        "kl_ref": None,
        "skipped": 0.0,
        "updates": 0.0,
        "train_tokens": 0.0,
    }


def _guard_nonfinite(loop: StepLoop, state: TrainerState, metrics: dict[str, Any]) -> None:
    """Count the step in ``loop``'s guard (``NonFiniteTrainingError`` after ``train.max_consecutive_nonfinite``
    skipped steps in a row) and copy its counts into ``state``, which checkpoints them."""
    try:
        loop.observe(skipped=metrics.get("skipped", 0.0) > 0)
    finally:  # also when it raises: the state says how the run ended
        state.consecutive_nonfinite, state.skipped_steps = loop.guard.in_a_row, loop.guard.total
        metrics["nonfinite_skipped_total"] = float(state.skipped_steps)


#: Test hook: seconds to sleep inside a checkpoint save, after the weights are written and before
#: the rest, so a test can ``kill -9`` the process mid-save (tests/algos/test_train_resume.py).
SAVE_DELAY_ENV = "VERILOOP_TEST_SAVE_DELAY"


def _checkpoint(run: RunParts) -> None:
    """Atomic save (see ``algos/run/checkpoint.py``); refuses non-finite weights, keeps the last K."""
    state = run.state
    trainer_state = {"state": dict(state.__dict__), "generator": run.generator.get_state().tolist()}
    delay = float(os.environ.get(SAVE_DELAY_ENV, "0") or 0)
    if run.sharded is not None:  # every rank: its shards, then rank 0 commits (sharded_checkpoint.py)
        from veriloop.algos.run.fsdp import state_modules
        from veriloop.algos.run.sharded_checkpoint import save_sharded

        save_sharded(run.run_dir, state.step, dist=run.dist, modules=state_modules(run.policy, run.critic),
                     optimizer=run.optimizer, scheduler=run.scheduler, trainer_state=trainer_state,
                     keep_last=run.cfg.run.keep_last, delay_s=delay)  # fmt: skip
        return
    weights = _trainable_state(run.policy, run.critic)
    check_finite(weights.items())  # the critic too; save_checkpoint checks the policy model again

    def save_model(folder: Path) -> None:
        torch.save(weights, folder / "model.pt")
        if delay > 0:  # test hook (SAVE_DELAY_ENV): a window to kill the process mid-save
            time.sleep(delay)

    save_checkpoint(run.run_dir, state.step, model=run.policy.model, save_model=save_model, optimizer=run.optimizer,
                    scheduler=run.scheduler, trainer_state=trainer_state, keep_last=run.cfg.run.keep_last)  # fmt: skip


def _evaluate(cfg: ExperimentConfig, policy: Policy, step: int, quiet: bool, *, tag: str | None = None,
              prefix: str = "eval", backend: Backend | None = None) -> dict[str, float]:  # fmt: skip
    from veriloop.algos.eval.loop import evaluate_config, write_report

    splits = cfg.env.resolved_eval_splits
    _say(quiet, f"evaluating {_checkpoint_label(cfg, step, tag)}: {len(splits)} split(s) ({', '.join(splits)}) x "
                f"{cfg.eval.num_problems} problems x {cfg.eval.n_samples} samples")  # fmt: skip
    report = evaluate_config(cfg, policy, step=step, backend=backend)
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
        "`veriloop.agents.load_policy(<this folder>)`.\n\n## Evaluation (held-out problems: sources below the table)\n\n"
        + summary
    )


def _summary(m: dict[str, float]) -> str:
    keys = [("reward/mean", "R"), ("success_rate", "acc"), ("response_length/mean", "len"),
            ("entropy", "H"), ("clip_frac_high", "clip+"), ("grad_norm", "|g|"), ("time/rollout_s", "t_roll"),
            ("time/train_s", "t_train")]  # fmt: skip
    return " ".join(f"{short}={m[k]:.3g}" for k, short in keys if m.get(k) is not None)


def _say(quiet: bool, text: str) -> None:
    say(text, quiet)
