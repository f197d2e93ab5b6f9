"""Supervised fine-tuning on token sequences, with per-turn loss masks.

Masked SFT (e.g. S2R's behaviour initialisation, Ma et al. 2025) trains on multi-turn traces with
the loss masked on the turns that are context, not targets (``mask_turns``); which turns those are
is the environment's call (``VerifierEnv.demonstration_episode``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from veriloop.agents.forward import first_loss_position, token_logprobs


def sft_loss(
    model: Any,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    loss_mask: torch.Tensor,
    **model_inputs: Any,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Token-mean cross-entropy on loss-masked tokens:
    L = -sum_{b,t} m_{b,t} log p(x_{b,t} | x_{b,<t}) / sum_{b,t} m_{b,t}.

    Args:
        input_ids, attention_mask, loss_mask: [B, T] (loss_mask 1 on tokens to learn; position 0
            has no prediction and must be 0).

    Returns:
        loss (scalar, with grad) and metrics ``loss/sft``, ``tokens``.
    """
    if not (input_ids.shape == attention_mask.shape == loss_mask.shape) or input_ids.dim() != 2:
        raise ValueError(
            f"input_ids, attention_mask, loss_mask must share [B, T]; got {tuple(input_ids.shape)}, "
            f"{tuple(attention_mask.shape)}, {tuple(loss_mask.shape)}"
        )
    if bool((loss_mask[:, 0] != 0).any()):
        raise ValueError("loss_mask[:, 0] must be 0: the first token has no context to be predicted from")
    logp, _ = token_logprobs(
        model, input_ids, attention_mask, first_position=first_loss_position(loss_mask), **model_inputs
    )  # [B, T]
    m = loss_mask.to(logp.dtype)
    n = m.sum()
    if n == 0:
        raise ValueError("sft_loss: loss_mask selects no token; nothing to learn from")
    loss = -(logp * m).sum() / n
    return loss, {"loss/sft": float(loss.detach()), "tokens": float(n)}


def mask_turns(loss_mask: torch.Tensor, turn_index: torch.Tensor, keep_turns: Sequence[bool]) -> torch.Tensor:
    """Zero the loss mask on tokens of turns whose ``keep_turns[k]`` is False.

    Args:
        loss_mask, turn_index: [T] or [B, T] (turn -1 = prompt). keep_turns: one flag per turn.
    """
    if loss_mask.shape != turn_index.shape:
        raise ValueError(
            f"loss_mask {tuple(loss_mask.shape)} and turn_index {tuple(turn_index.shape)} differ"
        )
    keep = torch.tensor(list(keep_turns) + [False], dtype=torch.bool)  # index -1 -> False
    idx = turn_index.long()
    if bool((idx >= len(keep_turns)).any()):
        raise ValueError(f"turn_index reaches {int(idx.max())} but keep_turns has {len(keep_turns)} entries")
    return loss_mask * keep[idx].to(loss_mask.dtype)


def _render(tokenizer: Any, messages: Sequence[dict[str, Any]], gen_prompt: bool) -> str:
    return tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=gen_prompt)


def build_sft_example(
    tokenizer: Any,
    messages: Sequence[dict[str, Any]],
    trainable_turns: Sequence[bool] | None = None,
) -> tuple[list[int], list[int]]:
    """Token ids and loss mask for a chat, built incrementally from the chat template.

    The conversation is rendered one message at a time; each new piece of text (the template's
    delta) is tokenized on its own, exactly like a token-in/token-out rollout does. Tokens of the
    k-th assistant message (its content and the template's end-of-turn marker, not the
    ``assistant`` header) get loss 1 if ``trainable_turns[k]`` (default: all assistant turns);
    everything else gets 0.

    Raises ValueError if the template is not prefix-stable (e.g. it rewrites earlier turns, as
    templates that strip old ``<think>`` blocks do): such chats cannot be trained turn by turn.

    Returns:
        (input_ids, loss_mask), two lists of equal length.
    """
    n_asst = sum(1 for m in messages if m.get("role") == "assistant")
    flags = [True] * n_asst if trainable_turns is None else list(trainable_turns)
    if len(flags) != n_asst:
        raise ValueError(
            f"trainable_turns has {len(flags)} flags but the chat has {n_asst} assistant messages"
        )
    ids: list[int] = []
    mask: list[int] = []
    text = ""
    k = 0

    def add(new_text: str, trainable: bool, upto: int) -> None:
        nonlocal text
        if not new_text.startswith(text):
            raise ValueError(
                f"chat template is not prefix-stable at message {upto}: rendering more messages changed "
                "earlier text; use a template that keeps past turns verbatim"
            )
        piece = new_text[len(text) :]
        toks = tokenizer(piece, add_special_tokens=False)["input_ids"] if piece else []
        ids.extend(toks)
        mask.extend([int(trainable)] * len(toks))
        text = new_text

    for i, msg in enumerate(messages):
        if msg.get("role") == "assistant":
            add(_render(tokenizer, messages[:i], gen_prompt=True), False, i)  # the assistant header
            add(_render(tokenizer, messages[: i + 1], gen_prompt=False), flags[k], i)
            k += 1
        else:
            add(_render(tokenizer, messages[: i + 1], gen_prompt=False), False, i)
    if mask and mask[0]:
        mask[0] = 0  # the first token is never predicted
    return ids, mask
