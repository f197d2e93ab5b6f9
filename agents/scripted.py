"""A policy that answers from a script, for tests and documentation.

``ScriptedPolicy`` plays the role of both policy and backend in :func:`veriloop.agents.engine.rollout`:
each turn it looks up a reply (by turn number, or by calling a function of the turn, the latest
observation and the task), tokenizes it with the real tokenizer and appends the end-of-turn token,
so trajectories carry real token ids: ``loss_mask = 1`` on reply tokens (as if sampled), log-prob
0.0 (a script has no probabilities).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Any

import torch

from veriloop.agents.backends import FinishReason, GenRequest, GenResult
from veriloop.agents.sampling_params import SamplingParams

Replies = dict[int, str] | Callable[[int, Any, dict[str, Any]], str]


class ScriptedPolicy:
    """Replies from a script instead of a model.

    Args:
        replies: ``{turn: text}``, or ``f(turn, observation, task) -> text``.
        tokenizer: The tokenizer (and chat template) trajectories are written in.
        end_with_eos: Append ``tokenizer.eos_token_id`` to each reply (as a model ending its turn would).
    """

    processor = None
    model = None
    is_vision = False

    def __init__(self, replies: Replies, tokenizer: Any, *, end_with_eos: bool = True) -> None:
        self.replies = replies
        self.tokenizer = tokenizer
        self.end_with_eos = end_with_eos
        self.calls: list[int] = []  # batch size of every generate call (for tests)

    def reply(self, turn: int, observation: Any, task: dict[str, Any]) -> str:
        if callable(self.replies):
            return str(self.replies(turn, observation, task))
        if turn not in self.replies:
            raise KeyError(f"the script has no reply for turn {turn}; it covers turns {sorted(self.replies)}")
        return self.replies[turn]

    def generate(
        self,
        requests: Sequence[GenRequest],
        sampling: SamplingParams,
        generator: torch.Generator | None = None,
    ) -> list[GenResult]:
        self.calls.append(len(requests))
        out = []
        for req in requests:
            ids = list(
                self.tokenizer(self.reply(req.turn, req.observation, req.task), add_special_tokens=False)[
                    "input_ids"
                ]
            )
            if self.end_with_eos:
                ids.append(int(self.tokenizer.eos_token_id))
            finish: FinishReason = "eos" if self.end_with_eos else "stop"
            if len(ids) > req.max_new_tokens:
                ids, finish = ids[: req.max_new_tokens], "length"
            out.append(GenResult(ids, [0.0] * len(ids), finish))
        return out

    def release(self, key: Hashable) -> None:
        """Nothing is cached per episode."""
