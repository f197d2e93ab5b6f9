"""Re-tokenization drift: how far kept token ids are from re-tokenizing the decoded conversation.

Token-in, token-out rollouts keep the sampled ids. Trainers that instead re-render the transcript
with the chat template and tokenize it again can end up training on a *different* token sequence
than the one sampled (a model may emit "Hel" + "lo" where the tokenizer writes "Hello"). This
module measures that gap for a trajectory:

    ref = tokenize(render(messages))  truncated to the text the trajectory covers
    drift = (#{t < min(n, m) : ids[t] != ref[t]} + |n - m|) / max(n, m)

with ``n = len(ids)``, ``m = len(ref)``. Zero means re-tokenizing would reproduce the exact ids.
"""

from __future__ import annotations

from typing import Any

from veriloop.agents.chat import ChatFormat
from veriloop.agents.trajectory import Trajectory


def mismatch_rate(ids: list[int], ref: list[int]) -> float:
    """Fraction of positions that differ, counting a length difference as mismatches."""
    n, m = len(ids), len(ref)
    if max(n, m) == 0:
        return 0.0
    differ = sum(a != b for a, b in zip(ids, ref))
    return (differ + abs(n - m)) / max(n, m)


def retokenized_ids(tokenizer: Any, trajectory: Trajectory, system_prompt: str | None = None) -> list[int]:
    """Token ids of the trajectory's transcript rendered by the chat template and tokenized afresh.

    The rendered text is cut to the length of the kept ids' text when it extends it (e.g. the
    template's ``"\\n"`` after the final ``<|im_end|>``, which a rollout never appends).
    """
    fmt = ChatFormat(tokenizer, system_prompt)
    text, spans = fmt.render_guarded(trajectory.messages, add_generation_prompt=False)  # contents as text
    kept_text = fmt.decode(trajectory.token_ids)
    if text.startswith(kept_text):
        text = text[: len(kept_text)]
        spans = [(a, min(b, len(text))) for a, b in spans if a < len(text)]
    return fmt.encode_guarded((text, spans))


def drift_rate(tokenizer: Any, trajectory: Trajectory) -> float:
    """Mismatch rate between the kept ids and a re-tokenization of the decoded conversation.

    ``trajectory.messages`` holds the system prompt if one was used, so no extra argument is needed.
    """
    return mismatch_rate(list(trajectory.token_ids), retokenized_ids(tokenizer, trajectory))
