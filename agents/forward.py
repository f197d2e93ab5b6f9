"""The one forward pass that turns token ids into per-token log-probabilities.

Rollouts use it to check recorded sampling log-probs; algorithms use it for the policy, the
reference and the old policy. Keeping one implementation means the numbers always agree.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.utils.checkpoint


def token_logprobs(
    model: Any,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    first_position: int = 1,
    shared_prefix: int = 0,
    **model_inputs: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probability of each token given the tokens before it.

    Args:
        model: A causal LM (or VLM) returning ``.logits`` of shape [B, T, V].
        input_ids: [B, T] token ids.
        attention_mask: [B, T], 1 on real tokens.
        temperature: Logits are divided by it, matching the sampler.
        with_entropy: Also return the per-position entropy of the distribution.
        first_position: The first position whose log-prob is needed (e.g. the first sampled
            token of the batch). Logits are computed only from there on (``logits_to_keep``): the
            vocabulary projection over a long prompt is most of the cost. Earlier positions are 0.
        shared_prefix: The first ``shared_prefix`` tokens are the same real tokens in every row
            (a GRPO group's prompt; see :func:`shared_prefix_length`). They are run once, as
            one row, and their keys/values are shared by every row's continuation: the same
            numbers (up to float rounding) and gradients for a fraction of the compute. Used only
            for text models (no ``model_inputs``) and when ``shared_prefix <= first_position``.
        **model_inputs: Extra inputs (e.g. ``pixel_values``) passed to the model.

    Returns:
        logprobs [B, T]: position t holds log p(x_t | x_<t); position 0 is 0.
        entropy [B, T] or None: entropy of p(. | x_<t) at position t; position 0 is 0.
    """
    if input_ids.shape != attention_mask.shape:
        raise ValueError(
            f"input_ids {tuple(input_ids.shape)} and attention_mask {tuple(attention_mask.shape)} differ"
        )
    T = input_ids.shape[1]
    first = min(max(int(first_position), 1), max(T - 1, 1))
    keep = T - first + 1  # logits at positions first-1 .. T-1
    if 1 < shared_prefix <= first and not model_inputs and input_ids.shape[0] > 1:
        logits = _shared_prefix_logits(model, input_ids, attention_mask, shared_prefix, keep)
    else:
        logits = _logits(model, input_ids, attention_mask, keep if first > 1 else 0, model_inputs)
    logits = logits[:, -keep:-1]  # [B, T-first, V]: predicts tokens first..T-1
    picked, ent = _picked_logprobs(logits, input_ids[:, first:], temperature, with_entropy)
    zeros = picked.new_zeros(input_ids.shape[0], first)
    logprobs = torch.cat([zeros, picked], dim=1)  # [B, T]
    entropy = torch.cat([zeros, ent], dim=1) if ent is not None else None
    return logprobs, entropy


#: Rows of [rows, V] logits turned into log-probs at once (~200 MB of fp32 for a 49k vocabulary).
CHUNK_ROWS = 1024


def _picked_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float, with_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``log_softmax(logits / T)`` at ``targets`` (and the entropy), a chunk of rows at a time.

    Done at once, the log-softmax, its exponent and their product each hold a [B, L, V] tensor
    that autograd keeps for the backward pass: with a 49k vocabulary, 8 rows of 600 tokens are
    ~1 GB per tensor, and long multi-turn batches ran out of memory. Each chunk is computed under
    activation checkpointing instead (recomputed in the backward pass), so only the model's own
    logits and their gradient stay [B, L, V].
    """
    b, n, v = logits.shape
    flat, tgt = logits.reshape(b * n, v), targets.reshape(b * n)
    picks, ents = [], []
    for start in range(0, b * n, CHUNK_ROWS):
        chunk, t = flat[start : start + CHUNK_ROWS], tgt[start : start + CHUNK_ROWS]
        if torch.is_grad_enabled() and chunk.requires_grad:
            out = torch.utils.checkpoint.checkpoint(_chunk_logprobs, chunk, t, temperature, with_entropy,
                                                    use_reentrant=False)  # fmt: skip
        else:
            out = _chunk_logprobs(chunk, t, temperature, with_entropy)
        picks.append(out[0])
        ents.append(out[1])
    picked = torch.cat(picks).reshape(b, n) if picks else flat.new_zeros(b, n)
    entropy = (torch.cat(ents).reshape(b, n) if ents else flat.new_zeros(b, n)) if with_entropy else None
    return picked, entropy


def _chunk_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float, with_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    logp_all = torch.log_softmax(logits.float() / temperature, dim=-1)  # [R, V]
    picked = torch.gather(logp_all, -1, targets.unsqueeze(-1)).squeeze(-1)
    ent = -(logp_all.exp() * logp_all).sum(-1) if with_entropy else picked.new_zeros(0)
    return picked, ent


def first_loss_position(loss_mask: torch.Tensor) -> int:
    """The first column where any row of ``loss_mask`` [B, T] is set (1 if none is)."""
    cols = loss_mask.bool().any(0).nonzero()
    return int(cols[0]) if len(cols) else 1


def _logits(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, keep: int,
            model_inputs: dict[str, Any]) -> torch.Tensor:  # fmt: skip
    """``model(...).logits``, for the last ``keep`` positions only when ``keep`` > 0 and the model
    takes ``logits_to_keep`` (transformers' causal LMs do); all positions otherwise."""
    if keep > 0:
        try:
            return model(input_ids=input_ids, attention_mask=attention_mask, logits_to_keep=keep,
                         **model_inputs).logits  # fmt: skip
        except TypeError as e:
            if "logits_to_keep" not in str(e):
                raise
    return model(input_ids=input_ids, attention_mask=attention_mask, **model_inputs).logits


def shared_prefix_length(input_ids: torch.Tensor, attention_mask: torch.Tensor, limit: int) -> int:
    """How many leading columns of ``input_ids`` [B, T] hold the same real token in every row
    (at most ``limit``, e.g. the first loss position, so no sampled token is shared)."""
    same = (input_ids == input_ids[:1]).all(0) & attention_mask.bool().all(0)  # [T]
    return min(int(same.long().cumprod(0).sum()), limit)


def _shared_prefix_logits(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, prefix: int,
                          keep: int) -> torch.Tensor:  # fmt: skip
    """Logits of the last ``keep`` positions, with columns ``0 .. prefix-2`` run once for all rows.

    The prefix's keys/values (one row, with their autograd graph) are expanded to B rows, so the
    backward pass sums every row's gradient into the one prefix computation. The continuation
    starts at column ``prefix - 1``, whose logits predict the first token after the prefix.
    """
    b, t = input_ids.shape
    head = model(input_ids=input_ids[:1, : prefix - 1], use_cache=True, logits_to_keep=1)
    cache = head.past_key_values
    for layer in cache.layers:  # [1, H, P-1, D] -> [B, H, P-1, D], no copy
        layer.keys = layer.keys.expand(b, -1, -1, -1)
        layer.values = layer.values.expand(b, -1, -1, -1)
    positions = torch.arange(prefix - 1, t, device=input_ids.device).expand(b, -1)  # [B, T-P+1]
    out = model(input_ids=input_ids[:, prefix - 1 :], attention_mask=attention_mask, position_ids=positions,
                past_key_values=cache, use_cache=True, logits_to_keep=keep)  # fmt: skip
    return out.logits
