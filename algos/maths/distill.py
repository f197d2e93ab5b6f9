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

from veriloop.algos.maths.losses import MAX_LOG_RATIO


def _check_same(names: tuple[str, ...], *xs: torch.Tensor) -> None:
    shapes = {tuple(x.shape) for x in xs}
    if len(shapes) != 1 or xs[0].dim() != 2:
        got = ", ".join(f"{n}={tuple(x.shape)}" for n, x in zip(names, xs))
        raise ValueError(f"expected {', '.join(names)} to share one [B, T] shape, got {got}")


def reverse_kl_distill_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    teacher_logprobs: torch.Tensor,
    mask: torch.Tensor,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token reverse KL to a teacher, on the student's own samples x_t ~ pi_old.

    The objective is KL(pi_theta || pi_T) = E_{x ~ pi_theta}[log pi_theta(x) - log pi_T(x)], summed
    over the sampled tokens. Its one-sample, per-token estimate at token t is
    k_t = log pi_old(x_t | x_<t) - log pi_T(x_t | x_<t) (k1; the tokens were drawn from pi_old), and
    the per-token advantage is its negative, A_t = log pi_T(x_t) - log pi_old(x_t) (detached: the
    teacher is not trained). The loss is the importance-weighted surrogate

        loss_t = -(pi_theta(x_t) / pi_old(x_t)) * A_t,

    whose gradient at theta = theta_old is (log pi_old - log pi_T)(x_t) * grad log pi_theta(x_t):
    tokens the teacher finds likelier than the student are pushed up, the others down. Each token
    is credited with its own KL term only (no sum over later tokens: a discount of 0, as in
    Thinking Machines' on-policy distillation). The ratio's log is clamped to +-``MAX_LOG_RATIO``.
    Aggregate the [B, T] map with ``losses.aggregate``; add it to an RL loss with a weight, or use
    it alone.

    Args:
        logprobs: [B, T] log pi_theta (with grad).
        old_logprobs: [B, T] log pi_old, the policy that sampled the tokens.
        teacher_logprobs: [B, T] log pi_T of the same tokens given the teacher's context.
        mask: [B, T] 1 on sampled tokens.

    Returns:
        per_token_loss [B, T] (0 where mask == 0, with zero gradient) and detached stats:
        ``reverse_kl`` (mean over masked tokens of k_t) and ``teacher_better_frac`` (the share of
        tokens with A_t > 0).
    """
    _check_same(("logprobs", "old_logprobs", "teacher_logprobs", "mask"), logprobs, old_logprobs,
                teacher_logprobs, mask)  # fmt: skip
    m = mask.bool()
    zero = torch.zeros_like(logprobs)
    log_ratio = torch.where(m, logprobs - old_logprobs.detach(), zero).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    adv = torch.where(m, (teacher_logprobs - old_logprobs).detach(), zero)
    loss = torch.where(m, -torch.exp(log_ratio) * adv, zero)
    count = m.sum().clamp(min=1)
    stats = {
        "reverse_kl": (-adv).sum().detach() / count,
        "teacher_better_frac": ((adv > 0) & m).sum().detach().to(logprobs.dtype) / count,
    }
    return loss, stats
