"""Typed records produced by rollouts and consumed by algorithms.

Token-in, token-out: a trajectory keeps the exact token ids the policy sampled and the token ids
of the environment's messages (tokenized as chat-template deltas), side by side in one sequence.
Only sampled tokens are trainable (``loss_mask == 1``).

These records hold plain Python data and typed records (no torch), so they can be logged, replayed
and collated; episode logs serialize the verdict with ``Verdict.to_dict``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from veriloop.envs.base import LearnerSignal
from veriloop.envs.verifiers import Verdict


@dataclass(frozen=True)
class TurnRecord:
    """One model action and the environment's answer to it.

    Attributes:
        index: Turn number, 0-based.
        start, end: Half-open token span ``[start, end)`` of the *sampled* tokens of this turn in
            ``Trajectory.token_ids``.
        text: The decoded action text sent to the environment.
        reward: Reward returned by ``env.step`` for this action.
        verdict: The step's :class:`~veriloop.envs.verifiers.Verdict` (``info["verdict"]``), typed
            as the env returned it; ``None`` when the step judged no answer (e.g. an S2R verify).
        info: The rest of the step's ``info`` (JSON-ready), e.g. reward components.
        hit_token_limit: Generation stopped at ``max_new_tokens`` without an end-of-turn token.
        terminated, truncated: As returned by ``env.step``.
        signal: The step's learner contract (``info["signal"]``, see ``veriloop.envs.base``): the
            only per-step facts besides ``reward`` and ``verdict`` that algorithms read.
    """

    index: int
    start: int
    end: int
    text: str
    reward: float
    verdict: Verdict | None
    info: dict[str, Any] = field(default_factory=dict)
    hit_token_limit: bool = False
    terminated: bool = False
    truncated: bool = False
    signal: LearnerSignal = field(default_factory=LearnerSignal)


@dataclass(frozen=True)
class Trajectory:
    """One whole episode, as tokens and as turns.

    Per-token lists all have length ``len(token_ids)``:
        token_ids: Prompt, sampled and environment tokens in conversation order.
        loss_mask: 1 on tokens the policy sampled, 0 on prompt/environment/template tokens.
        logprobs: Log-probability under the sampling policy for sampled tokens, 0.0 elsewhere.
        turn_index: The turn a token belongs to (sampled tokens of turn k and the environment's
            reply to turn k both carry k; an assistant prefix opening turn k carries k); -1 for the
            initial prompt.

    Attributes:
        env_id, env_kwargs, seed: Enough to replay the episode's start state.
        group_id: Episodes sharing a start state (same seed/problem) share a group id.
        turns: One record per model action.
        terminated, truncated: How the episode ended; ``stop_reason`` names the limit when the
            rollout itself cut it short ("max_turns", "max_context", ...), else ``None``.
        messages: The chat transcript (role/content dicts; images replaced by placeholders).
        task: The environment's task metadata from ``reset`` (``info["task"]``), e.g. cards, level.
        extras: Backend-specific inputs needed to re-run the forward pass (e.g. pixel values
            for vision models), keyed by name.
        sample_starts: Where each training sample begins in ``token_ids`` (ascending, first 0).
            One sample, ``(0,)``, while every turn's context extends the previous one; a new
            sample starts where it does not (a chat template that rewrites earlier turns, a
            compaction). Sample ``k`` is ``token_ids[sample_starts[k]:sample_starts[k + 1]]``: a
            whole context of its own, fed to the model as one sequence (see docs/multi-turn.md).
        split_reasons: Why each sample after the first starts: ``"template"`` (the chat template
            rewrote earlier turns) or ``"compaction"`` (a compactor shortened the history).
    """

    env_id: str
    env_kwargs: dict[str, Any]
    seed: int
    group_id: int
    token_ids: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    turn_index: list[int]
    turns: tuple[TurnRecord, ...]
    terminated: bool
    truncated: bool
    stop_reason: str | None = None
    messages: list[dict[str, Any]] = field(default_factory=list)
    task: dict[str, Any] = field(default_factory=dict)
    extras: dict[str, Any] = field(default_factory=dict)
    sample_starts: tuple[int, ...] = (0,)
    split_reasons: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        s = self.sample_starts
        if (
            not s
            or s[0] != 0
            or any(b <= a for a, b in zip(s, s[1:]))
            or s[-1] > max(len(self.token_ids) - 1, 0)
        ):
            raise ValueError(
                f"sample_starts must ascend from 0 inside the {len(self.token_ids)} tokens, got {s}"
            )
        if len(self.split_reasons) != len(s) - 1:
            raise ValueError(f"{len(s)} samples need {len(s) - 1} split_reasons, got {self.split_reasons}")

    @property
    def num_samples(self) -> int:
        return len(self.sample_starts)

    def sample_start(self, position: int) -> int:
        """Where the sample holding token ``position`` begins (its context starts there)."""
        return max(s for s in self.sample_starts if s <= position)

    def samples(self) -> list[tuple[int, int]]:
        """Half-open ``[start, end)`` spans of the samples in ``token_ids``."""
        ends = [*self.sample_starts[1:], len(self.token_ids)]
        return list(zip(self.sample_starts, ends))

    @property
    def total_reward(self) -> float:
        return float(sum(t.reward for t in self.turns))

    @property
    def num_turns(self) -> int:
        return len(self.turns)

    @property
    def num_generated_tokens(self) -> int:
        return int(sum(self.loss_mask))
