"""The one rollout loop: many multi-turn episodes, one batched generation call per turn.

    for turn in 0, 1, ...:
        requests = [context of every episode still running]      # finished episodes drop out
        samples  = backend.generate(requests)                    # ONE batched call
        for each episode: env.step(decoded sample); append the environment's delta tokens

Token-in, token-out: sampled ids are kept verbatim (``loss_mask = 1``, their sampling log-prob);
only the environment's new messages are tokenized, as chat-template deltas (see
:mod:`veriloop.agents.chat`), with ``loss_mask = 0`` and log-prob 0. An assistant prefix
(``env.assistant_prefix``, e.g. ``<think>``) follows every generation prompt as loss-0 tokens of the
turn it opens, and the environment reads it as the start of that turn's response. Limits are never silent: a
sample cut at ``max_new_tokens`` sets ``TurnRecord.hit_token_limit``; an episode cut by
``max_turns`` or ``max_context`` gets ``truncated=True`` and ``stop_reason`` naming the limit.

Samples: one per episode while every turn's context extends the previous one. Where it does not,
a new training sample starts (``Trajectory.sample_starts``, ``split_reasons``): a chat template
that rewrites earlier turns (``"template"``, e.g. one that drops past ``<think>`` blocks), or a
compactor that shortened the history (``"compaction"``, :mod:`veriloop.agents.compaction`). Each
sample is a whole context: the next turn is generated from the current sample's tokens only.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import gymnasium as gym
import torch

import veriloop.envs  # noqa: F401  (registers the environments that specs name)
from veriloop.agents.backends import Backend, GenRequest, GenResult, eos_token_ids
from veriloop.agents.chat import ChatFormat, observation_message
from veriloop.agents.compaction import Compactor, Messages, fit_request
from veriloop.agents.sampling_params import SamplingParams
from veriloop.agents.trajectory import Trajectory, TurnRecord
from veriloop.envs.base import SIGNAL_KEY, signal_of
from veriloop.envs.json_safe import jsonable
from veriloop.envs.verifiers import Verdict

if TYPE_CHECKING:
    from veriloop.configs.schema import RolloutConfig


@dataclass(frozen=True)
class EpisodeSpec:
    """How to start one episode: ``gym.make(env_id, **env_kwargs).reset(seed=seed)``.

    Episodes with the same ``group_id`` share a start state (same seed => same problem).
    """

    env_id: str
    env_kwargs: dict[str, Any] = field(default_factory=dict)
    seed: int = 0
    group_id: int = 0


def grouped_specs(
    env_id: str, kwargs: dict[str, Any], seeds: Sequence[int], group_size: int
) -> list[EpisodeSpec]:
    """``group_size`` episodes per seed (group ``g`` = ``seeds[g]``), for group-based baselines."""
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    return [
        EpisodeSpec(env_id, dict(kwargs), int(s), g) for g, s in enumerate(seeds) for _ in range(group_size)
    ]


@dataclass(frozen=True)
class RolloutLimits:
    """Limits the rollout enforces (outside the task; hitting one is recorded, never silent).

    Attributes:
        max_new_tokens: Most tokens per turn; ``None`` = ``SamplingParams.max_new_tokens``.
        max_context: Most tokens in a whole episode (prompt + samples + environment messages).
        max_turns: Most model actions per episode.
    """

    max_new_tokens: int | None = None
    max_context: int = 4096
    max_turns: int = 8

    def __post_init__(self) -> None:
        if self.max_turns < 1 or self.max_context < 2:
            raise ValueError(
                f"need max_turns >= 1 and max_context >= 2, got {self.max_turns}, {self.max_context}"
            )

    @classmethod
    def from_rollout(cls, rollout: RolloutConfig) -> RolloutLimits:
        """The limits of ``rollout`` (a config's ``rollout`` section), read from it in this one place."""
        return cls(
            max_new_tokens=rollout.max_new_tokens,
            max_context=rollout.max_context,
            max_turns=rollout.max_turns,
        )


def as_verdict(value: Any) -> Verdict | None:
    """A step's ``info["verdict"]`` as a typed :class:`Verdict` (an env outside veriloop may send
    its ``to_dict()`` form); None when the step has none."""
    if value is None or isinstance(value, Verdict):
        return value
    if isinstance(value, Mapping):
        return Verdict.from_dict(value) if value else None
    raise TypeError(f"info['verdict'] must be a Verdict, its dict or None, got {type(value).__name__}")


class _Episode:
    """Mutable state of one running episode (becomes a frozen :class:`Trajectory`)."""

    def __init__(
        self,
        key: int,
        spec: EpisodeSpec,
        fmt: ChatFormat,
        compact: Callable[[Messages], Messages] | None = None,
        reserve: int = 1,
    ) -> None:
        self.key, self.spec, self.fmt, self.compact, self.reserve = key, spec, fmt, compact, reserve
        self.env = gym.make(spec.env_id, **spec.env_kwargs)
        obs, info = self.env.reset(seed=spec.seed)
        self.obs, self.task = obs, jsonable(info.get("task", {}))
        message, image = observation_message(obs)
        self.messages: list[dict[str, Any]] = fmt.first_messages(message)
        self.ids: list[int] = []
        self.loss_mask: list[int] = []
        self.logprobs: list[float] = []
        self.turn_index: list[int] = []
        self.vision: dict[str, torch.Tensor] = {}
        self.turns: list[TurnRecord] = []
        self.context: list[dict[str, Any]] = list(self.messages)  # what the current sample renders
        self.sample_starts: list[int] = [0]
        self.split_reasons: list[str] = []
        self.done = self.terminated = self.truncated = False
        self.stop_reason: str | None = None
        if fmt.processor is not None:
            ids, inputs = fmt.encode_multimodal(
                fmt.prompt_text(self.messages), [image] if image is not None else []
            )
            self._extend(ids, -1)
            self._add_vision(inputs)
        else:
            if image is not None:
                raise ValueError(f"{spec.env_id} returns images but the policy has no processor; load a VLM")
            self._extend(fmt.prompt_ids(self.messages), -1)
        self._extend(fmt.prefix_ids, 0)  # the assistant prefix opens turn 0 (loss 0)

    def _extend(self, ids: Sequence[int], turn: int, logprobs: Sequence[float] | None = None) -> None:
        self.ids += ids
        self.loss_mask += [1 if logprobs is not None else 0] * len(ids)
        self.logprobs += list(logprobs) if logprobs is not None else [0.0] * len(ids)
        self.turn_index += [turn] * len(ids)

    def _add_vision(self, inputs: dict[str, torch.Tensor]) -> None:
        for name, tensor in inputs.items():
            self.vision[name] = torch.cat([self.vision[name], tensor]) if name in self.vision else tensor

    @property
    def context_len(self) -> int:
        """Tokens of the current sample: what the next turn is generated from."""
        return len(self.ids) - self.sample_starts[-1]

    def request(self, turn: int, budget: int) -> GenRequest:
        start = self.sample_starts[-1]
        ids = self.ids if start == 0 else self.ids[start:]
        return GenRequest(self.key, ids, budget, turn, self.obs, self.task, dict(self.vision))

    def stop(self, reason: str) -> None:
        self.done, self.truncated, self.stop_reason = True, True, reason

    def apply(self, turn: int, res: GenResult, eos: Sequence[int], limits: RolloutLimits) -> None:
        """Record the sample, step the environment, and append its reply's delta tokens."""
        start = len(self.ids)
        self._extend(res.token_ids, turn, res.logprobs)
        text = self.fmt.assistant_prefix + self.fmt.action_text(res.token_ids, eos)
        self.messages.append({"role": "assistant", "content": text})
        self.context.append(self.messages[-1])
        obs, reward, terminated, truncated, info = self.env.step(text)
        info = dict(info)
        signal = signal_of(info)  # the learner contract (built from the verdict if the env sends none)
        info.pop(SIGNAL_KEY, None)
        verdict = as_verdict(info.pop("verdict", None))
        self.turns.append(
            TurnRecord(
                turn,
                start,
                len(self.ids),
                text,
                float(reward),
                verdict,
                jsonable(info),
                res.finish == "length",
                bool(terminated),
                bool(truncated),
                signal,
            )
        )
        if terminated or truncated:
            self.done, self.terminated, self.truncated = True, bool(terminated), bool(truncated)
            return
        if turn + 1 >= limits.max_turns:
            return self.stop("max_turns")
        self._append_observation(obs, turn, res, limits)

    def _delta(
        self, message: dict[str, Any], image: Any, ended: bool
    ) -> tuple[list[int], dict[str, Any]] | None:
        """The reply's delta ids (and vision inputs), contents never read as special tokens; None
        where the template rewrites history."""
        if self.fmt.processor is None:
            ids = self.fmt.delta_ids_or_none(self.context, message, ended)
            return None if ids is None else (ids, {})
        text = self.fmt.delta_text_or_none(self.context, message, ended)
        if text is None:
            return None
        return self.fmt.encode_multimodal(text, [image] if image is not None else [])

    def _append_observation(self, obs: Any, turn: int, res: GenResult, limits: RolloutLimits) -> None:
        """Append the environment's reply as a delta of the current sample; start a new sample
        where the template rewrites history, or (with a compactor) where fewer than
        ``self.reserve`` tokens (a full turn) would be left."""
        message, image = observation_message(obs)
        ended = bool(res.token_ids) and res.token_ids[-1] == self.fmt.tokenizer.eos_token_id
        found = self._delta(message, image, ended)
        if found is None:  # the template rewrote an earlier turn
            return self._new_sample([*self.context, message], obs, turn, limits, "template")
        ids, inputs = found
        prefix = self.fmt.prefix_ids
        if (
            self.compact is not None
            and self.context_len + len(ids) + len(prefix) + self.reserve > limits.max_context
        ):
            return self._new_sample(self.compact([*self.context, message]), obs, turn, limits, "compaction")
        if self.context_len + len(ids) + len(prefix) >= limits.max_context:
            return self.stop("max_context")  # the reply would leave no room for one more token
        self._extend(ids, turn)
        self._extend(prefix, turn + 1)  # the assistant prefix opens the next turn
        self._add_vision(inputs)
        self.messages.append(message)
        self.context.append(message)
        self.obs = obs

    def _new_sample(self, context: Messages, obs: Any, turn: int, limits: RolloutLimits, reason: str) -> None:
        """Start a new training sample whose prompt is ``context`` (ending with the observation
        ``obs``) rendered afresh (loss 0)."""
        if self.fmt.processor is not None:
            raise ValueError(
                f"{self.spec.env_id}: a new sample ({reason}) would re-encode every image of the episode, "
                "which vision policies do not support; use a chat template that only appends and no compactor"
            )
        ids = self.fmt.prompt_ids(context)
        if len(ids) + len(self.fmt.prefix_ids) >= limits.max_context:
            return self.stop("max_context")  # even the rewritten context leaves no room to generate
        self.sample_starts.append(len(self.ids))
        self.split_reasons.append(reason)
        self._extend(ids, turn)
        self._extend(self.fmt.prefix_ids, turn + 1)
        self.messages.append(context[-1])
        self.context = list(context)
        self.obs = obs

    def trajectory(self) -> Trajectory:
        from veriloop.agents.vision import without_images

        return Trajectory(
            env_id=self.spec.env_id,
            env_kwargs=dict(self.spec.env_kwargs),
            seed=self.spec.seed,
            group_id=self.spec.group_id,
            token_ids=list(self.ids),
            loss_mask=list(self.loss_mask),
            logprobs=list(self.logprobs),
            turn_index=list(self.turn_index),
            turns=tuple(self.turns),
            terminated=self.terminated,
            truncated=self.truncated,
            stop_reason=self.stop_reason,
            messages=without_images(self.messages),
            task=self.task,
            extras=dict(self.vision),
            sample_starts=tuple(self.sample_starts),
            split_reasons=tuple(self.split_reasons),
        )


def _compaction(
    compactor: Compactor | None,
    backend: Backend,
    fmt: ChatFormat,
    sampling: SamplingParams,
    generator: torch.Generator,
    eos: Sequence[int],
    budget: int,
    max_context: int,
) -> Callable[[int], Callable[[Messages], Messages] | None]:
    """Episode key -> its compaction function (``compactor`` bound to a ``generate`` that asks the
    policy for one reply of up to ``budget`` tokens within ``max_context``, never trained), or None
    without a compactor."""
    if compactor is not None and fmt.processor is not None:
        raise ValueError(
            "compaction re-renders the history, which vision policies do not support: compactor=None"
        )

    def compact_for(key: int) -> Callable[[Messages], Messages] | None:
        if compactor is None:
            return None

        def generate(messages: Messages) -> str:
            fitted = fit_request(messages, lambda m: len(fmt.prompt_ids(m)) + budget <= max_context)
            if fitted is None:  # not even the task and the request fit: no reply
                return ""
            req = GenRequest(("compaction", key), fmt.prompt_ids(fitted), budget, observation=fitted[-1])
            (res,) = backend.generate([req], sampling, generator)
            backend.release(req.key)
            return fmt.action_text(res.token_ids, eos)

        return lambda messages: compactor(messages, generate)

    return compact_for


def _live(eps: Sequence[_Episode], limits: RolloutLimits) -> list[_Episode]:
    """The episodes still running; one whose context is full is stopped first (``max_context``)."""
    for ep in eps:
        if not ep.done and ep.context_len >= limits.max_context:
            ep.stop("max_context")
    return [ep for ep in eps if not ep.done]


class Player:
    """Plays episodes turn by turn: the one place that starts an episode (with its compactor and
    per-turn reserve) and plays a turn of many (requests within the budgets, one batched
    generation, the results applied, finished episodes released). :func:`rollout` drives it over
    a fixed list of episodes; the asynchronous generation worker (``veriloop.algos.loop.async_worker``)
    over the episodes running now, so both play with the same limits and the same compaction.

    Args:
        backend: Generates every request (turns and compaction replies) and forgets ended episodes.
        fmt: The chat format episodes are written in.
        eos: End-of-turn ids (``backends.eos_token_ids``).
        sampling: How tokens are drawn (``max_new_tokens`` with ``limits`` sets the per-turn budget).
        limits: Turn, per-turn token and context limits.
        generator: The one ``torch.Generator`` every generation draws from.
        compactor: Rewrites a history that would leave less than a turn's budget (``rollout``).
    """

    def __init__(
        self,
        backend: Backend,
        fmt: ChatFormat,
        eos: Sequence[int],
        sampling: SamplingParams,
        limits: RolloutLimits,
        generator: torch.Generator,
        compactor: Compactor | None = None,
    ) -> None:
        self.backend, self.fmt, self.eos, self.sampling = backend, fmt, eos, sampling
        self.limits, self.generator = limits, generator
        self.per_turn = min(sampling.max_new_tokens, limits.max_new_tokens or sampling.max_new_tokens)
        self._compact_for = _compaction(
            compactor, backend, fmt, sampling, generator, eos, self.per_turn, limits.max_context
        )

    def start(self, key: int, spec: EpisodeSpec) -> _Episode:
        """A new episode (its environment reset) under the key its requests carry."""
        return _Episode(key, spec, self.fmt, self._compact_for(key), self.per_turn)

    def turn(self, eps: Sequence[_Episode]) -> int:
        """One turn of every running episode of ``eps`` in one batched call; each ended episode
        (this turn, or stopped for a full context) is released. Returns how many played."""
        running = [ep for ep in eps if not ep.done]
        live = _live(running, self.limits)
        for ep in running:
            if ep.done:  # stopped at max_context before its turn
                self.backend.release(ep.key)
        if not live:
            return 0
        budgets = [min(self.per_turn, self.limits.max_context - ep.context_len) for ep in live]
        requests = [ep.request(len(ep.turns), b) for ep, b in zip(live, budgets)]
        results = self.backend.generate(requests, self.sampling, self.generator)
        for ep, res in zip(live, results):
            ep.apply(len(ep.turns), res, self.eos, self.limits)
            if ep.done:
                self.backend.release(ep.key)
        return len(live)


def default_backend(policy: Any) -> Backend:
    """The policy itself when it can generate (scripted policies), else the HF backend."""
    if hasattr(policy, "generate") and hasattr(policy, "release"):
        return policy
    from veriloop.agents.backends.hf import HFBackend

    return HFBackend(policy)


def rollout(
    policy: Any,
    episodes: Sequence[EpisodeSpec],
    *,
    sampling: SamplingParams,
    limits: RolloutLimits | None = None,
    backend: Backend | None = None,
    system_prompt: str | None = None,
    log_path: str | Path | None = None,
    compactor: Compactor | None = None,
    assistant_prefix: str | None = None,
) -> list[Trajectory]:
    """Play every episode to its end, batching all running episodes into one generation per turn.

    Args:
        policy: A :class:`~veriloop.agents.policy.Policy` or a :class:`~veriloop.agents.scripted.ScriptedPolicy`.
        episodes: What to play (see :func:`grouped_specs`).
        sampling: How tokens are drawn; ``sampling.seed`` seeds the one ``torch.Generator``.
        limits: Turn, per-turn token and context limits (default :class:`RolloutLimits`).
        backend: Generation backend (default: the HF backend over ``policy.model``).
        system_prompt: Optional system message before each first observation.
        assistant_prefix: Text every model turn starts with (``env.assistant_prefix``; loss 0).
        log_path: Append one JSON line per episode there (see :mod:`veriloop.agents.episode_log`).
        compactor: Rewrites an episode's history when its next turn would not have
            ``max_new_tokens`` left under ``max_context`` (:mod:`veriloop.agents.compaction`);
            a new training sample starts there. None (default): the episode is truncated.

    Returns:
        One :class:`Trajectory` per spec, in the order given.
    """
    fmt = ChatFormat(
        policy.tokenizer,
        system_prompt,
        processor=getattr(policy, "processor", None),
        assistant_prefix=assistant_prefix,
    )
    player = Player(
        backend or default_backend(policy),
        fmt,
        eos_token_ids(policy.tokenizer, getattr(policy, "model", None)),
        sampling,
        limits or RolloutLimits(),
        torch.Generator().manual_seed(sampling.seed),
        compactor,
    )
    eps = [player.start(i, spec) for i, spec in enumerate(episodes)]
    try:
        while player.turn(eps):
            pass
        trajectories = [ep.trajectory() for ep in eps]
    finally:
        for ep in eps:
            ep.env.close()
    if log_path is not None:
        from veriloop.agents.episode_log import append_episodes

        append_episodes(log_path, trajectories)
    return trajectories
