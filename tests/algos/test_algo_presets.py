"""Algorithm presets: every file loads, follows its paper, and bad names teach."""

from __future__ import annotations

import importlib.resources

import pytest

from veriloop.algos.presets import config_from_mapping, list_presets, load_preset

EXPECTED = {"ppo", "grpo", "rloo", "dapo", "dr_grpo", "reinforce_pp", "s2r_outcome_rloo", "s2r_process_grpo"}


def test_all_presets_ship_load_and_start_with_a_paper_comment():
    assert EXPECTED <= set(list_presets())
    folder = importlib.resources.files("veriloop.configs") / "algos"
    for name in EXPECTED:
        assert (folder / f"{name}.yaml").read_text().startswith("# ")
        assert load_preset(name).name == name


def test_presets_follow_the_papers():
    dapo = load_preset("dapo")
    assert (dapo.clip_low, dapo.clip_high, dapo.kl_coef, dapo.loss_agg) == (0.2, 0.28, 0.0, "token_mean")
    assert dapo.dynamic_sampling and dapo.overlong_penalty and not dapo.overlong_filter
    grpo = load_preset("grpo")
    assert (grpo.advantage, grpo.loss_agg, grpo.kl_coef, grpo.kl_estimator, grpo.kl_mode) == (
        "group_norm", "seq_mean_token_mean", 0.04, "k3", "loss")  # fmt: skip
    dr = load_preset("dr_grpo")
    assert (dr.advantage, dr.loss_agg) == ("group_mean", "seq_sum_constant")
    assert load_preset("rloo").advantage == "rloo"
    rpp = load_preset("reinforce_pp")
    assert (rpp.advantage, rpp.kl_mode) == ("batch_norm", "reward") and rpp.kl_coef > 0
    ppo = load_preset("ppo")
    assert (ppo.advantage, ppo.critic, ppo.whiten_advantages, ppo.kl_mode) == (
        "gae",
        "value_head",
        True,
        "reward",
    )
    s2r = load_preset("s2r_outcome_rloo")
    assert (s2r.advantage, s2r.reward_level) == ("rloo", "outcome")
    proc = load_preset("s2r_process_grpo")
    assert (proc.advantage, proc.process_baseline) == ("process", "position_kind")


def test_unknown_names_and_keys_suggest_the_closest():
    with pytest.raises(ValueError, match="Did you mean .dapo."):
        load_preset("dapoo")
    with pytest.raises(ValueError, match="Did you mean 'clip_high'"):
        config_from_mapping({"clip_hihg": 0.3})
    assert load_preset("dapo", overlong_max_len=512, overlong_cache_len=128).overlong_max_len == 512
    with pytest.raises(ValueError, match="overlong_cache_len"):
        load_preset("dapo", overlong_max_len=64, overlong_cache_len=128)
