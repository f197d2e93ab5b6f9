"""Per-token losses and their aggregation, as pure functions over [B, T] tensors.

Per-token terms (policy surrogate, KL, entropy, value) are computed first; ``aggregate`` then
turns a [B, T] map into a scalar, so the choice token-mean vs sequence-mean (DAPO vs GRPO vs
Dr. GRPO) is made in exactly one place (as in verl's ``core_algos.agg_loss``).
"""

from __future__ import annotations

from typing import Literal

import torch

from veriloop.configs.algo import KLEstimator, LossAgg


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


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: KLEstimator = "k3") -> torch.Tensor:
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
    mode: LossAgg = "token_mean",
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


# ------------------------------------------------------------------ objectives since DAPO (2025-26)
# Shared conventions: inputs are [B, T]; ``segments`` [B, T] (long, optional) splits a row into
# several sequences (``algo.sequence_unit="turn"`` passes the turn index); None = one sequence per
# row (the episode's sampled tokens, every turn, environment tokens excluded). Sequence-level
# objectives put the sequence's loss L_i on every one of its tokens, so ``seq_mean_token_mean``
# aggregation gives (1/G) sum_i L_i, the papers' sample mean.


def _seq_ids(mask: torch.Tensor, segments: torch.Tensor | None) -> tuple[torch.Tensor, int]:
    """[B, T] id of each token's sequence (row, segment), dense 0..S-1, and S."""
    b, t = mask.shape
    seg = torch.zeros_like(mask, dtype=torch.long) if segments is None else segments.long().clamp(min=0)
    if seg.shape != mask.shape:
        raise ValueError(f"segments {tuple(seg.shape)} must match mask {tuple(mask.shape)}")
    key = torch.arange(b, device=mask.device).unsqueeze(1) * (int(seg.max()) + 1 if seg.numel() else 1) + seg
    _, inv = torch.unique(key, return_inverse=True)
    return inv.view(b, t), int(inv.max()) + 1 if inv.numel() else 0


def sequence_mean(x: torch.Tensor, mask: torch.Tensor, segments: torch.Tensor | None = None) -> torch.Tensor:
    """Mean of ``x`` over the masked tokens of each token's sequence, broadcast back to [B, T].

    (1/|y_i|) sum_{t in y_i} x_t for every token of sequence y_i; differentiable; 0 for a sequence
    with no masked token. ``segments`` as above (None = one sequence per row).
    """
    _check_same(("x", "mask"), x, mask)
    ids, n = _seq_ids(mask, segments)
    m = mask.to(x.dtype)
    xm = torch.where(mask.bool(), x, torch.zeros_like(x))
    sums = torch.zeros(n, dtype=x.dtype, device=x.device).index_add(0, ids.flatten(), xm.flatten())
    cnt = torch.zeros(n, dtype=x.dtype, device=x.device).index_add(0, ids.flatten(), m.flatten())
    return (sums / cnt.clamp(min=1))[ids]


def _base_stats(log_ratio: torch.Tensor, m: torch.Tensor, low: torch.Tensor, high: torch.Tensor) -> dict:
    with torch.no_grad():
        r = log_ratio.exp()
        return {
            "clip_frac_low": _masked_mean(low.float(), m),
            "clip_frac_high": _masked_mean(high.float(), m),
            "approx_kl": _masked_mean((r - 1.0) - log_ratio, m),
        }


def _masked_inputs(logprobs, old_logprobs, advantages, mask):  # type: ignore[no-untyped-def]
    """(bool mask, log-ratio with grad, detached advantages), both 0 off the mask (no inf * 0)."""
    _check_same(("logprobs", "old_logprobs", "advantages", "mask"), logprobs, old_logprobs, advantages, mask)
    m = mask.bool()
    log_ratio = torch.where(m, logprobs - old_logprobs.detach(), torch.zeros_like(logprobs))
    adv = torch.where(m, advantages.detach(), torch.zeros_like(advantages))
    return m, log_ratio, adv


def gspo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float,
    clip_high: float,
    level: Literal["sequence", "token"] = "sequence",
    segments: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GSPO, group sequence policy optimisation (Zheng et al. 2025, Qwen; eqs. 5-7 and 10-11).

    s_i = (pi_theta(y_i) / pi_old(y_i))^(1/|y_i|) = exp((1/|y_i|) sum_t log rho_{i,t}),
    L_i = -min(s_i A_i, clip(s_i, 1 - clip_low, 1 + clip_high) A_i): one ratio, one clip decision
    per sequence. The paper's bounds are narrow (3e-4 / 4e-4): s_i is a geometric mean.

    ``level="sequence"``: A_i is one number per sequence (the advantages must be constant over
    each sequence's tokens, else ValueError: use ``level="token"`` or per-turn sequences).
    ``level="token"`` (GSPO-token, eq. 13): s_{i,t} = sg(s_i) rho_t / sg(rho_t), whose value is s_i
    but whose gradient reaches token t only through rho_t, so A_{i,t} may differ per token (turn-
    level credit); with a constant A_i it gives exactly GSPO's gradient under seq-mean aggregation.

    Returns:
        per_token_loss [B, T] (L_i, or its token form, on every masked token) and stats as
        ``clipped_pg_loss`` (clip fractions count tokens of clipped sequences).
    """
    m, log_ratio, adv = _masked_inputs(logprobs, old_logprobs, advantages, mask)
    seq_log = sequence_mean(log_ratio, mask, segments)  # [B, T] log s_i on each token of y_i
    if level == "sequence":
        spread = sequence_mean(adv, mask, segments)
        if bool(((adv - spread).abs() > 1e-5 * (1 + spread.abs()))[m].any()):
            raise ValueError(
                "gspo (sequence level) needs one advantage per sequence, but they vary within a "
                "sequence (per-turn credit?): use policy_loss=gspo_token or sequence_unit=turn"
            )
        s = torch.exp(seq_log)
    elif level == "token":
        s = torch.exp(seq_log.detach() + log_ratio - log_ratio.detach())
    else:
        raise ValueError(f"gspo level must be 'sequence' or 'token', got {level!r}")
    clipped = torch.clamp(s, 1.0 - clip_low, 1.0 + clip_high)
    loss = torch.maximum(-adv * s, -adv * clipped)
    loss = torch.where(m, loss, torch.zeros_like(loss))
    sd = s.detach()
    stats = _base_stats(
        log_ratio.detach(), m, (adv < 0) & (sd < 1.0 - clip_low), (adv > 0) & (sd > 1.0 + clip_high)
    )
    return loss, stats


def cispo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float,
    clip_high: float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """CISPO, clipped IS-weight policy optimisation (MiniMax-M1, MiniMax 2025, eq. 4).

    loss_t = -sg(clip(rho_t, 1 - clip_low, 1 + clip_high)) A_t log pi_theta(y_t).
    The importance weight is clipped and detached instead of the update: every token keeps the
    REINFORCE gradient -w_t A_t grad log pi, w_t in the clip range; none is dropped (PPO gives a
    token beyond the clip zero gradient). The paper sets no lower bound (``clip_low`` = 1 makes
    the lower end 0) and tunes only ``clip_high``. The loss *value* is a surrogate (its gradient
    is what counts); token-level aggregation as in the paper.

    Returns:
        per_token_loss [B, T] and stats; ``clip_frac_low/high`` = share of tokens whose weight was
        truncated (low: rho < 1 - clip_low; high: rho > 1 + clip_high), whatever the sign of A.
    """
    m, log_ratio, adv = _masked_inputs(logprobs, old_logprobs, advantages, mask)
    ratio = log_ratio.detach().exp()
    weight = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    lp = torch.where(m, logprobs, torch.zeros_like(logprobs))
    loss = torch.where(m, -weight * adv * lp, torch.zeros_like(lp))
    stats = _base_stats(log_ratio.detach(), m, ratio < 1.0 - clip_low, ratio > 1.0 + clip_high)
    return loss, stats


def sapo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    tau_pos: float,
    tau_neg: float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """SAPO, soft adaptive policy optimisation (Gao et al. 2025, Qwen): a smooth gate, no hard clip.

    loss_t = -f(rho_t; tau) A_t,  f(x; tau) = sigmoid(tau (x - 1)) * 4 / tau,
    tau = ``tau_pos`` if A_t > 0 else ``tau_neg`` (the paper: tau_neg > tau_pos, negative updates
    are damped faster; 1.0 and 1.05). d loss / d log pi = -A rho 4 sigma(1 - sigma): equal to the
    plain policy gradient -A at rho = 1 and decaying smoothly (never exactly 0) as rho leaves 1,
    so off-policy tokens are down-weighted instead of cut.

    Returns:
        per_token_loss [B, T] (the value carries the constant 2/tau at rho = 1) and stats;
        clip fractions report the tokens whose gate slope fell below half of its peak
        (|tau (rho - 1)| > 1.76), the soft analogue of "clipped".
    """
    if tau_pos <= 0 or tau_neg <= 0:
        raise ValueError(f"sapo temperatures must be > 0, got tau_pos={tau_pos}, tau_neg={tau_neg}")
    m, log_ratio, adv = _masked_inputs(logprobs, old_logprobs, advantages, mask)
    ratio = torch.exp(log_ratio)
    tau = torch.where(adv > 0, torch.full_like(adv, tau_pos), torch.full_like(adv, tau_neg))
    gate = torch.sigmoid(tau * (ratio - 1.0)) * 4.0 / tau
    loss = torch.where(m, -gate * adv, torch.zeros_like(gate))
    with torch.no_grad():
        far = (tau * (ratio - 1.0)).abs() > 1.7627  # 4 sigma (1 - sigma) < 1/2
        rd = ratio.detach()
    stats = _base_stats(log_ratio.detach(), m, far & (rd < 1.0), far & (rd > 1.0))
    return loss, stats


def gmpo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float,
    clip_high: float,
    segments: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GMPO, geometric-mean policy optimisation (Zhao et al. 2025, eq. 4): clip in log space.

    With sigma = sign(A_i) and l_t = log rho_t,
    L_i = -A_i exp( (1/|y_i|) sum_t sigma min(sigma l_t, sigma clip(l_t, -clip_low, clip_high)) ),
    i.e. the geometric mean of the token ratios, each clipped to [e^-clip_low, e^clip_high] only
    in the direction that would enlarge the update (PPO's pessimism, per token, in log space).
    The geometric mean is far less sensitive to one outlier ratio than GRPO's arithmetic mean,
    so the paper widens the range to e^{+-0.4}. With all token ratios equal to r it is PPO's
    clipped surrogate on r with bounds [e^-clip_low, e^clip_high]. The advantage must be one
    number per sequence (as GSPO's sequence level).

    Returns:
        per_token_loss [B, T] (L_i on every token of y_i) and stats (token clip fractions).
    """
    m, log_ratio, adv = _masked_inputs(logprobs, old_logprobs, advantages, mask)
    a_seq = sequence_mean(adv, mask, segments)
    if bool(((adv - a_seq).abs() > 1e-5 * (1 + a_seq.abs()))[m].any()):
        raise ValueError("gmpo needs one advantage per sequence: use sequence_unit=turn for per-turn credit")
    sgn = torch.sign(a_seq)
    clipped = torch.clamp(log_ratio, -clip_low, clip_high)
    kept = sgn * torch.minimum(sgn * log_ratio, sgn * clipped)  # [B, T] pessimistic log-ratio
    loss = -a_seq * torch.exp(sequence_mean(kept, mask, segments))
    loss = torch.where(m, loss, torch.zeros_like(loss))
    lr = log_ratio.detach()
    stats = _base_stats(lr, m, (a_seq < 0) & (lr < -clip_low), (a_seq > 0) & (lr > clip_high))
    return loss, stats


def token_covariance(advantages: torch.Tensor, logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Cov_t = (A_t - mean A)(log pi_t - mean log pi), means over the masked tokens (Cui et al.
    2025, eq. 11; detached), [B, T], -inf off the mask (never selected)."""
    _check_same(("advantages", "logprobs", "mask"), advantages, logprobs, mask)
    m = mask.bool()
    a, lp = advantages.detach(), logprobs.detach()
    cov = (a - _masked_mean(a, m)) * (lp - _masked_mean(lp, m))
    return torch.where(m, cov, torch.full_like(cov, float("-inf")))


def clip_cov_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float,
    clip_high: float,
    cov_ratio: float,
    cov_lb: float,
    cov_ub: float,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clip-Cov (Cui et al. 2025, "The entropy mechanism of RL for reasoning LMs", eq. 13).

    Entropy falls when tokens with a high covariance Cov_t (``token_covariance``) between
    advantage and log-prob are reinforced. Clip-Cov takes the PPO surrogate (``clipped_pg_loss``)
    and detaches (zero loss, zero gradient) max(1, floor(``cov_ratio`` x #tokens)) tokens drawn
    at random from those with cov_lb < Cov_t < cov_ub that PPO has not already clipped.
    The paper: cov_ratio 2e-4, [cov_lb, cov_ub] = [1, 5]. Computed per (micro-)batch.

    Returns:
        per_token_loss [B, T] and ``clipped_pg_loss``'s stats plus ``cov_frac`` (share of tokens
        detached).
    """
    loss, stats = clipped_pg_loss(
        logprobs, old_logprobs, advantages, mask, clip_low=clip_low, clip_high=clip_high
    )
    m = mask.bool()
    with torch.no_grad():
        cov = token_covariance(advantages, logprobs, mask)
        ratio = torch.exp(torch.where(m, logprobs - old_logprobs, torch.zeros_like(logprobs)))
        adv = torch.where(m, advantages, torch.zeros_like(advantages))
        clipped = ((adv > 0) & (ratio > 1 + clip_high)) | ((adv < 0) & (ratio < 1 - clip_low))
        cand = (m & ~clipped & (cov > cov_lb) & (cov < cov_ub)).flatten().nonzero().squeeze(1)
        n = max(1, int(cov_ratio * int(m.sum())))
        pick = cand[torch.randperm(cand.numel(), generator=generator)[:n]] if cand.numel() else cand
        keep = torch.ones(m.numel(), dtype=torch.bool, device=m.device)
        keep[pick] = False
        keep = keep.view_as(m)
    loss = torch.where(keep, loss, torch.zeros_like(loss))
    stats["cov_frac"] = _masked_mean((~keep).float(), m)
    return loss, stats


def kl_cov_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    cov_ratio: float,
    kl_coef: float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """KL-Cov (Cui et al. 2025, eq. 14): the unclipped surrogate, plus a KL penalty on the top-k
    tokens by covariance.

    loss_t = -rho_t A_t + 1[t in top-k Cov] * kl_coef |log rho_t|,  k = max(1, floor(cov_ratio x
    #tokens)). No ratio clip: the penalty restrains exactly the tokens that drive entropy down.
    The paper: cov_ratio 2e-3 (7B) / 2e-4 (32B), kl_coef 1. Computed per (micro-)batch.

    Returns:
        per_token_loss [B, T] and stats (clip fractions 0; ``cov_frac`` = share penalised).
    """
    m, log_ratio, adv = _masked_inputs(logprobs, old_logprobs, advantages, mask)
    loss = -adv * torch.exp(log_ratio)
    with torch.no_grad():
        cov = token_covariance(advantages, logprobs, mask).flatten()
        n = min(max(1, int(cov_ratio * int(m.sum()))), int(m.sum()))
        top = torch.zeros(m.numel(), dtype=torch.bool, device=m.device)
        top[torch.topk(cov, n).indices] = True
        top = top.view_as(m) & m
    loss = torch.where(top, loss + kl_coef * log_ratio.abs(), loss)
    loss = torch.where(m, loss, torch.zeros_like(loss))
    none = torch.zeros_like(m)
    stats = _base_stats(log_ratio.detach(), m, none, none)
    stats["cov_frac"] = _masked_mean(top.float(), m)
    return loss, stats
