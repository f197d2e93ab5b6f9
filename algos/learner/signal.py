"""What a group teaches: the one test of "informative" that every mode shares.

A group whose learning signals are all equal has zero group-relative advantage everywhere. The
dynamic-sampling drop (synchronous and asynchronous), the curriculum's gate,
``sampling/informative_fraction`` and the batch's baseline all ask these predicates, so the answer
is the same everywhere.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

T = TypeVar("T")


def verifier_failed(traj: Any) -> bool:
    """True when any turn's verdict has ``error`` set (timeout / memory / crash).

    Such an episode's reward is unknown, not wrong: it is dropped from its group's baseline.
    Works on any object with ``turns`` whose items have a ``verdict`` (``Verdict`` or None).
    """
    return any(turn.verdict is not None and turn.verdict.failed for turn in getattr(traj, "turns", ()))


def is_informative(rewards: Sequence[Any]) -> bool:
    """A group teaches something only if it has >= 2 rewards and they are not all equal.

    A reward may be a number or a tuple (one per turn or action, ``credit.learning_signal``)."""
    return len(rewards) >= 2 and max(rewards) != min(rewards)


def group_informative(group: Sequence[T], signal: Callable[[T], Any]) -> bool:
    """Whether a group teaches something: the learning signals (``signal``, e.g.
    ``credit.learning_signal``) of its judged episodes (verifier failures left out,
    ``verifier_failed``) are ``is_informative``. The one test of a group, in every mode: the
    dynamic-sampling drop (synchronous and asynchronous), the curriculum's gate and
    ``sampling/informative_fraction``."""
    return is_informative([signal(t) for t in group if not verifier_failed(t)])


def informative_fraction(groups: Sequence[Sequence[T]], signal: Callable[[T], Any]) -> float:
    """``sampling/informative_fraction``: the share of ``groups`` (every group played, kept or
    dropped) that are ``group_informative``; 0.0 for none."""
    return sum(group_informative(g, signal) for g in groups) / len(groups) if groups else 0.0
