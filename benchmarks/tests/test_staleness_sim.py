"""The simulated scheduler of the async benchmark (``benchmarks/staleness_sim.py``): a trainer and a
generator with fixed step and sync times and long-tail generation times, for K = 0, 1, 2, 4."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the benchmarks folder, as when run
from staleness_sim import long_tail_lengths, simulate  # noqa: E402


def test_simulated_k0_by_hand() -> None:
    """Equal generation times L, train T, sync S: K = 0 takes L + T + S per step; the trainer waits
    L of it, the generator T + S."""
    res = simulate(0, steps=3, groups_per_step=2, length=lambda gid: 2.0, train_s=1.0, sync_s=0.5)
    summary = res.summary(3, 0)
    assert summary["wall_s_per_step"] == pytest.approx(3.5)
    assert summary["trainer_wait_fraction"] == pytest.approx(2.0 / 3.5)
    assert summary["generator_wait_fraction"] == pytest.approx(1.5 / 3.5)
    assert summary["staleness_hist"] == [6]


def test_simulated_k1_overlaps_by_hand() -> None:
    """K = 1, L = T = 2, S = 0: after the first step generation runs during every update, so each
    further step takes max(L, T) = 2 s instead of L + T = 4 s."""
    res = simulate(1, steps=5, groups_per_step=1, length=lambda gid: 2.0, train_s=2.0, sync_s=0.0)
    assert res.wall_s == pytest.approx(2.0 + 5 * 2.0)
    assert res.staleness == [0, 1, 1, 1, 1]


@pytest.mark.parametrize("k", [0, 1, 2, 4])
def test_simulated_long_tail_keeps_the_bound(k: int) -> None:
    """Long-tail generation times (lognormal, sigma 1.5): every trained group has staleness <= K,
    every step trains n groups, and generation never runs more than K steps ahead."""
    steps, n = 40, 4
    res = simulate(
        k, steps=steps, groups_per_step=n, length=long_tail_lengths(7, sigma=1.5), train_s=1.0, sync_s=0.2
    )
    summary = res.summary(steps, k)
    assert max(res.staleness) <= k
    assert len(res.staleness) == steps * n
    assert sum(summary["staleness_hist"]) == steps * n  # type: ignore[arg-type]
    assert max(res.in_flight) <= (k + 1) * n  # the admitted capacity
    if k > 0:
        assert max(res.staleness) == k  # the long tail does use the whole bound
        assert max(res.spans) >= 1  # some group lived through a weight sync


def test_simulated_k_trades_idle_time_for_staleness() -> None:
    """The same long tail for K = 0, 1, 2, 4: the wall time per step and the trainer's idle share
    do not grow with K, and K = 1 already beats the synchronous loop."""
    runs = {
        k: simulate(
            k, steps=40, groups_per_step=4, length=long_tail_lengths(3, sigma=1.0), train_s=1.0, sync_s=0.2
        ).summary(40, k)
        for k in (0, 1, 2, 4)
    }
    walls = [runs[k]["wall_s_per_step"] for k in (0, 1, 2, 4)]
    waits = [runs[k]["trainer_wait_fraction"] for k in (0, 1, 2, 4)]
    assert all(b <= a + 1e-9 for a, b in zip(walls, walls[1:])), walls
    assert all(b <= a + 1e-9 for a, b in zip(waits, waits[1:])), waits
    assert walls[1] < 0.9 * walls[0]
    assert runs[0]["staleness_mean"] == 0.0 and runs[4]["staleness_mean"] > runs[1]["staleness_mean"]  # type: ignore[operator]
