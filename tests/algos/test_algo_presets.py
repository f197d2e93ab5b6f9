"""Algorithm presets: every file loads, follows its paper, and bad names teach."""

from __future__ import annotations

import importlib.resources

import pytest
import torch

from veriloop.algos.presets import config_from_mapping, list_presets, load_preset

EXPECTED = {"ppo", "grpo", "rloo", "dapo", "dr_grpo", "reinforce_pp", "s2r_outcome_rloo", "s2r_process_grpo"}


def test_all_presets_ship_load_and_start_with_a_paper_comment():
    assert EXPECTED <= set(list_presets())
    folder = importlib.resources.files("veriloop.configs") / "algos"
    for name in EXPECTED:
        assert (folder / f"{name}.yaml").read_text().startswith("# ")
        assert load_preset(name).name == name


# Each preset's settings as ../shared/docs/papers.md gives them (section numbers there).
PAPER_SETTINGS = {
    # 1. PPO: GAE, critic, clip 0.2, value loss (clipped), KL to the reference in the reward
    "ppo": dict(advantage="gae", critic="value_head", clip_low=0.2, clip_high=0.2, kl_mode="reward",
                kl_estimator="k1", gamma=1.0, lam=0.95, value_clip=0.2, whiten_advantages=True),
    # 2. GRPO: (R - mean) / std, sample-level mean, k3 KL in the loss with beta 0.04, clip 0.2
    "grpo": dict(advantage="group_norm", loss_agg="seq_mean_token_mean", kl_coef=0.04, kl_estimator="k3",
                 kl_mode="loss", clip_low=0.2, clip_high=0.2, critic="none"),
    # 3. DAPO: clip-higher 0.2 / 0.28, dynamic sampling, token-level loss, soft overlong punishment
    #    (L_max 20480 = 16384 expected + 4096 cache), no KL
    "dapo": dict(advantage="group_norm", clip_low=0.2, clip_high=0.28, loss_agg="token_mean", kl_coef=0.0,
                 dynamic_sampling=True, overlong_penalty=True, overlong_max_len=20480, overlong_cache_len=4096),
    # 4. Dr. GRPO: R - mean (no std), per-sequence token sum over a constant, no KL
    "dr_grpo": dict(advantage="group_mean", loss_agg="seq_sum_constant", kl_coef=0.0, clip_low=0.2,
                    clip_high=0.2),
    # 5. RLOO: leave-one-out baseline, no critic
    "rloo": dict(advantage="rloo", critic="none", kl_coef=0.0),
    # 6. REINFORCE++: batch-normalised advantage, per-token KL penalty in the reward, no critic
    "reinforce_pp": dict(advantage="batch_norm", kl_mode="reward", kl_estimator="k1", kl_coef=0.01,
                         critic="none"),
    # 7. S2R outcome-level RLOO on the final answer; process-level GRPO over comparable actions
    "s2r_outcome_rloo": dict(advantage="rloo", reward_level="outcome", critic="none"),
    "s2r_process_grpo": dict(advantage="process", process_baseline="position_kind", critic="none",
                             loss_agg="seq_mean_token_mean"),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(PAPER_SETTINGS))
def test_presets_follow_the_papers(name):
    cfg = load_preset(name)
    got = {k: getattr(cfg, k) for k in PAPER_SETTINGS[name]}
    assert got == PAPER_SETTINGS[name]
    assert cfg.needs_critic == (name == "ppo")  # only PPO learns a value function
    assert cfg.needs_reference == (name in ("ppo", "grpo", "reinforce_pp"))  # DAPO / Dr. GRPO drop KL
    assert cfg.dual_clip is None and cfg.entropy_coef == 0.0  # opt-in extras, off in every paper preset


def test_dapo_soft_punishment_starts_at_the_expected_length():
    from veriloop.algos.shaping import overlong_penalty

    dapo = load_preset("dapo")
    lengths = torch.tensor([16384, 18432, 20480, 20481])  # expected max, mid-cache, L_max, beyond
    pen = overlong_penalty(lengths, max_len=dapo.overlong_max_len, cache_len=dapo.overlong_cache_len)
    assert pen.tolist() == [0.0, -0.5, -1.0, -1.0]


def test_unknown_names_and_keys_suggest_the_closest():
    with pytest.raises(ValueError, match="Did you mean .dapo."):
        load_preset("dapoo")
    with pytest.raises(ValueError, match="Did you mean 'clip_high'"):
        config_from_mapping({"clip_hihg": 0.3})
    assert load_preset("dapo", overlong_max_len=512, overlong_cache_len=128).overlong_max_len == 512
    with pytest.raises(ValueError, match="overlong_cache_len"):
        load_preset("dapo", overlong_max_len=64, overlong_cache_len=128)
