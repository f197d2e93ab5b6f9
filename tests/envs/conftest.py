"""Shared helpers for the environment tests: scripted episodes."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import gymnasium
import numpy as np
import pytest

import veriloop.envs  # noqa: F401  (registers the environments)


def run_script(
    env: gymnasium.Env,
    seed: int | None,
    actions: Sequence[str] | Callable[[dict, int], str],
    options: dict | None = None,
) -> dict[str, Any]:
    """Reset with ``seed`` and play ``actions`` (a list, or ``f(task_info, step)``) until the episode ends."""
    obs, info = env.reset(seed=seed, options=options)
    out: dict[str, Any] = {
        "obs": [obs],
        "rewards": [],
        "terminated": [],
        "truncated": [],
        "infos": [],
        "task": info["task"],
    }
    step = 0
    while True:
        action = (
            actions(info["task"] if step == 0 else out["task"], step) if callable(actions) else actions[step]
        )
        obs, reward, terminated, truncated, info = env.step(action)
        for key, value in (
            ("obs", obs),
            ("rewards", reward),
            ("terminated", terminated),
            ("truncated", truncated),
            ("infos", info),
        ):
            out[key].append(value)
        step += 1
        if terminated or truncated:
            return out


def same_obs(a: Any, b: Any) -> bool:
    """Observation equality, images compared with ``np.array_equal``."""
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same_obs(a[k], b[k]) for k in a)
    if isinstance(a, np.ndarray):
        return np.array_equal(a, b)
    return a == b


@pytest.fixture
def script() -> Callable[..., dict[str, Any]]:
    """``script(env, seed, actions, options=None)`` -> dict of per-step lists (see :func:`run_script`)."""
    return run_script


@pytest.fixture
def obs_equal() -> Callable[[Any, Any], bool]:
    return same_obs
