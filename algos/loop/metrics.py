"""What a step logs besides the update's own numbers: the episodes played (``rollout_metrics``), the
step's wall-clock split (``step_timing``), its one-line summary (``step_summary``), and the lines that
say which training modes are on (``modes_line``) and what they did (``modes_tally``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from veriloop.agents.drift import drift_rate
from veriloop.agents.trajectory import Trajectory
from veriloop.algos.eval.loop import env_metrics, env_summary, final_sample, format_rate
from veriloop.algos.learner.signal import verifier_failed
from veriloop.algos.run.progress import say
from veriloop.configs.schema import ExperimentConfig


def rollout_metrics(trajs: Sequence[Trajectory], tokenizer: Any) -> dict[str, float]:
    """The same names for every algorithm (reward, success, length, truncation, R1 format, verifier,
    drift); ``format_rate`` is the evaluation's own formula (:func:`~veriloop.algos.eval.loop.format_rate`).

    Verifier errors and timeouts count episodes with a failed verification on any turn. An
    environment's own metrics (``LearnerSignal.step_metrics`` averaged over the steps with a value,
    and its ``summarize`` of the whole batch, e.g. the solve-verify loop's recall per class and
    balanced verification accuracy) come under ``rollout/``: the evaluation's formulas on the
    training episodes, so that a verifier collapsing to one verdict shows at the step it happens.
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
        "format_rate": format_rate(trajs),
        "turns/mean": sum(t.num_turns for t in trajs) / len(trajs),
        "verifier/errors": float(sum(verifier_failed(t) for t in trajs)),
        "verifier/timeouts": float(sum("timeout" in e for e in errors)),
        "drift_rate": sum(drift_rate(tokenizer, t) for t in drift_sample) / max(len(drift_sample), 1),
        "samples/split_rate": sum(t.num_samples > 1 for t in trajs) / len(trajs),
        "samples/per_episode": sum(t.num_samples for t in trajs) / len(trajs),
        "samples/episodes": float(len(trajs)),
        **{
            f"rollout/{name}": value
            for name, value in {**env_metrics(trajs)[0], **env_summary(trajs)}.items()
        },
    }


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
        "time/rollout_s": t_rollout,
        "time/train_s": t_train,
        "time/rollout_fraction": t_rollout / max(t_rollout + t_train, 1e-9),
        "throughput/rollout_tokens_per_s": gen_tokens / max(t_rollout, 1e-9),
        "throughput/train_tokens_per_s": metrics["train_tokens"] / max(t_train, 1e-9),
    }


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
        split = sum(
            float(r["samples/split_rate"]) * float(r["samples/episodes"])
            for r in rows
            if isinstance(r.get("samples/split_rate"), int | float)
            and isinstance(r.get("samples/episodes"), int | float)
        )
        said.append(f"compaction split {split:.0f} episodes")
    if cfg.curriculum.enabled:
        said.append(
            f"the curriculum gate rejected {total('curriculum/rejected_groups'):.0f} groups "
            f"({total('curriculum/refills'):.0f} refills, {total('curriculum/wasted_episodes'):.0f} episodes not trained on)"
        )
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


#: What the names in a step line mean (said once, when the RL steps start).
STEP_LEGEND = (
    "step lines: R = mean reward on the environment's scale (a wrong answer may score -1, length or format "
    "penalties lower it), acc = share solved, len = response tokens, H = entropy per token, clip+ = share "
    "of tokens clipped high, vbal = balanced accuracy of the policy's own verdicts (solve-verify only; "
    "0.5 = it says the same to every solve), |g| = gradient norm, t_roll / t_train = seconds generating / "
    "training"
)


def step_summary(m: dict[str, float]) -> str:
    keys = [
        ("reward/mean", "R"),
        ("success_rate", "acc"),
        ("response_length/mean", "len"),
        ("entropy", "H"),
        ("clip_frac_high", "clip+"),
        ("rollout/verify_balanced_acc", "vbal"),
        ("grad_norm", "|g|"),
        ("time/rollout_s", "t_roll"),
        ("time/train_s", "t_train"),
    ]
    return " ".join(f"{short}={m[k]:.3g}" for k, short in keys if m.get(k) is not None)
