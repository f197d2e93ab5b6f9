"""Every shipped experiment config loads, validates and names a registered environment."""

from __future__ import annotations

import gymnasium
import pytest

import veriloop.envs  # noqa: F401  (registers the environments)
from veriloop.configs.loader import load_config, shipped_experiments
from veriloop.configs.presets import list_presets

EXPECTED = {
    "math_grpo",
    "math_dapo",
    "points24_sft",
    "points24_grpo",
    "points24_dapo",
    "points24_rloo",
    "points24_ppo",
    "points24_vision_grpo",
    "solve_verify_outcome_rloo",
    "solve_verify_process_grpo",
    "quickstart",
}


def test_all_expected_experiments_ship() -> None:
    assert EXPECTED <= set(shipped_experiments())


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_experiment_loads_and_envs_exist(name: str) -> None:
    cfg = load_config(name)
    assert cfg.run.algo_preset is None or cfg.run.algo_preset in list_presets()
    for split, env in cfg.env.resolved_eval_splits.items():
        assert env.id in gymnasium.registry, f"{name}: split {split} names unregistered env {env.id}"
    assert set(cfg.eval.k_list) <= set(range(1, cfg.eval.n_samples + 1))


def test_quickstart_is_small() -> None:
    cfg = load_config("quickstart")
    assert cfg.policy.model == "default" and cfg.policy.lora
    # the README's main command must stay a short CPU run (see the timing quoted in the README)
    assert cfg.rollout.batch_size <= 32 and cfg.rollout.max_new_tokens <= 128 and cfg.train.steps <= 12
    # the faster precision on CPU (docs/precision.md): bf16 mixed precision over fp32 weights; fp32 stays the default
    assert cfg.policy.precision == "bf16" and cfg.policy.dtype == "float32"
    for name in ("math_grpo", "math_dapo"):  # the same task, full fine-tuning under autocast
        assert load_config(name).policy.precision == "bf16"


def test_points24_splits_follow_the_paper() -> None:
    text = load_config("points24_grpo").env
    assert (
        text.kwargs["face_cards"] == "10" and text.eval_splits["rule_ood"].kwargs["face_cards"] == "11-12-13"
    )
    vision = load_config("points24_vision_grpo").env
    assert vision.kwargs["suits"] == "black" and vision.eval_splits["visual_ood"].kwargs["suits"] == "red"
