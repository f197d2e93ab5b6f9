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


def test_a_row_binds_its_loss_to_config_fields_with_no_adapter():
    """A row is the loss, its bindings and its traits: the objective the learner builds from it is
    the pure function with those settings, and the rollout weights multiply a loss that takes none."""
    import torch

    from veriloop.algos.learner.algorithm import ObjectiveExtras, build_objective
    from veriloop.algos.maths.losses import clipped_pg_loss
    from veriloop.configs.algo import PolicyLossSpec

    row = PolicyLossSpec(
        "veriloop.algos.maths.losses:clipped_pg_loss",
        bind={"clip_low": "clip_high"},
        fixed={"clip_high": 0.1},
    )
    cfg = AlgoConfig(clip_low=0.9, clip_high=0.3)
    logp = torch.tensor([[0.5, -0.5, 0.2]])
    old, adv, mask = torch.zeros(1, 3), torch.tensor([[1.0, -1.0, 2.0]]), torch.ones(1, 3)
    want, _ = clipped_pg_loss(logp, old, adv, mask, clip_low=0.3, clip_high=0.1)
    got, _ = build_objective(row, cfg)(logp, old, adv, mask, None)
    assert torch.equal(got, want)
    w = torch.tensor([[2.0, 1.0, 0.5]])
    assert torch.equal(
        build_objective(row, cfg)(logp, old, adv, mask, None, ObjectiveExtras(is_weights=w))[0], want * w
    )


@pytest.mark.parametrize(
    ("bind", "says"),
    [
        ({"clip_lo": "clip_low"}, "has no parameter 'clip_lo'"),
        ({"clip_low": "clip_lo"}, "no field 'clip_lo'"),
    ],
)
def test_a_misspelt_binding_is_named_when_resolved(bind, says):
    from veriloop.algos.learner.algorithm import build_objective
    from veriloop.configs.algo import PolicyLossSpec

    row = PolicyLossSpec("veriloop.algos.maths.losses:cispo_loss", bind={"clip_high": "clip_high", **bind})
    with pytest.raises(ValueError, match=says):
        build_objective(row, AlgoConfig(), "mine")


def test_an_episode_row_is_its_baseline_spread_over_the_tokens():
    """An ``episode`` estimator row (RLOO's) is its maths function on the episode rewards, spread
    over each episode's sampled tokens: R = (1, 0, 0, 0) in groups (0, 0, 1, 1) gives 1, -1, 0, 0."""
    import torch

    x = U.RewardInputs(
        trajectories=[],
        turn_rewards=torch.tensor([[1.0], [0.0], [0.0], [0.0]], dtype=torch.float64),
        turn_mask=torch.ones(4, 1),
        groups=torch.tensor([0, 0, 1, 1]),
        valid=torch.ones(4, dtype=torch.bool),
        turn_index=torch.zeros(4, 2, dtype=torch.long),
        loss_mask=torch.tensor([[0.0, 1.0]] * 4),
        kl_tokens=torch.zeros(4, 2, dtype=torch.float64),
        values=None,
    )
    adv, returns = U.ADVANTAGE_ESTIMATORS["rloo"](AlgoConfig(advantage="rloo"), x)
    assert adv.tolist() == [[0.0, 1.0], [0.0, -1.0], [0.0, 0.0], [0.0, 0.0]] and returns is None
