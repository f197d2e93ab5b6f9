"""A veriloop environment behind TRL's ``GRPOTrainer(environment_factory=...)`` (``pip install 'veriloop[trl]'``).

TRL 1.16 documents (``GRPOTrainer`` docstring, "environment_factory") an environment as any object
with ``reset(**row) -> str | None`` (the string is appended to the last user message) whose public
methods become tools the model calls during generation; reward functions receive the rollouts'
``environments``. :class:`VeriloopToolEnv` is that object for any registered id::

    from trl import GRPOConfig, GRPOTrainer
    from veriloop.interop.trl_env import VeriloopToolEnv, seed_dataset, veriloop_reward

    trainer = GRPOTrainer(
        model=model, processing_class=tokenizer,          # a chat template with tool calling
        args=GRPOConfig(..., num_generations=8),
        train_dataset=seed_dataset(256),                    # one row per task: {"prompt", "seed"}
        environment_factory=lambda: VeriloopToolEnv("veriloop/Points24-text-v0"),
        reward_funcs=veriloop_reward,
    )

Mapping, and where it loses information:

* **Task.** ``reset(seed=..., **row)`` resets the env with the row's ``seed``. TRL copies a row
  ``num_generations`` times, so a GRPO group shares one task (a row without ``seed`` is an error: the
  group baseline would compare different tasks).
* **Turns.** Each call of the ``answer`` tool is one ``env.step``; its return value (the verifier's
  feedback) is the tool message. A model that answers in plain text without calling the tool is
  scored by :func:`veriloop_reward` on its final assistant message, as one step.
* **Reward.** TRL scores once per rollout: :func:`veriloop_reward` returns the SUM of the episode's
  step rewards (veriloop's ``reward_level: sum``). Per-turn rewards and which turn earned them are
  lost to TRL (they stay in ``env.rewards`` / ``env.verdicts``), and ``terminated`` vs ``truncated``
  is not visible to it.
* **Verifier failures** (``Verdict.error``: timeout / crash / memory) give ``None``, which TRL
  excludes from the reward for that sample instead of scoring it 0.
* **Images** (vision envs): ``reset`` returns ``[image, text]`` content blocks; the feedback images of
  later turns are not sent (the tool returns text). Untested here: no tiny VLM with a tool template.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import gymnasium

import veriloop.envs  # noqa: F401  (registers the ids)
from veriloop.interop._extras import require

require("trl", "trl", "veriloop.interop.trl_env (training veriloop envs with TRL)")

TOOL_HINT = "Submit each answer with the `answer` tool; its reply is the verifier's feedback."
OVER = "The episode is over; no more answers are checked."


class VeriloopToolEnv:
    """One veriloop env as a TRL ``environment_factory`` environment (see the module docstring).

    Args:
        env_id: Any registered id.
        env_kwargs: Keyword arguments for ``gymnasium.make``.

    Attributes (read after a rollout): ``rewards`` (per step), ``verdicts``, ``terminated``,
    ``truncated``, ``verifier_error``.
    """

    def __init__(self, env_id: str, env_kwargs: dict[str, Any] | None = None) -> None:
        self.env_id = env_id
        self._env = gymnasium.make(env_id, **(env_kwargs or {}))
        self._clear()

    def reset(self, **row: Any) -> str | list[dict[str, Any]]:
        """Start the row's episode (``row["seed"]``); returns the first observation for the prompt."""
        if "seed" not in row:
            raise ValueError(
                "each training row needs a 'seed' column, so that the num_generations rollouts of a row "
                "(a GRPO group) play the same task; build the dataset with seed_dataset(n)"
            )
        obs, _ = self._env.reset(seed=int(row["seed"]))
        self._clear()
        if isinstance(obs, dict):  # vision: the image first, then the text
            from PIL import Image

            return [
                {"type": "image", "image": Image.fromarray(obs["image"])},
                {"type": "text", "text": f"{obs['text']}\n\n{TOOL_HINT}"},
            ]
        return f"{obs}\n\n{TOOL_HINT}"

    def answer(self, response: str) -> str:
        """Submit an answer to the task and get the verifier's feedback.

        Args:
            response: Your complete answer, in the format the task asks for.

        Returns:
            The verifier's feedback: whether the answer is right and, while attempts remain, that
            you may try again.
        """
        return self._step(response)

    # ------------------------------------------------------------------ internals (not tools)
    @property
    def done(self) -> bool:
        return self.terminated or self.truncated

    def _clear(self) -> None:
        self.rewards: list[float] = []
        self.verdicts: list[Any] = []
        self.terminated = False
        self.truncated = False
        self.verifier_error: str | None = None

    def _step(self, response: str) -> str:
        if self.done:
            return OVER
        obs, reward, terminated, truncated, info = self._env.step(str(response))
        self.rewards.append(float(reward))
        self.verdicts.append(info.get("verdict"))
        self.terminated, self.truncated = bool(terminated), bool(truncated)
        self.verifier_error = info.get("verifier_error", self.verifier_error)
        return obs["text"] if isinstance(obs, dict) else str(obs)

    def _episode_reward(self) -> float | None:
        return None if self.verifier_error else float(sum(self.rewards))


def _final_text(completion: Any) -> str:
    """The last assistant message's text of a TRL completion (a message list or a plain string)."""
    if isinstance(completion, str):
        return completion
    for message in reversed(list(completion)):
        if message.get("role") == "assistant":
            content = message.get("content") or ""
            if isinstance(content, list):
                return "".join(block.get("text", "") for block in content if isinstance(block, dict))
            return str(content)
    return ""


def veriloop_reward(
    completions: Sequence[Any], environments: Sequence[VeriloopToolEnv] | None = None, **kwargs: Any
) -> list[float | None]:
    """TRL reward function: each rollout's summed env reward; ``None`` where the verifier failed.

    A rollout that never called the ``answer`` tool is scored on its final assistant message (one
    step), so plain-text answers count too.
    """
    if environments is None:
        raise ValueError(
            "veriloop_reward needs GRPOTrainer(environment_factory=...) (no environments passed)"
        )
    scores: list[float | None] = []
    for completion, env in zip(completions, environments, strict=True):
        if not env.rewards:
            env._step(_final_text(completion))
        scores.append(env._episode_reward())
    return scores


def seed_dataset(num_tasks: int, *, start_seed: int = 0, instruction: str = "") -> Any:
    """A ``datasets.Dataset`` of ``num_tasks`` rows ``{"prompt": [user message], "seed": s}``.

    The env's first observation is appended to ``instruction`` (the user message) by TRL.
    """
    datasets = require("datasets", "trl", "veriloop.interop.trl_env.seed_dataset")
    prompt = [{"role": "user", "content": instruction}]
    return datasets.Dataset.from_dict(
        {"prompt": [prompt] * num_tasks, "seed": list(range(start_seed, start_seed + num_tasks))}
    )
