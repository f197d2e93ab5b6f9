"""How the next token is drawn: the settings, and the one function that applies them.

Every backend that samples on its own (the HF backend) calls :func:`sample_next`, so the
log-probabilities recorded in trajectories always mean the same thing:

    q(x) = softmax(filter(logits / T))[x]

where ``filter`` keeps the ``top_k`` largest logits and then the smallest set of tokens whose
probability mass reaches ``top_p`` (everything else gets ``-inf``). The recorded log-prob of a
sampled token is ``log q(x)``: the log-probability under the distribution actually sampled from.
With ``T = 1``, ``top_k = 0`` and ``top_p = 1`` this is the model's own log-probability, which is
what :func:`veriloop.agents.forward.token_logprobs` recomputes (tested). Greedy decoding
(``temperature == 0``) records the untempered model log-probability ``log softmax(logits)[x]``
(a point mass would record 0 for every token, which helps nobody).

With top-k / top-p on, the recorded log-probs are of the *filtered* distribution, which the
trainer's forward pass does not reproduce: the update then recomputes pi_old itself, and the parts
that compare the trainer with the sampler's mu (rollout correction, DPPO) are refused by the config
check, and the ``mismatch/*`` metrics are logged as null (not measurable).

Sampling inverts the cumulative distribution: with C(v) = q(1) + ... + q(v) (float64) and one
uniform U per row, x = the first v with C(v) > U * C(V). That draws exactly from ``q`` (P[x = v]
= q(v); tokens with q = 0 never come up) with one random number per row. The alternatives cost
far more at decode time, where this runs once per generated token over the whole vocabulary:
measured at batch 32 x 49,152 on 2 CPU threads, 2.5 ms for this, 33 ms for the exponential race
(Gumbel-max: one random draw per vocabulary entry) and 27 ms for ``torch.multinomial``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from veriloop.configs.schema import RolloutConfig


@dataclass(frozen=True)
class SamplingParams:
    """Settings for drawing tokens.

    Attributes:
        temperature: Logits are divided by it; ``0`` means greedy (argmax).
        top_p: Nucleus sampling: keep the smallest set of tokens with mass >= top_p (1 = off).
        top_k: Keep only the k most likely tokens (0 = off).
        max_new_tokens: Most tokens generated per turn (``RolloutLimits`` may lower it).
        stop: Strings that end a turn early (the token completing the string is kept).
        seed: Seed of the ``torch.Generator`` used for sampling: same seed, same inputs, same tokens.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 256
    stop: tuple[str, ...] = ()
    seed: int = 0

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}; use 1.0 to switch it off")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if isinstance(self.stop, str):
            raise TypeError(
                f"stop must be a tuple of strings, got the string {self.stop!r}; write stop=({self.stop!r},)"
            )

    @classmethod
    def from_rollout(cls, rollout: RolloutConfig, *, seed: int) -> SamplingParams:
        """The sampling settings of ``rollout`` (a config's ``rollout`` section): the one place they
        are read from it, for training rollouts, rejection-sampled SFT data and the async worker."""
        r = rollout
        return cls(
            temperature=r.temperature,
            top_p=r.top_p,
            top_k=r.top_k,
            max_new_tokens=r.max_new_tokens,
            seed=seed,
        )

    @classmethod
    def greedy(cls, max_new_tokens: int = 256, stop: tuple[str, ...] = ()) -> SamplingParams:
        """Deterministic argmax decoding, for evaluation."""
        return cls(temperature=0.0, max_new_tokens=max_new_tokens, stop=stop)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def is_untruncated(self) -> bool:
        """True when recorded log-probs equal the model's own (T = 1, no top-k/top-p)."""
        return self.temperature == 1.0 and self.top_k == 0 and self.top_p == 1.0

    def with_seed(self, seed: int) -> SamplingParams:
        return replace(self, seed=seed)


def filtered_logprobs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Log-probabilities ``log q`` of the distribution sampled from (see module docstring).

    Args:
        logits: [B, V] raw next-token logits.

    Returns:
        [B, V] float32 log-probabilities; filtered-out tokens hold ``-inf``.
    """
    logits = logits.float()
    if params.is_greedy:
        return torch.log_softmax(logits, dim=-1)
    if params.temperature != 1.0:
        logits = logits / params.temperature
    if params.top_k > 0 and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[:, -1:]  # [B, 1]
        logits = logits.masked_fill(logits < kth, -math.inf)
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)  # [B, V]
        probs = torch.softmax(sorted_logits, dim=-1)
        mass_before = torch.cumsum(probs, dim=-1) - probs  # mass of strictly more likely tokens
        drop_sorted = mass_before >= params.top_p  # the first token is always kept
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, -math.inf)
    return torch.log_softmax(logits, dim=-1)


def sample_next(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row.

    Args:
        logits: [B, V] next-token logits.
        params: Sampling settings.
        generator: Source of randomness (ignored when greedy); may live on another device
            than ``logits`` (the rollout's generator is a CPU one).

    Returns:
        tokens [B] (int64) and their recorded log-probs [B] (float32).
    """
    logq = filtered_logprobs(logits, params)  # [B, V]
    if params.is_greedy:
        tokens = torch.argmax(logq, dim=-1)
    else:
        # U ~ Uniform[0, 1) per row, drawn where the generator lives (a CPU generator cannot fill
        # a CUDA tensor), so a seed gives the same draws whatever device the model runs on.
        where = generator.device if generator is not None else logq.device
        u = torch.rand(logq.shape[0], 1, device=where, dtype=torch.float64, generator=generator)
        cdf = logq.double().exp().cumsum(dim=-1)  # [B, V], non-decreasing
        tokens = torch.searchsorted(cdf, u.to(logq.device) * cdf[:, -1:], right=True).squeeze(-1)
        # U * C(V) rounding up to C(V) finds no token: take the last one with q > 0
        tokens = torch.where(tokens < logq.shape[-1], tokens, cdf.argmax(dim=-1))
    return tokens, logq.gather(-1, tokens[:, None]).squeeze(-1)
