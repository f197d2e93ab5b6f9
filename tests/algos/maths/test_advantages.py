"""Advantage estimators: hand-computed cases and invariants."""

from __future__ import annotations

import math

import pytest
import torch

from veriloop.algos.maths import advantages as A

S = 1 / math.sqrt(2)


def test_group_normalized_hand_case():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 3.0, 2.0, 4.0])
    g = torch.tensor([0, 0, 0, 0, 1, 2, 2])
    # group 0: mean 0.5, sample std sqrt(1/3) -> 0.5 / 0.57735 = 0.866; group 1 singleton -> 0;
    # group 2: mean 3, std sqrt(2) -> -1/sqrt(2), +1/sqrt(2)
    want = torch.tensor([0.8660, -0.8660, -0.8660, 0.8660, 0.0, -S, S])
    assert torch.allclose(A.group_normalized(r, g), want, atol=1e-4)
    dr = A.group_normalized(r, g, std_normalize=False)  # Dr. GRPO: R - mean
    assert torch.allclose(dr, torch.tensor([0.5, -0.5, -0.5, 0.5, 0.0, -1.0, 1.0]))


def test_group_normalized_sums_to_zero_per_group_and_all_equal_is_zero():
    torch.manual_seed(0)
    r, g = torch.randn(40), torch.randint(0, 5, (40,))
    for std in (True, False):
        adv = A.group_normalized(r, g, std_normalize=std)
        for k in g.unique():
            assert abs(float(adv[g == k].sum())) < 1e-4
    assert torch.equal(A.group_normalized(torch.ones(4), torch.zeros(4, dtype=torch.long)), torch.zeros(4))


def test_group_normalized_excludes_failed_verifications():
    r = torch.tensor([1.0, 0.0, 5.0])
    adv = A.group_normalized(r, torch.zeros(3, dtype=torch.long), valid=torch.tensor([True, True, False]))
    assert torch.allclose(adv, torch.tensor([S, -S, 0.0]), atol=1e-5)  # the 5.0 does not move the mean


def test_leave_one_out_hand_case_and_invariant():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 7.0])
    g = torch.tensor([0, 0, 0, 0, 1])
    assert torch.allclose(A.leave_one_out(r, g), torch.tensor([2 / 3, -2 / 3, -2 / 3, 2 / 3, 0.0]))
    torch.manual_seed(1)
    r, g = torch.randn(30), torch.randint(0, 4, (30,))
    adv = A.leave_one_out(r, g)
    for i in range(30):
        others = [float(r[j]) for j in range(30) if j != i and g[j] == g[i]]
        want = float(r[i]) - sum(others) / len(others) if others else 0.0
        assert abs(float(adv[i]) - want) < 1e-5


def test_leave_one_out_with_invalid_member():
    r = torch.tensor([1.0, 0.0, 0.0, -3.0])
    adv = A.leave_one_out(r, torch.zeros(4, dtype=torch.long), valid=torch.tensor([True, True, True, False]))
    assert torch.allclose(adv, torch.tensor([1.0, -0.5, -0.5, 0.0]))


def test_batch_normalized_and_whiten():
    r = torch.tensor([1.0, 2.0, 3.0, 4.0])
    sd = math.sqrt(1.25)  # population std
    want = torch.tensor([-1.5, -0.5, 0.5, 1.5]) / sd
    assert torch.allclose(A.batch_normalized(r), want, atol=1e-5)
    x = torch.tensor([[1.0, 100.0, 3.0]])
    m = torch.tensor([[1.0, 0.0, 1.0]])
    assert torch.allclose(A.whiten(x, m), torch.tensor([[-1.0, 0.0, 1.0]]), atol=1e-6)
    assert torch.allclose(A.whiten(x, m, shift_mean=False), torch.tensor([[1.0, 0.0, 3.0]]), atol=1e-6)


def test_gae_hand_case():
    r = torch.tensor([[0.0, 0.0, 1.0]])
    v = torch.tensor([[0.5, 0.6, 0.7]])
    adv, ret = A.gae(r, v, torch.ones(1, 3), gamma=0.9, lam=0.8)
    # A2 = 1 - .7 = .3; A1 = (.9*.7 - .6) + .72*.3 = .246; A0 = (.9*.6 - .5) + .72*.246 = .21712
    assert torch.allclose(adv, torch.tensor([[0.21712, 0.246, 0.3]]), atol=1e-6)
    assert torch.allclose(ret, torch.tensor([[0.71712, 0.846, 1.0]]), atol=1e-6)


def test_gae_gamma_lambda_one_is_return_minus_value():
    torch.manual_seed(2)
    mask = (torch.rand(3, 9) > 0.3).float()
    r = torch.randn(3, 9) * mask
    v = torch.randn(3, 9)
    adv, _ = A.gae(r, v, mask, gamma=1.0, lam=1.0)
    ret_to_go = torch.flip(torch.cumsum(torch.flip(r, [1]), 1), [1])
    assert torch.allclose(adv, (ret_to_go - v) * mask, atol=1e-5)


def test_gae_skips_environment_tokens():
    # tokens: s s e e s s (e = environment): the chain must equal the chain over s s s s
    mask = torch.tensor([[1.0, 1.0, 0.0, 0.0, 1.0, 1.0]])
    r = torch.tensor([[0.0, 0.5, 0.0, 0.0, 0.0, 1.0]])
    v = torch.tensor([[0.1, 0.2, 9.0, -9.0, 0.3, 0.4]])
    adv, ret = A.gae(r, v, mask, gamma=0.9, lam=0.7)
    keep = mask[0].bool()
    adv_c, ret_c = A.gae(r[:, keep], v[:, keep], torch.ones(1, 4), gamma=0.9, lam=0.7)
    assert torch.allclose(adv[:, keep], adv_c) and torch.allclose(ret[:, keep], ret_c)
    assert torch.all(adv[:, ~keep] == 0)
    with pytest.raises(ValueError, match="outside mask"):
        A.gae(r + 1.0, v, mask, gamma=1.0, lam=1.0)


def test_turn_returns_and_episode_rewards():
    r = torch.tensor([[1.0, 2.0, 3.0], [0.5, 9.0, 9.0]])
    m = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    assert torch.allclose(A.turn_returns(r, m, gamma=0.5), torch.tensor([[2.75, 3.5, 3.0], [0.5, 0.0, 0.0]]))
    assert torch.allclose(A.episode_rewards(r, m, "outcome"), torch.tensor([3.0, 0.5]))
    assert torch.allclose(A.episode_rewards(r, m, "sum"), torch.tensor([6.0, 0.5]))
    with pytest.raises(ValueError, match="turn_level"):
        A.episode_rewards(r, m, "turn")  # type: ignore[arg-type]


def test_turn_level_hand_case():
    # ep0: 2 turns rewards [0, 1]; ep1: 1 turn [1]; ep2: 2 turns [0, 0]; gamma 1
    r = torch.tensor([[0.0, 1.0], [1.0, 0.0], [0.0, 0.0]])
    m = torch.tensor([[1.0, 1.0], [1.0, 0.0], [1.0, 1.0]])
    adv = A.turn_level(r, m, torch.zeros(3, dtype=torch.long), gamma=1.0)
    # returns: ep0 [1, 1], ep1 [1], ep2 [0, 0]. Turn 0 baselines: ep0 (1+0)/2, ep1 (1+0)/2, ep2 (1+1)/2.
    # Turn 1: only ep0 and ep2 reached it; each is the other's baseline.
    assert torch.allclose(adv, torch.tensor([[0.5, 1.0], [0.5, 0.0], [-1.0, -1.0]]))


def test_turn_level_baseline_does_not_depend_on_own_return():
    torch.manual_seed(3)
    n, k = 8, 4
    lengths = torch.tensor([4, 1, 3, 2, 4, 2, 1, 3])
    m = (torch.arange(k).unsqueeze(0) < lengths.unsqueeze(1)).float()
    g = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    r = torch.randn(n, k)
    for std in (False, True):
        base = A.turn_returns(r, m, gamma=0.9) - A.turn_level(r, m, g, gamma=0.9, std_normalize=std)
        r2 = r.clone()
        r2[0] = torch.randn(k) * 10  # change episode 0's own rewards (hence its returns) entirely
        base2 = A.turn_returns(r2, m, gamma=0.9) - A.turn_level(r2, m, g, gamma=0.9, std_normalize=std)
        if not std:  # b = G - A must be the same for episode 0; the scale is also others-only
            assert torch.allclose(base[0], base2[0], atol=1e-5)
        adv_a = A.turn_level(r, m, g, gamma=0.9, std_normalize=std)
        adv_b = A.turn_level(r2, m, g, gamma=0.9, std_normalize=std)
        # with std: A = (G - b)/s, s from others only -> dA/dG is the same for both versions
        g1, g2 = A.turn_returns(r, m, gamma=0.9), A.turn_returns(r2, m, gamma=0.9)
        diff = (adv_b[0] - adv_a[0]) * m[0]
        scale = diff / torch.where(m[0] > 0, g2[0] - g1[0], torch.ones(k))
        assert torch.all(scale[m[0] > 0] > 0)
        if not std:
            assert torch.allclose(scale[m[0] > 0], torch.ones(int(m[0].sum())), atol=1e-5)
        # other groups untouched
        assert torch.allclose(adv_a[4:], adv_b[4:])


def test_process_advantages_groupings():
    # ep0: solve(-1) verify(+1) solve(+1) verify(+1); ep1: solve(+1) verify(+1); same problem
    r = torch.tensor([[-1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 0.0, 0.0]])
    m = torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 0.0, 0.0]])
    kind = torch.tensor([[0, 1, 0, 1], [0, 1, 0, 0]])
    g = torch.tensor([0, 0])
    pk = A.process_advantages(r, m, kind, g)  # default position_kind
    assert torch.allclose(pk, torch.tensor([[-S, 0.0, 0.0, 0.0], [S, 0.0, 0.0, 0.0]]), atol=1e-5)
    kd = A.process_advantages(r, m, kind, g, baseline="kind")  # solves: [-1, 1, 1]
    a, b = -(4 / 3) / math.sqrt(4 / 3), (2 / 3) / math.sqrt(4 / 3)
    assert torch.allclose(kd, torch.tensor([[a, 0.0, b, 0.0], [b, 0.0, 0.0, 0.0]]), atol=1e-5)
    gp = A.process_advantages(r, m, kind, g, baseline="group", std_normalize=False)
    assert torch.allclose(
        gp, torch.tensor([[-5 / 3, 1 / 3, 1 / 3, 1 / 3], [1 / 3, 1 / 3, 0.0, 0.0]]), atol=1e-5
    )
    apart = A.process_advantages(r, m, kind, torch.tensor([0, 1]))  # different problems never mix
    assert torch.all(apart == 0)


def test_broadcast_to_tokens():
    tix = torch.tensor([[-1, -1, 0, 0, 0, 1, 1, -1]])
    lm = torch.tensor([[0, 0, 1, 1, 0, 1, 1, 0]])
    per_turn = torch.tensor([[2.0, -3.0]])
    assert torch.equal(A.broadcast_to_tokens(per_turn, tix, lm), torch.tensor([[0, 0, 2, 2, 0, -3, -3, 0.0]]))
    assert torch.equal(
        A.broadcast_to_tokens(torch.tensor([5.0]), tix, lm), torch.tensor([[0, 0, 5, 5, 0, 5, 5, 0.0]])
    )
    with pytest.raises(ValueError, match="N=1"):
        A.broadcast_to_tokens(torch.ones(2), tix, lm)


def test_shape_errors_are_clear():
    with pytest.raises(ValueError, match="group_ids must have shape"):
        A.group_normalized(torch.ones(3), torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match="share one 2-d shape"):
        A.gae(torch.zeros(2, 3), torch.zeros(2, 4), torch.ones(2, 3), gamma=1.0, lam=1.0)
