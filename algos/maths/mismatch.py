"""Sampler-vs-trainer mismatch: how far the recorded log-probs are from the trainer's own.

The sampler (vLLM kernels, bf16, prefix-cached blocks; or the HF engine's KV cache) records
log mu(y_t) for each token it drew; the trainer recomputes log pi(y_t) for the same tokens with the
same weights before its update. They should agree; how far they do not is logged every step.
With d_t = log pi(y_t) - log mu(y_t) and r_t = exp(d_t) = pi / mu, over the tokens that train:

    k3_kl        = mean_t (r_t - 1 - d_t)        k3 estimate (Schulman 2020) of KL(mu || pi): the
                                                 tokens are drawn from mu, so it is unbiased, >= 0
                                                 per token and ~ d^2 / 2 for small d
    ratio_max    = max_t r_t,  ratio_min = min_t r_t
    outside_frac = share of tokens with r_t outside [0.5, 2]
    abs_log_ratio = mean_t |d_t|

The rollout corrections (TIS / MIS / sequence mask, ``veriloop.algos.maths.correction``) act on the same
r_t. :class:`MismatchStats` holds sums, so micro-batches combine exactly (``a + b``); the metrics
are read at the end (:meth:`MismatchStats.metrics`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

#: A ratio pi / mu outside [1 / OUTSIDE, OUTSIDE] counts towards ``outside_frac``.
OUTSIDE = 2.0
NAMES = ("mismatch/k3_kl", "mismatch/ratio_max", "mismatch/ratio_min", "mismatch/outside_frac",
         "mismatch/abs_log_ratio", "mismatch/tokens")  # fmt: skip


@dataclass(frozen=True)
class MismatchStats:
    """Sufficient statistics of the mismatch over some tokens (mergeable with ``+``).

    Attributes:
        tokens: How many tokens were compared.
        k3_sum: Sum of r - 1 - log r.
        abs_log_sum: Sum of |log r|.
        outside: How many tokens had r outside [1 / OUTSIDE, OUTSIDE].
        log_ratio_max: Largest log r (-inf when no tokens).
        log_ratio_min: Smallest log r (+inf when no tokens).
    """

    tokens: float = 0.0
    k3_sum: float = 0.0
    abs_log_sum: float = 0.0
    outside: float = 0.0
    log_ratio_max: float = -math.inf
    log_ratio_min: float = math.inf

    def __add__(self, other: MismatchStats) -> MismatchStats:
        return MismatchStats(
            self.tokens + other.tokens,
            self.k3_sum + other.k3_sum,
            self.abs_log_sum + other.abs_log_sum,
            self.outside + other.outside,
            max(self.log_ratio_max, other.log_ratio_max),
            min(self.log_ratio_min, other.log_ratio_min),
        )

    def metrics(self) -> dict[str, float]:
        """The logged numbers (module docstring); all 0 (ratios 1) when no token was compared."""
        n = self.tokens
        if n == 0:
            return dict(zip(NAMES, (0.0, 1.0, 1.0, 0.0, 0.0, 0.0)))
        return dict(
            zip(
                NAMES,
                (
                    self.k3_sum / n,
                    math.exp(self.log_ratio_max),
                    math.exp(self.log_ratio_min),
                    self.outside / n,
                    self.abs_log_sum / n,
                    n,
                ),
            )
        )


def mismatch_stats(
    trainer_logprobs: torch.Tensor, sampler_logprobs: torch.Tensor, mask: torch.Tensor
) -> MismatchStats:
    """Mismatch statistics of the tokens where ``mask`` is 1.

    Args:
        trainer_logprobs: [B, T] log pi(y_t), the trainer's own, before its update.
        sampler_logprobs: [B, T] log mu(y_t), recorded by the sampler.
        mask: [B, T] 1 on the sampled tokens that train, 0 elsewhere (prompt, environment, padding).

    Returns:
        :class:`MismatchStats` (float64 sums; nothing keeps a graph).
    """
    if not trainer_logprobs.shape == sampler_logprobs.shape == mask.shape:
        raise ValueError(
            f"trainer_logprobs {tuple(trainer_logprobs.shape)}, sampler_logprobs {tuple(sampler_logprobs.shape)} "
            f"and mask {tuple(mask.shape)} must have one shape [B, T]"
        )
    m = mask.bool()
    d = (trainer_logprobs.detach().double() - sampler_logprobs.detach().double())[m]  # [N] log r
    if d.numel() == 0:
        return MismatchStats()
    bound = math.log(OUTSIDE)
    return MismatchStats(
        tokens=float(d.numel()),
        k3_sum=float((torch.expm1(d) - d).sum()),  # r - 1 - log r, exact for tiny d
        abs_log_sum=float(d.abs().sum()),
        outside=float((d.abs() > bound).sum()),
        log_ratio_max=float(d.max()),
        log_ratio_min=float(d.min()),
    )
