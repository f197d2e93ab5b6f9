"""The update: the loss of a (micro-)batch and optimizer steps on a prepared rollout batch's mini-batches.

What to compute was picked once, by ``algorithm.resolve(cfg)`` (the estimator, the policy
objective and the aggregation, in a frozen :class:`~veriloop.algos.learner.algorithm.Algorithm`); the
functions here take that record only and call its parts: nothing is looked up or validated again
per batch, mini-batch or micro-batch.

Flow per rollout batch (the training loop calls these in order)::

    algo = resolve(cfg)                                      # once per run
    batch, m = prepare_batch(trajectories, algo, critic=critic, ref_model_ctx=policy.reference, ...)
    for epoch in range(cfg.epochs):
        for mb in minibatches(batch, size):
            metrics = update_step(model, optimizer, mb, algo, UpdateSettings.from_config(cfg))

``prepare_batch`` (``veriloop.algos.learner.prepare``) collates the batch once and attaches the
reference log-probs, the critic's values, the advantages (``compute_advantages``, in
``veriloop.algos.learner.credit``) and the rollout correction; ``update_step`` (here) runs the
policy objective, the KL, entropy and value terms and one optimizer step per mini-batch.

Every metric name is the same for every algorithm (zeros where a part is off).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from typing import Any

import torch

from veriloop.agents.forward import first_loss_position, token_logprobs, usable_shared_prefix
from veriloop.algos.learner.algorithm import Algorithm, ObjectiveExtras
from veriloop.algos.learner.batch import TokenBatch, minibatches
from veriloop.algos.learner.critic import ValueModel
from veriloop.algos.learner.prepare import reference_logprobs
from veriloop.algos.learner.step_settings import NO_SYNC, RankSync, UpdateSettings, loss_normalisers
from veriloop.algos.maths.distill import reverse_kl_distill_loss
from veriloop.algos.maths.losses import aggregate, entropy_bonus, kl_penalty, value_loss
from veriloop.algos.maths.mismatch import MismatchStats, mismatch_stats
from veriloop.algos.run.fsdp import is_sharded
from veriloop.configs.algo import AlgoConfig

METRIC_NAMES = (
    "loss/policy",
    "loss/kl",
    "loss/entropy",
    "loss/value",
    "clip_frac_low",
    "clip_frac_high",
    "approx_kl",
    "entropy",
    "mean_token_prob",
    "grad_norm",
)
_SUMMED = ("loss/policy", "loss/kl", "loss/entropy", "loss/value")  # already globally normalised


def policy_loss(
    model: Any,
    batch: TokenBatch,
    algo: Algorithm,
    *,
    ref_model_ctx: Callable[[], Any] | None = None,
    critic: ValueModel | None = None,
    agg_constant: float | None = None,
    total_tokens: float | None = None,
    total_seqs: float | None = None,
    temperature: float = 1.0,
    mismatch: list[MismatchStats] | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Loss of one (micro-)batch: aggregate(w * policy objective + kl_coef KL - entropy_coef H)
    + vf_coef V-loss.

    The policy objective is ``cfg.policy_loss`` (``POLICY_LOSSES``: PPO clip, GSPO, CISPO, SAPO,
    GMPO, Clip-Cov, KL-Cov, DPPO), which applies the rollout-correction weights w =
    ``batch.is_weights`` itself (``ObjectiveExtras``). With ``sequence_unit="turn"`` the sequence
    modes of the aggregation average per (episode, turn) (``aggregate``'s ``segments``).
    The KL term is in the loss only for ``kl_mode="loss"`` (GRPO); its reference log-probs come
    from ``batch.ref_logprobs`` or are computed under ``ref_model_ctx()``. The value loss is always
    token-mean. ``agg_constant`` (max new tokens) is used for ``seq_sum_constant`` when
    ``cfg.loss_agg_constant`` is None; ``total_tokens``/``total_seqs`` are the full batch's counts
    when this is one micro-batch of several (see ``aggregate``), also across data-parallel ranks.

    ``temperature`` must be the rollout's sampling temperature: ``batch.old_logprobs`` are
    log-probs of softmax(logits / T) (``veriloop.agents.sampling_params``), so the new log-probs
    of the ratio r_t = pi_theta / pi_old must be taken at the same T, or r_t != 1 before any update
    and the clip fires on a policy that has not moved. (Top-k / top-p filtering cannot be
    reproduced by this forward pass: with it on, take the old log-probs from the model itself,
    ``prepare_batch(..., recompute_old_logprobs=True)``, as the training loop does.)

    Returns:
        scalar loss (with grad) and ``METRIC_NAMES`` metrics (but grad_norm), + ``cov_frac`` (Clip-/KL-Cov).
    """
    mask = batch.loss_mask  # [B, T]
    first = first_loss_position(mask)
    # a group's rows share their prompt: run it once (same numbers, less compute; sharded: packed only)
    prefix = usable_shared_prefix(batch.input_ids, batch.attention_mask, first)
    logp, ent = token_logprobs(
        model,
        batch.input_ids,
        batch.attention_mask,
        with_entropy=True,
        temperature=temperature,
        first_position=first,
        shared_prefix=prefix,
        packed_only=is_sharded(model),
        **batch.extras,
    )
    assert ent is not None  # [B, T] like logp
    if mismatch is not None:  # sampler (mu) vs this forward pass, before any update (the caller's choice)
        mismatch.append(_mismatch(batch, logp))
    segments, agg = _aggregation(batch, algo, agg_constant, total_tokens, total_seqs)
    extras = ObjectiveExtras(batch.is_weights, batch.sampler_logprobs, batch.cov_select, batch.episode_index)
    pg, stats = algo.objective(logp, batch.old_logprobs, batch.advantages, mask, segments, extras)  # [B, T]
    loss_pg, stats = _with_distillation(pg, stats, logp, batch, algo, agg)
    zero = loss_pg.new_zeros(())
    loss_kl = (
        _kl_loss(model, batch, algo, logp, agg, ref_model_ctx, temperature) if algo.kl_loss_coef else zero
    )
    loss_ent = agg(entropy_bonus(ent, coef=algo.cfg.entropy_coef)) if algo.cfg.entropy_coef > 0 else zero
    loss_v = _value_loss(batch, algo.cfg, critic, total_tokens) if critic is not None else zero
    loss = loss_pg + loss_kl + loss_ent + loss_v
    return loss, _loss_metrics(loss_pg, loss_kl, loss_ent, loss_v, stats, logp, ent, mask)


def _aggregation(
    batch: TokenBatch,
    algo: Algorithm,
    constant: float | None,
    total_tokens: float | None,
    total_seqs: float | None,
) -> tuple[torch.Tensor | None, Callable[[torch.Tensor], torch.Tensor]]:
    """The sequences (turn segments or None) and ``algo.aggregation`` bound to this batch's mask,
    constant, normalisers, segments and episodes (the rows split from one episode are one)."""
    segments = batch.turn_index if algo.per_turn_segments else None
    agg = partial(
        algo.aggregation,
        mask=batch.loss_mask,
        constant=algo.cfg.loss_agg_constant or constant,
        total_tokens=total_tokens,
        total_seqs=total_seqs,
        segments=segments,
        episodes=batch.episode_index,
    )
    return segments, agg


def _with_distillation(
    pg: torch.Tensor, stats: dict[str, Any], logp: torch.Tensor, batch: TokenBatch, algo: Algorithm, agg: Any
) -> tuple[torch.Tensor, dict[str, Any]]:
    """The aggregated policy term: ``rl_coef`` x the RL objective + ``distill_coef`` x the per-token
    reverse KL to the teacher (``maths.distill``, on ``batch.teacher_logprobs``; its advantage is
    log pi_T - log pi_theta of this forward pass, its weight pi_theta / mu, with the trust region
    ``distill_trust_low`` / ``distill_tau`` and the cap ``distill_ratio_cap``); without distillation,
    the RL objective alone."""
    c = algo.cfg
    if c.distill_coef == 0:
        return agg(pg), stats
    if batch.teacher_logprobs is None:
        raise ValueError(
            "algo.distill_coef > 0 needs the teacher's log-probs: attach them with batch.with_teacher"
        )
    # mu: the sampler's record (kept beside a recomputed pi_old), else what old_logprobs hold
    mu = batch.sampler_logprobs if batch.sampler_logprobs is not None else batch.old_logprobs
    kd, kd_stats = reverse_kl_distill_loss(
        logp,
        mu,
        batch.teacher_logprobs,
        batch.loss_mask,
        trust_low=c.distill_trust_low,
        tau=c.distill_tau,
        ratio_cap=c.distill_ratio_cap,
    )
    return c.rl_coef * agg(pg) + c.distill_coef * agg(kd), {**stats, **kd_stats}


def _mismatch(batch: TokenBatch, logp: torch.Tensor) -> MismatchStats:
    """``mismatch_stats`` of the sampler's log-probs (mu, else pi_old) against this forward pass."""
    mu = batch.sampler_logprobs if batch.sampler_logprobs is not None else batch.old_logprobs
    return mismatch_stats(logp.detach(), mu, batch.loss_mask)


def _kl_loss(
    model: Any,
    batch: TokenBatch,
    algo: Algorithm,
    logp: torch.Tensor,
    agg: Callable[[torch.Tensor], torch.Tensor],
    ref_model_ctx: Callable[[], Any] | None,
    temperature: float,
) -> torch.Tensor:
    """kl_coef * aggregate(KL(pi_theta || pi_ref)) per token (``kl_mode="loss"``, GRPO)."""
    mask = batch.loss_mask
    ref = (
        batch.ref_logprobs
        if batch.ref_logprobs is not None
        else reference_logprobs(model, batch, ref_model_ctx, temperature)
    )
    ref = torch.where(mask.bool(), ref, logp.detach())  # d = 0 off the mask: no inf * 0 = nan
    return algo.kl_loss_coef * agg(kl_penalty(logp, ref, algo.cfg.kl_estimator))


def _value_loss(
    batch: TokenBatch, cfg: AlgoConfig, critic: ValueModel, total_tokens: float | None
) -> torch.Tensor:
    """vf_coef * token-mean clipped value loss against the GAE returns (whatever ``loss_agg`` is)."""
    if batch.returns is None or batch.old_values is None:
        raise ValueError("a critic needs batch.returns and batch.old_values (use prepare_batch)")
    v = critic(batch.input_ids, batch.attention_mask, **batch.extras)  # [B, T]
    vl = value_loss(v, batch.old_values, batch.returns, batch.loss_mask, clip=cfg.value_clip)
    return cfg.vf_coef * aggregate(vl, batch.loss_mask, "token_mean", total_tokens=total_tokens)


def _loss_metrics(
    loss_pg: torch.Tensor,
    loss_kl: torch.Tensor,
    loss_ent: torch.Tensor,
    loss_v: torch.Tensor,
    stats: dict[str, torch.Tensor],
    logp: torch.Tensor,
    ent: torch.Tensor,
    mask: torch.Tensor,
) -> dict[str, float]:
    """``METRIC_NAMES`` (but grad_norm) of one micro-batch; entropy and token prob are token means."""
    m = mask.bool()
    n = m.sum().clamp(min=1)
    metrics = {
        "loss/policy": float(loss_pg.detach()),
        "loss/kl": float(loss_kl.detach()),
        "loss/entropy": float(loss_ent.detach()),
        "loss/value": float(loss_v.detach()),
        "clip_frac_low": float(stats["clip_frac_low"]),
        "clip_frac_high": float(stats["clip_frac_high"]),
        "approx_kl": float(stats["approx_kl"]),
        "entropy": float((ent.detach() * m).sum() / n),
        "mean_token_prob": float((logp.detach().exp() * m).sum() / n),
    }
    if "cov_frac" in stats:
        metrics["cov_frac"] = float(stats["cov_frac"])
    if "reverse_kl" in stats:  # on-policy distillation: the student's KL to the teacher, per token
        metrics["distill/reverse_kl"] = float(stats["reverse_kl"])
        metrics["distill/teacher_better_frac"] = float(stats["teacher_better_frac"])
        metrics["distill/trust_masked_frac"] = float(stats["trust_masked_frac"])
        metrics["distill/ratio_capped_frac"] = float(stats["ratio_capped_frac"])
    return metrics


def update_step(
    model: Any,
    optimizer: torch.optim.Optimizer,
    batch: TokenBatch,
    algo: Algorithm,
    settings: UpdateSettings,
    *,
    ref_model_ctx: Callable[[], Any] | None = None,
    critic: ValueModel | None = None,
    sync: RankSync = NO_SYNC,
    mismatch: list[MismatchStats] | None = None,
) -> dict[str, float]:
    """One optimizer step on ``batch``: gradient accumulation over micro-batches, grad-norm clipping
    over the optimizer's parameters, and a non-finite guard (a NaN/inf loss or gradient norm skips
    the step and reports ``skipped=1``). The accumulated gradient equals the full-batch gradient:
    each micro-batch loss is normalised by the whole batch's token / sequence counts, and Clip-Cov
    / KL-Cov choose their tokens once for the whole batch (``select_tokens``).

    ``settings``: micro-batching, clipping, the token limit and the temperature
    (:class:`UpdateSettings`); ``sync``: what several ranks add (:class:`RankSync`; its
    ``on_before_step`` receives every trainable parameter of the optimizer and whether this
    process's loss was finite). ``mismatch``: when given, each micro-batch's sampler-vs-trainer
    :class:`MismatchStats` is appended (all forward passes of one step precede its optimizer step,
    so these are pre-update).

    Returns:
        ``METRIC_NAMES`` metrics (losses summed over micro-batches, rates token-weighted) + ``skipped``.
    """
    optimizer.zero_grad(set_to_none=True)
    batch = select_tokens(batch, algo)
    lengths = batch.loss_mask.sum(1)  # [B] sampled tokens per row; the losses are in the whole batch's units
    s = settings
    total_tokens = float(lengths.sum()) if sync.global_tokens is None else sync.global_tokens
    total_seqs = (
        float(loss_normalisers(batch, algo)["global_seqs"]) if sync.global_seqs is None else sync.global_seqs
    )
    loss_fn = partial(
        policy_loss,
        algo=algo,
        ref_model_ctx=ref_model_ctx,
        critic=critic,
        agg_constant=s.max_new_tokens,
        temperature=s.temperature,
        total_tokens=total_tokens,
        total_seqs=total_seqs,
        mismatch=mismatch,
    )
    # similar lengths, little padding; at most micro_batch_tokens padded tokens each when set
    micro = minibatches(batch, s.micro_batch_size, by_length=True, max_tokens=s.micro_batch_tokens)
    first = len(mismatch) if mismatch is not None else 0
    # rates weighted by the whole mini-batch's tokens: the ranks' parts then add up to its means
    sums, finite = _accumulate_gradients(model, micro, loss_fn, total_tokens, sync.pad_micro_batches)
    if sync.merge_metrics is not None:
        mine = sum(mismatch[first:], MismatchStats()) if mismatch is not None else None
        sums, merged = sync.merge_metrics(sums, mine)
        if mismatch is not None and merged is not None:
            mismatch[first:] = [merged]
    if sync.on_before_step is not None:
        trainable = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
        finite = sync.on_before_step(trainable, finite)
    params = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
    grad_norm = float(torch.nn.utils.clip_grad_norm_(params, s.max_grad_norm)) if params else 0.0
    skipped = not finite or not math.isfinite(grad_norm)
    if not skipped:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return {**sums, "grad_norm": grad_norm, "skipped": float(skipped)}


def select_tokens(batch: TokenBatch, algo: Algorithm) -> TokenBatch:
    """``batch`` with Clip-Cov's / KL-Cov's tokens chosen over all of it (``Algorithm.selector``,
    with log pi_old), once: micro-batches then slice the choice instead of each making its own
    (whose covariance means and token counts would be the micro-batch's). Other objectives, or a
    batch that already carries a choice: unchanged."""
    if algo.selector is None or batch.cov_select is not None:
        return batch
    chosen = algo.selector(batch.advantages, batch.old_logprobs, batch.loss_mask)
    return replace(batch, cov_select=chosen)


def _accumulate_gradients(
    model: Any,
    micro_batches: Any,
    loss_fn: Callable[..., tuple[torch.Tensor, dict[str, float]]],
    total_tokens: float,
    pad: Callable[[list[TokenBatch]], list[TokenBatch]] | None = None,
) -> tuple[dict[str, float], bool]:
    """Backward every micro-batch's loss (already in the whole batch's units); stop at the first
    non-finite loss. Returns the summed metrics (rates weighted by their share of ``total_tokens``,
    the mini-batch's) and whether all were finite.
    ``pad`` (sharded training, see ``update_step``): pad the micro-batches to every rank's count and
    run every one, stopping at nothing."""
    sums = dict.fromkeys(METRIC_NAMES, 0.0)
    finite, lockstep = True, pad is not None
    if pad is not None:
        micro_batches = pad(list(micro_batches))
    for mb in micro_batches:
        n_tok = float(mb.loss_mask.sum())
        if n_tok == 0 and not lockstep:
            continue  # nothing to train on in these rows
        loss, m = loss_fn(model, mb)
        if not torch.isfinite(loss):
            if not lockstep:
                return sums, False
            finite = False  # the step is skipped; the backward still runs its collectives
        loss.backward()
        if n_tok == 0 or not finite:
            continue
        for k, v in m.items():
            sums[k] = sums.get(k, 0.0) + (v if k in _SUMMED else v * n_tok / max(total_tokens, 1.0))
    return sums, finite
