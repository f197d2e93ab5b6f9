"""The ``curriculum`` section: defaults, range checks, cross-section checks, seeds it may use."""

from __future__ import annotations

import pytest

from veriloop.configs.loader import load_config
from veriloop.configs.schema import ConfigError


def test_defaults_are_off_and_valid():
    cfg = load_config(None, [])
    assert not cfg.curriculum.enabled
    assert [p.name for p in cfg.curriculum.pool_list()] == ["hard", "medium", "easy"]
    on = load_config(None, ["curriculum.pools_enabled=true", "curriculum.gate=true"])
    assert on.curriculum.enabled and on.curriculum.rounds == 4 and on.curriculum.seeds_per_problem == 4


def test_training_seeds_count_skipped_seeds_and_refills():
    base = load_config(None, []).train_seed_range
    on = load_config(
        None,
        [
            "curriculum.pools_enabled=true",
            "curriculum.max_scan=3",
            "curriculum.gate=true",
            "curriculum.max_rounds=2",
            "eval.seed_offset=10000000",
        ],
    )
    assert len(on.train_seed_range) == len(base) * 3 * 2
    with pytest.raises(ConfigError, match="overlap training seeds"):
        load_config(
            None, ["curriculum.pools_enabled=true", "curriculum.max_scan=64", "eval.seed_offset=20000"]
        )


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (["curriculum.alpha=0"], "alpha"),
        (["curriculum.gate_low=0.8", "curriculum.gate_high=0.2"], "gate_low"),
        (["curriculum.max_scan=0"], "max_scan"),
        (["curriculum.pools={a: {low: 0, high: 0.5, weight: 1}}"], "no pool"),
        (["curriculum.pools={a: {low: 0, high: 1, weight: 0}}"], "weight 0"),
        (["curriculum.gate=true", "algo.dynamic_sampling=true"], "one of them"),
        (["curriculum.gate=true", "rollout.group_size=1", "algo.advantage=batch_norm"], "group_size"),
        (
            ["curriculum.pools_enabled=true", "train.max_staleness=1", "algo.rollout_is=truncate"],
            "max_staleness",
        ),
    ],
)
def test_bad_settings_are_refused_with_the_fix(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, overrides)
