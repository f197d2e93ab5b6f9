"""The one forward pass that turns token ids into per-token log-probabilities.

Rollouts use it to check recorded sampling log-probs; algorithms use it for the policy, the
reference and the old policy. Keeping one implementation means the numbers always agree.
"""

from __future__ import annotations

from typing import Any

import torch


def token_logprobs(
    model: Any,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    **model_inputs: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probability of each token given the tokens before it.

    Args:
        model: A causal LM (or VLM) returning ``.logits`` of shape [B, T, V].
        input_ids: [B, T] token ids.
        attention_mask: [B, T], 1 on real tokens.
        temperature: Logits are divided by it, matching the sampler.
        with_entropy: Also return the per-position entropy of the distribution.
        **model_inputs: Extra inputs (e.g. ``pixel_values``) passed to the model.

    Returns:
        logprobs [B, T]: position t holds log p(x_t | x_<t); position 0 is 0.
        entropy [B, T] or None: entropy of p(. | x_<t) at position t; position 0 is 0.
    """
    if input_ids.shape != attention_mask.shape:
        raise ValueError(
            f"input_ids {tuple(input_ids.shape)} and attention_mask {tuple(attention_mask.shape)} differ"
        )
    logits = model(input_ids=input_ids, attention_mask=attention_mask, **model_inputs).logits  # [B, T, V]
    logits = logits[:, :-1].float() / temperature  # predicts tokens 1..T-1
    logp_all = torch.log_softmax(logits, dim=-1)  # [B, T-1, V]
    picked = torch.gather(logp_all, -1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)  # [B, T-1]
    zeros = picked.new_zeros(input_ids.shape[0], 1)
    logprobs = torch.cat([zeros, picked], dim=1)  # [B, T]
    entropy = None
    if with_entropy:
        ent = -(logp_all.exp() * logp_all).sum(-1)  # [B, T-1]
        entropy = torch.cat([zeros, ent], dim=1)
    return logprobs, entropy
