"""How a step samples: the sampler's settings and seed of every rollout call (``sampling_for``,
``sampling_stream``), its limits (``rollout_limits``), and DAPO dynamic sampling, which keeps only
groups that carry a learning signal.

A group whose rewards are all equal has zero group-relative advantage everywhere, so it only
dilutes the batch. DAPO over-samples and keeps sampling until the batch holds N informative groups.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, TypeVar

from veriloop.agents.engine import RolloutLimits
from veriloop.agents.sampling_params import SamplingParams
from veriloop.algos.learner.signal import group_informative, verifier_failed
from veriloop.configs.schema import ExperimentConfig

T = TypeVar("T")
logger = logging.getLogger(__name__)


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


def dynamic_sampling(
    sample_groups: Callable[[int], list[list[T]]],
    *,
    num_groups: int,
    max_rounds: int,
    reward_fn: Callable[[T], Any],
    accept: Callable[[list[T]], bool] | None = None,
    name: str = "dynamic sampling",
) -> tuple[list[list[T]], dict[str, float]]:
    """Sample groups until ``num_groups`` informative ones are kept or ``max_rounds`` have run.

    Each round asks ``sample_groups(n)`` for the number of groups still missing (the callable may
    over-sample internally). In every group, episodes whose verifier failed (``verifier_failed``)
    are removed first: they are neither a right nor a wrong answer, so they must not enter the
    baseline. The group is kept only if the remaining episodes' rewards (``reward_fn``) are not all
    equal (``group_informative``). Never returns a zero-variance group. If the rounds run out first,
    returns what it has and sets the ``short_batch`` stat to 1 (and logs a warning).

    Args:
        sample_groups: ``n -> groups``, each group a list of episodes sharing a start state.
        num_groups: informative groups wanted; max_rounds: cap on calls to ``sample_groups``.
        reward_fn: the reward of one episode that decides informativeness: the signal the
            estimator learns from (``credit.learning_signal``: a tuple, compared as a whole).
        accept: ``group -> keep?`` over the group's judged episodes, instead of
            ``group_informative`` (the curriculum's gate: ``curriculum.gate_accepts``).
        name: Who is sampling, in the warning of a short batch (``"the curriculum gate"``).

    Returns:
        kept groups (at most ``num_groups``), and stats: ``rounds``, ``sampled_groups``,
        ``kept_groups``, ``kept_fraction`` (kept / sampled), ``informative_fraction``
        (accepted groups / sampled; without ``accept`` that is ``informative_fraction`` of every
        group sampled; differs from ``kept_fraction`` when ``sample_groups`` over-samples and
        surplus informative groups are dropped), ``zero_variance_groups``, ``verifier_failed``
        (episodes dropped), ``short_batch`` (0 or 1).
    """
    if num_groups < 1 or max_rounds < 1:
        raise ValueError(f"need num_groups >= 1 and max_rounds >= 1, got {num_groups} and {max_rounds}")
    kept: list[list[T]] = []
    sampled = zero_var = failed = rounds = 0
    informative = 0
    while len(kept) < num_groups and rounds < max_rounds:
        rounds += 1
        groups = sample_groups(num_groups - len(kept))
        for group in groups:
            sampled += 1
            good = [t for t in group if not verifier_failed(t)]
            failed += len(group) - len(good)
            if accept(good) if accept is not None else group_informative(good, reward_fn):
                informative += 1
                kept.append(good)
            else:
                zero_var += 1
    kept = kept[:num_groups]
    short = len(kept) < num_groups
    if short:
        logger.warning("%s kept %d of %d groups after %d rounds", name, len(kept), num_groups, rounds)
    return kept, _stats(rounds, sampled, len(kept), informative, zero_var, failed, short)


def _stats(
    rounds: int, sampled: int, kept: int, informative: int, zero_var: int, failed: int, short: bool
) -> dict[str, float]:
    """``dynamic_sampling``'s stats, as floats (see its docstring)."""
    return {
        "rounds": float(rounds),
        "sampled_groups": float(sampled),
        "kept_groups": float(kept),
        "kept_fraction": kept / sampled if sampled else 0.0,
        "informative_fraction": informative / sampled if sampled else 0.0,
        "zero_variance_groups": float(zero_var),
        "verifier_failed": float(failed),
        "short_batch": float(short),
    }
