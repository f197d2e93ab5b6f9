"""Play every registered environment with a scripted agent: ``python -m veriloop.envs.demo``.

The agent reads the hidden ``info["task"]`` (gold answer, reference formula) -- something a real
policy never sees -- to answer right or wrong on purpose: on even episodes it answers wrong once
and then right; on odd episodes it is always wrong until the attempts run out. Each conversation is
printed with rewards and verdict reasons, then the episode's total reward.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping
from typing import Any

import gymnasium

from veriloop.envs import registered_ids


def right_answer(task: Mapping[str, Any]) -> str:
    """A correct response for a math task (``answer``) or a Points24 task (``solution``)."""
    if "answer" in task:
        return f"Working it out step by step, the result is \\boxed{{{task['answer']}}}."
    names = [code[:-1] for code in task["cards"]]
    return json.dumps({"cards": names, "formula": task["solution"]})


def wrong_answer(task: Mapping[str, Any]) -> str:
    """A response that is wrong but well formed (never equal to the gold answer)."""
    if "answer" in task:
        return "I am fairly sure it is \\boxed{987654321}."
    names = [code[:-1] for code in task["cards"]]
    values = sorted(task["values"], reverse=True)
    return json.dumps({"cards": names, "formula": "-".join(str(v) for v in values)})  # always < 24


def scripted_action(
    env_id: str, task: Mapping[str, Any], step: int, succeed: bool, first_right: int = 1
) -> str:
    """The demo agent's action at ``step`` (0-based): wrong until step ``first_right`` (1 by default;
    0 in a single-attempt env, so a succeeding agent does succeed), then right if ``succeed``."""
    if env_id.startswith("veriloop/SolveVerify"):
        solve_index, is_verify = divmod(step, 2)
        solved_right = succeed and solve_index >= 1
        if is_verify:
            return f"<verify>{'correct' if solved_right else 'incorrect'}</verify>"
        return right_answer(task) if solved_right else wrong_answer(task)
    return right_answer(task) if succeed and step >= first_right else wrong_answer(task)


def _show(obs: Any) -> str:
    if isinstance(obs, dict):
        return f"{obs['text']}\n  [image {obs['image'].shape} {obs['image'].dtype}]"
    return str(obs)


def play(env_id: str, seed: int, succeed: bool, *, echo: bool = True) -> float:
    """One scripted episode; returns its total reward."""
    env = gymnasium.make(env_id)
    obs, info = env.reset(seed=seed)
    task, total, step, done = info["task"], 0.0, 0, False
    first_right = 0 if getattr(env.unwrapped, "max_attempts", 2) < 2 else 1
    if echo:
        print(f"=== {env_id}  seed={seed}  agent={'succeeds' if succeed else 'fails'}")
        print(f"[obs] {_show(obs)}")
    while not done:
        action = scripted_action(env_id, task, step, succeed, first_right)
        obs, reward, terminated, truncated, info = env.step(action)
        total += float(reward)
        step += 1
        done = terminated or truncated
        if echo:
            verdict = info.get("verdict")
            reason = verdict.reason if verdict is not None else info.get("action_kind")
            print(f"[act] {action}")
            print(f"      reward={reward:+.1f} reason={reason} terminated={terminated} truncated={truncated}")
            print(f"[obs] {_show(obs)}")
    env.close()
    if echo:
        print(f"--- total reward {total:+.1f}\n")
    return total


def main(episodes: int = 2, seed: int = 0) -> int:
    """Play ``episodes`` episodes of every registered env; returns 0."""
    for env_id in registered_ids():
        for e in range(episodes):
            play(env_id, seed + e, succeed=(e % 2 == 0))
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    raise SystemExit(main(args.episodes, args.seed))
