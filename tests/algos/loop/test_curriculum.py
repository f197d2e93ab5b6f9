"""Difficulty-aware sampling: pools, the acceptance draw, running success rates, the group gate."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from veriloop.algos.loop.curriculum import (
    Pool,
    SuccessStats,
    accept_draw,
    bucket_name,
    check_pools,
    draw_problems,
    gate_accepts,
    paid_metrics,
    pool_metrics,
    pool_of,
    record_groups,
)
from veriloop.algos.loop.sampling import dynamic_sampling

POOLS = (Pool("hard", 0.0, 0.2, 1.0), Pool("medium", 0.2, 0.8, 1.0), Pool("easy", 0.8, 1.0, 0.0))


def ep(solved: bool, reward: float | None = None, level: int = 1, tokens: int = 3):
    turn = SimpleNamespace(signal=SimpleNamespace(solved=solved), verdict=None)
    return SimpleNamespace(
        turns=[turn],
        reward=float(solved) if reward is None else reward,
        task={"level": level},
        num_generated_tokens=tokens,
    )


def test_success_stats_ema_by_hand():
    s = SuccessStats(alpha=0.25, prior=0.5)
    assert s.rate("math/1") == 0.5  # unseen: the prior
    s.update("math/1", 1.0)  # first group sets the rate
    s.update("math/1", 0.0)  # 0.75 * 1 + 0.25 * 0
    s.update("math/1", 0.5)  # 0.75 * 0.75 + 0.25 * 0.5 = 0.6875
    assert s.rate("math/1") == pytest.approx(0.6875) and s.groups == {"math/1": 3}
    back = SuccessStats.from_state(s.state(), alpha=0.25, prior=0.5)
    assert back.rates == s.rates and back.groups == s.groups


def test_pools_must_cover_and_have_weight():
    check_pools(POOLS)
    with pytest.raises(ValueError, match="no pool"):
        check_pools([Pool("a", 0.0, 0.4, 1.0), Pool("b", 0.6, 1.0, 1.0)])
    with pytest.raises(ValueError, match="weight 0"):
        check_pools([Pool("a", 0.0, 1.0, 0.0)])
    with pytest.raises(ValueError, match="low <= high"):
        check_pools([Pool("a", 0.5, 0.1, 1.0)])
    assert pool_of(0.2, POOLS).name == "hard" and pool_of(0.9, POOLS).name == "easy"


def test_zero_weight_pool_is_never_drawn_and_draw_is_a_function_of_the_seed():
    stats = SuccessStats()
    stats.update("env/easy", 1.0)
    stats.update("env/hard", 0.0)
    bucket = lambda s: "env/easy" if s % 2 else "env/hard"  # noqa: E731
    d = draw_problems(100, 10, bucket_of=bucket, stats=stats, pools=POOLS, run_seed=7, max_scan=4)
    assert len(d.seeds) == 10 and all(s % 2 == 0 for s in d.seeds)
    assert d.pools == {"hard": 10, "medium": 0, "easy": 0} and d.forced == 0
    assert d.next_seed == 100 + 10 + d.skipped  # every offered seed is taken or skipped, once
    # the same seeds again, and a draw starting later agrees on the seeds they share
    again = draw_problems(100, 10, bucket_of=bucket, stats=stats, pools=POOLS, run_seed=7, max_scan=4)
    assert again == d
    later = draw_problems(d.seeds[3], 7, bucket_of=bucket, stats=stats, pools=POOLS, run_seed=7, max_scan=4)
    assert later.seeds == d.seeds[3:]
    assert accept_draw(7, 5) == accept_draw(7, 5) != accept_draw(8, 5)


def test_weights_set_the_share_of_a_pool():
    pools = (Pool("hard", 0.0, 0.5, 1.0), Pool("easy", 0.5, 1.0, 0.25))
    stats = SuccessStats()
    stats.update("e", 1.0)
    stats.update("h", 0.0)
    d = draw_problems(
        0, 4000, bucket_of=lambda s: "e" if s % 2 else "h", stats=stats, pools=pools, run_seed=0, max_scan=4
    )
    # equal offers, easy taken a quarter as often: 1 / (1 + 0.25) of the batch is hard
    assert d.pools["hard"] / 4000 == pytest.approx(0.8, abs=0.02)


def test_scan_bound_fills_the_batch_with_skipped_seeds():
    pools = (Pool("a", 0.0, 0.5, 1e-9), Pool("b", 0.5, 1.0, 1.0))
    stats = SuccessStats(prior=0.0)  # every bucket in "a": almost never taken
    d = draw_problems(10, 3, bucket_of=str, stats=stats, pools=pools, run_seed=0, max_scan=2)
    assert d.seeds == (10, 11, 12) and d.forced == 3 and d.skipped == 3 and d.next_seed == 16


def test_gate_by_hand():
    assert not gate_accepts([1, 1, 1], [1, 1, 1], low=0, high=1)  # all equal: every advantage 0
    assert gate_accepts([1, 0, 0], [1, 0, 0], low=0, high=1)
    assert not gate_accepts([1, 0, 0, 0], [1, 0, 0, 0], low=0.3, high=1)  # 0.25 < low
    assert gate_accepts([1, 1, 0, 0], [1, 1, 0, 0], low=0.3, high=0.5)
    assert not gate_accepts([(1, 0), (1, 0)], [1, 1], low=0, high=1)  # tuple signals compare whole
    with pytest.raises(ValueError):
        gate_accepts([1, 0], [1], low=0, high=1)


def test_gate_refills_through_dynamic_sampling_and_counts_the_cost():
    rounds = iter([[[ep(True), ep(True)], [ep(True), ep(False)]], [[ep(False), ep(True)]]])
    played = []

    def sample(n):
        groups = next(rounds)
        played.extend(t for g in groups for t in g)
        return groups

    accept = lambda group: gate_accepts([t.reward for t in group], [t.reward for t in group], low=0, high=1)  # noqa: E731
    kept, gs = dynamic_sampling(sample, num_groups=2, max_rounds=3, reward_fn=lambda t: t, accept=accept)
    assert len(kept) == 2 and gs["rounds"] == 2
    m = paid_metrics(played, kept=4, gate_stats=gs)
    assert m["curriculum/rejected_groups"] == 1 and m["curriculum/refills"] == 1
    assert m["curriculum/paid_episodes"] == 6 and m["curriculum/paid_tokens"] == 18
    assert m["curriculum/wasted_episodes"] == 2


def test_record_groups_and_pool_metrics():
    stats = SuccessStats(alpha=0.5)
    groups = [
        [ep(True, level=1), ep(True, level=1)],
        [ep(False, level=5), ep(True, level=5)],
        [ep(False, level=9), ep(False, level=9)],
    ]
    record_groups(stats, groups, lambda t: bucket_name("math", t.task, ["level"]))
    assert stats.rates == {"math/1": 1.0, "math/5": 0.5, "math/9": 0.0}
    d = draw_problems(0, 2, bucket_of=lambda s: "math/5", stats=stats, pools=POOLS, run_seed=0, max_scan=8)
    m = pool_metrics(stats, POOLS, d)
    assert m["curriculum/buckets"] == 3
    assert (
        m["curriculum/pool/hard/buckets"],
        m["curriculum/pool/medium/buckets"],
        m["curriculum/pool/easy/buckets"],
    ) == (1, 1, 1)
    assert m["curriculum/pool/medium/drawn"] == 2
    assert bucket_name("p24", {"target": 24}, ["level", "target"]) == "p24/24"
    assert bucket_name("p24", {}, ["level"]) == "p24"
