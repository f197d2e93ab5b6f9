"""The VerifierEnv loop: flags, give-up, verifier failures, pinned tasks, errors, UnicodeText."""

from __future__ import annotations

import gymnasium
import pytest

from veriloop.envs import UnicodeText
from veriloop.envs.base import EpisodeOverError, gave_up
from veriloop.envs.verifiers import Verdict


def test_unicode_text_space():
    space = UnicodeText(max_length=12, seed=0)
    assert "½ × ♠ 日本 🙂" in space
    assert "x" * 13 not in space and 3 not in space and b"ab" not in space
    samples = [space.sample() for _ in range(50)]
    assert all(s in space and s.isprintable() for s in samples)
    assert len(set(samples)) > 40
    assert UnicodeText(max_length=12) == space and UnicodeText(max_length=11) != space


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("I give up", True),
        ("bla\n  i GIVE up!  \n\n", True),
        ("I give up. Just kidding: \\boxed{3}", False),
        ("I won't give up", False),
        ("", False),
    ],
)
def test_gave_up_phrase(text, expected):
    assert gave_up(text) is expected


def test_give_up_terminates_with_penalty():
    env = gymnasium.make("veriloop/Points24-text-v0")
    env.reset(seed=0)
    _, reward, terminated, truncated, info = env.step("This is too hard.\nI give up.")
    assert (reward, terminated, truncated) == (-5.0, True, False)  # DEFAULT_REWARDS["gave_up"]
    assert info["verdict"].reason == "gave_up"


def test_step_after_end_and_before_reset_raise():
    env = gymnasium.make("veriloop/MathVerify-v0").unwrapped
    with pytest.raises(EpisodeOverError, match="reset"):
        env.step("\\boxed{1}")
    env.reset(seed=0)
    _, _, terminated, truncated, _ = env.step("\\boxed{1}")
    assert terminated and not truncated  # single turn: the one answer decides the task
    with pytest.raises(EpisodeOverError, match="after the episode ended"):
        env.step("\\boxed{2}")
    with pytest.raises(TypeError, match="str"):
        env.reset(seed=0)
        env.step(42)


@pytest.mark.parametrize(
    "env_id", ["veriloop/MathVerifyRetry-v0", "veriloop/Points24-text-v0", "veriloop/SolveVerify-v0"]
)
def test_verifier_failure_truncates_with_zero_reward(env_id, monkeypatch):
    env = gymnasium.make(env_id)
    unwrapped = env.unwrapped
    target = getattr(unwrapped, "inner", unwrapped)
    failed = Verdict(
        correct=False, error="timeout", reason="verifier_error", feedback="The verifier timed out."
    )
    monkeypatch.setattr(target, "check", lambda response, task: failed)
    env.reset(seed=0)
    _, reward, terminated, truncated, info = env.step("\\boxed{5}")
    assert (reward, terminated, truncated) == (0.0, False, True)
    assert info["verifier_error"] == "timeout"
    assert info["verdict"] is failed


def test_options_task_pins_the_problem():
    env = gymnasium.make("veriloop/MathVerify-v0")
    _, info = env.reset(seed=3)
    obs_a, info_a = env.reset(seed=99, options={"task": info["task"]})
    assert info_a["task"] == info["task"]
    assert info["task"]["question"] in obs_a
    _, reward, *_ = env.step(f"\\boxed{{{info['task']['answer']}}}")
    assert reward == 1.0
    p24 = gymnasium.make("veriloop/Points24-vision-v0")
    _, info = p24.reset(seed=0, options={"task": ["QS", "3C", "5S", "AC"]})
    assert info["task"]["values"] == [10, 3, 5, 1]
    with pytest.raises(ValueError, match="four cards"):
        p24.reset(options={"task": ["QS"]})


def test_info_task_is_fresh_each_call():
    env = gymnasium.make("veriloop/Points24-text-v0")
    _, info = env.reset(seed=0)
    info["task"]["cards"].append("junk")
    _, _, _, _, step_info = env.step("I give up")
    assert "junk" not in step_info["task"]["cards"]


def test_render_ansi_transcript():
    env = gymnasium.make("veriloop/MathVerifyRetry-v0", render_mode="ansi")
    env.reset(seed=0)
    env.step("\\boxed{123456}")
    text = env.render()
    assert "[action]\n\\boxed{123456}" in text and "Try again. You have 2 attempts left." in text
