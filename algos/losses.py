"""Per-token losses and their aggregation, as pure functions over [B, T] tensors.

Per-token terms (policy surrogate, KL, entropy, value) are computed first; ``aggregate`` then
turns a [B, T] map into a scalar, so the choice token-mean vs sequence-mean (DAPO vs GRPO vs
Dr. GRPO) is made in exactly one place (as in verl's ``core_algos.agg_loss``).
"""

from __future__ import annotations

from typing import Literal

import torch

KLKind = Literal["k1", "k2", "k3"]
AggMode = Literal["token_mean", "seq_mean_token_mean", "seq_sum_constant"]


def _check_same(names: tuple[str, ...], *xs: torch.Tensor) -> None:
    shapes = {tuple(x.shape) for x in xs}
    if len(shapes) != 1 or xs[0].dim() != 2:
        got = ", ".join(f"{n}={tuple(x.shape)}" for n, x in zip(names, xs))
        raise ValueError(f"expected {', '.join(names)} to share one [B, T] shape, got {got}")


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    m = mask.to(x.dtype)
    return (x * m).sum() / m.sum().clamp(min=1)


def policy_ratio(logprobs: torch.Tensor, old_logprobs: torch.Tensor) -> torch.Tensor:
    """r_t = pi_theta(x_t | x_<t) / pi_old(x_t | x_<t) = exp(log pi_theta - log pi_old), [B, T]."""
    _check_same(("logprobs", "old_logprobs"), logprobs, old_logprobs)
    return torch.exp(logprobs - old_logprobs)


def clipped_pg_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float,
    clip_high: float,
    dual_clip: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped surrogate with decoupled bounds (Schulman et al. 2017; DAPO clip-higher).

    loss_t = -min(r_t A_t, clip(r_t, 1 - clip_low, 1 + clip_high) A_t).
    Dual clip (Ye et al. 2020), for A_t < 0 only: loss_t = min(loss_t, -c A_t), c = ``dual_clip``.

    The clip is "active" (the token gets no gradient) when A > 0 and r > 1 + clip_high ("high"),
    or A < 0 and r < 1 - clip_low ("low"); elsewhere d loss_t / d log pi_theta = -A_t r_t, also
    for ratios outside the range on the other side (A > 0, r < 1 - clip_low: still pushed up).
    Positions with mask == 0 get loss 0 and exactly zero gradient, whatever their inputs hold.

    Args:
        logprobs: [B, T] log pi_theta (with grad); old_logprobs: [B, T] log pi_old (sampling);
        advantages: [B, T]; mask: [B, T] 1 on tokens that count.

    Returns:
        per_token_loss [B, T] (0 where mask == 0) and stats (detached scalars):
        ``clip_frac_low``, ``clip_frac_high`` (fractions of masked tokens), ``dual_clip_frac``,
        ``approx_kl`` = mean over masked tokens of (r - 1) - log r, an estimate of KL(pi_old || pi_theta).
    """
    _check_same(("logprobs", "old_logprobs", "advantages", "mask"), logprobs, old_logprobs, advantages, mask)
    m = mask.bool()
    # Off the mask the log-ratio and advantage are set to 0 *before* exp: a masked-out position
    # with an extreme old log-prob (padding, an environment token) would otherwise give
    # exp(...) = inf and a 0 * inf = NaN gradient through the torch.where below.
    log_ratio = torch.where(m, logprobs - old_logprobs.detach(), torch.zeros_like(logprobs))
    ratio = torch.exp(log_ratio)
    adv = torch.where(m, advantages.detach(), torch.zeros_like(advantages))
    surr = -adv * ratio
    surr_clipped = -adv * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    loss = torch.maximum(surr, surr_clipped)
    dual_active = torch.zeros_like(m)
    if dual_clip is not None:
        bound = -adv * dual_clip
        dual_active = (adv < 0) & (loss > bound)
        loss = torch.where(adv < 0, torch.minimum(loss, bound), loss)
    loss = torch.where(m, loss, torch.zeros_like(loss))
    with torch.no_grad():
        stats = {
            "clip_frac_low": _masked_mean(((adv < 0) & (ratio < 1.0 - clip_low)).float(), m),
            "clip_frac_high": _masked_mean(((adv > 0) & (ratio > 1.0 + clip_high)).float(), m),
            "dual_clip_frac": _masked_mean(dual_active.float(), m),
            "approx_kl": _masked_mean((ratio - 1.0) - log_ratio, m),
        }
    return loss, stats


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: KLKind = "k3") -> torch.Tensor:
    """Per-token estimate of KL(pi_theta || pi_ref) from samples of pi_theta (Schulman 2020).

    With d = log pi_theta - log pi_ref:
      k1 = d (unbiased, can be negative); k2 = d^2 / 2 (biased, low variance);
      k3 = exp(-d) - 1 + d = pi_ref/pi_theta - log(pi_ref/pi_theta) - 1 (unbiased, >= 0; GRPO).

    Args:
        logprobs, ref_logprobs: [B, T]. Returns: [B, T] (mask it yourself or via ``aggregate``).
    """
    _check_same(("logprobs", "ref_logprobs"), logprobs, ref_logprobs)
    d = logprobs - ref_logprobs.detach()
    if kind == "k1":
        return d
    if kind == "k2":
        return 0.5 * d * d
    if kind == "k3":
        return torch.exp(-d) - 1.0 + d
    raise ValueError(f"kl kind must be 'k1', 'k2' or 'k3', got {kind!r}")


def entropy_bonus(entropy: torch.Tensor, *, coef: float) -> torch.Tensor:
    """Per-token entropy loss term: -coef * H_t (minimising it raises the entropy), [B, T].

    The c_2 S[pi_theta](s_t) bonus of PPO's combined objective (Schulman et al. 2017, eq. 9).
    ``entropy`` [B, T] is the second output of ``token_logprobs(..., with_entropy=True)``; mask and
    reduce the result with ``aggregate`` like the policy term.
    """
    if entropy.dim() != 2:
        raise ValueError(f"entropy must be [B, T], got {tuple(entropy.shape)}")
    return -coef * entropy


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip: float | None = None,
) -> torch.Tensor:
    """Per-token critic loss (PPO, Schulman et al. 2017): 0.5 (V - R)^2, or with ``clip`` = eps_v
    the clipped form of OpenAI baselines' PPO2,
    0.5 max((V - R)^2, (V_old + clip(V - V_old, -eps_v, eps_v) - R)^2): once V has moved more
    than eps_v from V_old towards R, the clipped branch is the larger one and the gradient is 0,
    so one batch cannot drag the critic far from its rollout-time values.

    Args:
        values: [B, T] (with grad); old_values: [B, T] values at rollout time; returns: [B, T];
        mask: [B, T]. Returns: [B, T], 0 where mask == 0; aggregate it with ``aggregate``.
    """
    _check_same(("values", "old_values", "returns", "mask"), values, old_values, returns, mask)
    m = mask.bool()
    v_now = values.detach()
    ret = torch.where(m, returns.detach(), v_now)  # off the mask: no error, hence no gradient
    loss = (values - ret) ** 2
    if clip is not None:
        old = torch.where(m, old_values.detach(), v_now)
        clipped = old + torch.clamp(values - old, -clip, clip)
        loss = torch.maximum(loss, (clipped - ret) ** 2)
    return torch.where(m, 0.5 * loss, torch.zeros_like(loss))


def aggregate(
    per_token: torch.Tensor,
    mask: torch.Tensor,
    mode: AggMode = "token_mean",
    constant: float | None = None,
    *,
    total_tokens: float | None = None,
    total_seqs: float | None = None,
) -> torch.Tensor:
    """Reduce a [B, T] per-token loss to a scalar (verl-style aggregation).

    * ``token_mean`` (DAPO): sum_{i,t} l_{i,t} m_{i,t} / sum_{i,t} m_{i,t}; every token weighs 1/#tokens.
    * ``seq_mean_token_mean`` (GRPO): 1/B' sum_i (sum_t l m / sum_t m), B' = rows with >= 1 token;
      a token of sequence i weighs 1 / (B' |o_i|).
    * ``seq_sum_constant`` (Dr. GRPO): 1/B' sum_i sum_t l m / ``constant`` (e.g. max new tokens).

    For gradient accumulation, pass the whole batch's ``total_tokens`` (token_mean) or
    ``total_seqs`` (sequence modes) so that the micro-batch losses sum to the full-batch loss.
    Entries where mask == 0 are selected away (not multiplied by 0), so a NaN or inf there
    (e.g. the entropy of a padding position) neither reaches the loss nor its gradient.

    Args:
        per_token: [B, T] per-token loss; mask: [B, T] 1 on tokens that count.
    """
    _check_same(("per_token", "mask"), per_token, mask)
    m = mask.to(per_token.dtype)
    lm = torch.where(mask.bool(), per_token, torch.zeros_like(per_token))
    if mode == "token_mean":
        denom = m.sum().clamp(min=1) if total_tokens is None else total_tokens
        return lm.sum() / denom
    if mode == "seq_mean_token_mean":
        lengths = m.sum(1)
        per_seq = lm.sum(1) / lengths.clamp(min=1)
        denom = (lengths > 0).sum().clamp(min=1) if total_seqs is None else total_seqs
        return per_seq.sum() / denom
    if mode == "seq_sum_constant":
        if constant is None or constant <= 0:
            raise ValueError(
                f"seq_sum_constant needs a positive constant (e.g. max new tokens), got {constant}"
            )
        denom = (m.sum(1) > 0).sum().clamp(min=1) if total_seqs is None else total_seqs
        return lm.sum() / constant / denom
    raise ValueError(
        f"aggregate mode must be token_mean, seq_mean_token_mean or seq_sum_constant, got {mode!r}"
    )
