"""OpenEnv both ways: veriloop envs served by OpenEnv's (openenv 0.10) app, driven by OpenEnv's own client;
and an OpenEnv client wrapped as a gymnasium.Env (check_env) against those local servers."""

from __future__ import annotations

import sys
import warnings

import gymnasium
import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env
from openenv.core import GenericEnvClient

import veriloop.envs  # noqa: F401
from veriloop.envs.demo import right_answer, wrong_answer
from veriloop.interop import MissingExtraError
from veriloop.interop.openenv_client import OpenEnvClientEnv, make_openenv_env
from veriloop.interop.openenv_server import decode_png, serve


@pytest.fixture(scope="module")
def text_server():
    with serve("veriloop/Points24-text-v0", expose_task=True) as base_url:
        yield base_url


@pytest.fixture(scope="module")
def vision_server():
    with serve("veriloop/Points24-vision-v0", expose_task=True) as base_url:
        yield base_url


def test_whole_multi_turn_episode_through_openenv_client(text_server):
    with GenericEnvClient(base_url=text_server).sync() as client:
        result = client.reset(seed=5)
        task = result.observation["task"]
        assert not result.done and "24" in result.observation["text"]
        rewards, flags = [], []
        for attempt in range(3):  # wrong, wrong, right: three turns in one server-side episode
            answer = right_answer(task) if attempt == 2 else wrong_answer(task)
            result = client.step({"response": answer})
            obs = result.observation
            rewards.append(result.reward)
            flags.append((result.done, obs["terminated"], obs["truncated"]))
            assert obs["attempt"] == attempt + 1
        assert rewards == [-1.0, -1.0, 10.0]
        assert flags == [(False, False, False), (False, False, False), (True, True, False)]
        assert obs["verdict"]["correct"] and obs["verdict"]["reason"] == "correct"
        assert obs["reward_components"] == {"verdict": 10.0}
        # the same seed on the same session replays the task
        assert client.reset(seed=5).observation["task"] == task


def test_budget_end_is_truncated_not_terminated(text_server):
    with GenericEnvClient(base_url=text_server).sync() as client:
        task = client.reset(seed=1).observation["task"]
        for _ in range(5):  # Points24-text allows 5 attempts
            result = client.step({"response": wrong_answer(task)})
        assert result.done and result.observation["truncated"] and not result.observation["terminated"]


def test_gold_is_withheld_by_default():
    with serve("veriloop/MathVerify-v0") as base_url, GenericEnvClient(base_url=base_url).sync() as client:
        assert client.reset(seed=0).observation["task"] is None


def test_images_cross_as_png(vision_server):
    local = gymnasium.make("veriloop/Points24-vision-v0")
    expected, _ = local.reset(seed=2)
    with GenericEnvClient(base_url=vision_server).sync() as client:
        obs = client.reset(seed=2).observation
    assert obs["text"] == expected["text"]
    assert np.array_equal(decode_png(obs["image_png"]), expected["image"])  # lossless


def test_client_env_passes_check_env_and_keeps_flags(text_server):
    env = make_openenv_env(text_server)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_env(env.unwrapped)
    obs, info = env.reset(seed=5)
    task = info["openenv_observation"]["task"]
    assert obs == gymnasium.make("veriloop/Points24-text-v0").reset(seed=5)[0]
    _, reward, terminated, truncated, info = env.step(wrong_answer(task))
    assert (reward, terminated, truncated) == (-1.0, False, False)
    assert info["verdict"]["reason"] == "wrong_value" and "done_only" not in info
    _, reward, terminated, truncated, _ = env.step(right_answer(task))
    assert (reward, terminated, truncated) == (10.0, True, False)
    env.close()


def test_client_env_with_images_passes_check_env(vision_server):
    local = gymnasium.make("veriloop/Points24-vision-v0")
    shape = local.observation_space["image"].shape
    env = make_openenv_env(vision_server, image_shape=shape)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_env(env.unwrapped)
    obs, _ = env.reset(seed=2)
    assert np.array_equal(obs["image"], local.reset(seed=2)[0]["image"])
    env.close()


def test_missing_extra_names_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "openenv.core", None)
    with pytest.raises(MissingExtraError, match=r"veriloop\[openenv\]"):
        OpenEnvClientEnv("http://127.0.0.1:1")
