"""The third algorithm audit: split samples weigh as their episode, no gradient lost past the
log-ratio clamp, DPPO's ratio cap, distillation on the trainer's numbers, GDPO with one component.
Each value and gradient below is computed by hand in the comments."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from veriloop.algos.learner.algorithm import ObjectiveExtras, resolve
from veriloop.algos.maths import losses as L
from veriloop.configs.algo import AlgoConfig

E20 = math.exp(20.0)


def _grad(fn, lp: torch.Tensor) -> torch.Tensor:
    """d(sum of fn's per-token loss) / d log pi, [1, T]."""
    x = lp.clone().requires_grad_(True)
    loss, _ = fn(x)
    loss.sum().backward()
    assert x.grad is not None
    return x.grad


# ------------------------------------------------------------- 2. past the +-20 log-ratio clamp


def test_clamp_log_ratio_is_the_identity_inside_and_straight_through_outside():
    x = torch.tensor([[-25.0, -19.5, 0.25, 19.5, 25.0]], requires_grad=True)
    y = L.clamp_log_ratio(x)
    assert y.tolist() == [[-20.0, -19.5, 0.25, 19.5, 20.0]]
    (y * torch.tensor([[1.0, 2.0, 3.0, 4.0, 5.0]])).sum().backward()
    assert x.grad.tolist() == [[1.0, 2.0, 3.0, 4.0, 5.0]]  # the old clamp gave 0 at +-25


@pytest.mark.parametrize("log_r", [19.5, 20.5, 30.0])
def test_ppo_clip_unclipped_side_keeps_its_gradient_past_the_clamp(log_r):
    """A = -1, r = e^log_r >> 1 + 0.2: the unclipped side, loss = -A r = r, d/d log pi = r, with r
    taken at the clamp past it: e^19.5 inside, e^20 at 20.5 and 30 (the old clamp gave 0 there)."""

    def fn(x):
        return L.clipped_pg_loss(
            x,
            torch.zeros(1, 1),
            -torch.ones(1, 1),
            torch.ones(1, 1),  # noqa: E731
            clip_low=0.2,
            clip_high=0.2,
        )

    g = _grad(fn, torch.full((1, 1), log_r))
    assert float(g) == pytest.approx(math.exp(min(log_r, 20.0)), rel=1e-5)


def test_ppo_clip_keeps_the_gradient_below_the_lower_clamp():
    """A = +1, log r = -20.5: r < 1 - 0.2 is the unclipped side for A > 0 (still pushed up), loss =
    -r, gradient -r at the clamp = -e^-20 (the old clamp: 0); at -19.5 it is -e^-19.5."""

    def fn(x):
        return L.clipped_pg_loss(
            x,
            torch.zeros(1, 2),
            torch.ones(1, 2),
            torch.ones(1, 2),  # noqa: E731
            clip_low=0.2,
            clip_high=0.2,
        )

    g = _grad(fn, torch.tensor([[-19.5, -20.5]]))
    assert g[0].tolist() == pytest.approx([-math.exp(-19.5), -math.exp(-20.0)], rel=1e-5)


def test_dppo_keeps_policy_gradient_and_pull_back_past_the_clamp():
    """A = +1, tau = 1e-3, both tokens kept by the TV mask (D = pi - mu < 0.2):
    token 0: log mu = -30, log pi = -9.5, log r = 20.5 -> clamped to 20: d/d log pi = -A e^20 + 2 tau 20;
    token 1: log mu = -0.1, log pi = -20.6, log r = -20.5 -> -20: -A e^-20 + 2 tau (-20) = -0.04.
    The old clamp gave both 0 (not even the tau log^2 pull-back)."""
    mu = torch.tensor([[-30.0, -0.1]])

    def fn(x):
        return L.dppo_loss(
            x,
            mu,
            torch.ones(1, 2),
            torch.ones(1, 2),
            divergence="tv",  # noqa: E731
            delta_low=0.2,
            delta_high=0.2,
            tau=1e-3,
        )

    g = _grad(fn, torch.tensor([[-9.5, -20.6]]))
    assert float(g[0, 0]) == pytest.approx(-E20 + 2e-3 * 20, rel=1e-5)
    assert float(g[0, 1]) == pytest.approx(-math.exp(-20.0) - 2e-3 * 20, rel=1e-5)
    inside = _grad(fn, torch.tensor([[-10.6, -19.7]]))  # log r = 19.4 and -19.6: the plain formula
    assert float(inside[0, 0]) == pytest.approx(-math.exp(19.4) + 2e-3 * 19.4, rel=1e-5)
    assert float(inside[0, 1]) == pytest.approx(-math.exp(-19.6) - 2e-3 * 19.6, rel=1e-5)


@pytest.mark.parametrize("log_r", [-19.5, -20.5])
def test_sapo_keeps_its_gradient_below_the_clamp(log_r):
    """A = +1, tau = 1: d loss / d log pi = -A r 4 sigma(r - 1)(1 - sigma(r - 1)) at r = e^max(log_r, -20)
    (about -4.1e-9 at the clamp; the old clamp gave 0). Above +20 the gate is saturated in float32
    (sigma = 1): 0 with either clamp, so only the lower side can tell them apart."""

    def fn(x):
        return L.sapo_loss(
            x,
            torch.zeros(1, 1),
            torch.ones(1, 1),
            torch.ones(1, 1),  # noqa: E731
            tau_pos=1.0,
            tau_neg=1.05,
        )

    r = math.exp(max(log_r, -20.0))
    s = 1 / (1 + math.exp(-(r - 1)))
    assert float(_grad(fn, torch.full((1, 1), log_r))) == pytest.approx(-r * 4 * s * (1 - s), rel=1e-4)


@pytest.mark.parametrize("log_r", [-20.5, -19.5, 19.5, 20.5])
def test_cispo_gradient_is_the_clipped_weight_on_both_sides_of_the_clamp(log_r):
    """CISPO's weight is detached, so its gradient -clip(r, 0.8, 1.2) A never went through the
    clamp: A = 1 gives -0.8 below 1 and -1.2 above (this one held before the change too)."""

    def fn(x):
        return L.cispo_loss(
            x,
            torch.zeros(1, 1),
            torch.ones(1, 1),
            torch.ones(1, 1),  # noqa: E731
            clip_low=0.2,
            clip_high=0.2,
        )

    assert float(_grad(fn, torch.full((1, 1), log_r))) == pytest.approx(-0.8 if log_r < 0 else -1.2)


# ------------------------------------------------------------------------- 3. DPPO's ratio cap


def test_dppo_ratio_cap_bounds_the_weight_of_a_rare_token():
    """mu = 0.001, pi = 0.05: r = 50, D = 0.049 inside the TV region, A = 1, tau = 1e-3.
    No cap (prime-rl): loss -50 + tau log^2 50, d/d log pi = -50 + 2 tau log 50.
    Cap 20 (verl, the paper's section 5.4): loss -20 + tau log^2 50, d/d log pi = -20 + 2 tau log 50."""
    lp, mu = torch.tensor([[math.log(0.05)]]), torch.tensor([[math.log(0.001)]])
    one = torch.ones(1, 1)
    kw = dict(divergence="tv", delta_low=0.2, delta_high=0.2, tau=1e-3)
    pen = 1e-3 * math.log(50) ** 2
    for cap, w in ((None, 50.0), (20.0, 20.0)):
        fn = lambda x, cap=cap: L.dppo_loss(x, mu, one, one, ratio_cap=cap, **kw)  # noqa: E731
        assert float(fn(lp)[0]) == pytest.approx(-w + pen, rel=1e-5)
        assert float(_grad(fn, lp)) == pytest.approx(-w + 2e-3 * math.log(50), rel=1e-5)


def test_dppo_ratio_cap_below_the_cap_is_bit_identical_and_reaches_the_objective():
    """r = 5 < 20: the capped loss and gradient are the uncapped ones bit for bit; the config's
    ``dppo_ratio_cap`` reaches the objective (off by default, as prime-rl)."""
    lp, mu = (
        torch.tensor([[math.log(0.05), math.log(0.05)]]),
        torch.tensor([[math.log(0.01), math.log(0.001)]]),
    )
    adv, m = torch.ones(1, 2), torch.ones(1, 2)
    kw = dict(divergence="tv", delta_low=0.2, delta_high=0.2, tau=1e-3)
    free = lambda x: L.dppo_loss(x, mu, adv, m, **kw)  # noqa: E731
    capped = lambda x: L.dppo_loss(x, mu, adv, m, ratio_cap=20.0, **kw)  # noqa: E731
    assert torch.equal(free(lp)[0][0, 0], capped(lp)[0][0, 0])
    assert torch.equal(_grad(free, lp)[0, 0], _grad(capped, lp)[0, 0])
    assert AlgoConfig().dppo_ratio_cap is None
    obj = resolve(AlgoConfig(policy_loss="dppo", dppo_ratio_cap=20.0)).objective
    g = _grad(lambda x: obj(x, torch.zeros(1, 2), adv, m, None, ObjectiveExtras(sampler_logprobs=mu)), lp)
    assert float(g[0, 1]) == pytest.approx(-20.0 + 2e-3 * math.log(50), rel=1e-5)
    with pytest.raises(ValueError, match="dppo_ratio_cap"):
        AlgoConfig(policy_loss="dppo", dppo_ratio_cap=0.0).validate()


# ------------------------------------------------------------------ 5. GDPO with one component


def test_gdpo_with_one_component_is_grpo_with_the_authors_eps():
    """Two groups of three, one reward component: [1, 0, 0] and [1, 1, 0]. Group mean 1/3 (2/3),
    Bessel std sqrt(1/3) = 0.57735 in both, eps 1e-4: (2/3) / 0.57745 = 1.15450 and (1/3) / 0.57745
    = 0.57725. No batch whitening (the authors' fallback to GRPO); the old code whitened these by
    their batch std sqrt(4/5) into +-1.29 / +-0.645."""
    from veriloop.algos.maths.multi_reward import component_normalized

    r = torch.tensor([[1.0], [0.0], [0.0], [1.0], [1.0], [0.0]])
    g = torch.tensor([0, 0, 0, 1, 1, 1])
    hi, lo = (2 / 3) / (math.sqrt(1 / 3) + 1e-4), (1 / 3) / (math.sqrt(1 / 3) + 1e-4)
    got = component_normalized(r, g)
    assert got.tolist() == pytest.approx([hi, -lo, -lo, lo, lo, -hi], abs=1e-6)


def test_gdpo_estimator_falls_back_to_grpo_for_a_single_reward(make_traj):
    """Episodes without ``reward_components``: one component (the reward itself); advantage=gdpo
    then gives group_norm's advantages up to eps (1e-4 against 1e-6), not their batch whitening."""
    from veriloop.algos.learner.credit import compute_advantages

    trajs = [
        make_traj([([10 + i], [], r)], group_id=i // 3) for i, r in enumerate([1.0, 0.0, 0.0, 1.0, 1.0, 0.0])
    ]
    gdpo = compute_advantages(trajs, resolve(AlgoConfig(advantage="gdpo"))).advantages
    grpo = compute_advantages(trajs, resolve(AlgoConfig(advantage="group_norm"))).advantages
    assert torch.allclose(gdpo, grpo, atol=1e-3)
    assert float(gdpo[0].sum()) == pytest.approx((2 / 3) / (math.sqrt(1 / 3) + 1e-4), abs=1e-5)


# ------------------------------------------------- 4. self-distillation on the trainer's numbers


def test_distillation_advantage_is_trainer_against_trainer():
    """The sampler recorded log mu = -1.1 for a token the trainer gives log pi = -1.0 (a bf16-size
    mismatch, 0.1 here to be seen); the teacher (a trainer forward pass) gives -0.5.
    New: A = -0.5 - (-1.0) = 0.5, weight r = e^0.1: loss -0.5 e^0.1, d/d log pi = -0.5 e^0.1.
    Old: A = -0.5 - (-1.1) = 0.6 (the mismatch inside the advantage): -0.6 e^0.1."""
    from veriloop.algos.maths.distill import reverse_kl_distill_loss

    mu, teacher, one = torch.tensor([[-1.1]]), torch.tensor([[-0.5]]), torch.ones(1, 1)
    fn = lambda x: reverse_kl_distill_loss(x, mu, teacher, one)  # noqa: E731
    lp = torch.tensor([[-1.0]])
    loss, stats = fn(lp)
    assert float(loss) == pytest.approx(-0.5 * math.exp(0.1), rel=1e-6)
    assert float(_grad(fn, lp)) == pytest.approx(-0.5 * math.exp(0.1), rel=1e-6)
    assert float(stats["reverse_kl"]) == pytest.approx(-0.5)  # log pi_theta - log pi_T


def test_distillation_trust_region_as_prime_rl():
    """prime-rl's opsd trust region, trust_low 0.2, tau 1e-3; teacher log 0.4 on both tokens.
    Token 0: pi = 0.3, mu = 0.6, pi - mu = -0.3 < -0.2: dropped, gradient only 2 tau log(0.5).
    Token 1: pi = 0.5, mu = 0.6, pi - mu = -0.1: kept, -(5/6) log(0.4 / 0.5) + 2 tau log(5/6)."""
    from veriloop.algos.maths.distill import reverse_kl_distill_loss

    mu, teacher, m = (
        torch.log(torch.tensor([[0.6, 0.6]])),
        torch.log(torch.tensor([[0.4, 0.4]])),
        torch.ones(1, 2),
    )
    fn = lambda x: reverse_kl_distill_loss(x, mu, teacher, m, trust_low=0.2, tau=1e-3)  # noqa: E731
    lp = torch.log(torch.tensor([[0.3, 0.5]]))
    g = _grad(fn, lp)
    assert g[0].tolist() == pytest.approx(
        [2e-3 * math.log(0.5), -(5 / 6) * math.log(0.8) + 2e-3 * math.log(5 / 6)], rel=1e-5
    )
    assert float(fn(lp)[1]["trust_masked_frac"]) == 0.5
    off = _grad(lambda x: reverse_kl_distill_loss(x, mu, teacher, m), lp)  # the default: no trust region
    assert off[0].tolist() == pytest.approx([-0.5 * math.log(0.4 / 0.3), -(5 / 6) * math.log(0.8)], rel=1e-5)


def test_distillation_settings_reach_the_update(tiny_llama, make_traj):
    """``distill_trust_low`` / ``distill_tau`` reach the update's loss: a teacher far below the
    student and a sampler record far above it drop every token, so the trust region's loss is
    the penalty alone, tau (log pi / mu)^2 > 0, where without it the loss is the KD surrogate."""
    from veriloop.agents.forward import token_logprobs
    from veriloop.algos.learner.batch import collate, with_teacher
    from veriloop.algos.learner.update import policy_loss

    trajs = [make_traj([((10, 11, 12), [], 1.0)], group_id=0), make_traj([((20, 21), [], 0.0)], group_id=0)]
    batch = collate(trajs, [[0.0] * len(t.token_ids) for t in trajs])
    with torch.no_grad():
        lp, _ = token_logprobs(tiny_llama, batch.input_ids, batch.attention_mask)
    m = batch.loss_mask
    # mu = 1 (log 0): pi - mu < -0.2 wherever pi < 0.8, as on a random tiny model
    batch = with_teacher(
        replace(batch, old_logprobs=torch.zeros_like(lp) * m), [(lp[i] - 1.0).tolist() for i in range(2)]
    )
    out = {}
    for trust in (None, 0.2):
        cfg = AlgoConfig(
            distill_coef=1.0, rl_coef=0.0, loss_agg="token_mean", distill_trust_low=trust, distill_tau=1e-3
        )
        loss, metrics = policy_loss(tiny_llama, batch, resolve(cfg))
        out[trust] = (float(loss.detach()), metrics["distill/trust_masked_frac"])
    tok = lp[m.bool()]
    assert out[0.2][1] == 1.0 and out[None][1] == 0.0
    assert out[0.2][0] == pytest.approx(float((1e-3 * tok**2).mean()), rel=1e-4)
    # no trust region: -(pi / mu) (log pi_T - log pi) + tau log^2 = pi + tau log^2 pi per token
    assert out[None][0] == pytest.approx(float((tok.exp() + 1e-3 * tok**2).mean()), rel=1e-4)


# ------------------------------------------------------- 1. a split episode weighs as one episode

# Episode A: one sample of 2 tokens (row 0). Episode B: two samples, of 1 and 3 tokens (rows 1, 2).
SPLIT_MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
SPLIT_EPISODES = torch.tensor([[0, 0, 0], [1, 1, 1], [1, 1, 1]])


def _close(t: torch.Tensor, rows: list, rel: float = 1e-6) -> bool:
    return torch.allclose(t.double(), torch.tensor(rows, dtype=torch.float64), rtol=rel, atol=1e-9)


def _token_weights(mode, episodes, constant=None):
    """d aggregate / d per-token loss: each token's weight, [3, 3]."""
    x = torch.zeros(3, 3, requires_grad=True)
    L.aggregate(x, SPLIT_MASK, mode, constant, episodes=episodes).backward()
    return x.grad


def test_seq_mean_weighs_a_split_episode_once():
    """G = 2 episodes: A's tokens weigh 1 / (2 x 2) = 0.25; B's tokens 1 / (2 x 4) = 0.125, so
    sample B1 carries 1/4 of B's 1/2 and B2 3/4 (their shares of B's tokens). The per-sample
    rule (no ``episodes``): 3 sequences of 1/3 each, A 1/3 in total and B 2/3."""
    w = _token_weights("seq_mean_token_mean", SPLIT_EPISODES)
    assert _close(w, [[0.25, 0.25, 0], [0.125, 0, 0], [0.125] * 3])
    assert float(w[0].sum()) == pytest.approx(0.5) and float(w[1:].sum()) == pytest.approx(0.5)
    per_sample = _token_weights("seq_mean_token_mean", None)
    assert _close(per_sample, [[1 / 6, 1 / 6, 0], [1 / 3, 0, 0], [1 / 9] * 3])
    assert L.sequence_count(SPLIT_MASK, None, SPLIT_EPISODES) == 2 and L.sequence_count(SPLIT_MASK) == 3


def test_seq_sum_constant_divides_by_episodes():
    """Dr. GRPO, constant 4: every token 1 / (4 x 2 episodes) = 0.125 (per sample: 1 / (4 x 3))."""
    assert _close(
        _token_weights("seq_sum_constant", SPLIT_EPISODES, 4.0),
        [[0.125, 0.125, 0], [0.125, 0, 0], [0.125] * 3],
    )
    assert _close(
        _token_weights("seq_sum_constant", None, 4.0), [[1 / 12, 1 / 12, 0], [1 / 12, 0, 0], [1 / 12] * 3]
    )


def test_the_issues_example_one_sample_against_three():
    """An episode of 1 sample and one of 3 (2 tokens each): 0.25 / 0.75 per sample, 0.5 / 0.5 per episode."""
    mask = torch.ones(4, 2)
    episodes = torch.tensor([0, 1, 1, 1]).unsqueeze(1).expand(4, 2)
    for eps, want in ((episodes, (0.5, 0.5)), (None, (0.25, 0.75))):
        x = torch.zeros(4, 2, requires_grad=True)
        L.aggregate(x, mask, "seq_mean_token_mean", episodes=eps).backward()
        assert (float(x.grad[0].sum()), float(x.grad[1:].sum())) == pytest.approx(want)


@pytest.mark.parametrize("loss", ["gspo", "gmpo"])
def test_one_sequence_ratio_per_episode(loss):
    """Log-ratios A: [0.0, 0.2]; B1: [0.3]; B2: [0.2, -0.1, 0.2]; A_A = +1, A_B = -1; clip wide
    (GMPO, no clip active, is then GSPO's unclipped form). Per episode: s_A = e^0.1,
    s_B = e^((0.3 + 0.3) / 4) = e^0.15; seq-mean over 2 episodes, so d/d log pi = -A s / (2 |o|):
    A's tokens -e^0.1 / 4, B's tokens +e^0.15 / 8. Per sample: B1 s = e^0.3, B2 s = e^0.1, three
    sequences: B1's token e^0.3 / 3, B2's tokens e^0.1 / 9, A's tokens -e^0.1 / 6."""
    lr = torch.tensor([[0.0, 0.2, 0.0], [0.3, 0.0, 0.0], [0.2, -0.1, 0.2]])
    adv = torch.tensor([[1.0, 1.0, 0.0], [-1.0, 0.0, 0.0], [-1.0, -1.0, -1.0]])
    fn = L.gspo_loss if loss == "gspo" else L.gmpo_loss

    def grads(episodes):
        x = lr.clone().requires_grad_(True)
        per, _ = fn(x, torch.zeros(3, 3), adv, SPLIT_MASK, clip_low=0.9, clip_high=9.0, episodes=episodes)
        L.aggregate(per, SPLIT_MASK, "seq_mean_token_mean", episodes=episodes).backward()
        return x.grad

    a, b = -math.exp(0.1) / 4, math.exp(0.15) / 8
    assert _close(grads(SPLIT_EPISODES), [[a, a, 0], [b, 0, 0], [b, b, b]], rel=1e-5)
    a, b1, b2 = -math.exp(0.1) / 6, math.exp(0.3) / 3, math.exp(0.1) / 9
    assert _close(grads(None), [[a, a, 0], [b1, 0, 0], [b2, b2, b2]], rel=1e-5)


def _split_group(make_traj):
    """One group of two episodes, rewards 1 and 0 (GRPO: A = +-0.5 / sqrt(1/2) = +-0.7071). The
    first is split into two samples (the second re-reads the prompt, as a template rewrite)."""
    split = make_traj([((10, 11), (1, 2, 3), 0.0), ((12, 13, 14), (), 1.0)], group_id=0)
    split = replace(split, sample_starts=(0, 5), split_reasons=("template",))
    return [split, make_traj([((20, 21, 22), (), 0.0)], group_id=0)]


def test_prepare_batch_marks_split_rows_and_keeps_them_together(make_traj):
    """Rows [split sample 0, split sample 1, other]: episode_index [0, 0, 1] per row (None under
    ``split_weight=sample`` and without splits); mini-batches of one row and ranks keep rows 0, 1 together."""
    from veriloop.algos.learner.batch import minibatches, rank_rows
    from veriloop.algos.learner.prepare import prepare_batch
    from veriloop.algos.learner.step_settings import loss_normalisers

    trajs = _split_group(make_traj)
    batch, _ = prepare_batch(trajs, resolve(AlgoConfig()))
    assert batch.episode_index is not None and batch.episode_index[:, 0].tolist() == [0, 0, 1]
    assert loss_normalisers(batch, resolve(AlgoConfig()))["global_seqs"] == 2.0
    assert prepare_batch(trajs, resolve(AlgoConfig(split_weight="sample")))[0].episode_index is None
    assert prepare_batch(trajs[1:], resolve(AlgoConfig()))[0].episode_index is None
    for chunks in (minibatches(batch, 1, by_length=True), minibatches(batch, 1, shuffle=torch.Generator())):
        assert sorted(c.size for c in chunks) == [1, 2]
    assert [rank_rows(batch, r, 2).episode_index[:, 0].tolist() for r in (0, 1)] == [[0, 0], [1]]


@pytest.mark.parametrize("loss", ["ppo_clip", "gspo"])
def test_grpo_loss_at_ratio_one_is_zero_when_episodes_weigh_alike(loss, make_traj, tiny_llama):
    """At ratio 1 the loss is -(sum of sequence weights x A): per episode 1/2 (0.7071 - 0.7071) = 0;
    per sample the split episode counts twice, -(2 x 0.7071 - 0.7071) / 3 = -0.2357."""
    from veriloop.algos.learner.prepare import prepare_batch
    from veriloop.algos.learner.update import policy_loss

    trajs = _split_group(make_traj)
    got = {}
    for rule in ("episode", "sample"):
        algo = resolve(AlgoConfig(policy_loss=loss, split_weight=rule))
        batch, _ = prepare_batch(trajs, algo, model=tiny_llama, recompute_old_logprobs=True)
        got[rule] = float(policy_loss(tiny_llama, batch, algo)[0].detach())
    assert got["episode"] == pytest.approx(0.0, abs=1e-5)
    assert got["sample"] == pytest.approx(-0.5 / math.sqrt(0.5) / 3, abs=1e-5)


@pytest.mark.parametrize("preset", ["grpo", "dr_grpo", "gspo"])
def test_without_splits_both_rules_are_the_same_numbers(preset, make_traj, tiny_llama):
    """No episode split (the quickstart): the batch carries no episode index and both rules give
    the loss and every gradient bit for bit (the per-sample rule is the code path from before)."""
    from veriloop.algos.learner.prepare import prepare_batch
    from veriloop.algos.learner.update import policy_loss
    from veriloop.configs.presets import load_preset

    trajs = [
        make_traj([((10 + i, 11, 12 + i)[: 2 + i % 2], (), float(i % 2))], group_id=i // 2) for i in range(4)
    ]
    out = []
    for rule in ("episode", "sample"):
        algo = resolve(replace(load_preset(preset), split_weight=rule, kl_coef=0.0))
        batch, _ = prepare_batch(trajs, algo)
        assert batch.episode_index is None
        tiny_llama.zero_grad()
        loss, _ = policy_loss(tiny_llama, batch, algo, agg_constant=16)
        loss.backward()
        out.append((loss.detach(), [p.grad.clone() for p in tiny_llama.parameters()]))
    assert torch.equal(out[0][0], out[1][0])
    assert all(torch.equal(a, b) for a, b in zip(out[0][1], out[1][1]))


def test_geometric_rollout_mask_takes_a_split_episode_whole():
    """log(pi_old / mu): A [0.0, 0.2], B1 [0.3], B2 [0.2, -0.1, 0.2]; bounds [0.9, 1.2]. Per episode
    B's geometric mean is e^((0.3 + 0.3) / 4) = e^0.15 = 1.16: kept whole. Per sample B1's is
    e^0.3 = 1.35 (dropped) and B2's e^0.1 (kept)."""
    from veriloop.algos.maths.correction import geometric_sequence_mask

    lw = torch.tensor([[0.0, 0.2, 0.0], [0.3, 0.0, 0.0], [0.2, -0.1, 0.2]])
    kw = dict(low=0.9, high=1.2)
    whole = geometric_sequence_mask(lw, torch.zeros(3, 3), SPLIT_MASK, episodes=SPLIT_EPISODES, **kw)
    assert torch.equal(whole, SPLIT_MASK.bool())
    apart = geometric_sequence_mask(lw, torch.zeros(3, 3), SPLIT_MASK, **kw)
    assert apart[1, 0].item() is False and bool(apart[2].all()) and bool(apart[0, :2].all())
