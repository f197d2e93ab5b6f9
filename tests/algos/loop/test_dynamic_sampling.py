"""DAPO dynamic sampling: informative groups only, verifier failures out of the baseline."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from veriloop.algos.learner.signal import is_informative, verifier_failed
from veriloop.algos.loop.sampling import dynamic_sampling
from veriloop.envs.verifiers import Verdict


def ep(reward: float, error: str | None = None):
    return SimpleNamespace(
        reward=reward,
        turns=[SimpleNamespace(verdict=Verdict(correct=reward > 0, error=error))],  # type: ignore[arg-type]
    )


def test_keeps_only_informative_groups_and_stops_at_target():
    rounds = iter([[[ep(1), ep(1)], [ep(1), ep(0)]], [[ep(0), ep(0)], [ep(0), ep(1)], [ep(1), ep(0)]]])
    kept, stats = dynamic_sampling(
        lambda n: next(rounds), num_groups=2, max_rounds=5, reward_fn=lambda t: t.reward
    )
    assert len(kept) == 2 and all(is_informative([t.reward for t in g]) for g in kept)
    assert stats["rounds"] == 2 and stats["sampled_groups"] == 5
    assert stats["kept_fraction"] == pytest.approx(2 / 5) and stats["short_batch"] == 0


def test_asks_for_missing_groups_and_reports_short_batch():
    asked = []

    def sample(n):
        asked.append(n)
        return [[ep(1), ep(1)]] * n

    kept, stats = dynamic_sampling(sample, num_groups=3, max_rounds=2, reward_fn=lambda t: t.reward)
    assert kept == [] and asked == [3, 3] and stats["short_batch"] == 1 and stats["zero_variance_groups"] == 6


def test_verifier_failures_are_dropped_from_groups():
    groups = [[ep(1), ep(0, error="timeout")], [ep(1), ep(0), ep(0, error="crash")]]
    kept, stats = dynamic_sampling(lambda n: groups, num_groups=2, max_rounds=1, reward_fn=lambda t: t.reward)
    # group 1 has a single judged episode left: no baseline -> not informative
    assert len(kept) == 1 and [t.reward for t in kept[0]] == [1, 0]
    assert not any(verifier_failed(t) for g in kept for t in g) and stats["verifier_failed"] == 2


def test_never_returns_zero_variance_group_random():
    rng = random.Random(0)

    def sample(n):
        return [
            [ep(rng.choice([0, 1]), error=rng.choice([None] * 5 + ["timeout"])) for _ in range(4)]
            for _ in range(n)
        ]

    kept, _ = dynamic_sampling(sample, num_groups=20, max_rounds=10, reward_fn=lambda t: t.reward)
    assert len(kept) == 20
    for g in kept:
        rewards = [t.reward for t in g]
        assert len(g) >= 2 and max(rewards) != min(rewards)


def test_over_sampling_keeps_the_target_and_reports_both_fractions():
    # asked for 2, the sampler returns 4 groups: 3 informative, 1 all-correct -> keep the first 2
    groups = [[ep(1), ep(0)], [ep(1), ep(1)], [ep(0), ep(1)], [ep(1), ep(0)]]
    kept, stats = dynamic_sampling(lambda n: groups, num_groups=2, max_rounds=3, reward_fn=lambda t: t.reward)
    assert kept == [groups[0], groups[2]] and stats["rounds"] == 1
    assert stats["kept_fraction"] == pytest.approx(2 / 4)
    assert stats["informative_fraction"] == pytest.approx(3 / 4) and stats["zero_variance_groups"] == 1
