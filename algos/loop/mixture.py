"""Several environments in one run: which environment each training problem comes from.

A mixture is ``{name: (env id, kwargs, weight)}`` (``env.mixture`` in the config). Each problem
(one env seed, one GRPO group) is drawn from one environment, so a group never mixes tasks and its
baseline compares like with like. The draw depends only on the problem's seed and the run's seed,
never on the step, the rank or how many problems came before: a resumed or data-parallel run
assigns every problem to the same environment as an uninterrupted single-process run.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from veriloop.agents.trajectory import Trajectory


def assign_envs(weights: Mapping[str, float], seeds: Sequence[int], run_seed: int = 0) -> list[str]:
    """The environment name of each problem seed: a draw with probability ``w / sum(w)``.

    Args:
        weights: ``{name: weight > 0}``, in a fixed order (the config's).
        seeds: The problems' env seeds.
        run_seed: Salt, so that two runs with different ``rollout.seed`` mix differently.

    Returns:
        One name per seed. Deterministic in ``(run_seed, seed)`` alone.
    """
    names = list(weights)
    w = np.array([weights[n] for n in names], dtype=np.float64)
    if not len(names) or (w <= 0).any() or not np.isfinite(w).all():
        raise ValueError(f"mixture weights must be finite and > 0, got {dict(weights)}")
    edges = np.cumsum(w / w.sum())
    out = []
    for s in seeds:
        u = np.random.default_rng([int(run_seed) & 0xFFFFFFFF, int(s) & 0xFFFFFFFF, 0x6D6978]).random()
        out.append(names[min(int(np.searchsorted(edges, u, side="right")), len(names) - 1)])
    return out


def per_env_metrics(
    trajs: Sequence[Trajectory], envs: Mapping[str, tuple[str, Mapping[str, Any]]]
) -> dict[str, float]:
    """``env/<name>/{episodes,reward_mean}`` for each mixture environment.

    Args:
        trajs: The step's episodes.
        envs: ``{name: (env id, kwargs)}``; an episode belongs to the entry with its id and kwargs.
    """
    key = {(env_id, _canonical(kwargs)): name for name, (env_id, kwargs) in envs.items()}
    out: dict[str, float] = {}
    for name in envs:
        mine = [t for t in trajs if key.get((t.env_id, _canonical(t.env_kwargs))) == name]
        out[f"env/{name}/episodes"] = float(len(mine))
        if mine:
            out[f"env/{name}/reward_mean"] = sum(t.total_reward for t in mine) / len(mine)
    return out


def _canonical(kwargs: Mapping[str, Any]) -> str:
    return json.dumps(kwargs, sort_keys=True, default=str)
