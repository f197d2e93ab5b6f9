"""Reward shaping and sample filtering: DAPO's overlong handling, the R1 format reward, the
KL-in-reward penalty and class-balanced judgement rewards."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from veriloop.algos.maths.losses import kl_penalty
from veriloop.configs.algo import KLEstimator
from veriloop.envs.verifiers import r1_format_ok


def overlong_penalty(lengths: torch.Tensor, *, max_len: int, cache_len: int) -> torch.Tensor:
    """DAPO soft overlong punishment (Yu et al. 2025, eq. 13), added to the task reward.

    R_length(y) = 0                                   if |y| <= L_max - L_cache
                = ((L_max - L_cache) - |y|) / L_cache  if L_max - L_cache < |y| <= L_max
                = -1                                  if |y| > L_max

    Args:
        lengths: [N] generated lengths |y| (tokens). max_len: L_max; cache_len: L_cache.

    Returns:
        [N] float penalties in [-1, 0].
    """
    if lengths.dim() != 1:
        raise ValueError(f"lengths must be [N], got {tuple(lengths.shape)}")
    if not 0 < cache_len < max_len:
        raise ValueError(f"need 0 < cache_len < max_len, got cache_len={cache_len}, max_len={max_len}")
    y = lengths.to(torch.float64)
    start = float(max_len - cache_len)
    ramp = (start - y) / cache_len
    out = torch.where(y <= start, torch.zeros_like(y), ramp)
    out = torch.where(y > max_len, torch.full_like(y, -1.0), out)
    return out.to(torch.float32)


def overlong_filter_mask(hit_token_limit: torch.Tensor) -> torch.Tensor:
    """DAPO overlong filtering: keep-mask [N] (1.0 keep, 0.0 drop) for samples that were cut at the
    generation limit, whose loss is masked out so a truncation is not punished as a wrong answer."""
    if hit_token_limit.dim() != 1:
        raise ValueError(f"hit_token_limit must be [N], got {tuple(hit_token_limit.shape)}")
    return (~hit_token_limit.bool()).to(torch.float32)


def format_reward(
    texts: Sequence[str], *, bonus: float, check: Callable[[str], bool] = r1_format_ok
) -> torch.Tensor:
    """DeepSeek-R1-Zero's format reward (DeepSeek-AI 2025): ``bonus`` for a response shaped
    ``<think>...</think><answer>...</answer>`` (``check``, by default the same rule that
    ``MathVerify-v0``'s ``reward="r1"`` scheme uses), else 0.

    For environments that do not score format themselves; MathVerify with ``reward="r1"`` already
    adds it, so turning both on would count it twice.

    Args:
        texts: N responses (one per turn). Returns: [N] float rewards in {0, bonus}.
    """
    return torch.tensor([bonus if check(t) else 0.0 for t in texts], dtype=torch.float32)


def class_balanced_rewards(rewards: torch.Tensor, classes: torch.Tensor) -> torch.Tensor:
    """Judgement rewards weighted so that every class of truth counts equally (balanced accuracy).

    A judge rewarded +1 for a verdict that matches the truth and -1 otherwise earns its plain
    accuracy, which a constant verdict can win when one class is rare: with 75% of solves wrong,
    "always incorrect" earns 0.75. Each classed reward is weighted by the inverse share of its class
    among the batch's classed rewards:

        r'_i = r_i * n / (m * n_{c(i)})

    where n is the number of classed rewards, n_c the number in class c and m the number of classes
    present. Then mean_i r'_i = (1/m) sum_c mean_{i in c} r_i: with +-1 rewards, 2 * balanced
    accuracy - 1, which is 0 (chance) for any constant verdict, whatever the class shares. With a
    single class present the weights are 1. Rewards of no class (class -1) are left as they are.

    Args:
        rewards: [...] rewards. classes: [...] int class index per reward, -1 = no class (not a
            judgement, a padding position, an episode left out).

    Returns:
        The weighted rewards, float64, shaped like ``rewards``.
    """
    if rewards.shape != classes.shape:
        raise ValueError(f"rewards {tuple(rewards.shape)} and classes {tuple(classes.shape)} differ in shape")
    out = rewards.to(torch.float64).clone()
    cls = classes.long()
    present = [c for c in torch.unique(cls).tolist() if c >= 0]
    if len(present) < 2:
        return out
    n = float((cls >= 0).sum())
    for c in present:
        hit = cls == c
        out[hit] = out[hit] * n / (len(present) * float(hit.sum()))
    return out


def kl_reward_penalty(
    token_rewards: torch.Tensor,
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    mask: torch.Tensor,
    *,
    coef: float,
    kind: KLEstimator = "k1",
) -> torch.Tensor:
    """KL-in-reward (kl_mode="reward"; InstructGPT-style PPO, REINFORCE++):
    r'_t = r_t - coef * KL_t on sampled tokens, KL_t from ``kl_penalty`` with the rollout policy's
    log-probs (no gradient flows through a reward).

    Args:
        token_rewards, logprobs, ref_logprobs, mask: [B, T]. Returns: [B, T].
    """
    if not (token_rewards.shape == logprobs.shape == ref_logprobs.shape == mask.shape):
        raise ValueError(
            "token_rewards, logprobs, ref_logprobs and mask must share [B, T], got "
            f"{tuple(token_rewards.shape)}, {tuple(logprobs.shape)}, {tuple(ref_logprobs.shape)}, {tuple(mask.shape)}"
        )
    kl = kl_penalty(logprobs.detach(), ref_logprobs, kind).to(token_rewards.dtype)
    return token_rewards - coef * kl * mask.to(token_rewards.dtype)
