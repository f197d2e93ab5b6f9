"""DPPO (Qi et al. 2026): the binary TV / KL trust-region masks and the squared log-ratio
penalty, by hand; the ratio is against the sampler's recorded log-probs."""

from __future__ import annotations

import math

import pytest
import torch

from veriloop.algos.learner.algorithm import ObjectiveExtras, resolve
from veriloop.algos.learner.batch import collate
from veriloop.algos.learner.prepare import prepare_batch
from veriloop.algos.maths import losses as L
from veriloop.configs.algo import AlgoConfig
from veriloop.configs.presets import load_preset

# pi_theta(y_t), mu(y_t), A_t for six tokens; tau = 0.1, TV bounds 0.2 / 0.2, KL bounds 0.1 / 0.1.
PI = [0.5, 0.9, 0.2, 0.6, 0.99, 0.3]
MU = [0.4, 0.5, 0.5, 0.55, 0.9, 0.8]
ADV = [1.0, 1.0, -1.0, -1.0, 1.0, 1.0]
# TV: D = pi - mu = [.1, .4, -.3, .05, .09, -.5]: token 1 (A > 0, D > .2) and token 2 (A < 0,
#     D < -.2) are dropped; token 5 moved *down* with A > 0 (towards what A wants undone): kept.
# KL: D = KL(Bern(mu) || Bern(pi)) = [.0201, .5108, .2231, .0051, .1445, .5341], signed by pi - mu:
#     token 4 (0.9 -> 0.99, A > 0) is dropped too: TV 0.09 looks small, the binary KL does not.
# r = pi / mu = [1.25, 1.8, .4, 1.0909, 1.1, .375]; loss_t = -M A r + tau (log r)^2;
# d loss_t / d log pi_t = -M A r + 2 tau log r.
TV_LOSS = [-1.245021, 0.034549, 0.083959, 1.091666, -1.099092, -0.278797]
TV_GRAD = [-1.205371, 0.117557, -0.183258, 1.108311, -1.080938, -0.571166]
KL_LOSS = TV_LOSS[:4] + [0.000908] + TV_LOSS[5:]
KL_GRAD = TV_GRAD[:4] + [0.019062] + TV_GRAD[5:]


def _run(divergence: str, delta: float):
    lp = torch.log(torch.tensor([PI], dtype=torch.float64)).requires_grad_(True)
    mu = torch.log(torch.tensor([MU], dtype=torch.float64))
    loss, stats = L.dppo_loss(
        lp,
        mu,
        torch.tensor([ADV], dtype=torch.float64),
        torch.ones(1, 6),
        divergence=divergence,
        delta_low=delta,
        delta_high=delta,
        tau=0.1,
    )
    loss.sum().backward()
    return loss, lp.grad, stats


@pytest.mark.parametrize(
    ("divergence", "delta", "want_loss", "want_grad", "dropped_high"),
    [("tv", 0.2, TV_LOSS, TV_GRAD, 1), ("kl", 0.1, KL_LOSS, KL_GRAD, 2)],
)
def test_dppo_values_and_gradients_by_hand(divergence, delta, want_loss, want_grad, dropped_high):
    loss, grad, stats = _run(divergence, delta)
    assert loss[0].tolist() == pytest.approx(want_loss, abs=1e-6)
    assert grad[0].tolist() == pytest.approx(want_grad, abs=1e-6)
    assert float(stats["clip_frac_high"]) == pytest.approx(dropped_high / 6)
    assert float(stats["clip_frac_low"]) == pytest.approx(1 / 6)
    r = [p / q for p, q in zip(PI, MU)]
    assert float(stats["approx_kl"]) == pytest.approx(sum(x - 1 - math.log(x) for x in r) / 6, rel=1e-6)


def test_dppo_masked_positions_and_bad_settings():
    lp = torch.tensor([[-0.5, 50.0]], requires_grad=True)  # the second position is off the mask
    loss, _ = L.dppo_loss(
        lp,
        torch.tensor([[-0.5, -90.0]]),
        torch.ones(1, 2),
        torch.tensor([[1.0, 0.0]]),
        divergence="tv",
        delta_low=0.2,
        delta_high=0.2,
        tau=1e-3,
    )
    loss.sum().backward()
    assert loss[0, 1] == 0 and lp.grad[0, 1] == 0 and lp.grad[0, 0] == pytest.approx(-1.0)
    with pytest.raises(ValueError, match="'tv' or 'kl'"):
        L.dppo_loss(
            lp,
            lp.detach(),
            torch.ones(1, 2),
            torch.ones(1, 2),
            divergence="js",
            delta_low=0.2,
            delta_high=0.2,
            tau=0.0,
        )  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="rollout correction"):
        AlgoConfig(policy_loss="dppo", rollout_is="truncate").validate()
    with pytest.raises(ValueError, match="dppo_low"):
        AlgoConfig(policy_loss="dppo", dppo_high=0.0).validate()


def test_the_preset_is_prime_rls_default():
    cfg = load_preset("dppo")
    assert (cfg.policy_loss, cfg.dppo_divergence, cfg.dppo_low, cfg.dppo_high, cfg.dppo_tau) == (
        "dppo",
        "tv",
        0.2,
        0.2,
        1e-3,
    )
    assert cfg.needs_sampler_logprobs and not cfg.needs_old_recompute and cfg.kl_coef == 0


def test_dppo_takes_its_ratio_against_the_recorded_log_probs(tiny_llama, make_traj, with_logprobs):
    """prepare_batch keeps what the sampler recorded (any backend writes ``Trajectory.logprobs``)
    as mu, and the objective reads it, not pi_old; without it the objective refuses to guess."""
    trajs = [make_traj([([10, 11, 12], [], r)], group_id=0) for r in (1.0, -1.0)]
    batch0 = collate(trajs, [[0.0] * len(t.token_ids) for t in trajs])
    from veriloop.agents.forward import token_logprobs

    with torch.no_grad():
        lp, _ = token_logprobs(tiny_llama, batch0.input_ids, batch0.attention_mask)
    recorded = [
        with_logprobs(t, lp[i, : len(t.token_ids)] - 0.3) for i, t in enumerate(trajs)
    ]  # mu = pi e^-0.3
    cfg = load_preset("dppo")
    batch, _ = prepare_batch(recorded, resolve(cfg))
    m = batch.loss_mask.bool()
    assert torch.allclose(batch.sampler_logprobs[m], (lp - 0.3)[m].float(), atol=1e-6)
    obj = resolve(cfg).objective
    extras = ObjectiveExtras(sampler_logprobs=batch.sampler_logprobs)
    per_token, stats = obj(
        lp.float(), torch.zeros_like(lp).float(), batch.advantages, batch.loss_mask, None, extras
    )
    r = math.exp(0.3)  # pi / mu on every token, whatever old_logprobs holds
    assert float(stats["approx_kl"]) == pytest.approx(r - 1 - 0.3, rel=1e-4)
    with pytest.raises(ValueError, match="sampler's log-probs"):
        obj(lp, lp, batch.advantages, batch.loss_mask, None, None)
