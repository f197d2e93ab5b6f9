"""Every registered env passes Gymnasium's checker; users can register their own in a few lines."""

from __future__ import annotations

import dataclasses
import inspect
import subprocess
import sys
import typing
import warnings

import gymnasium
import pytest
from gymnasium.utils.env_checker import check_env

import veriloop.envs
from veriloop.envs import ENVS, SPLITS, VerifierEnv, registered_ids, split_env
from veriloop.envs.verifiers import Verdict

OURS = sorted(ENVS)
#: Walked from Gymnasium's registry itself, so an env registered any other way is checked too.
REGISTERED = registered_ids()


def test_registry_lists_every_env():
    assert REGISTERED == sorted(i for i in gymnasium.registry if i.startswith("veriloop/"))
    assert set(OURS) <= set(REGISTERED)
    assert len(OURS) == 8
    for env_id in OURS:
        assert gymnasium.registry[env_id].disable_env_checker is False


@pytest.mark.parametrize("env_id", REGISTERED)
def test_check_env(env_id):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a checker warning is a failure too
        env = gymnasium.make(env_id)
        check_env(env.unwrapped)
        # and through make's own passive checker
        env.reset(seed=1)
        env.step(env.action_space.sample())
        env.close()


def test_every_split_points_at_a_registered_env():
    for family, splits in SPLITS.items():
        assert "id" in splits, family
        for split in splits:
            env_id, kwargs = split_env(family, split)
            assert env_id in gymnasium.registry
            env = gymnasium.make(env_id, **kwargs)
            env.reset(seed=0)
            env.close()


def test_split_env_suggests_names():
    with pytest.raises(KeyError, match="Did you mean 'points24-vision'"):
        split_env("points24-vison", "id")
    with pytest.raises(KeyError, match="visual_ood"):
        split_env("points24-vision", "visual-ood")


def test_make_with_unknown_kwarg_value_explains():
    with pytest.raises(ValueError, match="face_cards must be one of"):
        gymnasium.make("veriloop/Points24-text-v0", face_cards="J=11")
    with pytest.raises(ValueError, match="Did you mean 'illegal_numbers'"):
        gymnasium.make("veriloop/Points24-text-v0", rewards={"ilegal_numbers": -3})


class Capitals(VerifierEnv):
    """A user's own env: four methods."""

    COUNTRIES = (("France", "Paris"), ("Japan", "Tokyo"), ("Peru", "Lima"))

    def sample_task(self):
        country, capital = self.COUNTRIES[int(self.np_random.integers(len(self.COUNTRIES)))]
        return {"country": country, "answer": capital}

    def prompt(self, task):
        return f"What is the capital of {task['country']}?"

    def check(self, response, task):
        ok = task["answer"].lower() in response.lower()
        return Verdict(
            correct=ok,
            reason="correct" if ok else "wrong_value",
            feedback="Correct." if ok else "That is not right.",
        )

    def reward(self, verdict, task):
        value = 1.0 if verdict.correct else 0.0
        return value, {"accuracy": value}


def test_user_env_registers_and_passes_check_env():
    env_id = "veriloop/TestCapitals-v0"
    if env_id not in gymnasium.registry:
        gymnasium.register(id=env_id, entry_point=Capitals, kwargs={"max_attempts": 2})
    try:
        assert env_id in registered_ids()
        env = gymnasium.make(env_id)
        check_env(env.unwrapped)
        obs, info = env.reset(seed=3)
        answer = info["task"]["answer"]
        _, r1, term1, trunc1, _ = env.step("London")
        _, r2, term2, trunc2, info = env.step(f"It is {answer}.")
        assert (r1, term1, trunc1, r2, term2, trunc2) == (0.0, False, False, 1.0, True, False)
        assert info["attempt"] == 2 and info["reward_components"] == {"accuracy": 1.0}
    finally:
        del gymnasium.registry[env_id]


def test_no_torch_import():
    code = (
        "import sys, gymnasium, veriloop.envs\n"
        "from veriloop.envs.demo import right_answer\n"
        "for env_id in veriloop.envs.registered_ids():\n"
        "    env = gymnasium.make(env_id); obs, info = env.reset(seed=0)\n"
        "    env.step(right_answer(info['task']) if 'SolveVerify' not in env_id else 'x')\n"
        "bad = sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))\n"
        "assert not bad, bad\n"
        "print('ok', len(veriloop.envs.registered_ids()))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(f"ok {len(ENVS | veriloop.envs.INTEROP_ENVS)}")


def test_package_exports():
    assert set(veriloop.envs.__all__) >= {"VerifierEnv", "UnicodeText", "SPLITS", "registered_ids"}


def test_public_verifier_api():
    """The signatures other code may rely on ("Verifiers are public")."""
    from collections.abc import Sequence

    from veriloop.envs.verifiers import check_math, check_points24

    math_sig = inspect.signature(check_math)
    assert list(math_sig.parameters)[:2] == ["response", "gold"]
    assert all(p.kind is p.KEYWORD_ONLY for p in list(math_sig.parameters.values())[2:])
    assert typing.get_type_hints(check_math) == {
        "response": str,
        "gold": str,
        "timeout": float,
        "float_rounding": int,
        "return": Verdict,
    }
    p24_sig = inspect.signature(check_points24)
    assert list(p24_sig.parameters) == ["response", "cards", "target"]
    assert p24_sig.parameters["target"].default == 24
    assert typing.get_type_hints(check_points24) == {
        "response": str,
        "cards": Sequence[int],
        "target": int,
        "return": Verdict,
    }
    fields = {f.name: f for f in dataclasses.fields(Verdict)}
    assert {"correct", "error", "feedback", "parsed"} <= set(fields)
    hints = typing.get_type_hints(Verdict)
    assert hints["correct"] is bool and hints["feedback"] is str
    assert hints["parsed"] == (str | None)
    assert all(isinstance(kind, str) for kind in typing.get_args(typing.get_args(hints["error"])[0]))
    assert type(None) in typing.get_args(hints["error"])
    verdict = Verdict(correct=False)
    assert (verdict.error, verdict.feedback, verdict.parsed) == (None, "", None)
