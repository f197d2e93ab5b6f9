"""Compaction: rewrite a long episode's history so the next turn fits its context budget.

A compactor is a function ``compactor(messages, generate) -> messages``:

* ``messages`` is the current context as chat messages (system prompt if any, the task, then
  assistant and user turns), ending with the environment's newest message;
* ``generate(messages) -> str`` asks the policy for one reply to ``messages`` (for compactors that
  summarise; its tokens are never trained). The request is made to fit the context budget: when
  ``messages`` and the reply's tokens would not fit ``max_context``, the oldest turns after the task
  are left out of it (:func:`fit_request`);
* it returns the shorter context, which must still end with that newest message.

The rollout (:func:`veriloop.agents.engine.rollout`, ``compactor=``) calls it when the next turn
would not have its full token budget (``max_new_tokens``) left under ``max_context``, renders the
result as a fresh prompt and starts a new training sample there: the turns before it are trained
in the context they were sampled in, the turns after it in the compacted one. Without a
compactor the episode is truncated (``stop_reason="max_context"``), as before. See
docs/multi-turn.md.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

Messages = list[dict[str, Any]]
Generate = Callable[[Messages], str]
Compactor = Callable[[Messages, Generate], Messages]

SUMMARY_REQUEST = (
    "Your context is nearly full. Summarise the attempts so far in a few lines: what you tried, what "
    "the feedback said, and what to try next. Write only the summary."
)


def _head(messages: Sequence[dict[str, Any]]) -> int:
    """How many leading messages are the system prompt and the task (the first user message)."""
    first_user = next((i for i, m in enumerate(messages) if m["role"] == "user"), None)
    if first_user is None:
        raise ValueError("a context to compact needs a user message (the task); got none")
    return first_user + 1


def fit_request(messages: Messages, fits: Callable[[Messages], bool]) -> Messages | None:
    """``messages`` (system prompt, task, turns, ending with a request) with the oldest turns after
    the task dropped, one at a time, until ``fits`` says the request fits; None when even the system
    prompt, the task and the request alone do not."""
    head = _head(messages)
    for drop in range(len(messages) - head):  # the last message (the request) is always kept
        kept = [*messages[:head], *messages[head + drop :]]
        if fits(kept):
            return kept
    return None


def _check(messages: Sequence[dict[str, Any]]) -> None:
    if not messages or messages[-1]["role"] != "user":
        raise ValueError("compactors take a context that ends with the environment's newest (user) message")


@dataclass(frozen=True)
class KeepLastTurns:
    """Keep the system prompt, the task and the last ``k`` exchanges (assistant turn + the
    environment's answer); drop the turns in between. Deterministic; ``generate`` is not used.

    Example, ``k = 1``: ``[system, task, a0, u0, a1, u1, a2, u2]`` -> ``[system, task, a2, u2]``.
    """

    k: int = 1

    def __post_init__(self) -> None:
        if self.k < 0:
            raise ValueError(f"KeepLastTurns needs k >= 0 exchanges to keep, got {self.k}")

    def __call__(self, messages: Messages, generate: Generate) -> Messages:
        _check(messages)
        head = _head(messages)
        body = messages[head:-1]  # a0, u0, a1, u1, ..., a_last (the newest user message apart)
        keep = body[len(body) - (2 * self.k - 1) :] if self.k > 0 else []
        return [*messages[:head], *keep, messages[-1]] if len(keep) < len(body) else list(messages)


@dataclass(frozen=True)
class PolicySummary:
    """Ask the policy to summarise the turns so far; keep the system prompt, the task, its
    summary (as its own assistant turn) and the newest message.

    The summary is generated from the full current context plus :data:`SUMMARY_REQUEST`; it is
    context for the next sample only (never trained: it was not an action the environment saw).
    """

    request: str = SUMMARY_REQUEST

    def __call__(self, messages: Messages, generate: Generate) -> Messages:
        _check(messages)
        head = _head(messages)
        summary = generate([*messages, {"role": "user", "content": self.request}]).strip()
        note = {"role": "assistant", "content": f"Summary of my earlier attempts: {summary}"}
        return [*messages[:head], note, messages[-1]]


def make_compactor(kind: str, keep: int = 1) -> Compactor | None:
    """The compactor a config names (``rollout.compaction``): ``"none"`` -> None (truncate),
    ``"keep_last"`` -> :class:`KeepLastTurns` (``keep``), ``"summary"`` -> :class:`PolicySummary`."""
    if kind == "none":
        return None
    if kind == "keep_last":
        return KeepLastTurns(keep)
    if kind == "summary":
        return PolicySummary()
    raise ValueError(f"unknown compaction {kind!r}: choose none, keep_last or summary")
