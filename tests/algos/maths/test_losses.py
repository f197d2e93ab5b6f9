"""Per-token losses and aggregation: hand-computed numbers, autograd checks."""

from __future__ import annotations

import math

import pytest
import torch

from veriloop.algos.maths import losses as L


def _pg(ratios, adv, mask=None, **kw):
    lp = torch.log(torch.tensor([ratios])).requires_grad_(True)
    old = torch.zeros_like(lp)
    a = torch.tensor([adv])
    m = torch.ones_like(a) if mask is None else torch.tensor([mask])
    kw = {"clip_low": 0.2, "clip_high": 0.28, **kw}
    loss, stats = L.clipped_pg_loss(lp, old, a, m, **kw)
    loss.sum().backward()
    return loss.detach(), stats, lp.grad


def test_clipped_pg_loss_values_stats_and_gradient():
    ratios = [1.5, 0.5, 1.1, 0.9, 1.5, 0.5]
    adv = [1.0, -1.0, 1.0, -1.0, -1.0, 1.0]
    loss, stats, grad = _pg(ratios, adv)
    # clipped in the advantage's direction: tokens 0 (high) and 1 (low) -> constant, zero grad
    assert torch.allclose(loss, torch.tensor([[-1.28, 0.8, -1.1, 0.9, 1.5, -0.5]]), atol=1e-6)
    # d(-A r)/d log r = -A r elsewhere, including ratios outside the range on the other side
    assert torch.allclose(grad, torch.tensor([[0.0, 0.0, -1.1, 0.9, 1.5, -0.5]]), atol=1e-6)
    assert float(stats["clip_frac_high"]) == pytest.approx(1 / 6)
    assert float(stats["clip_frac_low"]) == pytest.approx(1 / 6)
    kl = sum((r - 1) - math.log(r) for r in ratios) / 6
    assert float(stats["approx_kl"]) == pytest.approx(kl, rel=1e-5)


def test_masked_tokens_get_no_loss_and_no_gradient():
    loss, stats, grad = _pg([1.1, 0.7, 1.3], [2.0, -3.0, 1.0], mask=[1.0, 0.0, 1.0])
    assert loss[0, 1] == 0 and grad[0, 1] == 0
    assert grad[0, 0] != 0
    assert float(stats["clip_frac_high"]) == pytest.approx(1 / 2)  # fractions over masked tokens only


def test_dual_clip_bounds_negative_advantage_loss():
    loss, stats, grad = _pg([5.0, 5.0], [-1.0, 1.0], dual_clip=3.0)
    assert torch.allclose(loss, torch.tensor([[3.0, -1.28]]))
    assert torch.all(grad == 0)
    assert float(stats["dual_clip_frac"]) == pytest.approx(0.5)


def test_policy_ratio():
    assert torch.allclose(
        L.policy_ratio(torch.tensor([[0.0, math.log(2)]]), torch.zeros(1, 2)), torch.tensor([[1.0, 2.0]])
    )


def test_kl_estimators():
    lp, ref = torch.tensor([[math.log(2.0)]]), torch.zeros(1, 1)
    d = math.log(2.0)
    assert float(L.kl_penalty(lp, ref, "k1")) == pytest.approx(d)
    assert float(L.kl_penalty(lp, ref, "k2")) == pytest.approx(d * d / 2)
    assert float(L.kl_penalty(lp, ref, "k3")) == pytest.approx(0.5 - 1 + d)
    x = torch.randn(4, 7)
    assert torch.all(L.kl_penalty(x, torch.randn(4, 7), "k3") >= 0)
    z = torch.zeros(1, 3, requires_grad=True)
    L.kl_penalty(z, torch.zeros(1, 3), "k3").sum().backward()
    assert torch.all(z.grad == 0)  # k3 has zero gradient at pi = pi_ref
    with pytest.raises(ValueError, match="k1"):
        L.kl_penalty(lp, ref, "k4")  # type: ignore[arg-type]


def test_entropy_bonus_and_value_loss():
    assert torch.allclose(L.entropy_bonus(torch.tensor([[1.0, 2.0]]), coef=0.1), torch.tensor([[-0.1, -0.2]]))
    v, old, ret, m = (torch.tensor([[x]]) for x in (1.0, 0.5, 2.0, 1.0))
    assert float(L.value_loss(v, old, ret, m)) == pytest.approx(0.5)
    # clipped value 0.5 + 0.2 = 0.7: max((1-2)^2, (0.7-2)^2) / 2 = 0.845
    assert float(L.value_loss(v, old, ret, m, clip=0.2)) == pytest.approx(0.845)
    assert float(L.value_loss(v, old, ret, torch.zeros(1, 1))) == 0.0


def test_token_mean_vs_sequence_mean_dapo_example():
    # sample A: 1 token with loss 1; sample B: 3 tokens with loss 2 each (padded to T = 3)
    per_tok = torch.tensor([[1.0, 0.0, 0.0], [2.0, 2.0, 2.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
    tm = L.aggregate(per_tok, mask, "token_mean")
    sm = L.aggregate(per_tok, mask, "seq_mean_token_mean")
    sc = L.aggregate(per_tok, mask, "seq_sum_constant", constant=4)
    assert float(tm.detach()) == pytest.approx(7 / 4)  # (1 + 6) / 4 tokens
    assert float(sm.detach()) == pytest.approx(1.5)  # (1/1 + 6/3) / 2 samples
    assert float(sc.detach()) == pytest.approx(7 / 4 / 2)  # (1 + 6) / 4 / 2 samples
    # per-token weights: token-mean gives every token 1/4; sequence-mean gives A's token 1/2 and
    # each of B's tokens 1/6 (long sequences' tokens count less: DAPO's argument)
    (g_tm,) = torch.autograd.grad(tm, per_tok)
    (g_sm,) = torch.autograd.grad(sm, per_tok)
    assert torch.allclose(g_tm, torch.tensor([[0.25, 0, 0], [0.25, 0.25, 0.25]]))
    assert torch.allclose(g_sm, torch.tensor([[0.5, 0, 0], [1 / 6, 1 / 6, 1 / 6]]))


def test_aggregate_micro_batches_sum_to_full_batch():
    torch.manual_seed(0)
    x = torch.randn(4, 6)
    m = (torch.rand(4, 6) > 0.4).float()
    m[:, 0] = 1
    for mode in ("token_mean", "seq_mean_token_mean", "seq_sum_constant"):
        full = L.aggregate(x, m, mode, constant=6)
        parts = sum(
            L.aggregate(x[i : i + 2], m[i : i + 2], mode, constant=6, total_tokens=m.sum(), total_seqs=4)
            for i in (0, 2)
        )
        assert float(parts) == pytest.approx(float(full), rel=1e-5)
    with pytest.raises(ValueError, match="constant"):
        L.aggregate(x, m, "seq_sum_constant")


def test_dual_clip_leaves_moderate_negative_advantage_losses_alone():
    # A = -1: r = 2 -> loss 2 < c = 3, unbounded branch, gradient -A r = 2; r = 0.5 is clipped
    # low (1 - 0.2 = 0.8): loss 0.8, gradient 0; r = 4 -> bounded at 3, gradient 0
    loss, stats, grad = _pg([2.0, 0.5, 4.0], [-1.0, -1.0, -1.0], dual_clip=3.0)
    assert torch.allclose(loss, torch.tensor([[2.0, 0.8, 3.0]]), atol=1e-6)
    assert torch.allclose(grad, torch.tensor([[2.0, 0.0, 0.0]]), atol=1e-6)
    assert float(stats["dual_clip_frac"]) == pytest.approx(1 / 3)


def test_clipped_value_loss_gradient():
    # V_old 0.5, R 2, eps 0.2. V = 1.0 moved 0.5 towards R: clipped value 0.7, (0.7-2)^2 > (1-2)^2,
    # gradient 0. V = 0.6 inside the range: gradient V - R = -1.4. V = 0 moved away from R:
    # (0-2)^2 = 4 > (0.3-2)^2, unclipped branch, gradient -2.
    v = torch.tensor([[1.0, 0.6, 0.0]], requires_grad=True)
    old, ret, m = torch.full((1, 3), 0.5), torch.full((1, 3), 2.0), torch.ones(1, 3)
    loss = L.value_loss(v, old, ret, m, clip=0.2)
    assert torch.allclose(loss.detach(), torch.tensor([[0.845, 0.98, 2.0]]), atol=1e-6)
    loss.sum().backward()
    assert torch.allclose(v.grad, torch.tensor([[0.0, -1.4, -2.0]]), atol=1e-6)


def test_masked_positions_get_exactly_zero_gradient_with_extreme_inputs():
    # Off the mask: an old log-prob of -1e4 (ratio e^1e4 = inf), a huge advantage, a NaN entropy and
    # an inf return. None of it may reach the loss or the gradient (0 * inf would be NaN).
    mask = torch.tensor([[1.0, 0.0, 1.0]])
    lp = torch.tensor([[-0.5, -2.0, -1.0]], requires_grad=True)
    clean_old, clean_adv = torch.tensor([[-0.6, 0.0, -1.0]]), torch.tensor([[1.0, 0.0, -2.0]])
    wild_old, wild_adv = torch.tensor([[-0.6, -1e4, -1.0]]), torch.tensor([[1.0, 1e30, -2.0]])
    grads = []
    for old, adv in ((clean_old, clean_adv), (wild_old, wild_adv)):
        for mode in ("token_mean", "seq_mean_token_mean", "seq_sum_constant"):
            pg, _ = L.clipped_pg_loss(lp, old, adv, mask, clip_low=0.2, clip_high=0.28, dual_clip=3.0)
            (g,) = torch.autograd.grad(L.aggregate(pg, mask, mode, constant=4), lp)
            assert torch.isfinite(g).all() and g[0, 1] == 0
            grads.append(g)
    for clean, wild in zip(grads[:3], grads[3:]):
        assert torch.equal(clean, wild)
    ent = torch.tensor([[1.0, float("nan"), 2.0]], requires_grad=True)
    agg = L.aggregate(L.entropy_bonus(ent, coef=0.1), mask, "token_mean")
    assert float(agg.detach()) == pytest.approx(-0.15)
    agg.backward()
    assert torch.isfinite(ent.grad).all() and ent.grad[0, 1] == 0
    v = torch.zeros(1, 3, requires_grad=True)
    ret = torch.tensor([[1.0, float("inf"), 1.0]])
    vl = L.value_loss(v, torch.zeros(1, 3), ret, mask, clip=0.2)
    L.aggregate(vl, mask, "token_mean").backward()
    assert torch.isfinite(v.grad).all() and v.grad[0, 1] == 0
