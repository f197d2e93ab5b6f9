"""Tests for veriloop.configs.loader: precedence, overrides, error messages, round trip."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from veriloop.configs.loader import config_to_yaml, dump_config, load_algo_preset, load_config
from veriloop.configs.presets import load_preset
from veriloop.configs.schema import ConfigError, ExperimentConfig


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "exp.yaml"
    path.write_text(text)
    return path


def test_defaults_without_a_file() -> None:
    assert load_config(None) == ExperimentConfig()


def test_preset_then_file_keys_then_overrides(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "algo:\n  preset: dapo\n  clip_high: 0.3\n  overlong_max_len: 256\n  overlong_cache_len: 64\nrollout:\n  group_size: 4\n",
    )
    cfg = load_config(path, ["algo.clip_low=0.1", "rollout.group_size=8"])
    dapo = load_preset("dapo")
    assert cfg.algo.name == "dapo" and cfg.algo.dynamic_sampling == dapo.dynamic_sampling
    assert cfg.algo.clip_high == 0.3  # file over preset
    assert cfg.algo.clip_low == 0.1  # override over preset
    assert cfg.rollout.group_size == 8  # override over file
    assert cfg.run.algo_preset == "dapo"


def test_override_values_are_parsed_as_yaml() -> None:
    cfg = load_config(
        None,
        [
            "eval.k_list=[1, 2]",
            "train.lr=3e-4",
            "policy.lora=false",
            "env.kwargs.face_cards=11-12-13",
            "env.eval_splits.rule_ood.kwargs.level=3",
            "policy.keep_reference=null",
            "run.name=abc",
        ],
    )
    assert cfg.eval.k_list == [1, 2]
    assert cfg.train.lr == 3e-4 and isinstance(cfg.train.lr, float)  # YAML reads 3e-4 as a string
    assert cfg.policy.lora is False
    assert cfg.env.kwargs == {"face_cards": "11-12-13"}
    assert cfg.env.eval_splits["rule_ood"].kwargs == {"level": 3}
    assert cfg.run.name == "abc"


def test_run_algo_preset_is_the_same_setting(tmp_path: Path) -> None:
    assert load_config(None, ["run.algo_preset=rloo"]).algo == load_preset("rloo")
    clash = write(tmp_path, "algo: {preset: rloo}\nrun: {algo_preset: grpo}\n")
    with pytest.raises(ConfigError, match="run.algo_preset names 'grpo': keep one"):
        load_config(clash)


def test_unknown_key_names_file_line_and_closest(tmp_path: Path) -> None:
    path = write(tmp_path, "rollout:\n  group_size: 4\n  temprature: 0.7\ngroup_size: 2\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = str(info.value)
    assert "2 problems" in message
    assert f"{path}:3: rollout.temprature: unknown key. Did you mean rollout.temperature?" in message
    assert f"{path}:4: group_size: unknown key. Did you mean rollout.group_size?" in message


def test_unknown_override_key() -> None:
    with pytest.raises(
        ConfigError,
        match=r"override 'algo.clip_hihg=0.3': algo.clip_hihg: unknown key. Did you mean algo.clip_high",
    ):
        load_config(None, ["algo.clip_hihg=0.3"])


def test_type_and_choice_errors(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "rollout:\n  group_size: eight\ntrain:\n  schedule: cosin\n  steps: 1.5\npolicy:\n  lora: 1\n",
    )
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = str(info.value)
    assert f"{path}:2: rollout.group_size: expects int, got 'eight' (str)" in message
    assert (
        f"{path}:4: train.schedule: must be one of constant, linear, cosine; got 'cosin' (did you mean cosine?)"
        in message
    )
    assert f"{path}:5: train.steps: expects int, got 1.5 (float)" in message
    assert f"{path}:7: policy.lora: expects bool, got 1 (int)" in message
    with pytest.raises(ConfigError, match=r"algo.dual_clip: expects float, got 'x'"):
        load_config(None, ["algo.dual_clip=x"])
    with pytest.raises(
        ConfigError, match=r"run.name: expects str \| None, got 5 \(int\)|run.name: expects str, got 5"
    ):
        load_config(None, ["run.name=5"])


def test_unknown_preset_and_bad_override_syntax() -> None:
    with pytest.raises(ConfigError, match=r"unknown algorithm preset 'dapoo'. Did you mean 'dapo'"):
        load_config(None, ["algo.preset=dapoo"])
    with pytest.raises(ConfigError, match="must look like key=value"):
        load_config(None, ["rollout.group_size"])
    with pytest.raises(ConfigError, match="rollout.group_size is a value, not a section"):
        load_config(None, ["rollout.group_size=4", "rollout.group_size.x=1"])


def test_file_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="Did you mean points24_grpo"):
        load_config("points24_grpp")
    dup = write(tmp_path, "train:\n  lr: 0.1\n  lr: 0.2\n")
    with pytest.raises(ConfigError, match=r"exp.yaml:3: train.lr: duplicate key"):
        load_config(dup)
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(write(tmp_path, "- 1\n- 2\n"))


def test_cross_field_check_after_loading() -> None:
    with pytest.raises(ConfigError, match="set algo.critic=value_head"):
        load_config(None, ["algo.advantage=gae"])
    assert load_config(None, ["algo.preset=ppo"]).algo.critic == "value_head"


def test_dump_load_round_trip(tmp_path: Path) -> None:
    cfg = load_config(
        "points24_vision_grpo", ["algo.clip_high=0.25", "policy.target_modules=[q_proj, v_proj]"]
    )
    path = tmp_path / "resolved.yaml"
    path.write_text(config_to_yaml(cfg))
    again = load_config(path)
    assert again == cfg
    assert dump_config(again) == yaml.safe_load(path.read_text())


def test_loader_reads_presets_through_load_preset() -> None:
    for name in ["grpo", "dapo", "ppo", "rloo"]:
        assert load_preset(name) == load_algo_preset(name)
