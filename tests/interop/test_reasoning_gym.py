"""veriloop/ReasoningGym-v0: three reasoning-gym datasets end to end, scored in the verifier worker."""

from __future__ import annotations

import sys
import warnings

import gymnasium
import pytest
from gymnasium.utils.env_checker import check_env

import veriloop.envs  # noqa: F401  (registers the ids)
from veriloop.interop import MissingExtraError
from veriloop.interop.reasoning_gym_env import ENV_ID, score_in_worker


@pytest.mark.parametrize(
    ("dataset", "config", "wrong"),
    [
        ("chain_sum", {"min_terms": 2, "max_terms": 3}, "<answer>123456789</answer>"),
        ("word_sorting", {}, "<answer>zzz, yyy</answer>"),
        ("letter_counting", {}, "\\boxed{9999}"),
    ],
)
def test_dataset_end_to_end(dataset, config, wrong):
    env = gymnasium.make(ENV_ID, dataset=dataset, config=config, max_attempts=2)
    obs, info = env.reset(seed=3)
    task = info["task"]
    assert task["dataset"] == dataset and task["question"] in obs and "<answer>" in obs
    assert task["answer"] not in obs.replace(task["question"], "")  # the format line leaks nothing
    # wrong first (the gold is never shown), then right: reasoning-gym's own scorer decides
    obs, reward, terminated, truncated, info = env.step(f"Let me think. {wrong}")
    assert (reward, terminated, truncated) == (0.0, False, False)
    assert info["verdict"].reason == "wrong_value" and info["verdict"].error is None
    assert task["answer"] not in obs and "Try again" in obs
    obs, reward, terminated, truncated, info = env.step(f"So: <answer>{task['answer']}</answer>")
    assert (reward, terminated, truncated) == (1.0, True, False)
    assert info["verdict"].correct and info["reward_components"] == {"score": 1.0}
    # same seed, same item; another seed, (almost surely) another item
    assert env.reset(seed=3)[1]["task"] == task
    assert env.reset(seed=4)[1]["task"]["index"] != task["index"]
    env.close()


def test_check_env_and_single_turn_default():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        env = gymnasium.make(ENV_ID)
        check_env(env.unwrapped)
    _, info = env.reset(seed=0)
    _, reward, terminated, truncated, info = env.step("no tags here")
    assert (reward, terminated, truncated, info["verdict"].reason) == (0.0, True, False, "no_answer")


def test_pinned_task_and_partial_credit():
    env = gymnasium.make(ENV_ID, dataset="word_sorting")
    _, info = env.reset(options={"task": {"index": 7}})
    assert info["task"]["index"] == 7
    with pytest.raises(ValueError, match="index"):
        env.reset(options={"task": {"index": 10**9}})


def test_deadline_kills_the_scorer_and_is_a_verifier_error():
    env = gymnasium.make(ENV_ID, dataset="chain_sum", timeout_s=1e-9)  # the reply cannot arrive in 1 ns
    _, info = env.reset(seed=0)
    _, reward, terminated, truncated, info = env.step(f"<answer>{info['task']['answer']}</answer>")
    assert info["verdict"].error == "timeout" and info["verifier_error"] == "timeout"
    assert (reward, terminated, truncated) == (0.0, False, True)  # not decided: excluded, not wrong


def test_worker_refuses_an_irreproducible_item():
    with pytest.raises(RuntimeError, match="not reproducible"):
        score_in_worker("chain_sum", '{"seed": 0}', 0, "some other question", "1")


def test_unknown_dataset_suggests_the_closest():
    with pytest.raises(KeyError, match="chain_sum"):
        gymnasium.make(ENV_ID, dataset="chain_sun")


def test_missing_extra_names_it(monkeypatch):
    from veriloop.interop.reasoning_gym_env import ReasoningGymEnv

    monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # as if not installed
    with pytest.raises(MissingExtraError, match=r"veriloop\[reasoning-gym\]"):
        ReasoningGymEnv("chain_sum")
