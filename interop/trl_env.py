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

Several environments in one run (TRL 1.16 accepts a dict ``environment_factory``; each row's
``environment`` column picks one, and a GRPO group stays in one environment)::

    trainer = GRPOTrainer(
        ...,
        train_dataset=mixed_seed_dataset({"points24": 128, "math": 128}),
        environment_factory=environment_factories(
            {"points24": "veriloop/Points24-text-v0", "math": ("veriloop/MathVerifyRetry-v0", {})}
        ),
        reward_funcs=veriloop_reward,
    )
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
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


def environment_factories(
    envs: Mapping[str, str | tuple[str, dict[str, Any]]],
) -> dict[str, Callable[[], VeriloopToolEnv]]:
    """TRL's dict ``environment_factory``: ``{name: env_id or (env_id, env_kwargs)}`` -> factories.

    Each id (and kwargs) is checked now by building one env, so a typo fails before TRL starts.
    """
    if not envs:
        raise ValueError("environment_factories needs at least one {name: env_id} entry")
    out: dict[str, Callable[[], VeriloopToolEnv]] = {}
    for name, spec in envs.items():
        env_id, kwargs = (spec, {}) if isinstance(spec, str) else spec
        try:
            gymnasium.make(env_id, **kwargs).close()
        except Exception as e:  # noqa: BLE001  (gymnasium's "did you mean", or the env's own complaint)
            raise ValueError(f"environment {name!r}: cannot make {env_id!r} with {kwargs}: {e}") from None
        out[name] = functools.partial(VeriloopToolEnv, env_id, dict(kwargs))
    return out


def mixed_seed_dataset(tasks: Mapping[str, int], *, start_seed: int = 0, instruction: str = "") -> Any:
    """Rows ``{"prompt", "seed", "environment"}`` for a dict ``environment_factory``:
    ``tasks[name]`` rows per environment (seeds from ``start_seed``), interleaved name by name."""
    datasets = require("datasets", "trl", "veriloop.interop.trl_env.mixed_seed_dataset")
    if not tasks or any(n < 1 for n in tasks.values()):
        raise ValueError(f"mixed_seed_dataset needs {{name: rows >= 1}}, got {dict(tasks)}")
    rows = [(name, start_seed + i) for i in range(max(tasks.values())) for name, n in tasks.items() if i < n]
    prompt = [{"role": "user", "content": instruction}]
    return datasets.Dataset.from_dict(
        {"prompt": [prompt] * len(rows), "seed": [s for _, s in rows], "environment": [n for n, _ in rows]}
    )
