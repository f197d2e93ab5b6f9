"""One RL step's parts, shared by the synchronous loop (:mod:`veriloop.algos.loop.train`) and the
asynchronous one (:mod:`veriloop.algos.loop.async_loop`): the run's records (:class:`RunParts`,
:class:`TrainerState`), the sampling settings and limits of a rollout, the update of one batch
(``train_on_batch``), the step's metrics, the non-finite guard, evaluation and checkpointing.

Both loops import this module; neither imports the other's internals from here.
"""

from __future__ import annotations

import json
import os
import sys
import time
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from veriloop.agents.backends import Backend, ServingBackend
from veriloop.agents.drift import drift_rate
from veriloop.agents.engine import RolloutLimits
from veriloop.agents.policy import Policy
from veriloop.agents.sampling_params import SamplingParams
from veriloop.agents.teacher import score_with_teacher
from veriloop.agents.trajectory import Trajectory
from veriloop.algos.eval.loop import final_sample
from veriloop.algos.learner.algorithm import Algorithm, resolve
from veriloop.algos.learner.batch import TokenBatch, minibatches, rank_rows, with_teacher
from veriloop.algos.learner.critic import ValueModel
from veriloop.algos.learner.signal import verifier_failed
from veriloop.algos.learner.update import (
    METRIC_NAMES,
    NO_SYNC,
    RankSync,
    UpdateSettings,
    loss_normalisers,
    prepare_batch,
    select_tokens,
    update_step,
)
from veriloop.algos.maths.mismatch import NAMES as MISMATCH_NAMES
from veriloop.algos.maths.mismatch import MismatchStats
from veriloop.algos.run.checkpoint import check_finite, save_checkpoint
from veriloop.algos.run.distributed import DistContext
from veriloop.algos.run.guards import LearningGuard, first_step_check
from veriloop.algos.run.log import RunLog
from veriloop.algos.run.nonfinite import NonFiniteGuard
from veriloop.algos.run.phase import StepLoop
from veriloop.algos.run.progress import say
from veriloop.algos.run.setup import trainable_state
from veriloop.configs.schema import ExperimentConfig

SINGLE_PROCESS = DistContext()


@dataclass
class TrainerState:
    """Everything besides weights/optimizer that a resumed run needs to continue exactly."""

    step: int = 0
    next_seed: int = 0
    consecutive_nonfinite: int = 0
    skipped_steps: int = 0
    uninformative_in_a_row: int = 0
    truncation_warned: bool = False
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
    backend: LiveBackend | None = None  # vLLM (in-process or servers); None = the HF engine
    sharded: Any = None  # fsdp.Sharded under train.parallel=fsdp with several ranks, else None


def sampling_for(cfg: ExperimentConfig, stream: int) -> SamplingParams:
    return SamplingParams.from_rollout(cfg.rollout, seed=cfg.rollout.seed * 100_003 + stream)


def rollout_limits(cfg: ExperimentConfig) -> RolloutLimits:
    return RolloutLimits.from_rollout(cfg.rollout)


#: Rounds of dynamic sampling one step may run, and data-parallel ranks, that ``sampling_stream``
#: keeps apart (``max_sampling_rounds`` <= 16 and <= 64 processes give every draw its own stream).
ROUNDS_PER_STEP = 16


MAX_RANKS = 64


def sampling_stream(step: int, round_: int, rank: int) -> int:
    """The sampling stream of one rollout call: ``(step * 16 + round) * 64 + rank``.

    Reproducible (a resumed run draws the same numbers at the same step) and distinct across
    steps, dynamic-sampling rounds within a step and data-parallel ranks; ``sampling_for`` turns it
    into the sampler's seed."""
    return (step * ROUNDS_PER_STEP + round_) * MAX_RANKS + rank


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
        "samples/episodes": float(len(trajs)),
    }


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
    t_teacher = None
    if cfg.algo.distill_coef > 0:  # on-policy distillation: a teacher scores the student's own tokens
        t0 = time.perf_counter()
        batch = with_teacher(batch, score_with_teacher(policy, trajs, teacher=cfg.algo.distill_teacher,
                             teacher_model=cfg.algo.distill_teacher_model, temperature=r.temperature,
                             micro_batch=cfg.train.micro_batch_size))  # fmt: skip
        t_teacher = time.perf_counter() - t0
    policy.model.train()
    sums: dict[str, float] = {}
    updates = 0
    # sampler vs trainer, measured in the first update's forward passes, unless prepare_batch did
    # (pi_old recomputed for the rollout correction) or it cannot be measured (top-k / top-p)
    measure = not truncated and not cfg.algo.needs_old_recompute
    mismatch: list[MismatchStats] = []
    settings = UpdateSettings.from_config(cfg)
    per_mb = -(-cfg.mini_batch_size * batch.size // len(trajs))  # rows: a split episode is several
    for _ in range(cfg.algo.epochs):
        for mb in minibatches(batch, per_mb, shuffle=generator):
            mb = select_tokens(mb, algo)  # Clip-Cov / KL-Cov: chosen over the mini-batch, all ranks alike
            part = rank_rows(mb, dist.rank, dist.world_size) if dist.enabled else mb  # whole episodes
            sync = NO_SYNC
            if dist.enabled:  # every rank's loss in the whole mini-batch's units: gradients just add up
                norm = loss_normalisers(mb, algo)
                sync = RankSync(**dist.update_kwargs(mb), global_tokens=norm["global_tokens"],
                                global_seqs=norm["global_seqs"])  # fmt: skip
            m = update_step(policy.model, optimizer, part, algo, settings, ref_model_ctx=ref_ctx, critic=critic,
                            sync=sync, mismatch=mismatch if updates == 0 and measure else None)  # fmt: skip
            for k, v in m.items():
                sums[k] = sums.get(k, 0.0) + v
            updates += 1
    policy.model.eval()
    out: dict[str, float | None] = {k: v / max(updates, 1) for k, v in sums.items()}  # means over updates
    out["skipped"] = sums.get("skipped", 0.0)  # count, not mean
    out["updates"] = float(updates)
    out["train_tokens"] = float(batch.loss_mask.sum())
    out["kl_ref"] = kl_to_reference(batch)  # None without a reference: logged as null
    if t_teacher is not None:  # part of time/train_s: the teacher's forward passes
        out["time/teacher_s"] = t_teacher
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


def step_loop(run: RunParts) -> StepLoop:
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


#: The loop's name for a backend with its own copy of the weights: the contract declared beside the
#: backends (``agents.backends.base.ServingBackend``).
LiveBackend = ServingBackend


def step_timing(
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


def modes_line(cfg: ExperimentConfig) -> str:
    """One line saying which training modes are on: precision, async (K and the correction it
    runs with), compaction, curriculum, dynamic sampling."""
    algo, k = cfg.algo, cfg.train.max_staleness
    parts = ["bf16 mixed precision" if cfg.policy.precision == "bf16" else "fp32"]
    if k > 0:
        fix = (
            f"policy_loss={algo.policy_loss}"
            if algo.objective.reads_sampler
            else f"rollout_is={algo.rollout_is}"
        )
        parts.append(f"async (max_staleness={k}, corrected by {fix})")
    else:
        parts.append("synchronous")
    if cfg.rollout.compaction != "none":
        parts.append(f"compaction {cfg.rollout.compaction} (keep {cfg.rollout.compaction_keep})")
    cur = cfg.curriculum
    if cur.enabled:
        on = [w for w, flag in (("difficulty pools", cur.pools_enabled), ("gate", cur.gate)) if flag]
        parts.append(f"curriculum ({' + '.join(on)})")
    if algo.dynamic_sampling and not cur.enabled:
        parts.append("dynamic sampling")
    return "modes: " + ", ".join(parts)


def modes_tally(rows: Sequence[Mapping[str, Any]], cfg: ExperimentConfig) -> str | None:
    """What the modes did over a run's RL rows (metrics.jsonl), in one line; None when no mode
    that counts anything was on."""

    def total(key: str) -> float:
        return sum(float(r[key]) for r in rows if isinstance(r.get(key), int | float))

    said = []
    if cfg.rollout.compaction != "none":
        split = sum(float(r["samples/split_rate"]) * float(r["samples/episodes"]) for r in rows
                    if isinstance(r.get("samples/split_rate"), int | float) and isinstance(r.get("samples/episodes"), int | float))  # fmt: skip
        said.append(f"compaction split {split:.0f} episodes")
    if cfg.curriculum.enabled:
        said.append(f"the curriculum gate rejected {total('curriculum/rejected_groups'):.0f} groups "
                    f"({total('curriculum/refills'):.0f} refills, {total('curriculum/wasted_episodes'):.0f} episodes not trained on)")  # fmt: skip
    elif cfg.algo.dynamic_sampling:
        said.append(f"dynamic sampling ran {total('sampling/rounds') - len(rows):.0f} extra rounds")
    if cfg.train.max_staleness > 0:
        stale = [
            float(r["async/staleness_max"])
            for r in rows
            if isinstance(r.get("async/staleness_max"), int | float)
        ]
        dropped = max(
            (float(r["async/dropped"]) for r in rows if isinstance(r.get("async/dropped"), int | float)),
            default=0.0,
        )
        said.append(
            f"async: staleness at most {max(stale, default=0.0):.0f} steps, {dropped:.0f} groups dropped before training (nothing to learn in them)"
        )
    return ("the modes did: " + "; ".join(said)) if said else None


def say_modes_tally(cfg: ExperimentConfig, run_dir: Path, quiet: bool) -> None:
    """:func:`modes_tally` of the run's ``metrics.jsonl`` (its RL rows), said when there is one."""
    path = run_dir / "metrics.jsonl"
    rows = (
        [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []
    )
    line = modes_tally([r for r in rows if "reward/mean" in r], cfg)
    if line:
        say(quiet=quiet, text=line)


def advance_schedule(scheduler: Any) -> None:
    """One RL step of the learning-rate schedule, whether or not the step updated anything (a step
    that kept no group trains nothing; PyTorch's warning about a schedule that moves before the
    optimizer does is about a mistake this is not)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step")
        scheduler.step()


def no_update() -> dict[str, float | None]:
    """Update metrics of a step without a batch: the same keys, null values, zero updates."""
    return {
        **dict.fromkeys(METRIC_NAMES),
        "kl_ref": None,
        "skipped": 0.0,
        "updates": 0.0,
        "train_tokens": 0.0,
    }


def guard_nonfinite(loop: StepLoop, state: TrainerState, metrics: dict[str, Any]) -> None:
    """Count the step in ``loop``'s guard (``NonFiniteTrainingError`` after ``train.max_consecutive_nonfinite``
    skipped steps in a row) and copy its counts into ``state``, which checkpoints them."""
    try:
        loop.observe(skipped=metrics.get("skipped", 0.0) > 0)
    finally:  # also when it raises: the state says how the run ended
        state.consecutive_nonfinite, state.skipped_steps = loop.guard.in_a_row, loop.guard.total
        metrics["nonfinite_skipped_total"] = float(state.skipped_steps)


def guard_learning(run: RunParts, metrics: dict[str, Any]) -> None:
    """Count the logged step in the learning guard (``guards.LearningGuard``: ``UninformativeRunError``
    after ``train.max_uninformative_steps`` steps in a row without an informative group, one warning
    when ``truncation_rate`` passes ``train.warn_truncation_above``); ``run.state`` keeps its counts."""
    cfg, state = run.cfg, run.state
    guard = LearningGuard(cfg.train.max_uninformative_steps, cfg.train.warn_truncation_above, cfg.rollout.group_size,
                          state.uninformative_in_a_row, state.truncation_warned, cfg.algo.estimator.group_based)  # fmt: skip
    try:
        guard.observe(metrics) if run.dist.is_main else guard.observe(metrics, warn=lambda _: None)
    finally:  # also when it raises: the state says how the run ended
        state.uninformative_in_a_row, state.truncation_warned = guard.in_a_row, guard.truncation_warned


def report_first_step(run: RunParts, step: int, metrics: dict[str, Any]) -> None:
    """Before the run's first update (step 0, rank 0): the base policy's groups in one line
    (``guards.first_step_check``); on stderr as a warning when a share is extreme."""
    if step != 0 or not run.dist.is_main:
        return
    line, extreme = first_step_check(metrics, run.cfg.rollout.group_size)
    if extreme:
        print(f"veriloop: warning: {line}", file=sys.stderr, flush=True)
    else:
        say(quiet=run.quiet, text=line)


#: Test hook: seconds to sleep inside a checkpoint save, after the weights are written and before
#: the rest, so a test can ``kill -9`` the process mid-save (tests/algos/loop/test_train_resume.py).
SAVE_DELAY_ENV = "VERILOOP_TEST_SAVE_DELAY"


def checkpoint_run(run: RunParts) -> None:
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
    weights = trainable_state(run.policy, run.critic)
    check_finite(weights.items())  # the critic too; save_checkpoint checks the policy model again

    def save_model(folder: Path) -> None:
        torch.save(weights, folder / "model.pt")
        if delay > 0:  # test hook (SAVE_DELAY_ENV): a window to kill the process mid-save
            time.sleep(delay)

    save_checkpoint(run.run_dir, state.step, model=run.policy.model, save_model=save_model, optimizer=run.optimizer,
                    scheduler=run.scheduler, trainer_state=trainer_state, keep_last=run.cfg.run.keep_last)  # fmt: skip


def evaluate_step(cfg: ExperimentConfig, policy: Policy, step: int, quiet: bool, *, tag: str | None = None,
              prefix: str = "eval", backend: Backend | None = None, reuse: bool = False) -> dict[str, float]:  # fmt: skip
    """Evaluate ``policy`` as ``cfg.eval`` says, write ``RUN/eval/<tag or step-N>.json`` and return its
    numbers flat (``prefix/split/metric``). With ``reuse``, a report already there with the same
    evaluation settings is read back instead (an interrupted run does not evaluate the same
    weights twice)."""
    from veriloop.algos.eval.loop import evaluate_config
    from veriloop.algos.eval.report import write_report

    splits, label = cfg.env.resolved_eval_splits, _checkpoint_label(cfg, step, tag)
    path = Path(cfg.run.out_dir) / cfg.run_name / "eval" / f"{tag or f'step-{step:06d}'}.json"
    report = reusable_report(cfg, path) if reuse else None
    if report is not None:
        say(quiet=quiet, text=f"{label}: evaluated before the interruption, reusing {path}")
    else:
        say(quiet=quiet, text=f"evaluating {label}: {len(splits)} split(s) ({', '.join(splits)}) x "
                    f"{cfg.eval.num_problems} problems x {cfg.eval.n_samples} samples")  # fmt: skip
        report = evaluate_config(cfg, policy, step=step, backend=backend)
        report["meta"]["checkpoint"] = label
        write_report(report, path.parent, path.stem)
    flat = {f"{prefix}/{split}/{k}": float(v) for split, m in report["splits"].items()
            for k, v in m.items() if isinstance(v, int | float) and not isinstance(v, bool)}  # fmt: skip
    shown = ", ".join(f"{k}={v:.3f}" for k, v in flat.items() if k.endswith("avg@n"))
    say(quiet=quiet, text=f"{prefix} @{step}: {shown}")
    return flat


def reusable_report(cfg: ExperimentConfig, path: Path) -> dict[str, Any] | None:
    """The report at ``path`` when it was made with ``cfg``'s evaluation settings (problems,
    samples, temperature, splits...); None when there is none or it differs."""
    from veriloop.algos.eval.report import read_report

    if not path.is_file():
        return None
    try:
        report = read_report(path)
        meta = report["meta"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    e, seeds = cfg.eval, list(cfg.eval_seed_range)
    want = {"num_problems": len(seeds), "first_seed": seeds[0], "n_samples": e.n_samples,
            "k_list": list(e.k_list), "temperature": e.temperature, "greedy": e.greedy,
            "max_new_tokens": cfg.rollout.max_new_tokens, "sampling_seed": e.seed_offset}  # fmt: skip
    splits = {n: [str(sp.id), dict(sp.kwargs)] for n, sp in cfg.env.resolved_eval_splits.items()}
    saved = {n: [str(sp.get("id")), sp.get("kwargs") or {}] for n, sp in meta.get("splits", {}).items()}
    same = json.dumps(splits, sort_keys=True, default=str) == json.dumps(saved, sort_keys=True, default=str)
    if any(meta.get(k) != v for k, v in want.items()) or not same:
        return None
    return report


def _checkpoint_label(cfg: ExperimentConfig, step: int, tag: str | None) -> str:
    """What was evaluated, in words: the tables name it instead of the model's file name."""
    if tag == "base":
        return "base model (before SFT)"
    if step == 0:
        return "start (after SFT)" if cfg.sft.steps > 0 else "base model (step 0)"
    return f"RL step {step}"


#: What the names in a step line mean (said once, when the RL steps start).
STEP_LEGEND = (
    "step lines: R = mean reward on the environment's scale (a wrong answer may score -1, length or format "
    "penalties lower it), acc = share solved, len = response tokens, H = entropy per token, clip+ = share "
    "of tokens clipped high, |g| = gradient norm, t_roll / t_train = seconds generating / training"
)


def step_summary(m: dict[str, float]) -> str:
    keys = [("reward/mean", "R"), ("success_rate", "acc"), ("response_length/mean", "len"),
            ("entropy", "H"), ("clip_frac_high", "clip+"), ("grad_norm", "|g|"), ("time/rollout_s", "t_roll"),
            ("time/train_s", "t_train")]  # fmt: skip
    return " ".join(f"{short}={m[k]:.3g}" for k, short in keys if m.get(k) is not None)
