"""The objectives since DAPO (GSPO, CISPO, SAPO, GMPO, Clip-Cov, KL-Cov) and rollout correction:
a hand-computed case and an invariant each, and multi-turn episodes with environment tokens."""

from __future__ import annotations

import math

import pytest
import torch

from veriloop.algos.learner.algorithm import resolve
from veriloop.algos.learner.prepare import prepare_batch
from veriloop.algos.maths import correction as C
from veriloop.algos.maths import losses as L
from veriloop.configs.algo import AlgoConfig


def grad_of(fn, lp, *args, **kw):  # type: ignore[no-untyped-def]
    lp = lp.clone().requires_grad_(True)
    loss, stats = fn(lp, *args, **kw)
    loss.sum().backward()
    return loss.detach(), lp.grad, stats


# ------------------------------------------------------------------------------------------ GSPO


def test_gspo_sequence_ratio_is_exp_of_mean_log_ratio_and_clips_per_sequence():
    lp = torch.tensor([[-1.0, -2.0, 0.0], [-1.0, 0.0, 0.0]])
    old = torch.tensor([[-1.2, -1.9, 0.0], [-1.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    adv = torch.tensor([[2.0, 2.0, 0.0], [-1.0, 0.0, 0.0]])
    loss, g, stats = grad_of(L.gspo_loss, lp, old, adv, mask, clip_low=0.5, clip_high=0.5)
    s0 = math.exp((0.2 - 0.1) / 2)  # exp(mean log ratio) of row 0
    assert loss[0, :2].tolist() == pytest.approx([-2 * s0] * 2) and loss[0, 2] == 0
    # d(-A s)/d lp_t = -A s / |y|, and L sits on both tokens: the sum's gradient is -A s each
    assert g[0, :2].tolist() == pytest.approx([-2 * s0] * 2) and g[0, 2] == 0
    # narrow clip: s0 = 1.051 > 1 + 0.01 with A > 0 -> the whole sequence is clipped, no gradient
    _, g, stats = grad_of(L.gspo_loss, lp, old, adv, mask, clip_low=0.01, clip_high=0.01)
    assert torch.all(g[0] == 0) and float(stats["clip_frac_high"]) == pytest.approx(2 / 3)


def test_gspo_with_one_token_is_ppo_and_token_variant_matches_sequence_gradient():
    lp, old = torch.tensor([[-0.5], [-2.0]]), torch.tensor([[-0.7], [-1.5]])
    adv, mask = torch.tensor([[1.0], [-1.0]]), torch.ones(2, 1)
    kw = dict(clip_low=0.2, clip_high=0.2)
    a, ga, _ = grad_of(L.gspo_loss, lp, old, adv, mask, **kw)
    b, gb, _ = grad_of(L.clipped_pg_loss, lp, old, adv, mask, **kw)
    torch.testing.assert_close(a, b) and torch.testing.assert_close(ga, gb)
    # GSPO-token: same value as GSPO, and with a per-sequence advantage the same gradient once
    # aggregated per sequence (seq_mean_token_mean)
    lp = torch.tensor([[-1.0, -2.0, -0.3]])
    old, adv, mask = torch.tensor([[-1.1, -1.9, -0.2]]), torch.full((1, 3), 0.7), torch.ones(1, 3)
    for level in ("sequence", "token"):
        x = lp.clone().requires_grad_(True)
        loss, _ = L.gspo_loss(x, old, adv, mask, clip_low=0.5, clip_high=0.5, level=level)
        L.aggregate(loss, mask, "seq_mean_token_mean").backward()
        if level == "sequence":
            want_v, want_g = loss.detach(), x.grad
    torch.testing.assert_close(loss.detach(), want_v) and torch.testing.assert_close(x.grad, want_g)


def test_gspo_refuses_varying_advantages_unless_token_level():
    lp = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="gspo_token"):
        L.gspo_loss(lp, lp, torch.tensor([[1.0, -1.0]]), torch.ones(1, 2), clip_low=0.1, clip_high=0.1)
    L.gspo_loss(
        lp, lp, torch.tensor([[1.0, -1.0]]), torch.ones(1, 2), clip_low=0.1, clip_high=0.1, level="token"
    )


def test_sequence_is_the_episode_or_each_turn_and_skips_environment_tokens():
    """Row: 2 sampled tokens (turn 0), 2 environment tokens, 1 sampled token (turn 1)."""
    lr = torch.tensor([[0.3, 0.1, 9.0, -9.0, -0.4]])  # log ratios; env positions hold junk
    mask = torch.tensor([[1.0, 1.0, 0.0, 0.0, 1.0]])
    turns = torch.tensor([[0, 0, 0, 0, 1]])
    episode = L.sequence_mean(lr, mask)
    assert episode[0, 0] == pytest.approx(0.0) and episode[0, 4] == pytest.approx(0.0)  # (0.3+0.1-0.4)/3
    per_turn = L.sequence_mean(lr, mask, turns)
    assert per_turn[0, :2].tolist() == pytest.approx([0.2, 0.2]) and per_turn[0, 4] == pytest.approx(-0.4)
    # GSPO over the episode: the environment tokens change nothing
    old = torch.zeros(1, 5)
    adv = torch.tensor([[1.0, 1.0, 0.0, 0.0, 1.0]])
    a, _ = L.gspo_loss(lr, old, adv, mask, clip_low=1.0, clip_high=1.0)
    b, _ = L.gspo_loss(lr * mask, old, adv, mask, clip_low=1.0, clip_high=1.0)
    torch.testing.assert_close(a, b)
    assert float(a[0, 0]) == pytest.approx(-1.0)  # s = exp(0) = 1
    # per turn, each turn has its own ratio and may have its own advantage
    adv2 = torch.tensor([[1.0, 1.0, 0.0, 0.0, -2.0]])
    c, _ = L.gspo_loss(lr, old, adv2, mask, clip_low=1.0, clip_high=1.0, segments=turns)
    assert float(c[0, 0]) == pytest.approx(-math.exp(0.2)) and float(c[0, 4]) == pytest.approx(
        2 * math.exp(-0.4)
    )


# ----------------------------------------------------------------------------------------- CISPO


def test_cispo_keeps_a_gradient_on_clipped_tokens():
    lp = torch.tensor([[0.0, 0.0]])
    old = torch.log(torch.tensor([[1 / 1.5, 1 / 0.9]]))  # ratios 1.5 and 0.9
    adv, mask = torch.tensor([[1.0, 1.0]]), torch.ones(1, 2)
    loss, g, stats = grad_of(L.cispo_loss, lp, old, adv, mask, clip_low=1.0, clip_high=0.2)
    assert g[0].tolist() == pytest.approx([-1.2, -0.9])  # -clip(rho) * A: nonzero beyond the clip
    _, g_ppo, _ = grad_of(L.clipped_pg_loss, lp, old, adv, mask, clip_low=0.2, clip_high=0.2)
    assert g_ppo[0, 0] == 0  # PPO drops the same token
    assert float(stats["clip_frac_high"]) == 0.5 and loss[0, 0] == 0  # value: -w A log pi = 0 at lp 0


# ------------------------------------------------------------------------------------------ SAPO


def test_sapo_gate_value_gradient_and_temperature_by_sign():
    lp, mask = torch.tensor([[0.0, 0.0, 0.0]]), torch.ones(1, 3)
    old = torch.log(torch.tensor([[1.0, 1 / 1.5, 1.0]]))  # ratios 1, 1.5, 1
    adv = torch.tensor([[1.0, 1.0, -1.0]])
    loss, g, _ = grad_of(L.sapo_loss, lp, old, adv, mask, tau_pos=1.0, tau_neg=2.0)
    sig = 1 / (1 + math.exp(-0.5))
    assert loss[0].tolist() == pytest.approx([-2.0, -4 * sig, 2 / 2.0])  # -4/tau sigma(tau(r-1)) A
    # gradient w.r.t. log pi: -A r 4 sigma (1 - sigma): exactly -A at r = 1 (plain policy gradient)
    assert g[0].tolist() == pytest.approx([-1.0, -1.5 * 4 * sig * (1 - sig), 1.0])
    # invariant: the gate's gradient decays smoothly but never reaches 0 (no hard clip)
    far = torch.log(torch.tensor([[1 / 6.0]]))  # rho = 6: -dloss/dlogpi = 6 * 4 sigma(5)(1 - sigma(5))
    _, g, _ = grad_of(
        L.sapo_loss, torch.zeros(1, 1), far, torch.ones(1, 1), torch.ones(1, 1), tau_pos=1.0, tau_neg=1.0
    )
    assert -float(g) == pytest.approx(6 * 4 * 0.9933071 * (1 - 0.9933071), rel=1e-4) and 0 < -float(g) < 0.2


# ------------------------------------------------------------------------------------------ GMPO


def test_gmpo_equal_ratios_is_ppo_in_log_space_and_hand_case():
    for r, a in ((1.3, 1.0), (1.3, -1.0), (0.6, -1.0), (0.9, 1.0)):
        old = torch.full((1, 3), -math.log(r))
        lp, adv, mask = torch.zeros(1, 3), torch.full((1, 3), a), torch.ones(1, 3)
        got, gg, _ = grad_of(L.gmpo_loss, lp, old, adv, mask, clip_low=0.2, clip_high=0.2)
        want = -min(r * a, min(max(r, math.exp(-0.2)), math.exp(0.2)) * a)
        assert float(got[0, 0]) == pytest.approx(want), (r, a)
    # hand case: ratios e^0.3, e^-0.1, A = 1, eps 0.2: only the first is clipped (to e^0.2)
    lp, old = torch.tensor([[0.3, -0.1]]), torch.zeros(1, 2)
    loss, g, stats = grad_of(
        L.gmpo_loss, lp, old, torch.ones(1, 2), torch.ones(1, 2), clip_low=0.2, clip_high=0.2
    )
    assert float(loss[0, 0]) == pytest.approx(-math.exp((0.2 - 0.1) / 2))
    # gradient of the sum of L_i on both tokens (2 L): token 0 clipped -> 0; token 1: 2 * L / 2
    assert float(g[0, 0]) == 0 and float(g[0, 1]) == pytest.approx(-math.exp(0.05))
    assert float(stats["clip_frac_high"]) == 0.5


# -------------------------------------------------------------------------------- Clip-Cov, KL-Cov


def test_token_covariance_hand_case():
    adv = torch.tensor([[1.0, -1.0, 0.0]])
    lp = torch.tensor([[-1.0, -3.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    cov = L.token_covariance(adv, lp, mask)
    assert cov[0, :2].tolist() == [1.0, 1.0] and cov[0, 2] == float("-inf")  # (1)(1), (-1)(-1)


def test_clip_cov_detaches_tokens_in_the_window_and_kl_cov_penalises_the_top():
    adv = torch.tensor([[2.0, -1.0, 0.1, 0.1]])  # mean 0.3
    lp = torch.tensor([[-1.0, -5.0, -3.0, -3.0]])  # mean -3: cov = 1.7*2, (-1.3)(-2), 0, 0
    old, mask = lp.clone(), torch.ones(1, 4)
    loss, g, stats = grad_of(
        L.clip_cov_loss,
        lp,
        old,
        adv,
        mask,
        clip_low=0.2,
        clip_high=0.2,
        cov_ratio=0.5,
        cov_lb=1.0,
        cov_ub=5.0,
        generator=torch.Generator().manual_seed(0),
    )
    # 2 of 4 tokens (cov_ratio 0.5) drawn from the 2 in (1, 5): both detached
    assert g[0, :2].tolist() == [0.0, 0.0] and g[0, 2:].tolist() == pytest.approx([-0.1, -0.1])
    assert float(stats["cov_frac"]) == 0.5
    # KL-Cov, k = 1: the top token gets + coef |log rho| (0 at rho = 1; its gradient +-coef)
    lp2 = lp + torch.tensor([[0.1, 0.0, 0.0, 0.0]])
    loss, g, stats = grad_of(L.kl_cov_loss, lp2, old, adv, mask, cov_ratio=0.25, kl_coef=1.0)
    r = math.exp(0.1)
    assert float(loss[0, 0]) == pytest.approx(-2 * r + 0.1) and float(g[0, 0]) == pytest.approx(-2 * r + 1)
    assert float(stats["cov_frac"]) == 0.25 and float(g[0, 1]) == pytest.approx(1.0)
    # invariant: with cov_ratio -> nothing selected beyond 1 token, the rest is the plain surrogate
    assert g[0, 2:].tolist() == pytest.approx([-0.1, -0.1])


# ---------------------------------------------------------------------------- rollout correction


def test_truncated_is_hand_case_and_no_op_when_sampler_equals_old():
    old = torch.log(torch.tensor([[0.5, 0.5, 0.5]]))
    mu = torch.log(torch.tensor([[0.5, 0.1, 0.4]]))
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    w = C.truncated_is_weights(old, mu, mask, cap=2.0)
    assert w[0].tolist() == pytest.approx([1.0, 2.0, 1.0])  # ratio 5 capped at 2; off mask 1
    assert torch.all(C.truncated_is_weights(old, old, mask, cap=2.0) == 1.0)


def test_masked_is_and_geometric_sequence_mask():
    old = torch.log(torch.tensor([[0.5, 0.5, 0.5], [0.5, 0.5, 0.5]]))
    mu = torch.log(torch.tensor([[0.5, 0.1, 0.4], [0.5, 0.5, 0.4]]))
    mask = torch.ones(2, 3)
    w, keep = C.masked_is_weights(old, mu, mask, low=0.5, high=2.0)
    assert keep[0].tolist() == [True, False, True] and w[0].tolist() == pytest.approx([1.0, 1.0, 1.25])
    seq = C.geometric_sequence_mask(old, mu, mask, low=0.9, high=1.1)
    # row 0: exp(mean(log 1, log 5, log 1.25)) = (6.25)^(1/3) = 1.84 -> dropped; row 1: 1.077 kept
    assert seq[0].tolist() == [False] * 3 and seq[1].tolist() == [True] * 3
    w, keep, stats = C.rollout_correction(
        old, mu, mask, token="truncate", cap=2.0, low=0.5, high=2.0, seq_mask=True, seq_low=0.9, seq_high=1.1
    )
    assert stats["rollout_corr/seq_masked_frac"] == 0.5 and stats["rollout_corr/token_frac"] == pytest.approx(
        3 / 6
    )
    assert not [
        k for k in stats if k.startswith("mismatch/")
    ]  # measured in one place: algos/maths/mismatch.py


def test_prepare_batch_recomputes_pi_old_keeps_mu_and_weights_the_loss(tiny_llama, make_traj):
    """mu = the recorded -1.0 per token (fixture); pi_old = the tiny model's own log-probs.
    Multi-turn: environment tokens sit between the turns and never enter the correction."""
    trajs = [make_traj([([10, 11], [30, 31], 0.0), ([12], [], r)], group_id=0) for r in (1.0, -1.0)]
    cfg = AlgoConfig(advantage="rloo", rollout_is="truncate", rollout_is_cap=1e9)
    batch, metrics = prepare_batch(trajs, resolve(cfg), model=tiny_llama)
    m = batch.loss_mask.bool()
    assert torch.all(batch.sampler_logprobs[m] == -1.0) and not torch.all(batch.old_logprobs[m] == -1.0)
    want = torch.exp(batch.old_logprobs - batch.sampler_logprobs)
    torch.testing.assert_close(batch.is_weights[m], want[m])
    assert m[0].tolist()[5:7] == [False, False]  # environment tokens: not trained, not corrected
    assert {"rollout_corr/token_frac", "rollout_corr/seq_frac", "mismatch/k3_kl"} <= set(metrics)
    # masked IS with bounds no ratio meets: every token leaves the loss (and its normalisers)
    cfg = AlgoConfig(advantage="rloo", rollout_is="mask", rollout_is_low=0.99, rollout_is_high=1.01)
    batch, metrics = prepare_batch(trajs, resolve(cfg), model=tiny_llama)
    assert batch.loss_mask.sum() == 0 and metrics["rollout_corr/seq_frac"] == 1.0


def test_sequence_level_losses_refuse_per_turn_credit_in_config():
    with pytest.raises(ValueError, match="gspo_token"):
        AlgoConfig(policy_loss="gspo", reward_level="turn").validate()
    AlgoConfig(policy_loss="gspo", reward_level="turn", sequence_unit="turn").validate()
    AlgoConfig(policy_loss="gspo_token", reward_level="turn").validate()
