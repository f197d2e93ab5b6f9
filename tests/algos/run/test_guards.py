"""The learning guards: a run with no informative group for N steps stops (exit 4 from the CLI),
a step with too many samples cut at ``max_new_tokens`` warns once, the non-finite guard stays."""

from __future__ import annotations

from pathlib import Path

import pytest

import veriloop.algos.loop.train as T
from veriloop.agents.testing import TINY_MATH_GRPO
from veriloop.algos.run.guards import (
    LearningGuard,
    RunStoppedError,
    UninformativeRunError,
    stop_if_nothing_trained,
)
from veriloop.algos.run.log import read_metrics
from veriloop.algos.run.nonfinite import NonFiniteTrainingError
from veriloop.cli.main import run as cli_run
from veriloop.configs.loader import load_config
from veriloop.configs.schema import ConfigError
from veriloop.envs.math_env import MathVerifyEnv
from veriloop.envs.verifiers import Verdict

FAST = [
    *TINY_MATH_GRPO,
    "train.micro_batch_size=2",
    "eval.at_start=false",
    "eval.every=0",
    "eval.num_problems=1",
    "eval.n_samples=1",
    "eval.k_list=[1]",
    "eval.greedy=false",
    "run.tensorboard=false",
    "run.checkpoint_every=0",
]


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def always_right(monkeypatch: pytest.MonkeyPatch) -> None:
    """A scripted verifier: every response is correct, so every sample gets reward 1."""
    monkeypatch.setattr(
        MathVerifyEnv, "check", lambda self, response, task: Verdict(correct=True, reason="correct")
    )


@pytest.fixture
def coin(monkeypatch: pytest.MonkeyPatch) -> None:
    """A scripted verifier whose rewards differ within a group (even length = correct)."""

    def check(self, response: str, task) -> Verdict:  # type: ignore[no-untyped-def]
        return Verdict(correct=len(response) % 2 == 0, reason="scripted")

    monkeypatch.setattr(MathVerifyEnv, "check", check)


def test_guard_counts_resets_and_stops() -> None:
    guard = LearningGuard(limit=3, warn_truncation_above=0.5, group_size=4)
    for frac in (0.0, 0.0, 0.5, 0.0, 0.0):  # an informative step resets the count
        guard.observe({"sampling/informative_fraction": frac})
    assert guard.in_a_row == 2
    with pytest.raises(UninformativeRunError, match="no informative group for 3 steps in a row") as e:
        guard.observe({"sampling/informative_fraction": 0.0, "reward/mean": 0.0, "reward/std": 0.0})
    assert "rollout.group_size=4" in str(e.value) and "train.max_uninformative_steps=0" in str(e.value)
    assert isinstance(e.value, RunStoppedError)
    off = LearningGuard(limit=0, warn_truncation_above=0.5, group_size=4)
    for _ in range(50):
        off.observe({"sampling/informative_fraction": 0.0})  # 0 = never stops


def test_without_a_group_baseline_a_step_teaches_when_its_rewards_differ() -> None:
    """batch_norm and gae (PPO) need no group: with rollout.group_size=1 no group is ever informative,
    yet a step whose rewards differ has an advantage; only a step of equal rewards counts."""
    guard = LearningGuard(limit=2, warn_truncation_above=0.5, group_size=1, group_based=False)
    for _ in range(5):
        guard.observe({"sampling/informative_fraction": 0.0, "reward/std": 0.5})
    assert guard.in_a_row == 0
    guard.observe({"sampling/informative_fraction": 0.0, "reward/std": 0.0})
    with pytest.raises(UninformativeRunError, match="every sample of a step got the same reward for 2 steps"):
        guard.observe({"sampling/informative_fraction": 0.0, "reward/std": 0.0, "reward/mean": 0.0})
    cfg = load_config(None, ["run.algo_preset=ppo", "rollout.group_size=1"])
    assert cfg.algo.estimator.group_based is False  # what the loop passes as group_based


def test_truncation_warns_once_above_the_threshold() -> None:
    said: list[str] = []
    guard = LearningGuard(limit=0, warn_truncation_above=0.5, group_size=2)
    for rate in (0.5, 0.2):  # at the threshold is not above it
        guard.observe({"truncation_rate": rate}, warn=said.append)
    assert said == []
    for rate in (0.75, 1.0, 0.9):
        guard.observe({"truncation_rate": rate}, warn=said.append)
    assert len(said) == 1 and "75%" in said[0] and "rollout.max_new_tokens" in said[0]


def test_a_run_where_every_sample_gets_the_same_reward_stops(tmp_path: Path, always_right) -> None:
    cfg = load_config(
        None,
        [
            *FAST,
            "train.steps=5",
            "train.max_uninformative_steps=2",
            f"run.out_dir={tmp_path}",
            "run.name=same",
        ],
    )
    with pytest.raises(UninformativeRunError, match="2 steps in a row"):
        T.train(cfg, quiet=True)
    rows = read_metrics(tmp_path / "same")
    assert [r["step"] for r in rows] == [1, 2]  # the steps that led to the stop are logged
    assert all(r["sampling/informative_fraction"] == 0.0 and r["reward/mean"] == 1.0 for r in rows)
    assert not (tmp_path / "same" / "final").exists()  # nothing trained: no final policy


def test_the_cli_exits_non_zero_with_one_line(tmp_path: Path, always_right, capsys) -> None:
    rc = cli_run(
        [
            "train",
            "quickstart",
            *FAST,
            "train.steps=4",
            "train.max_uninformative_steps=2",
            "sft.steps=0",
            f"run.out_dir={tmp_path}",
            "run.name=same",
        ]
    )
    err = capsys.readouterr().err
    assert rc == 4, err[-2000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith("veriloop train: train: no informative group for 2 steps in a row")
    assert "reward/mean 1" in last and "too hard or too easy" in last and "Traceback" not in err
    assert (
        "warning: step-0 groups (base policy): 100% with zero reward variance" in err
    )  # before the first update


def _ended(steps: int, in_a_row: int, prompts: int = 8, least: int = 32):  # type: ignore[no-untyped-def]
    from types import SimpleNamespace

    cfg = SimpleNamespace(
        train=SimpleNamespace(untrained_after_groups=least),
        rollout=SimpleNamespace(prompts_per_step=prompts, group_size=2),
        algo=load_config(None, []).algo,
    )
    return cfg, SimpleNamespace(step=steps, uninformative_in_a_row=in_a_row)


def test_the_end_of_run_rule() -> None:
    """None of the run's steps informative and at least 32 groups played: trained nothing."""
    with pytest.raises(UninformativeRunError, match="in all 4 steps \\(32 groups") as e:
        stop_if_nothing_trained(*_ended(4, 4))
    assert "train.untrained_after_groups=0" in str(e.value) and "too hard or too easy" in str(e.value)
    stop_if_nothing_trained(*_ended(4, 3))  # the first step had an informative group
    stop_if_nothing_trained(*_ended(3, 3))  # 24 groups: too few to tell
    stop_if_nothing_trained(*_ended(1, 1, prompts=2))  # a 1-step smoke test of a tiny model: ends as before
    stop_if_nothing_trained(*_ended(4, 4, least=0))  # 0 = off
    stop_if_nothing_trained(*_ended(0, 0))  # no step (train.steps=0): nothing to judge


def test_a_short_run_that_trained_nothing_exits_non_zero(tmp_path: Path, always_right, capsys) -> None:
    """4 steps, under train.max_uninformative_steps=10, of 8 groups each where every sample gets reward 1."""
    rc = cli_run(
        [
            "train",
            "quickstart",
            *FAST,
            "train.steps=4",
            "rollout.prompts_per_step=8",
            "sft.steps=0",
            "train.micro_batch_size=16",
            f"run.out_dir={tmp_path}",
            "run.name=same",
        ]
    )
    err = capsys.readouterr().err
    assert rc == 4, err[-2000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith(
        "veriloop train: train: the run ended without one informative group: in all 4 steps "
        "(32 groups of rollout.group_size=2 samples)"
    )
    assert "train.untrained_after_groups=0 turns this check off" in last and "Traceback" not in err
    assert [r["step"] for r in read_metrics(tmp_path / "same")] == [1, 2, 3, 4]  # it ran to its end
    assert not (tmp_path / "same" / "final").exists()  # nothing trained: no final policy
    off = ["train.untrained_after_groups=0", "run.name=unchecked"]
    assert (
        cli_run(
            [
                "train",
                "quickstart",
                *FAST,
                "train.steps=4",
                "rollout.prompts_per_step=8",
                "sft.steps=0",
                "train.micro_batch_size=16",
                f"run.out_dir={tmp_path}",
                *off,
            ]
        )
        == 0
    )
    assert (tmp_path / "unchecked" / "final").is_dir()


def test_an_informative_run_finishes_and_warns_about_truncation_once(tmp_path: Path, coin, capsys) -> None:
    cfg = load_config(
        None,
        [
            *FAST,
            "train.steps=3",
            "train.max_uninformative_steps=0",
            "train.warn_truncation_above=0",
            f"run.out_dir={tmp_path}",
            "run.name=coin",
        ],
    )
    T.train(cfg, quiet=True)
    rows = read_metrics(tmp_path / "coin")
    err = capsys.readouterr().err
    assert any(r["truncation_rate"] > 0 for r in rows)  # the tiny random model runs into the limit
    assert err.count("were cut at rollout.max_new_tokens") == 1


def test_the_non_finite_guard_is_a_run_stop() -> None:
    assert issubclass(NonFiniteTrainingError, RunStoppedError)  # the CLI gives it one line and exit 4


@pytest.mark.parametrize(
    "bad",
    [
        "train.max_uninformative_steps=-1",
        "train.warn_truncation_above=1.5",
        "train.untrained_after_groups=-1",
    ],
)
def test_bad_settings_are_refused(bad: str) -> None:
    with pytest.raises(ConfigError, match=bad.split("=")[0]):
        load_config(None, ["policy.model=tiny", bad]).validate()


def test_step_0_shares_of_cut_samples_and_verifier_errors_come_with_advice(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    """A scripted verifier that crashes on every answer, and 2 new tokens that cut every sample: the
    line before the first update gives both shares (as logged at step 1) and what to change."""

    def crash(self, response: str, task) -> Verdict:  # type: ignore[no-untyped-def]
        raise RuntimeError("scripted verifier crash")

    monkeypatch.setattr(MathVerifyEnv, "check", crash)
    rc = cli_run(
        [
            "train",
            "quickstart",
            *FAST,
            "rollout.max_new_tokens=2",
            "train.steps=1",
            "sft.steps=0",
            f"run.out_dir={tmp_path}",
            "run.name=crash",
        ]
    )
    err = capsys.readouterr().err
    assert rc == 0, err[-2000:]  # one step of 2 groups: too few to judge the run (it ends as before)
    (row,) = read_metrics(tmp_path / "crash")
    assert row["truncation_rate"] == 1.0 and row["verifier/errors"] == row["samples/episodes"] == 4.0
    line = next(x for x in err.splitlines() if "step-0 groups (base policy)" in x)
    assert line.startswith(
        "veriloop: warning: step-0 groups (base policy): 100% with zero reward variance, "
        "100% of samples cut at rollout.max_new_tokens, 100% verifier errors"
    )
    assert "raise rollout.max_new_tokens" in line and "check the verifier" in line


# ---------------------------------------------------------------------- start-of-run checks

KEEP = "{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' -}}"
NO_SYSTEM = (  # a template that silently leaves the system message out
    "{%- for m in messages -%}{%- if m['role'] != 'system' -%}" + KEEP + "{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)
NO_USER = NO_SYSTEM.replace("!= 'system'", "!= 'user'")


def _tokenizer(template: str):  # type: ignore[no-untyped-def]
    from veriloop.agents.testing import tiny_tokenizer

    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = template
    return tokenizer


def test_a_template_that_drops_the_prompt_is_refused() -> None:
    from veriloop.agents.chat import ChatFormat

    with pytest.raises(ValueError, match="drops the system message"):
        ChatFormat(_tokenizer(NO_SYSTEM), system_prompt="Answer in \\boxed{}.")
    ChatFormat(_tokenizer(NO_SYSTEM))  # no system prompt set: nothing is lost
    with pytest.raises(ValueError, match="drops the user message"):
        ChatFormat(_tokenizer(NO_USER))


def test_first_step_line_and_its_advice() -> None:
    from veriloop.algos.run.guards import first_step_check

    line, extreme = first_step_check(
        {
            "sampling/informative_fraction": 0.25,
            "truncation_rate": 0.125,
            "verifier/errors": 1.0,
            "samples/episodes": 16.0,
        },
        4,
    )
    assert (
        line
        == (
            "step-0 groups (base policy): 75% with zero reward variance, 12% of samples cut at "
            "rollout.max_new_tokens, 6% verifier errors"
        )
        and not extreme
    )
    line, extreme = first_step_check(
        {
            "sampling/informative_fraction": 0.0,
            "truncation_rate": 0.75,
            "verifier/errors": 4.0,
            "samples/episodes": 16.0,
            "reward/mean": 0.0,
        },
        4,
    )
    assert extreme and "too hard or too easy for this model at this group size" in line
    assert "raise rollout.max_new_tokens" in line and "check the verifier" in line


def test_a_run_on_a_template_that_drops_the_system_message_stops_before_training(
    tmp_path: Path, capsys
) -> None:
    """A local model whose chat template leaves the system message out: one line (exit 2) before the
    run folder is made or the model loads."""
    from veriloop.agents.loading import save_policy
    from veriloop.agents.testing import tiny_policy

    policy = tiny_policy()
    policy.tokenizer.chat_template = NO_SYSTEM
    save_policy(policy, tmp_path / "model")
    args = [
        "train",
        "quickstart",
        *FAST,
        f"policy.model={tmp_path / 'model'}",
        "policy.lora=false",
        "sft.steps=0",
        "train.steps=1",
        "env.system_prompt='Answer in \\boxed{}.'",
        f"run.out_dir={tmp_path}",
        "run.name=r",
    ]
    rc = cli_run(args)
    err = capsys.readouterr().err
    assert rc == 2, err[-2000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith("veriloop train: policy.model: the chat template drops the system"), err[-2000:]
    assert "Traceback" not in err and not (tmp_path / "r").exists()  # before the run folder is made
    assert cli_run([*args, "env.system_prompt=null"]) == 0, capsys.readouterr().err[
        -1500:
    ]  # the same folder starts


def test_a_loaded_policy_whose_template_drops_the_user_text_is_refused_in_one_line() -> None:
    """Models whose tokenizer is not checked before loading (shipped, Hub) are checked once loaded."""
    from veriloop.algos.run.setup import check_chat_template

    with pytest.raises(ConfigError, match="^policy.model: the chat template drops the user message"):
        check_chat_template(_tokenizer(NO_USER), None, None)
    check_chat_template(_tokenizer(NO_SYSTEM), None, None)  # no system prompt set: nothing is lost
