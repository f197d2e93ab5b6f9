"""Same seed + same actions -> the same episode, for every registered env; other seeds differ."""

from __future__ import annotations

import random

import gymnasium
import numpy as np
import pytest

from veriloop.envs import ENVS
from veriloop.envs.demo import scripted_action


def _play(env_id, seed, script, succeed):
    env = gymnasium.make(env_id)
    out = script(env, seed, lambda task, step: scripted_action(env_id, task, step, succeed))
    env.close()
    return out


@pytest.mark.parametrize("env_id", sorted(ENVS))
@pytest.mark.parametrize("succeed", [True, False])
def test_same_seed_same_episode(env_id, succeed, script, obs_equal):
    a, b = _play(env_id, 7, script, succeed), _play(env_id, 7, script, succeed)
    assert a["task"] == b["task"]
    assert len(a["obs"]) == len(b["obs"]) >= 2
    assert all(obs_equal(x, y) for x, y in zip(a["obs"], b["obs"]))
    assert a["rewards"] == b["rewards"]
    assert a["terminated"] == b["terminated"] and a["truncated"] == b["truncated"]
    assert [i.get("verdict") for i in a["infos"]] == [i.get("verdict") for i in b["infos"]]
    # the scripted agent's plan is visible in the flags
    assert a["terminated"][-1] == (succeed or env_id == "veriloop/MathVerify-v0")


@pytest.mark.parametrize("env_id", sorted(ENVS))
def test_different_seeds_differ(env_id, script, obs_equal):
    episodes = [_play(env_id, seed, script, True) for seed in (0, 1, 2)]
    tasks = [str(e["task"]) for e in episodes]
    assert len(set(tasks)) == 3
    assert not obs_equal(episodes[0]["obs"][0], episodes[1]["obs"][0])


# Per env: what the demo's scripted agent must get, by the rules of each env (see veriloop.envs.demo:
# it answers wrong first; the succeeding agent then answers right, the failing one stays wrong).
# (rewards, terminated, truncated, verdict reasons or SolveVerify action kinds)
_MATH_ONE = ([-1.0], [True], [False], ["wrong_value"])  # single turn: the one answer decides
_P24_WIN = ([-1.0, 10.0], [False, True], [False, False], ["wrong_value", "correct"])
_P24_LOSE = ([-1.0] * 5, [False] * 5, [False] * 4 + [True], ["wrong_value"] * 5)  # VIter = 5
RULES = {
    ("veriloop/MathVerify-v0", True): _MATH_ONE,
    ("veriloop/MathVerify-v0", False): _MATH_ONE,
    ("veriloop/MathVerifyRetry-v0", True): (
        [-1.0, 1.0],
        [False, True],
        [False, False],
        ["wrong_value", "correct"],
    ),
    ("veriloop/MathVerifyRetry-v0", False): (
        [-1.0] * 3,
        [False] * 3,
        [False, False, True],
        ["wrong_value"] * 3,
    ),
    ("veriloop/SolveVerify-v0", True): (
        [-1.0, 1.0, 1.0, 1.0],  # wrong solve, honest "incorrect", right solve, honest "correct"
        [False, False, False, True],
        [False] * 4,
        ["solve", "verify", "solve", "verify"],
    ),
    ("veriloop/SolveVerify-v0", False): (
        [-1.0, 1.0] * 3,
        [False] * 6,
        [False] * 5 + [True],
        ["solve", "verify"] * 3,
    ),
}
for _id in ENVS:
    if "Points24" in _id:
        RULES[(_id, True)], RULES[(_id, False)] = _P24_WIN, _P24_LOSE


@pytest.mark.parametrize(("env_id", "succeed"), sorted(RULES))
def test_scripted_agent_plays_by_the_rules(env_id, succeed, script):
    """A full episode of every env: rewards, flags and verdicts are what the env's rules say."""
    rewards, terminated, truncated, kinds = RULES[(env_id, succeed)]
    out = _play(env_id, 3, script, succeed)
    assert out["rewards"] == rewards
    assert out["terminated"] == terminated and out["truncated"] == truncated
    infos = out["infos"]
    assert [i["attempt"] for i in infos][-1] == sum(k in ("solve", "wrong_value", "correct") for k in kinds)
    if env_id.startswith("veriloop/SolveVerify"):
        assert [i["action_kind"] for i in infos] == kinds
        assert infos[-1]["outcome_reward"] == (1.0 if succeed else -1.0)
        assert infos[-1]["stats"]["wrong_to_right"] == int(succeed)
        assert infos[-1]["stats"]["verify_accuracy"] == 1.0
        return
    verdicts = [i["verdict"] for i in infos]
    assert [v.reason for v in verdicts] == kinds
    assert all(v.error is None and v.parsed for v in verdicts)
    assert [v.correct for v in verdicts] == [k == "correct" for k in kinds]
    if "Points24" in env_id:
        task = out["task"]
        assert all(i["recognition"] == 1.0 for i in infos)  # the agent names the dealt ranks
        assert [i["reward_components"] for i in infos] == [{"verdict": r} for r in rewards]
        if "vision" in env_id:
            from veriloop.envs.points24.cards import parse_code
            from veriloop.envs.points24.render import render_cards

            image = render_cards([parse_code(c) for c in task["cards"]])
            assert all(np.array_equal(o["image"], image) for o in out["obs"])  # every turn shows the hand
            assert not any(label in out["obs"][0]["text"] for label in task["labels"])
    if not out["truncated"][-1]:
        return
    last = out["obs"][-1]["text"] if isinstance(out["obs"][-1], dict) else out["obs"][-1]
    assert "Try again" not in last  # no promise of another attempt once the budget is used


@pytest.mark.parametrize("env_id", sorted(ENVS))
def test_episodes_use_only_the_env_rng(env_id, script, obs_equal):
    """Global RNGs neither influence an episode nor are consumed by it."""
    random.seed(1)
    np.random.seed(1)
    a = _play(env_id, 5, script, True)
    after_random, after_np = random.random(), np.random.random()
    random.seed(2)
    np.random.seed(2)
    b = _play(env_id, 5, script, True)
    assert a["task"] == b["task"] and all(obs_equal(x, y) for x, y in zip(a["obs"], b["obs"]))
    random.seed(1)
    np.random.seed(1)
    assert (random.random(), np.random.random()) == (after_random, after_np)


def test_demo_plays_every_env(capsys):
    from veriloop.envs import registered_ids
    from veriloop.envs.demo import main

    assert main(episodes=2, seed=0) == 0
    printed = capsys.readouterr().out
    for env_id in registered_ids():
        assert printed.count(f"=== {env_id}  seed=") == 2
    assert printed.count("--- total reward") == 2 * len(registered_ids())
    assert "--- total reward +9.0" in printed  # Points24: -1 then +10
