"""Guards that stop a run which cannot learn, or warn when its samples are mostly cut off.

A step whose every group got the same learning signal (``sampling/informative_fraction == 0``: all
rewards equal within each group) has no group-relative advantage anywhere, so it trains nothing.
``train.max_uninformative_steps`` such steps in a row stop the run with
:class:`UninformativeRunError`: a run that trained nothing is a failure, not a success. The
share of samples cut at ``rollout.max_new_tokens`` (``truncation_rate``) above
``train.warn_truncation_above`` is reported once per run.

A run shorter than that limit is judged at its end (:func:`stop_if_nothing_trained`): if none of
its steps had an informative group and it played at least ``train.untrained_after_groups`` groups
(default 32), it trained nothing and fails the same way. Fewer groups are too few to tell: a
1-step smoke test, or a tiny random model that never solves a problem, ends as before. With 32
groups, a task on which a group is informative one time in ten ends up with none 3% of the time
(0.9^32), one time in five 0.08%.

Both loops (``train.py``, ``async_loop.py``) count a step after it is logged, so the rows that led
to a stop are in ``metrics.jsonl``; the end-of-run check runs once the loop is done, before
``final/`` is written.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any


class RunStoppedError(RuntimeError):
    """The run stopped itself because going on would waste the compute (the CLI exits 4)."""


class UninformativeRunError(RunStoppedError):
    """``train.max_uninformative_steps`` steps in a row had no informative group."""


def _warn(text: str) -> None:
    print(f"veriloop: warning: {text}", file=sys.stderr, flush=True)


@dataclass
class LearningGuard:
    """Counts steps without an informative group, and warns once about truncated samples.

    Attributes:
        limit: this many uninformative steps in a row stop the run; 0 = never.
        warn_truncation_above: a step whose ``truncation_rate`` exceeds this warns (once).
        group_size: samples per group, named in the message.
        in_a_row: uninformative steps since the last informative one (restored on resume).
        truncation_warned: the truncation warning was given (restored on resume).
        group_based: the advantage's baseline is the group (``algo.advantage``'s ``group_based``);
            else (``batch_norm``, ``gae``) a step teaches when its samples' rewards differ at all
            (:func:`step_has_signal`).
    """

    limit: int
    warn_truncation_above: float
    group_size: int
    in_a_row: int = 0
    truncation_warned: bool = False
    group_based: bool = True

    def observe(self, metrics: Mapping[str, Any], warn: Callable[[str], None] = _warn) -> None:
        """Count one step from its logged metrics; raises :class:`UninformativeRunError` at the limit."""
        signal = step_has_signal(metrics, self.group_based)
        if signal is not None:
            self.in_a_row = 0 if signal else self.in_a_row + 1
        cut = metrics.get("truncation_rate")
        if cut is not None and float(cut) > self.warn_truncation_above and not self.truncation_warned:
            self.truncation_warned = True
            warn(
                f"{float(cut):.0%} of this step's samples were cut at rollout.max_new_tokens (above "
                f"train.warn_truncation_above={self.warn_truncation_above:g}): their rewards judge unfinished "
                "answers; raise rollout.max_new_tokens, ask for shorter answers in the prompt, or add an "
                "overlong penalty (algo.overlong_max_len)"
            )
        if self.limit > 0 and self.in_a_row >= self.limit:
            raise UninformativeRunError(self.message(metrics))

    def message(self, metrics: Mapping[str, Any]) -> str:
        """Why the run stopped and what to change, from the last step's reward."""
        reward = metrics.get("reward/mean")
        level = f" (last step's reward/mean {float(reward):.3g})" if reward is not None else ""
        side = ""
        if reward is not None and metrics.get("reward/std") is not None and float(metrics["reward/std"]) == 0:
            side = " every sample got the same reward:"
        if not self.group_based:
            return (
                f"train: every sample of a step got the same reward for {self.in_a_row} steps in a row{level}: "
                f"there was no advantage and nothing was trained. {_ADVICE}; "
                "train.max_uninformative_steps=0 turns this check off"
            )
        return (
            f"train: no informative group for {self.in_a_row} steps in a row{level}:{side} within every group of "
            f"rollout.group_size={self.group_size} samples the learning signal was the same, so there was no "
            f"advantage and nothing was trained. {_ADVICE}; train.max_uninformative_steps=0 turns this check off"
        )


#: What to change when a run cannot learn (every stop message ends with it, then its off switch).
_ADVICE = (
    "The task is too hard or too easy for this model at this group size: raise rollout.group_size or "
    "rollout.temperature, pick an easier (or harder) task, start with an SFT warm-up (sft.steps), or check "
    "the verifier and the chat template"
)


def step_has_signal(metrics: Mapping[str, Any], group_based: bool = True) -> bool | None:
    """Whether a logged step could teach anything (None: not logged). With a group baseline, some
    group was informative (``sampling/informative_fraction > 0``); with a batch-wide or learned one
    (``batch_norm``, ``gae``, which also run with ``rollout.group_size=1``, where no group is ever
    informative), the step's rewards were not all equal (``reward/std > 0``)."""
    value = metrics.get("sampling/informative_fraction" if group_based else "reward/std")
    return None if value is None else float(value) > 0


def stop_if_nothing_trained(cfg: Any, state: Any) -> None:
    """At the end of the run: raise :class:`UninformativeRunError` when none of its ``state.step``
    steps had an informative group (``state.uninformative_in_a_row`` counts them all, a resumed run's
    included) and they played at least ``cfg.train.untrained_after_groups`` groups
    (``state.step * cfg.rollout.prompts_per_step``, the groups asked for; 0 = never)."""
    steps, least = int(state.step), int(cfg.train.untrained_after_groups)
    groups = steps * int(cfg.rollout.prompts_per_step)
    if least <= 0 or steps == 0 or int(state.uninformative_in_a_row) < steps or groups < least:
        return
    head, same = (
        ("one informative group", "every sample of a group got the same learning signal")
        if cfg.algo.estimator.group_based
        else ("a learning signal", "every sample of a step got the same reward")
    )
    raise UninformativeRunError(
        f"train: the run ended without {head}: in all {steps} steps ({groups} groups of "
        f"rollout.group_size={cfg.rollout.group_size} samples) {same}, so there was no advantage and nothing "
        f"was trained. {_ADVICE}; train.untrained_after_groups=0 turns this check off"
    )


def first_step_check(metrics: Mapping[str, Any], group_size: int) -> tuple[str, bool]:
    """The base policy's first groups, before the first update, in one line, with what to change when
    a share is extreme; returns the line and whether it is a warning.

    Shares: groups with zero reward variance (``1 - sampling/informative_fraction``), samples cut at
    ``max_new_tokens`` (``truncation_rate``), episodes whose verifier failed (``verifier/errors`` over
    ``samples/episodes``)."""
    flat = 1.0 - float(metrics.get("sampling/informative_fraction", 0.0))
    cut = float(metrics.get("truncation_rate", 0.0))
    errors = float(metrics.get("verifier/errors", 0.0)) / max(
        float(metrics.get("samples/episodes", 1.0)), 1.0
    )
    reward = float(metrics.get("reward/mean", 0.0))
    advice = []
    if flat >= 1.0:
        advice.append(
            f"every group has one reward (reward/mean {reward:.3g}): the task is too hard or too easy for "
            f"this model at this group size; raise rollout.group_size (now {group_size}) or the temperature, "
            "pick another task or start with an SFT warm-up (sft.steps)"
        )
    if cut > 0.5:
        advice.append(
            "most samples hit the token limit: raise rollout.max_new_tokens or ask for shorter answers"
        )
    if errors > 0.1:
        advice.append("many verifier errors: check the verifier (a timeout: raise env.kwargs.timeout)")
    line = (
        f"step-0 groups (base policy): {flat:.0%} with zero reward variance, {cut:.0%} of samples cut at "
        f"rollout.max_new_tokens, {errors:.0%} verifier errors"
    )
    return (line + ("; " + "; ".join(advice) if advice else ""), bool(advice))
