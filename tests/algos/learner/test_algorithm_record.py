"""``algorithm.resolve``: an AlgoConfig's parts are looked up once into a frozen ``Algorithm``."""

from __future__ import annotations

import dataclasses
import inspect

import pytest

from veriloop.algos.learner import algorithm as U
from veriloop.algos.maths.losses import aggregate
from veriloop.configs.algo import AlgoConfig


def test_resolve_looks_every_part_up_once():
    cfg = AlgoConfig(
        advantage="rloo", policy_loss="cispo", loss_agg="token_mean", kl_coef=0.05, kl_mode="loss"
    )
    algo = U.resolve(cfg)
    assert algo.estimator is U.ADVANTAGE_ESTIMATORS["rloo"]
    assert algo.aggregation.func is aggregate and algo.aggregation.keywords == {"mode": "token_mean"}
    assert algo.kl_loss_coef == 0.05 and algo.kl_reward_coef == 0.0
    assert U.resolve(algo) is algo  # a resolved record passes through
    with pytest.raises(dataclasses.FrozenInstanceError):
        algo.kl_loss_coef = 0.0  # type: ignore[misc]


def test_every_estimator_has_one_signature():
    for name, fn in U.ADVANTAGE_ESTIMATORS.items():
        assert list(inspect.signature(fn).parameters) == ["cfg", "x"], name


def test_unknown_estimator_suggests_the_closest():
    cfg = AlgoConfig()
    object.__setattr__(cfg, "advantage", "group_nrom")
    with pytest.raises(ValueError, match="did you mean 'group_norm'"):
        U.resolve(cfg)


def test_unknown_policy_loss_suggests_the_closest():
    cfg = AlgoConfig()
    object.__setattr__(cfg, "policy_loss", "cispoo")
    with pytest.raises(ValueError, match=r"unknown policy_loss 'cispoo' \(did you mean 'cispo'\?\)"):
        U.pick_policy_loss(cfg)


def test_every_policy_loss_has_one_signature():
    """Each table entry, built from the default config, takes (logp, old, adv, mask, segments,
    extras); DPPO reads the sampler's log-probs from the extras."""
    import torch

    from veriloop.algos.learner.algorithm import ObjectiveExtras

    logp = torch.tensor([[0.0, -1.0, -0.5]])  # [B, T]
    mask = torch.tensor([[0.0, 1.0, 1.0]])
    adv = torch.tensor([[0.0, 1.0, 1.0]])
    for name in U.POLICY_LOSSES:
        cfg = AlgoConfig(policy_loss=name)
        loss, stats = U.pick_policy_loss(cfg)(
            logp, logp, adv, mask, None, ObjectiveExtras(sampler_logprobs=logp)
        )
        assert loss.shape == (1, 3), name
        assert {"clip_frac_low", "clip_frac_high", "approx_kl"} <= set(stats), name
