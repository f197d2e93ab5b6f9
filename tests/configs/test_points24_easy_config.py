"""The reachable Points24 variant's experiment (``points24_easy_grpo``): the same variant on both splits."""

from __future__ import annotations

import pytest

import veriloop.envs  # noqa: F401  (registers the environments)
from veriloop.configs.loader import load_config
from veriloop.configs.schema import ConfigError


def test_easy_variant_config_validates_and_keeps_the_rule_split() -> None:
    cfg = load_config("points24_easy_grpo")
    cfg.env.resolve()  # makes every split's env: bad kwargs would fail here
    splits = cfg.env.resolved_eval_splits
    ident, ood = dict(splits["id"].kwargs), dict(splits["rule_ood"].kwargs)
    assert (ident.pop("face_cards"), ood.pop("face_cards")) == ("10", "11-12-13")
    assert ident == ood and ident["num_cards"] == 3 and ident["target"] == 12
    assert cfg.sft.source == "solver" and cfg.policy.lora and cfg.run.algo_preset == "grpo"


def test_a_bad_variant_option_is_refused_before_any_model_loads() -> None:
    cfg = load_config("points24_easy_grpo", ["env.kwargs.num_cards=5"])
    with pytest.raises(ConfigError, match=r"env.kwargs.*num_cards must be one of \(2, 3, 4\).*got 5"):
        cfg.env.resolve()
