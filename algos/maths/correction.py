"""Rollout correction: the sampler is not the trainer.

The sampler's recorded log-probs mu (vLLM kernels, bf16, an older weight version) differ from
pi_old, the trainer's own log-probs of the same tokens under the rollout-time weights. The PPO-
family ratio rho = pi_theta / pi_old assumes the tokens came from pi_old; the factor
pi_old / mu corrects for the rest. Each function here takes

    old_logprobs [B, T]      log pi_old, recomputed by the trainer before the update
    sampler_logprobs [B, T]  log mu, recorded by the sampler (``Trajectory.logprobs``)
    mask [B, T]              1 on sampled tokens that train

and returns a per-token *weight* (multiplies the policy loss, detached) and a *keep* mask (tokens
and sequences dropped from the loss, its normalisers included). They combine with any policy loss
in ``losses.py``. References: Yao et al. 2025, "Your efficient RL framework secretly brings you
off-policy RL training" (truncated IS); Ling team 2025, IcePop (masked IS); verl's rollout-
correction module (geometric sequence mask).

Conventions a user porting settings should know: every bound here is on pi_old / mu (verl's are on
mu / pi_old, so verl's [a, b] is [1/b, 1/a] here; the two agree only for bounds symmetric in log
space, such as [0.5, 2]). The sampler-vs-trainer mismatch itself (``mismatch/*``) is measured in
one place, ``veriloop.algos.maths.mismatch``. Not with top-p / top-k sampling: mu is then the filtered
distribution's and pi_old / mu the nucleus mass (the config check refuses the combination).
"""

from __future__ import annotations

import torch

from veriloop.algos.maths.losses import _check_same, _masked_mean, sequence_mean
from veriloop.configs.algo import RolloutIS


def _log_w(old_logprobs: torch.Tensor, sampler_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    _check_same(("old_logprobs", "sampler_logprobs", "mask"), old_logprobs, sampler_logprobs, mask)
    d = (old_logprobs - sampler_logprobs).detach().double()
    return torch.where(mask.bool(), d, torch.zeros_like(d))


def truncated_is_weights(
    old_logprobs: torch.Tensor, sampler_logprobs: torch.Tensor, mask: torch.Tensor, *, cap: float
) -> torch.Tensor:
    """Truncated importance sampling (TIS): w_t = min(pi_old(y_t) / mu(y_t), C), C = ``cap``.

    Unbiased up to the truncation; the cap bounds the variance a token with a tiny mu could add.
    With mu = pi_old every weight is 1 (a no-op). Returns: [B, T] float weights, 1 off the mask.
    """
    if cap <= 0:
        raise ValueError(f"truncated IS needs a positive cap C (e.g. 2.0), got {cap}")
    w = torch.exp(_log_w(old_logprobs, sampler_logprobs, mask)).clamp(max=cap)
    return torch.where(mask.bool(), w, torch.ones_like(w)).to(old_logprobs.dtype)


def masked_is_weights(
    old_logprobs: torch.Tensor, sampler_logprobs: torch.Tensor, mask: torch.Tensor, *, low: float, high: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked importance sampling (MIS, IcePop): w_t = (pi_old / mu) 1[low <= pi_old / mu <= high].

    A token whose ratio leaves [low, high] (IcePop: [0.5, 2]) is dropped from the loss outright
    rather than down-weighted: such a token is evidence the two engines disagree, not a sample.

    Returns:
        weights [B, T] (the ratio on kept tokens, 1 elsewhere) and keep [B, T] (bool, False on
        dropped tokens and off the mask).
    """
    if not 0 <= low < 1 < high:
        raise ValueError(f"masked IS needs 0 <= low < 1 < high, got low={low}, high={high}")
    r = torch.exp(_log_w(old_logprobs, sampler_logprobs, mask))
    keep = mask.bool() & (r >= low) & (r <= high)
    w = torch.where(keep, r, torch.ones_like(r)).to(old_logprobs.dtype)
    return w, keep


def geometric_sequence_mask(
    old_logprobs: torch.Tensor,
    sampler_logprobs: torch.Tensor,
    mask: torch.Tensor,
    *,
    low: float,
    high: float,
    segments: torch.Tensor | None = None,
    episodes: torch.Tensor | None = None,
) -> torch.Tensor:
    """Sequence-level geometric mask: drop sequence y_i when
    g_i = exp((1/|y_i|) sum_t log(pi_old / mu)) falls outside [low, high].

    g_i is the per-token geometric mean of the sequence's ratio, so it does not explode with
    length the way the product pi_old(y_i)/mu(y_i) does; tight bounds (e.g. [0.999, 1.001]) reject
    sequences the sampler saw through a systematically different model. ``segments`` as in
    ``losses.sequence_mean`` (None = one sequence per row: the episode's sampled tokens), and so
    are ``episodes`` (the rows split from one episode are one sequence).

    Returns: keep [B, T] (bool; False on every token of a rejected sequence and off the mask).
    """
    if not 0 <= low <= 1 <= high:
        raise ValueError(f"the geometric mask needs 0 <= low <= 1 <= high, got low={low}, high={high}")
    g = torch.exp(sequence_mean(_log_w(old_logprobs, sampler_logprobs, mask), mask, segments, episodes))
    return mask.bool() & (g >= low) & (g <= high)


def rollout_correction(
    old_logprobs: torch.Tensor,
    sampler_logprobs: torch.Tensor,
    mask: torch.Tensor,
    *,
    token: RolloutIS,
    cap: float,
    low: float,
    high: float,
    seq_mask: bool,
    seq_low: float,
    seq_high: float,
    segments: torch.Tensor | None = None,
    episodes: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """The token correction (``none`` / ``truncate`` / ``mask``) and optionally the geometric
    sequence mask, combined: weights [B, T], keep [B, T] (bool) and stats. ``segments`` and
    ``episodes`` [B, T] say what a sequence is, as in ``geometric_sequence_mask``.

    Stats (shares of the masked tokens / of the sequences with >= 1 masked token):
    ``rollout_corr/token_frac`` tokens whose weight was capped or that were dropped,
    ``rollout_corr/seq_frac`` sequences with at least one such token or rejected whole,
    ``rollout_corr/seq_masked_frac`` sequences rejected by the geometric mask. (The mismatch
    itself, ``mismatch/*``, is ``veriloop.algos.maths.mismatch``'s.)
    """
    m = mask.bool()
    weights = torch.ones_like(old_logprobs)
    keep = m.clone()
    touched = torch.zeros_like(m)
    if token == "truncate":
        weights = truncated_is_weights(old_logprobs, sampler_logprobs, mask, cap=cap)
        touched = m & (_log_w(old_logprobs, sampler_logprobs, mask) > torch.log(torch.tensor(cap)).double())
    elif token == "mask":
        weights, keep = masked_is_weights(old_logprobs, sampler_logprobs, mask, low=low, high=high)
        touched = m & ~keep
    elif token != "none":
        raise ValueError(f"rollout_is must be 'none', 'truncate' or 'mask', got {token!r}")
    seq_rejected = torch.zeros_like(m)
    if seq_mask:
        seq_keep = geometric_sequence_mask(
            old_logprobs,
            sampler_logprobs,
            mask,
            low=seq_low,
            high=seq_high,
            segments=segments,
            episodes=episodes,
        )
        seq_rejected = m & ~seq_keep
        keep &= seq_keep
        touched |= seq_rejected
    rows = m.any(1)
    n_rows = max(int(rows.sum()), 1)
    stats = {
        "rollout_corr/token_frac": float(_masked_mean(touched.float(), m)),
        "rollout_corr/seq_frac": float(touched.any(1).sum()) / n_rows,
        "rollout_corr/seq_masked_frac": float(seq_rejected.any(1).sum()) / n_rows,
    }
    return weights, keep, stats
