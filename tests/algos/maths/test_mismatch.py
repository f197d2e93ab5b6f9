"""Sampler-vs-trainer mismatch statistics: a hand-computed case and the invariants."""

from __future__ import annotations

import math

import pytest
import torch

from veriloop.algos.maths.mismatch import MismatchStats, mismatch_stats


def test_hand_computed_case():
    # pi / mu per token: 0.8 / 0.2 = 4, 0.1 / 0.5 = 0.2, 0.5 / 0.5 = 1; the last token is masked out
    pi = torch.tensor([[0.8, 0.1, 0.5, 0.9]]).log()
    mu = torch.tensor([[0.2, 0.5, 0.5, 0.01]]).log()
    mask = torch.tensor([[1, 1, 1, 0]])
    m = mismatch_stats(pi, mu, mask).metrics()
    # r - 1 - log r: 4 - 1 - 1.386294 = 1.613706; 0.2 - 1 + 1.609438 = 0.809438; 0
    assert m["mismatch/k3_kl"] == pytest.approx((1.613706 + 0.809438 + 0.0) / 3, abs=1e-6)
    assert m["mismatch/ratio_max"] == pytest.approx(4.0)
    assert m["mismatch/ratio_min"] == pytest.approx(0.2)
    assert m["mismatch/outside_frac"] == pytest.approx(2 / 3)  # 4 and 0.2 lie outside [0.5, 2]
    assert m["mismatch/abs_log_ratio"] == pytest.approx((1.386294 + 1.609438) / 3, abs=1e-6)
    assert m["mismatch/tokens"] == 3


def test_no_mismatch_and_no_tokens():
    lp = torch.randn(2, 5).clamp(max=0)
    m = mismatch_stats(lp, lp.clone(), torch.ones(2, 5)).metrics()
    assert (
        m["mismatch/k3_kl"],
        m["mismatch/ratio_max"],
        m["mismatch/ratio_min"],
        m["mismatch/outside_frac"],
    ) == (
        0.0,
        1.0,
        1.0,
        0.0,
    )
    empty = mismatch_stats(lp, lp - 1, torch.zeros(2, 5)).metrics()
    assert empty["mismatch/tokens"] == 0 and empty["mismatch/k3_kl"] == 0.0


def test_micro_batches_combine_exactly():
    g = torch.Generator().manual_seed(0)
    pi, mu = -torch.rand(4, 7, generator=g) * 3, -torch.rand(4, 7, generator=g) * 3
    mask = (torch.rand(4, 7, generator=g) > 0.3).long()
    whole = mismatch_stats(pi, mu, mask).metrics()
    parts = mismatch_stats(pi[:1], mu[:1], mask[:1]) + mismatch_stats(pi[1:], mu[1:], mask[1:])
    for k, v in parts.metrics().items():
        assert v == pytest.approx(whole[k], rel=1e-12)
    assert (MismatchStats() + parts).metrics() == parts.metrics()


def test_k3_is_unbiased_for_kl_of_the_sampler_to_the_trainer():
    """Weighting each token by mu (the sampler draws them), the k3 terms sum to KL(mu || pi)."""
    mu = torch.tensor([0.5, 0.3, 0.15, 0.05], dtype=torch.float64)
    pi = torch.tensor([0.4, 0.4, 0.1, 0.1], dtype=torch.float64)
    d = pi.log() - mu.log()
    per_token = d.exp() - 1 - d  # what mismatch_stats sums for each drawn token
    kl = float((mu * (mu.log() - pi.log())).sum())
    assert float((mu * per_token).sum()) == pytest.approx(kl, rel=1e-12)
    assert (per_token >= 0).all()
    stats = mismatch_stats(pi.log()[None], mu.log()[None], torch.ones(1, 4))
    assert stats.k3_sum == pytest.approx(float(per_token.sum()))


def test_shapes_must_agree():
    with pytest.raises(ValueError, match="must have one shape"):
        mismatch_stats(torch.zeros(2, 3), torch.zeros(2, 4), torch.ones(2, 3))
    assert math.isinf(MismatchStats().log_ratio_max)
