"""Every named choice has one home: its ``Literal`` in the config lists exactly the keys of the table
that implements it, and the table's row carries the traits the config checks and the update read
(adding an estimator or an objective is its function plus one row)."""

from typing import get_args, get_type_hints

import pytest

from veriloop.agents.backends import BACKENDS
from veriloop.agents.backends.base import BackendName
from veriloop.algos.learner import algorithm
from veriloop.configs.algo import (
    ADVANTAGES,
    POLICY_LOSSES,
    SEQUENCE_LEVEL_LOSSES,
    Advantage,
    AlgoConfig,
    PolicyLoss,
)
from veriloop.configs.schema import ConfigError, ExperimentConfig, RolloutConfig


def test_every_config_literal_equals_its_tables_keys():
    assert set(get_args(Advantage)) == set(ADVANTAGES) == set(algorithm.ADVANTAGE_ESTIMATORS)
    assert set(get_args(PolicyLoss)) == set(POLICY_LOSSES) == set(algorithm.POLICY_LOSS_BUILDERS)
    assert set(get_args(BackendName)) == set(BACKENDS)
    assert set(get_args(get_type_hints(RolloutConfig)["backend"])) == {"auto", *BACKENDS}


def test_every_row_names_a_function_that_exists():
    for name, spec in ADVANTAGES.items():
        assert callable(algorithm.ADVANTAGE_ESTIMATORS[name]), name
        assert spec.estimator.startswith("veriloop.algos.") and ":" in spec.estimator
    for name, spec in POLICY_LOSSES.items():
        assert callable(algorithm.POLICY_LOSS_BUILDERS[name](AlgoConfig(policy_loss=name))), name
        if spec.selector:
            assert callable(algorithm.resolve(AlgoConfig(policy_loss=name)).selector), name


@pytest.mark.parametrize("name", list(ADVANTAGES))
def test_an_estimators_traits_decide_the_config_checks(name):
    spec = ADVANTAGES[name]
    cfg = ExperimentConfig()
    cfg.algo.advantage = name  # type: ignore[assignment]
    cfg.rollout.group_size = 1
    if spec.needs_critic:
        with pytest.raises(ConfigError, match="needs a critic"):
            cfg.validate()
        cfg.algo.critic = "value_head"
    assert cfg.algo.needs_critic == spec.needs_critic
    if spec.group_based:
        with pytest.raises(ConfigError, match="rollout.group_size >= 2"):
            cfg.validate()
    cfg.algo.reward_level = "turn"
    if not spec.turn_rewards:
        with pytest.raises(ConfigError, match="normalises episode rewards"):
            cfg.validate()


def test_a_sequence_level_objective_is_its_rows_trait():
    assert SEQUENCE_LEVEL_LOSSES == ("gspo", "gspo_token", "gmpo")
    assert {n for n, s in POLICY_LOSSES.items() if s.reads_sampler} == {"dppo"}
    assert AlgoConfig(policy_loss="dppo").needs_sampler_logprobs


def test_an_unknown_name_is_refused_with_the_closest_choice():
    with pytest.raises(ValueError, match=r"unknown advantage estimator 'rlooo' \(did you mean 'rloo'\?\)"):
        AlgoConfig(advantage="rlooo").validate()  # type: ignore[arg-type]
