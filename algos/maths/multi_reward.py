"""Advantages of multi-part rewards: normalise each component within its group, then sum.

When a reward is a sum of parts (correctness, format, length...), GRPO normalises the sum, so the
part with the largest spread decides every advantage and a small part (a 0.1 format bonus) is
drowned, or distinct reward combinations collapse onto one advantage. GDPO (Liu et al. 2026,
"GDPO: Group reward-Decoupled Normalization Policy Optimization for Multi-reward RL
Optimization"; also in NeMo-RL and TRL) normalises each component within the group first.

Shapes: N episodes, C components. ``valid [N]`` as in ``advantages``: False = verifier failed,
left out of every statistic, advantage 0.
"""

from __future__ import annotations

import torch

from veriloop.algos.maths.advantages import group_normalized


def component_normalized(
    components: torch.Tensor,
    group_ids: torch.Tensor,
    *,
    weights: torch.Tensor | None = None,
    batch_normalize: bool = True,
    eps: float = 1e-4,
    valid: torch.Tensor | None = None,
) -> torch.Tensor:
    """GDPO: per-component group normalisation, a weighted sum, then batch normalisation
    (Liu et al. 2026, eqs. 4-6).

        A_ik     = (R_ik - mean_g(R_k)) / (std_g(R_k) + eps)     for each component k, group g of i
        A_i      = sum_k w_k A_ik
        A_hat_i  = (A_i - mean_batch(A)) / (std_batch(A) + eps)   (``batch_normalize``, C >= 2)

    std is the Bessel-corrected sample std (as ``group_normalized``); a component constant within
    a group contributes 0 there (its numerator is 0), so it never divides by a near-zero std into
    a large number. The batch statistics are over the valid episodes.

    With a single component (C = 1) this *is* GRPO, w_1 (R_i - mean_g(R)) / (std_g(R) + eps),
    with no batch whitening, whatever ``batch_normalize`` says: the authors' code applies GDPO only
    with more than one reward and falls back to GRPO otherwise (whitening one GRPO advantage over
    the batch moves it by about 0.5 on a binary reward). eps = 1e-4 is the authors' (both
    normalisations, and their GRPO fallback); ``group_normalized``'s own default is 1e-6.

    Args:
        components: [N, C] reward components of each episode.
        group_ids: [N] group of each episode.
        weights: [C] component weights w_k (default all 1).
        batch_normalize: Whiten the summed advantage over the batch (GDPO's last step; C >= 2).
        valid: [N] bool, False = verifier failed (advantage 0, out of the statistics).

    Returns:
        [N] advantages (0 for invalid episodes).
    """
    if components.dim() != 2 or group_ids.shape != components.shape[:1]:
        raise ValueError(
            f"components must be [N, C] and group_ids [N], got {tuple(components.shape)} and {tuple(group_ids.shape)}"
        )
    c = components.shape[1]
    w = torch.ones(c, dtype=torch.float64) if weights is None else weights.double()
    if w.shape != (c,):
        raise ValueError(f"weights must have one entry per component ({c}), got {tuple(w.shape)}")
    ok = torch.ones(components.shape[0], dtype=torch.bool) if valid is None else valid.bool()
    x = components.double()
    adv = sum(w[k] * group_normalized(x[:, k], group_ids, eps=eps, valid=ok) for k in range(c))
    adv = torch.as_tensor(adv, dtype=torch.float64)
    if batch_normalize and c > 1 and int(ok.sum()) > 1:  # one component: GRPO, as the authors'
        mean = adv[ok].mean()
        std = adv[ok].std()
        adv = (adv - mean) / (std + eps)
    adv = torch.where(ok, adv, torch.zeros_like(adv))
    return adv.to(components.dtype)
