"""Tests for veriloop.configs.schema: documentation parsing, derived values, cross-field checks."""

from __future__ import annotations

import dataclasses

import pytest

from veriloop.configs.algo import AlgoConfig
from veriloop.configs.describe import describe, field_docs
from veriloop.configs.env import SplitConfig
from veriloop.configs.schema import ConfigError, EvalConfig, ExperimentConfig, RolloutConfig, TrainConfig


def test_every_setting_is_documented_once() -> None:
    rows = describe(ExperimentConfig)
    keys = [key for key, _, _, _ in rows]
    assert len(keys) == len(set(keys))
    undocumented = [key for key, _, _, doc in rows if not doc]
    assert undocumented == []
    # the algo section is AlgoConfig itself, not a copy
    algo_keys = {k.split(".", 1)[1] for k in keys if k.startswith("algo.")}
    assert algo_keys == {f.name for f in dataclasses.fields(AlgoConfig)}


def test_describe_rows() -> None:
    rows = {key: (tp, default, doc) for key, tp, default, doc in describe(ExperimentConfig)}
    assert rows["rollout.group_size"][:2] == ("int", 8)
    assert rows["train.schedule"][0] == "constant|linear|cosine"
    assert rows["policy.keep_reference"][:2] == ("bool | None", None)
    assert rows["eval.k_list"][:2] == ("list[int]", [1, 4, 8])
    # shared docs ("gamma, lam: ...") and continuation lines are parsed
    assert rows["algo.gamma"][2] == rows["algo.lam"][2] and "GAE" in rows["algo.gamma"][2]
    assert rows["algo.advantage"][2].endswith("per-action baselines).")


def test_field_docs_stops_at_section_end() -> None:
    class Documented:
        """Title.

        Attributes:
            a: First
                continued.
            b, c: Shared.

        Note:
            not_a_field: ignored.
        """

    assert field_docs(Documented) == {"a": "First continued.", "b": "Shared.", "c": "Shared."}


def test_derived_values() -> None:
    cfg = ExperimentConfig(
        rollout=RolloutConfig(prompts_per_step=4, group_size=8), train=TrainConfig(micro_batch_size=4)
    )
    assert cfg.rollout.batch_size == 32 and cfg.mini_batch_size == 32 and cfg.grad_accumulation_steps == 8
    assert cfg.keep_reference is False  # default algo has kl_coef 0
    cfg.algo.kl_coef = 0.04
    assert cfg.keep_reference is True
    cfg.policy.keep_reference = False
    with pytest.raises(ConfigError, match="policy.keep_reference=false but algo.kl_coef=0.04"):
        cfg.validate()
    cfg.env.eval_splits = {"rule_ood": SplitConfig(kwargs={"face_cards": "11-12-13"})}
    splits = cfg.env.resolved_eval_splits
    assert list(splits) == ["id", "rule_ood"]
    assert splits["rule_ood"] == SplitConfig(cfg.env.id, {"face_cards": "11-12-13"})
    assert cfg.run_name == "grpo-MathVerify-v0"


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda c: setattr(c.algo, "advantage", "gae"), "needs a critic: set algo.critic=value_head"),
        (lambda c: setattr(c.rollout, "group_size", 1), "set rollout.group_size >= 2"),
        (lambda c: setattr(c.eval, "k_list", [1, 16]), r"raise eval.n_samples to >= 16 or drop \[16\]"),
        (lambda c: setattr(c.train, "micro_batch_size", 5), r"choose one of \[1, 2, 4, 8, 16, 32, 64\]"),
        (lambda c: setattr(c.train, "mini_batch_size", 48), "must divide the batch"),
        (lambda c: setattr(c.eval, "seed_offset", 500), r"set eval.seed_offset >= 800"),
        (lambda c: setattr(c.rollout, "max_new_tokens", 4096), "raise max_context"),
        (lambda c: setattr(c.rollout, "top_p", 0.0), r"rollout.top_p must be in \(0, 1\]"),
        (lambda c: setattr(c.train, "warmup_steps", 1000), "train.warmup_steps must be in"),
        (lambda c: setattr(c.run, "keep_last", 0), "run.keep_last >= 1"),
        (lambda c: setattr(c.run, "log_samples", -1), "run.log_samples must be >= 0, got -1: set it to the"),
        (
            lambda c: setattr(c.algo, "overlong_penalty", True),
            "set algo.overlong_max_len=256 algo.overlong_cache_len=64",
        ),
    ],
)
def test_cross_field_errors_say_how_to_fix(change, message: str) -> None:
    cfg = ExperimentConfig()
    cfg.validate()  # the defaults are valid
    change(cfg)
    cfg.algo.overlong_max_len = 4096 if cfg.algo.overlong_penalty else cfg.algo.overlong_max_len
    with pytest.raises(ConfigError, match=message):
        cfg.validate()


def test_log_samples_is_a_documented_run_setting() -> None:
    rows = {key: (tp, default, doc) for key, tp, default, doc in describe(ExperimentConfig)}
    assert rows["run.log_samples"][:2] == ("int", 4) and "samples.jsonl" in rows["run.log_samples"][2]
    from veriloop.configs.loader import load_config

    assert load_config(None, ["run.log_samples=0"]).run.log_samples == 0
    with pytest.raises(ConfigError, match="run.log_samples must be >= 0, got -2"):
        load_config(None, ["run.log_samples=-2"])


def test_seed_ranges_account_for_sampling_rounds_and_sft() -> None:
    cfg = ExperimentConfig()
    base = cfg.train_seed_range
    assert base == range(0, cfg.train.steps * cfg.rollout.prompts_per_step)
    cfg.algo.dynamic_sampling = True
    cfg.sft.steps = 10
    assert cfg.train_seed_range.stop == base.stop * cfg.algo.max_sampling_rounds + cfg.sft.examples
    assert EvalConfig().seed_offset >= cfg.train_seed_range.stop
