"""Per-token losses and their aggregation, as pure functions over [B, T] tensors.

Per-token terms (policy surrogate, KL, entropy, value) are computed first; ``aggregate`` then
turns a [B, T] map into a scalar, so the choice token-mean vs sequence-mean (DAPO vs GRPO vs
Dr. GRPO) is made in exactly one place (as in verl's ``core_algos.agg_loss``).
"""

from __future__ import annotations

from typing import Literal

import torch

from veriloop.configs.algo import KLEstimator, LossAgg

#: Token log-ratios are clamped to [-MAX_LOG_RATIO, MAX_LOG_RATIO] before exp (verl's 20): a ratio of
#: e^20 = 4.9e8 already means the token is off-policy, and past a log-ratio of 88 float32's exp is
#: inf (GSPO's and SAPO's loss, then their gradient, become inf / NaN). The clamp acts on the value
#: only (``clamp_log_ratio``): inside the range it is the identity, value and gradient; outside it
#: the value is +-MAX_LOG_RATIO and the gradient still 1, so such a token keeps the gradient of a
#: token at the bound (-A e^20 for PPO's unclipped side, DPPO's 2 tau 20 pull-back) instead of none.
MAX_LOG_RATIO = 20.0


def clamp_log_ratio(log_ratio: torch.Tensor, bound: float = MAX_LOG_RATIO) -> torch.Tensor:
    """clip(x, -bound, bound) in value, identity in gradient (a straight-through clamp), [B, T].

    x_c = x where |x| <= bound, else sg(clip(x)) + (x - sg(x)): d x_c / d x = 1 everywhere, so the
    objective's gradient is taken at the clamped ratio (verl clamps the detached weight the same
    way for DPPO) and a token far off-policy is not silently dropped. Inside the range the output
    is ``log_ratio`` itself, bit for bit.
    """
    inside = log_ratio.abs() <= bound
    outside = log_ratio.detach().clamp(-bound, bound) + (log_ratio - log_ratio.detach())
    return torch.where(inside, log_ratio, outside)


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
    log_ratio = clamp_log_ratio(torch.where(m, logprobs - old_logprobs.detach(), torch.zeros_like(logprobs)))
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

    The ``c_2 S[pi_theta](s_t)`` bonus of PPO's combined objective (Schulman et al. 2017, eq. 9).
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
    segments: torch.Tensor | None = None,
    episodes: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reduce a [B, T] per-token loss to a scalar (verl-style aggregation).

    * ``token_mean`` (DAPO): sum_{i,t} l_{i,t} m_{i,t} / sum_{i,t} m_{i,t}; every token weighs 1/#tokens.
    * ``seq_mean_token_mean`` (GRPO): 1/B' sum_i (sum_t l m / sum_t m), B' = sequences with >= 1
      token; a token of sequence i weighs 1 / (B' |o_i|).
    * ``seq_sum_constant`` (Dr. GRPO): 1/B' sum_i sum_t l m / ``constant`` (e.g. max new tokens).

    A sequence is a row, or with ``segments`` [B, T] (``sequence_unit="turn"``: the turn index) one
    (row, segment) pair: two turns of one episode are two sequences, each weighing 1/B' whatever
    its length (``sequence_count`` counts them). With ``episodes`` [B, T] (the episode of each
    token's row: rows split from one episode share it) a sequence is an (episode, segment) pair
    instead, so the samples of a split episode are one sequence: each token of episode i weighs
    1 / (B' |o_i|) with |o_i| all its samples' tokens, i.e. a sample weighs its share |o_i^s| / |o_i|
    of the episode's 1 / B' (``split_weight="episode"``; every row of the episode must be here).

    For gradient accumulation, pass the whole batch's ``total_tokens`` (token_mean) or
    ``total_seqs`` (sequence modes) so that the micro-batch losses sum to the full-batch loss.
    Entries where mask == 0 are selected away (not multiplied by 0), so a NaN or inf there
    (e.g. the entropy of a padding position) neither reaches the loss nor its gradient.

    Args:
        per_token: [B, T] per-token loss; mask: [B, T] 1 on tokens that count.
    """
    _check_same(("per_token", "mask"), per_token, mask)
    if (segments is not None or episodes is not None) and mode != "token_mean":
        return _aggregate_segments(per_token, mask, mode, constant, total_seqs, segments, episodes)
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


def _aggregate_segments(
    per_token: torch.Tensor,
    mask: torch.Tensor,
    mode: LossAgg,
    constant: float | None,
    total_seqs: float | None,
    segments: torch.Tensor | None,
    episodes: torch.Tensor | None = None,
) -> torch.Tensor:
    """``aggregate``'s sequence modes with one sequence per (row or episode, segment)."""
    ids, n = _seq_ids(mask, segments, episodes)
    m = mask.to(per_token.dtype)
    lm = torch.where(mask.bool(), per_token, torch.zeros_like(per_token))
    sums = per_token.new_zeros(n).index_add(0, ids.flatten(), lm.flatten())  # [S]
    lengths = per_token.new_zeros(n).index_add(0, ids.flatten(), m.flatten())  # [S]
    denom = (lengths > 0).sum().clamp(min=1) if total_seqs is None else total_seqs
    if mode == "seq_mean_token_mean":
        return (sums / lengths.clamp(min=1)).sum() / denom
    if mode == "seq_sum_constant":
        if constant is None or constant <= 0:
            raise ValueError(
                f"seq_sum_constant needs a positive constant (e.g. max new tokens), got {constant}"
            )
        return sums.sum() / constant / denom
    raise ValueError(
        f"aggregate mode must be token_mean, seq_mean_token_mean or seq_sum_constant, got {mode!r}"
    )


def sequence_count(
    mask: torch.Tensor, segments: torch.Tensor | None = None, episodes: torch.Tensor | None = None
) -> int:
    """How many sequences hold >= 1 masked token: rows, or (row, segment) pairs, or with
    ``episodes`` (episode, segment) pairs (``aggregate``)."""
    if segments is None and episodes is None:
        return int((mask.sum(1) > 0).sum())
    ids, n = _seq_ids(mask, segments, episodes)
    cnt = torch.zeros(n, dtype=torch.float64, device=mask.device).index_add(
        0, ids.flatten(), mask.double().flatten()
    )
    return int((cnt > 0).sum())


# ------------------------------------------------------------------ objectives since DAPO (2025-26)
# Shared conventions: inputs are [B, T]; ``segments`` [B, T] (long, optional) splits a row into
# several sequences (``algo.sequence_unit="turn"`` passes the turn index); None = one sequence per
# row (the episode's sampled tokens, every turn, environment tokens excluded); ``episodes`` [B, T]
# (long, optional: the episode of each token's row) makes the rows split from one episode one
# sequence (``split_weight="episode"``), so GSPO / GMPO take one ratio per episode. Sequence-level
# objectives put the sequence's loss L_i on every one of its tokens, so ``seq_mean_token_mean``
# aggregation with the same ``segments`` gives (1/G) sum_i L_i, the papers' sample mean (the
# config check refuses a length-weighted aggregation for them).


def _seq_ids(
    mask: torch.Tensor, segments: torch.Tensor | None, episodes: torch.Tensor | None = None
) -> tuple[torch.Tensor, int]:
    """[B, T] id of each token's sequence (row, segment), or (episode, segment) with ``episodes``,
    dense 0..S-1, and S."""
    b, t = mask.shape
    seg = torch.zeros_like(mask, dtype=torch.long) if segments is None else segments.long().clamp(min=0)
    if seg.shape != mask.shape:
        raise ValueError(f"segments {tuple(seg.shape)} must match mask {tuple(mask.shape)}")
    if episodes is not None and episodes.shape != mask.shape:
        raise ValueError(f"episodes {tuple(episodes.shape)} must match mask {tuple(mask.shape)}")
    unit = torch.arange(b, device=mask.device).unsqueeze(1) if episodes is None else episodes.long()
    key = unit * (int(seg.max()) + 1 if seg.numel() else 1) + seg
    _, inv = torch.unique(key, return_inverse=True)
    return inv.view(b, t), int(inv.max()) + 1 if inv.numel() else 0


def sequence_mean(
    x: torch.Tensor,
    mask: torch.Tensor,
    segments: torch.Tensor | None = None,
    episodes: torch.Tensor | None = None,
) -> torch.Tensor:
    """Mean of ``x`` over the masked tokens of each token's sequence, broadcast back to [B, T].

    (1/|y_i|) sum_{t in y_i} x_t for every token of sequence y_i; differentiable; 0 for a sequence
    with no masked token. ``segments`` and ``episodes`` as above (None = one sequence per row).
    """
    _check_same(("x", "mask"), x, mask)
    ids, n = _seq_ids(mask, segments, episodes)
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
    """(bool mask, log-ratio with grad, its value clamped to +-MAX_LOG_RATIO (``clamp_log_ratio``),
    detached advantages), both 0 off the mask (no inf * 0)."""
    _check_same(("logprobs", "old_logprobs", "advantages", "mask"), logprobs, old_logprobs, advantages, mask)
    m = mask.bool()
    log_ratio = clamp_log_ratio(torch.where(m, logprobs - old_logprobs.detach(), torch.zeros_like(logprobs)))
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
    is_weights: torch.Tensor | None = None,
    episodes: torch.Tensor | None = None,
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
    ``episodes`` [B, T]: the rows split from one episode are one sequence y_i (one s_i per episode).
    ``is_weights`` [B, T] (rollout correction, pi_old / mu per token, detached): as verl does, each
    token's term of the token form is multiplied by its own weight, so token t's gradient is
    -A_i s_i w_t / |y_i| grad log pi_t (both levels: the value is unchanged, w_t L_i per token).
    Multiplying the sequence form's loss instead would scale every token of y_i by the *mean* of
    the sequence's weights (w = [2, 0] would give gradients [-0.5, -0.5], not [-1, 0]).

    Returns:
        per_token_loss [B, T] (L_i, or its token form, on every masked token) and stats as
        ``clipped_pg_loss`` (clip fractions count tokens of clipped sequences).
    """
    m, log_ratio, adv = _masked_inputs(logprobs, old_logprobs, advantages, mask)
    seq_log = sequence_mean(log_ratio, mask, segments, episodes)  # [B, T] log s_i on each token of y_i
    if level == "sequence":
        spread = sequence_mean(adv, mask, segments, episodes)
        if bool(((adv - spread).abs() > 1e-5 * (1 + spread.abs()))[m].any()):
            raise ValueError(
                "gspo (sequence level) needs one advantage per sequence, but they vary within a "
                "sequence (per-turn credit?): use policy_loss=gspo_token or sequence_unit=turn"
            )
    elif level != "token":
        raise ValueError(f"gspo level must be 'sequence' or 'token', got {level!r}")
    if level == "sequence" and is_weights is None:
        s = torch.exp(seq_log)
    else:
        s = torch.exp(seq_log.detach() + log_ratio - log_ratio.detach())
    clipped = torch.clamp(s, 1.0 - clip_low, 1.0 + clip_high)
    loss = torch.maximum(-adv * s, -adv * clipped)
    if is_weights is not None:
        loss = loss * is_weights.detach()
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
    is what counts); token-level aggregation as in the paper. The cap is relative, 1 + clip_high
    (MiniMax's eps_high); TRL's CISPO cap is the absolute bound on the weight, so TRL's c ports as
    clip_high = c - 1.

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
    is_weights: torch.Tensor | None = None,
    episodes: torch.Tensor | None = None,
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

    ``episodes`` [B, T]: rows split from one episode are one sequence y_i (one ratio per episode).

    ``is_weights`` [B, T] (rollout correction, detached): the sequence's loss is multiplied by the
    geometric mean of its tokens' weights, W_i = exp((1/|y_i|) sum_t log w_t), as verl does, the
    same kind of mean as the objective's ratio (not their arithmetic mean).

    Returns:
        per_token_loss [B, T] (L_i on every token of y_i) and stats (token clip fractions).
    """
    m, log_ratio, adv = _masked_inputs(logprobs, old_logprobs, advantages, mask)
    a_seq = sequence_mean(adv, mask, segments, episodes)
    if bool(((adv - a_seq).abs() > 1e-5 * (1 + a_seq.abs()))[m].any()):
        raise ValueError("gmpo needs one advantage per sequence: use sequence_unit=turn for per-turn credit")
    sgn = torch.sign(a_seq)
    clipped = torch.clamp(log_ratio, -clip_low, clip_high)
    kept = sgn * torch.minimum(sgn * log_ratio, sgn * clipped)  # [B, T] pessimistic log-ratio
    loss = -a_seq * torch.exp(sequence_mean(kept, mask, segments, episodes))
    if is_weights is not None:
        log_w = torch.where(m, is_weights.detach().clamp(min=1e-30).log(), torch.zeros_like(loss))
        loss = loss * torch.exp(sequence_mean(log_w, mask, segments, episodes))
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


def clip_cov_select(
    advantages: torch.Tensor,
    logprobs: torch.Tensor,
    mask: torch.Tensor,
    *,
    cov_ratio: float,
    cov_lb: float,
    cov_ub: float,
    eligible: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Clip-Cov's token choice (Cui et al. 2025, eq. 13): max(1, floor(``cov_ratio`` x #tokens))
    tokens drawn at random from those with cov_lb < Cov_t < cov_ub (``token_covariance``), among
    ``eligible`` (default: every masked token). Returns [B, T] bool, True on the chosen tokens."""
    m = mask.bool()
    ok = m if eligible is None else m & eligible
    with torch.no_grad():
        cov = token_covariance(advantages, logprobs, mask)
        cand = (ok & (cov > cov_lb) & (cov < cov_ub)).flatten().nonzero().squeeze(1)
        n = max(1, int(cov_ratio * int(m.sum())))
        pick = cand[torch.randperm(cand.numel(), generator=generator)[:n]] if cand.numel() else cand
        chosen = torch.zeros(m.numel(), dtype=torch.bool, device=m.device)
        chosen[pick] = True
    return chosen.view_as(m)


def kl_cov_select(
    advantages: torch.Tensor, logprobs: torch.Tensor, mask: torch.Tensor, *, cov_ratio: float
) -> torch.Tensor:
    """KL-Cov's token choice (Cui et al. 2025, eq. 14): the k = max(1, floor(``cov_ratio`` x
    #tokens)) masked tokens with the largest Cov_t. Returns [B, T] bool."""
    m = mask.bool()
    with torch.no_grad():
        cov = token_covariance(advantages, logprobs, mask).flatten()
        n = min(max(1, int(cov_ratio * int(m.sum()))), int(m.sum()))
        top = torch.zeros(m.numel(), dtype=torch.bool, device=m.device)
        top[torch.topk(cov, n).indices] = True
    return top.view_as(m) & m


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
    select: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clip-Cov (Cui et al. 2025, "The entropy mechanism of RL for reasoning LMs", eq. 13).

    Entropy falls when tokens with a high covariance Cov_t (``token_covariance``) between
    advantage and log-prob are reinforced. Clip-Cov takes the PPO surrogate (``clipped_pg_loss``)
    and detaches (zero loss, zero gradient) max(1, floor(``cov_ratio`` x #tokens)) tokens drawn
    at random from those with cov_lb < Cov_t < cov_ub that PPO has not already clipped
    (``clip_cov_select``). The paper: cov_ratio 2e-4, [cov_lb, cov_ub] = [1, 5], and no PPO clip
    (its recipes set clip low = high = 1).

    ``select`` [B, T] bool: the tokens to detach, chosen beforehand over a larger batch (the
    update chooses once per mini-batch, so micro-batching cannot change the choice: the means of
    Cov_t and the token count are the mini-batch's). None = choose here, over these inputs.

    Returns:
        per_token_loss [B, T] and ``clipped_pg_loss``'s stats plus ``cov_frac`` (share of tokens
        detached).
    """
    loss, stats = clipped_pg_loss(
        logprobs, old_logprobs, advantages, mask, clip_low=clip_low, clip_high=clip_high
    )
    m = mask.bool()
    if select is None:
        with torch.no_grad():
            ratio = torch.exp(torch.where(m, logprobs - old_logprobs, torch.zeros_like(logprobs)))
            adv = torch.where(m, advantages, torch.zeros_like(advantages))
            clipped = ((adv > 0) & (ratio > 1 + clip_high)) | ((adv < 0) & (ratio < 1 - clip_low))
        select = clip_cov_select(
            advantages,
            logprobs,
            mask,
            cov_ratio=cov_ratio,
            cov_lb=cov_lb,
            cov_ub=cov_ub,
            eligible=~clipped,
            generator=generator,
        )
    keep = ~(select.bool() & m)
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
    select: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """KL-Cov (Cui et al. 2025, eq. 14): the unclipped surrogate, plus a KL penalty on the top-k
    tokens by covariance.

    loss_t = -rho_t A_t + 1[t in top-k Cov] * kl_coef |log rho_t|,  k = max(1, floor(cov_ratio x
    #tokens)). No ratio clip: the penalty restrains exactly the tokens that drive entropy down.
    The paper: cov_ratio 2e-3 (7B) / 2e-4 (32B), kl_coef 1. ``select`` [B, T] bool: the top-k
    tokens chosen beforehand (``kl_cov_select`` over the mini-batch, as the update does); None =
    choose here, over these inputs.

    Returns:
        per_token_loss [B, T] and stats (clip fractions 0; ``cov_frac`` = share penalised).
    """
    m, log_ratio, adv = _masked_inputs(logprobs, old_logprobs, advantages, mask)
    loss = -adv * torch.exp(log_ratio)
    top = (
        kl_cov_select(advantages, logprobs, mask, cov_ratio=cov_ratio)
        if select is None
        else select.bool() & m
    )
    loss = torch.where(top, loss + kl_coef * log_ratio.abs(), loss)
    loss = torch.where(m, loss, torch.zeros_like(loss))
    none = torch.zeros_like(m)
    stats = _base_stats(log_ratio.detach(), m, none, none)
    stats["cov_frac"] = _masked_mean(top.float(), m)
    return loss, stats


def dppo_divergence(
    logprobs: torch.Tensor,
    sampler_logprobs: torch.Tensor,
    mask: torch.Tensor,
    divergence: Literal["tv", "kl"],
) -> torch.Tensor:
    """DPPO's per-token divergence on the binary split {y_t, not y_t}, signed by pi - mu (detached,
    float64, 0 off the mask): ``tv`` pi(y_t) - mu(y_t); ``kl`` sign(pi - mu) KL(Bern(mu) || Bern(pi)).
    """
    m = mask.bool()
    with torch.no_grad():
        p = torch.where(m, logprobs.detach().double().exp(), torch.zeros_like(logprobs, dtype=torch.float64))
        q = torch.where(m, sampler_logprobs.detach().double().exp(), torch.zeros_like(p))
        if divergence == "tv":
            return p - q
        pc, qc = p.clamp(1e-12, 1 - 1e-12), q.clamp(1e-12, 1 - 1e-12)
        kl = qc * (qc / pc).log() + (1 - qc) * ((1 - qc) / (1 - pc)).log()
        return torch.sign(p - q) * kl


def _check_dppo(divergence: str, delta_low: float, delta_high: float, tau: float, cap: float | None) -> None:
    if divergence not in ("tv", "kl"):
        raise ValueError(f"dppo divergence must be 'tv' or 'kl', got {divergence!r}")
    if delta_low <= 0 or delta_high <= 0 or tau < 0 or (cap is not None and cap <= 0):
        raise ValueError(
            f"dppo needs delta_low, delta_high > 0, tau >= 0 and ratio_cap > 0 or None, got {delta_low}, "
            f"{delta_high}, {tau}, {cap}"
        )


def dppo_loss(
    logprobs: torch.Tensor,
    sampler_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    divergence: Literal["tv", "kl"],
    delta_low: float,
    delta_high: float,
    tau: float,
    ratio_cap: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """DPPO, divergence proximal policy optimisation (Qi et al. 2026, "Rethinking the trust region
    in LLM reinforcement learning", arXiv 2602.04879; the Binary-TV / Binary-KL variants).

    The ratio is taken against the sampler, r_t = pi_theta(y_t) / mu(y_t) (mu: the log-probs the
    sampler recorded), and PPO's ratio clip is replaced by a trust region on the divergence between
    the two distributions at that state, approximated on the binary split {y_t, not y_t}:

        TV: D_t = pi_theta(y_t) - mu(y_t)
        KL: D_t = KL(Bern(mu(y_t)) || Bern(pi_theta(y_t)))
              = mu log(mu / pi) + (1 - mu) log((1 - mu) / (1 - pi)), signed by pi - mu
        M_t = 0 if (A_t > 0 and D_t > delta_high) or (A_t < 0 and D_t < -delta_low), else 1
        L = -sum_t M_t r_t A_t + tau sum_t (log r_t)^2

    A token's policy gradient is dropped only when it has already moved too far *in the direction
    its advantage pushes* (as PPO's clip: a token pushed back towards mu keeps its gradient), and
    the small squared log-ratio penalty (prime-rl's default tau = 1e-3, after Kimi K2.5) pulls
    every token back towards mu: d L_t / d log pi_t = -M_t A_t r_t + 2 tau log r_t. The mask is
    detached (a 0/1 choice, no gradient through D_t). Log-ratios are clamped to +-MAX_LOG_RATIO in
    value only (``clamp_log_ratio``): a kept token past it keeps -A e^20 and 2 tau (+-20).
    ``ratio_cap`` = c (None = off, as prime-rl): the weight is min(r_t, c), detached above c (verl's
    ``dppo_tv``, c = 20, the paper's section 5.4): d L_t / d log pi_t = -M_t A_t min(r_t, c) + 2 tau
    log r_t; the penalty is not capped. (A rare token inside the TV region, mu = 0.001, pi = 0.05,
    has r = 50.) mu must be the distribution sampled from *and* the trainer's (no top-p / top-k).

    Args:
        logprobs: [B, T] log pi_theta (with grad); sampler_logprobs: [B, T] log mu (recorded);
        advantages: [B, T]; mask: [B, T]; divergence: ``tv`` or ``kl``; delta_low / delta_high:
        the bounds for A < 0 / A > 0 (prime-rl: TV 0.2 / 0.2); tau: the penalty weight;
        ratio_cap: the cap c on the weight (verl 20), or None.

    Returns:
        per_token_loss [B, T] (0 off the mask) and stats: ``clip_frac_low`` / ``clip_frac_high``
        (shares of masked tokens dropped with A < 0 / A > 0), ``approx_kl`` = mean of r - 1 - log r
        (a k3 estimate of KL(mu || pi_theta): the tokens are drawn from mu).
    """
    _check_dppo(divergence, delta_low, delta_high, tau, ratio_cap)
    m, log_ratio, adv = _masked_inputs(logprobs, sampler_logprobs, advantages, mask)
    d = dppo_divergence(logprobs, sampler_logprobs, m, divergence)
    high = m & (adv > 0) & (d > delta_high)
    low = m & (adv < 0) & (d < -delta_low)
    keep = ~(high | low)
    ratio = torch.exp(log_ratio)
    if ratio_cap is not None:  # value min(r, c); gradient min(r, c) d log pi (the factor is 1 below c)
        r = ratio.detach()
        ratio = ratio * (r.clamp(max=ratio_cap) / r)
    pg = torch.where(keep, -adv * ratio, torch.zeros_like(ratio))
    loss = torch.where(m, pg + tau * log_ratio * log_ratio, torch.zeros_like(ratio))
    return loss, _base_stats(log_ratio.detach(), m, low, high)
