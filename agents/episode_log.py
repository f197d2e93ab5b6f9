"""Replayable episode logs: one JSON line per episode.

Each line holds what is needed to re-create the start state (env id, kwargs, seed) and, per turn,
the sampled token ids, the action text sent to the environment, the reward and the verdict.
:func:`replay` re-makes the environment, re-sends the recorded texts and returns what the
environment answers now, so a log can be checked against the current code:

    {"env_id": ..., "env_kwargs": {...}, "seed": 3, "group_id": 1, "stop_reason": null,
     "terminated": true, "truncated": false, "task": {...},
     "turns": [{"ids": [...], "text": "...", "reward": 1.0, "verdict": {...},
                "hit_token_limit": false, "terminated": true, "truncated": false}]}
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from veriloop.agents.trajectory import Trajectory


def episode_record(traj: Trajectory) -> dict[str, Any]:
    """The JSON-ready log record of one trajectory."""
    return {
        "env_id": traj.env_id,
        "env_kwargs": traj.env_kwargs,
        "seed": traj.seed,
        "group_id": traj.group_id,
        "stop_reason": traj.stop_reason,
        "terminated": traj.terminated,
        "truncated": traj.truncated,
        "task": traj.task,
        "turns": [
            {
                "ids": traj.token_ids[t.start : t.end],
                "text": t.text,
                "reward": t.reward,
                "verdict": None if t.verdict is None else t.verdict.to_dict(),
                "hit_token_limit": t.hit_token_limit,
                "terminated": t.terminated,
                "truncated": t.truncated,
            }
            for t in traj.turns
        ],
    }


def append_episodes(path: str | Path, trajectories: Iterable[Trajectory]) -> None:
    """Append one JSON line per trajectory to ``path`` (created with its folder if missing)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a", encoding="utf-8") as f:
        for traj in trajectories:
            f.write(json.dumps(episode_record(traj)) + "\n")


def read_episodes(path: str | Path) -> Iterator[dict[str, Any]]:
    with Path(path).open(encoding="utf-8") as f:
        for line in f:
            if line.strip():
                yield json.loads(line)


def replay(log_line: str | dict[str, Any]) -> list[dict[str, Any]]:
    """Re-create the environment from a log line and re-step the recorded action texts.

    Returns:
        Per turn: ``{"reward", "verdict", "terminated", "truncated"}`` as the environment gives them now.
    """
    import gymnasium as gym

    from veriloop.envs.json_safe import jsonable

    record = json.loads(log_line) if isinstance(log_line, str) else log_line
    env = gym.make(record["env_id"], **record["env_kwargs"])
    try:
        env.reset(seed=record["seed"])
        out = []
        for turn in record["turns"]:
            _, reward, terminated, truncated, info = env.step(turn["text"])
            out.append(
                {
                    "reward": float(reward),
                    "verdict": jsonable(info.get("verdict", {})),
                    "terminated": bool(terminated),
                    "truncated": bool(truncated),
                }
            )
            if terminated or truncated:
                break
        return out
    finally:
        env.close()
