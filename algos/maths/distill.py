"""On-policy distillation: the student samples, a teacher scores every sampled token.

No reward is needed: the learning signal is the per-token reverse KL between the student and the
teacher on the student's own samples (Agarwal et al. 2024, "On-Policy Distillation of Language
Models: Learning from Self-Generated Mistakes" (GKD); Lu & Thinking Machines 2025, "On-Policy
Distillation"). The teacher is another model, or the policy itself given privileged context (the
gold answer, a verified solution) that the student's prompt never holds ("self-distillation").

Shapes: [B, T] token maps, as in ``losses``; ``mask`` is 1 on the tokens the student sampled.
"""

from __future__ import annotations

import torch

from veriloop.algos.maths.losses import clamp_log_ratio


def _check_same(names: tuple[str, ...], *xs: torch.Tensor) -> None:
    shapes = {tuple(x.shape) for x in xs}
    if len(shapes) != 1 or xs[0].dim() != 2:
        got = ", ".join(f"{n}={tuple(x.shape)}" for n, x in zip(names, xs))
        raise ValueError(f"expected {', '.join(names)} to share one [B, T] shape, got {got}")


def reverse_kl_distill_loss(
    logprobs: torch.Tensor,
    sampler_logprobs: torch.Tensor,
    teacher_logprobs: torch.Tensor,
    mask: torch.Tensor,
    *,
    trust_low: float | None = None,
    tau: float = 0.0,
    ratio_cap: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token reverse KL to a teacher, on the student's own samples x_t ~ mu (the sampler).

    The objective is KL(pi_theta || pi_T) = E_{x ~ pi_theta}[log pi_theta(x) - log pi_T(x)], summed
    over the sampled tokens. Its gradient is E_{x ~ pi_theta}[(log pi_theta - log pi_T)(x) grad log
    pi_theta(x)]; with the tokens drawn from mu, its one-sample, per-token surrogate is

        A_t    = sg(log pi_T(x_t) - log pi_theta(x_t))     (the advantage; detached)
        r_t    = pi_theta(x_t) / mu(x_t)                    (importance weight, mu = the sampler)
        w_t    = min(r_t, c) in value and gradient factor   (``ratio_cap`` c; None: w_t = r_t)
        M_t    = 0 if pi_theta(x_t) - mu(x_t) < -``trust_low`` else 1    (``trust_low`` None: 1)
        loss_t = -M_t w_t A_t + ``tau`` (log r_t)^2,

    with gradient d loss_t / d log pi_theta = -M_t min(r_t, c) A_t + 2 tau log r_t: tokens the
    teacher finds likelier than the student are pushed up, the others down. r_t corrects for the
    token x_t drawn from mu, not for the prefix: the objective is the reverse KL at the states the
    sampler visited. On-policy those are the student's own; when the sampler keeps the initial
    student's weights (``sampler_weights=initial``, distillation on its rollouts) they are the
    initial student's, and r_t moves away from 1 as the student trains: the cap c (truncated IS, as
    ``rollout_is_cap`` and DPPO's ``ratio_cap``) bounds the weight above, ``trust_low`` drops the
    tokens the student has already pushed down, and ``tau`` pulls log r_t back towards 0. Both sides of A_t are the
    *trainer's* numbers (the teacher's forward pass and this one: prime-rl's ``ref_kl`` loss), so
    the sampler-trainer mismatch (about 1e-3 per token in bf16) enters only the weight r_t, never
    the advantage. ``trust_low`` / ``tau``: prime-rl's ``opsd`` trust region (0.2 / 1e-3 there).
    Each token is credited with its own KL term only (a discount of 0, as Thinking Machines').
    log r_t is clamped to +-``MAX_LOG_RATIO`` in value only (``clamp_log_ratio``).

    Args:
        logprobs: [B, T] log pi_theta (with grad).
        sampler_logprobs: [B, T] log mu, what the tokens were sampled from (the sampler's record;
            the trainer's own pi_old under top-k / top-p, whose record is of another distribution).
        teacher_logprobs: [B, T] log pi_T of the same tokens given the teacher's context.
        mask: [B, T] 1 on sampled tokens.
        trust_low: the trust region's bound on pi_theta - mu, or None (off); tau: the penalty weight.
        ratio_cap: the cap c on the weight r_t, or None (off).

    Returns:
        per_token_loss [B, T] (0 where mask == 0, with zero gradient) and detached stats:
        ``reverse_kl`` (mean over masked tokens of log pi_theta - log pi_T), ``teacher_better_frac``
        (the share of tokens with A_t > 0), ``trust_masked_frac`` (the share with M_t = 0) and
        ``ratio_capped_frac`` (the share with r_t > c; 0 without a cap).
    """
    _check_same(
        ("logprobs", "sampler_logprobs", "teacher_logprobs", "mask"),
        logprobs,
        sampler_logprobs,
        teacher_logprobs,
        mask,
    )
    if (trust_low is not None and trust_low <= 0) or tau < 0 or (ratio_cap is not None and ratio_cap <= 0):
        raise ValueError(
            f"need trust_low > 0 or None, tau >= 0 and ratio_cap > 0 or None, got {trust_low}, {tau}, {ratio_cap}"
        )
    m = mask.bool()
    zero = torch.zeros_like(logprobs)
    log_ratio = clamp_log_ratio(torch.where(m, logprobs - sampler_logprobs.detach(), zero))
    adv = torch.where(m, (teacher_logprobs - logprobs).detach(), zero)
    dropped = torch.zeros_like(m)
    if trust_low is not None:
        with torch.no_grad():
            dropped = m & (logprobs.exp() - sampler_logprobs.exp() < -trust_low)
    weight = torch.exp(log_ratio)
    capped = torch.zeros_like(m)
    if ratio_cap is not None:  # value min(r, c); gradient factor min(r, c) (as DPPO's ratio_cap)
        r = weight.detach()
        capped = m & (r > ratio_cap)
        weight = weight * (r.clamp(max=ratio_cap) / r)
    pg = torch.where(dropped, zero, -weight * adv)
    loss = torch.where(m, pg + tau * log_ratio * log_ratio, zero)
    return loss, _stats(adv, m, dropped, capped)


def _stats(
    adv: torch.Tensor, m: torch.Tensor, dropped: torch.Tensor, capped: torch.Tensor
) -> dict[str, torch.Tensor]:
    """Means over the masked tokens: -A (the k1 reverse KL), A > 0, the trust region's drops and
    the capped weights."""
    count = m.sum().clamp(min=1)
    return {
        "reverse_kl": (-adv).sum().detach() / count,
        "teacher_better_frac": ((adv > 0) & m).sum().detach().to(adv.dtype) / count,
        "trust_masked_frac": dropped.sum().detach().to(adv.dtype) / count,
        "ratio_capped_frac": capped.sum().detach().to(adv.dtype) / count,
    }
