"""The update: a rollout batch in, advantages once, then optimizer steps on its mini-batches.

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

Every metric name is the same for every algorithm (zeros where a part is off).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

import torch

from veriloop.agents.forward import first_loss_position, token_logprobs, usable_shared_prefix
from veriloop.agents.trajectory import Trajectory
from veriloop.algos.learner.algorithm import Algorithm, ObjectiveExtras, RewardInputs
from veriloop.algos.learner.batch import SampleRows, TokenBatch, collate, minibatches, with_advantages
from veriloop.algos.learner.critic import ValueModel, values
from veriloop.algos.learner.signal import verifier_failed
from veriloop.algos.maths import advantages as A
from veriloop.algos.maths.correction import rollout_correction
from veriloop.algos.maths.distill import reverse_kl_distill_loss
from veriloop.algos.maths.losses import aggregate, entropy_bonus, kl_penalty, sequence_count, value_loss
from veriloop.algos.maths.mismatch import MismatchStats, mismatch_stats
from veriloop.algos.maths.shaping import (
    format_reward,
    kl_reward_penalty,
    overlong_filter_mask,
    overlong_penalty,
)
from veriloop.algos.run.fsdp import is_sharded
from veriloop.configs.algo import AlgoConfig
from veriloop.configs.schema import ExperimentConfig

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


@dataclass(frozen=True)
class Advantages:
    """Output of ``compute_advantages``.

    Attributes:
        advantages: [N, T] per-token advantages (right-padded like ``collate``), 0 off the loss mask.
        returns: [N, T] value targets (GAE only) or None.
        sample_mask: [N] 1 = the episode trains, 0 = dropped (verifier failed, overlong filter).
        metrics: counts for logging (``samples/verifier_failed``, ``samples/overlong_filtered``...).
    """

    advantages: torch.Tensor
    returns: torch.Tensor | None
    sample_mask: torch.Tensor
    metrics: dict[str, float]


def _turn_reward(traj: Trajectory, j: int, cfg: AlgoConfig) -> float:
    """The reward of turn ``j`` of ``traj`` that ``cfg`` learns from, read from the environment's
    learner contract (``turn.signal``, see ``veriloop.envs.base.LearnerSignal``).

    ``advantage="process"`` reads ``signal.process_reward`` and ``reward_level="outcome"`` the last
    turn's ``signal.outcome_reward``, so neither preset silently learns from the other signal when
    the env returns it as the step reward. An episode the *rollout* cut (``max_context``,
    ``max_turns``) never reached the env's final step; its last turn's ``outcome_reward`` is then the
    outcome the env gives an episode that stops there. Where the env reports none (``None``): the
    step reward.
    """
    turn = traj.turns[j]
    value = None
    if cfg.estimator.signal == "action":  # process rewards, one per action
        value = turn.signal.process_reward
    elif cfg.reward_level == "outcome" and j == traj.num_turns - 1:
        value = turn.signal.outcome_reward
    return float(turn.reward if value is None else value)


def _turn_tensors(trajs: Sequence[Trajectory], cfg: AlgoConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-turn rewards [N, K] (``_turn_reward``, plus the R1 format reward on the last turn and
    DAPO's soft overlong punishment per turn if on) and the turn mask [N, K].

    The format reward is credited once per episode, on its last turn (the answer that counts):
    paid on every turn, a third-attempt success would out-earn a first-attempt one. For the same
    reason ``reward_level="sum"`` refuses an episode with a positive reward before its last turn.
    """
    k = max(1, max(t.num_turns for t in trajs))
    rewards = torch.zeros(len(trajs), k, dtype=torch.float64)
    mask = torch.zeros(len(trajs), k)
    for i, t in enumerate(trajs):
        for j in range(t.num_turns):
            rewards[i, j] = _turn_reward(t, j, cfg)
            mask[i, j] = 1.0
    if cfg.reward_level == "sum" and cfg.estimator.signal != "action":
        _refuse_paid_attempts(trajs, rewards)
    if cfg.format_reward > 0:  # R1-Zero format bonus, once per episode
        for i, t in enumerate(trajs):
            if t.num_turns:
                bonus = format_reward([t.turns[-1].text], bonus=cfg.format_reward)
                rewards[i, t.num_turns - 1] += float(bonus[0])
    if cfg.overlong_penalty:  # each turn's generation is one response y in DAPO's formula
        lengths = torch.tensor(
            [[tr.end - tr.start for tr in t.turns] + [0] * (k - t.num_turns) for t in trajs]
        )
        pen = overlong_penalty(
            lengths.flatten(), max_len=cfg.overlong_max_len, cache_len=cfg.overlong_cache_len
        )
        rewards = rewards + pen.view_as(rewards).double() * mask.double()
    return rewards, mask


def _refuse_paid_attempts(trajs: Sequence[Trajectory], rewards: torch.Tensor) -> None:
    """``reward_level="sum"`` with a positive reward before the last turn pays for extra turns."""
    for i, t in enumerate(trajs):
        early = rewards[i, : max(t.num_turns - 1, 0)]
        if bool((early > 0).any()):
            j = int((early > 0).nonzero()[0])
            raise ValueError(
                f"reward_level='sum' adds up per-turn rewards, but turn {j} of an episode (group "
                f"{t.group_id}, {t.env_id}) scored {float(early[j]):+g} before the episode ended: every "
                "extra attempt would earn it again (e.g. a format bonus per turn makes a third-attempt "
                "success worth more than a first-attempt one). Use reward_level=outcome (the last turn's "
                "reward) or reward_level=turn, or make the environment's non-final rewards <= 0"
            )


def _reward_inputs(
    trajectories: Sequence[Trajectory],
    algo: Algorithm,
    tokens: TokenBatch,
    values: torch.Tensor | None,
    ref_logprobs: torch.Tensor | None,
) -> RewardInputs:
    """The estimator's inputs: shaped turn rewards [N, K], groups / validity [N], KL rewards [N, T]."""
    cfg = algo.cfg
    turn_r, turn_m = _turn_tensors(trajectories, cfg)
    loss_mask = tokens.loss_mask
    kl_tokens = torch.zeros_like(loss_mask, dtype=torch.float64)
    if algo.kl_reward_coef > 0:
        if ref_logprobs is None or ref_logprobs.shape != loss_mask.shape:
            raise ValueError(f"kl_mode='reward' needs ref_logprobs of shape {tuple(loss_mask.shape)}")
        kl_tokens = kl_reward_penalty(
            kl_tokens,
            tokens.old_logprobs.double(),
            ref_logprobs.double(),
            loss_mask,
            coef=cfg.kl_coef,
            kind=cfg.kl_estimator,
        )
    return RewardInputs(
        trajectories=trajectories,
        turn_rewards=turn_r,
        turn_mask=turn_m,
        groups=torch.tensor([t.group_id for t in trajectories], dtype=torch.long),
        valid=torch.tensor([not verifier_failed(t) for t in trajectories]),
        turn_index=tokens.turn_index,
        loss_mask=loss_mask,
        kl_tokens=kl_tokens,
        values=values,
    )


def compute_advantages(
    trajectories: Sequence[Trajectory],
    algo: Algorithm,
    *,
    values: torch.Tensor | None = None,
    ref_logprobs: torch.Tensor | None = None,
    tokens: TokenBatch | None = None,
) -> Advantages:
    """Per-token advantages for a rollout batch, with the estimator ``algo`` picked (``cfg.advantage``).

    * Episodes whose verifier failed are left out of every baseline and get ``sample_mask`` 0.
    * ``overlong_filter``: episodes with a turn cut at the token limit get ``sample_mask`` 0 (their
      reward still enters the group baseline; only their loss is masked, as in DAPO).
    * ``overlong_penalty``: DAPO's soft punishment is added to each turn's reward (per-turn length).
    * ``kl_mode="reward"``: -kl_coef * KL_t is added as token rewards; for GAE it enters the
      token chain. Other critic-free estimators add the KL return-to-go to their advantage.
    * ``batch_norm`` (REINFORCE++, Hu 2025) and ``group_mean_batch_norm`` (REINFORCE++-baseline):
      the token's return is the raw reward (episode reward, or the turn's return-to-go at
      ``reward_level="turn"``; minus the group mean for the baseline variant) plus the KL
      penalty's return-to-go sum_{s >= t} (0 without KL), and it is whitened over all valid
      *tokens* of the batch, as OpenRLHF and verl do: one rule whatever ``kl_coef`` is, so a
      long episode weighs by its tokens in the mean and std with or without the KL term.
    * ``reward_level="outcome"`` / ``advantage="process"`` read the learner contract's
      ``outcome_reward`` / ``process_reward`` when the environment reports them, see ``_turn_reward``.
    * ``whiten_advantages``: whiten over the training tokens of the batch at the end.
    * GAE: each turn's reward sits on its last sampled token (``reward_level="outcome"``: only the
      last turn's); critic-free ``turn`` level uses ``turn_level`` (leave-one-out by turn index).

    Args:
        values: [N, T] critic values aligned with ``collate`` (required for ``gae``).
        ref_logprobs: [N, T] reference log-probs (required when kl_mode="reward" and kl_coef > 0).
        tokens: the batch already collated from ``trajectories`` (``prepare_batch``); None = collate here.
    """
    if not trajectories:
        raise ValueError("compute_advantages needs at least one trajectory")
    if tokens is None:
        tokens = collate(trajectories, [[0.0] * len(t.token_ids) for t in trajectories])
    x = _reward_inputs(trajectories, algo, tokens, values, ref_logprobs)
    keep = x.valid.clone()
    if algo.cfg.overlong_filter:
        hit = torch.tensor([any(tr.hit_token_limit for tr in t.turns) for t in trajectories])
        keep &= overlong_filter_mask(hit).bool()
    adv, returns = algo.estimator(algo.cfg, x)
    tok_keep = x.loss_mask * keep.unsqueeze(1).to(x.loss_mask.dtype)
    if algo.cfg.whiten_advantages:
        adv = A.whiten(adv, tok_keep.double(), eps=1e-6)
    metrics = {
        "samples/verifier_failed": float((~x.valid).sum()),
        "samples/overlong_filtered": float((x.valid & ~keep).sum()),
        "adv/mean": float((adv * tok_keep).sum() / tok_keep.sum().clamp(min=1)),
    }
    adv = (adv * tok_keep).float()
    ret = None if returns is None else (returns * tok_keep).float()
    return Advantages(adv, ret, keep.float(), metrics)


def learning_signal(traj: Trajectory, cfg: AlgoConfig) -> tuple[float, ...]:
    """The rewards of one episode that ``cfg``'s estimator learns from (``_turn_reward`` plus
    shaping): one number for ``reward_level`` outcome / sum, one per turn (action) for ``turn``
    and ``process``. Dynamic sampling judges a group on this, not on the raw step rewards: a
    group whose signals are all equal carries no advantage, whatever its ``total_reward`` says."""
    turn_r, turn_m = _turn_tensors([traj], cfg)
    if cfg.estimator.signal == "action" or cfg.reward_level == "turn":
        return tuple(float(x) for x in turn_r[0, : traj.num_turns])
    return (float(A.episode_rewards(turn_r, turn_m, cfg.reward_level)[0]),)


def _ref_logprobs(
    model: Any,
    batch: TokenBatch,
    ref_model_ctx: Callable[[], Any] | None,
    temperature: float = 1.0,
) -> torch.Tensor:
    """Reference log-probs [B, T] at the sampling ``temperature``, computed inside ``ref_model_ctx()``.

    The one reference path: the context is ``Policy.reference`` (it yields the frozen copy, or the
    LoRA model with its adapter disabled). A context that yields nothing (e.g. a bare
    ``peft_model.disable_adapter``) makes ``model`` itself the reference while it is open."""
    if ref_model_ctx is None:
        raise ValueError(
            "kl_coef > 0 needs a reference: precompute batch.ref_logprobs, or pass ref_model or ref_model_ctx"
        )
    with ref_model_ctx() as yielded, torch.no_grad():
        net = yielded if yielded is not None and callable(yielded) else model
        lp, _ = token_logprobs(
            net,
            batch.input_ids,
            batch.attention_mask,
            temperature=temperature,
            first_position=first_loss_position(batch.loss_mask),
            **batch.extras,
        )
    return lp.detach()


def _as_context(ref_model: Any, ref_model_ctx: Callable[[], Any] | None) -> Callable[[], Any] | None:
    """A plain reference model as a context that yields it, so there is one reference path."""
    if ref_model is None:
        return ref_model_ctx
    return lambda: contextlib.nullcontext(ref_model)


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
        else _ref_logprobs(model, batch, ref_model_ctx, temperature)
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


def loss_normalisers(batch: TokenBatch, algo: Algorithm | None = None) -> dict[str, float]:
    """``update_step(**loss_normalisers(mini_batch))`` on each data-parallel rank: the whole
    mini-batch's token and sequence counts, so every rank's loss (policy *and* value) is already
    in the mini-batch's units and the ranks' gradients are simply summed (``grad_sync(1.0)``).
    Weighting each rank by one share instead cannot be right for both the sequence-normalised
    policy loss and the token-normalised value loss at once. With ``algo``'s ``sequence_unit="turn"``
    a sequence is an (episode, turn) pair; with ``batch.episode_index`` the rows of one episode count
    once (``split_weight="episode"``)."""
    segments = batch.turn_index if algo is not None and algo.per_turn_segments else None
    return {
        "global_tokens": float(batch.loss_mask.sum()),
        "global_seqs": float(sequence_count(batch.loss_mask, segments, batch.episode_index)),
    }


@dataclass(frozen=True)
class UpdateSettings:
    """How one optimizer step runs, read from the config once (:meth:`from_config`).

    Attributes:
        micro_batch_size: rows per forward/backward pass (gradient accumulation over the rest).
        max_grad_norm: global gradient-norm clip (``inf`` = none; the norm is still reported).
        micro_batch_tokens: at most this many padded tokens per micro-batch (0 = no cap).
        max_new_tokens: ``seq_sum_constant``'s divisor when ``algo.loss_agg_constant`` is None.
        temperature: the rollout's sampling temperature (see ``policy_loss``).
    """

    micro_batch_size: int
    max_grad_norm: float
    micro_batch_tokens: int = 0
    max_new_tokens: int | None = None
    temperature: float = 1.0

    @classmethod
    def from_config(cls, cfg: ExperimentConfig) -> UpdateSettings:
        """``train``'s micro-batching and clipping, ``rollout``'s token limit and temperature."""
        return cls(
            micro_batch_size=cfg.train.micro_batch_size,
            max_grad_norm=cfg.train.max_grad_norm or float("inf"),
            micro_batch_tokens=cfg.train.micro_batch_tokens,
            max_new_tokens=cfg.rollout.max_new_tokens,
            temperature=cfg.rollout.temperature,
        )


@dataclass(frozen=True)
class RankSync:
    """What several ranks add to one optimizer step (one process: the defaults, nothing).

    Attributes:
        on_before_step: ``(params, finite) -> finite``, run after the last backward and before
            clipping (data parallelism: the gradient all-reduce, ``DistContext.grad_sync``).
        global_tokens, global_seqs: the loss normalisers when the batch is this rank's part of a
            larger mini-batch (``loss_normalisers``); None = the batch's own counts.
        pad_micro_batches: sharded training (``fsdp.lockstep``: every pass is a collective, so all
            ranks run as many, also without training tokens or after a non-finite loss).
        merge_metrics: ``(sums, mismatch) -> (sums, mismatch)`` over the ranks
            (``DistContext.merge_step_metrics``), so the logged losses, rates and mismatch are the
            whole mini-batch's, as one process logs them, not this rank's part.
    """

    on_before_step: Callable[[list[torch.nn.Parameter], bool], bool] | None = None
    global_tokens: float | None = None
    global_seqs: float | None = None
    pad_micro_batches: Callable[[list[TokenBatch]], list[TokenBatch]] | None = None
    merge_metrics: (
        Callable[[dict[str, float], MismatchStats | None], tuple[dict[str, float], MismatchStats | None]]
        | None
    ) = None


NO_SYNC = RankSync()


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


def prepare_batch(
    trajectories: Sequence[Trajectory],
    algo: Algorithm,
    *,
    model: Any = None,
    critic: ValueModel | None = None,
    ref_model: Any = None,
    ref_model_ctx: Callable[[], Any] | None = None,
    pad_id: int = 0,
    temperature: float = 1.0,
    recompute_old_logprobs: bool = False,
) -> tuple[TokenBatch, dict[str, float]]:
    """Collate a rollout batch once and attach everything the update needs, once per rollout:
    reference log-probs (if ``cfg.needs_reference``), rollout-time values (if a critic), the
    advantages and returns from ``compute_advantages``, the sample mask, and the rollout
    correction. ``temperature``: the rollout's sampling temperature, used for the reference
    log-probs (see ``policy_loss``). The reference is ``ref_model_ctx()`` (``Policy.reference``);
    ``ref_model`` is the same for a plain model.

    ``recompute_old_logprobs``: replace the recorded sampling log-probs with ``model``'s own at
    ``temperature``. Needed when the sampler truncated the distribution (top-k / top-p): the
    recorded numbers are then log-probs of the *filtered* distribution, which the update's
    forward pass (unfiltered) cannot reproduce, so the ratio would start away from 1.

    Rollout correction (``cfg.needs_old_recompute``): pi_old is always recomputed by ``model``
    and the recorded log-probs are kept as mu (``batch.sampler_logprobs``, also for DPPO); the
    correction's weights go to ``batch.is_weights`` and what it drops leaves the loss mask. Its
    stats (``rollout_corr/*``) and the mismatch of mu against this pi_old over every sampled token
    (``mismatch/*``: measured here, then, and nowhere else) join the returned metrics.
    """
    c = algo.cfg
    # one row per sample (= per episode unless a template rewrite or a compaction split one):
    # the model runs on the contexts that were sampled; advantages are computed per episode
    rows = SampleRows.of(trajectories)
    pieces = rows.pieces(trajectories)
    base = collate(pieces, [[0.0] * len(t.token_ids) for t in pieces], pad_id=pad_id)  # [R, T]
    sampler_lp = base.old_logprobs  # mu: what the sampler recorded, [R, T]
    _refuse_filtered_mu(recompute_old_logprobs, c)
    if recompute_old_logprobs or c.needs_old_recompute:
        base = _recompute_old_logprobs(model, base, temperature)
    ref_ctx = _as_context(ref_model, ref_model_ctx)
    ref = _ref_logprobs(model, base, ref_ctx, temperature) * base.loss_mask if c.needs_reference else None
    old_v = None
    if c.needs_critic:
        if critic is None:
            raise ValueError(
                "advantage='gae' needs a critic: pass critic=ValueModel(policy) or ValueModel.separate(...)"
            )
        with torch.no_grad():
            old_v = values(critic, base).detach()  # [R, T]
    batch, adv = _row_advantages(rows, base, trajectories, algo, old_v, ref, pad_id)
    if c.needs_sampler_logprobs and not c.needs_old_recompute:  # DPPO: mu as recorded
        return replace(batch, sampler_logprobs=sampler_lp * batch.loss_mask), adv.metrics
    if not c.needs_old_recompute:
        return batch, adv.metrics
    seen = mismatch_stats(batch.old_logprobs, sampler_lp * batch.loss_mask, batch.loss_mask).metrics()
    batch, stats = _correct_rollout(batch, sampler_lp, c)
    return batch, {**adv.metrics, **stats, **seen}


def _row_advantages(
    rows: SampleRows,
    base: TokenBatch,
    trajectories: Sequence[Trajectory],
    algo: Algorithm,
    old_v: torch.Tensor | None,
    ref: torch.Tensor | None,
    pad_id: int,
) -> tuple[TokenBatch, Advantages]:
    """Advantages computed per episode (on the episode view ``[N, T_ep]``, the samples end to end,
    so per-turn credit follows ``turn_index``) and moved onto the sample rows ``base`` ``[R, T]``,
    with the critic values and reference log-probs of the rows. A row is kept with its episode.
    ``split_weight="episode"`` with a split episode: ``episode_index`` says which rows are one."""
    episodes = rows.episode_view(base, trajectories, pad_id)  # [N, T_ep]
    n, t_ep = episodes.loss_mask.shape
    shape, width = (int(n), int(t_ep)), base.loss_mask.shape[1]
    adv = compute_advantages(
        trajectories,
        algo,
        values=rows.to_episodes(old_v, shape),
        ref_logprobs=rows.to_episodes(ref, shape),
        tokens=episodes,
    )
    keep = adv.sample_mask[list(rows.episode)]  # [R]
    episode = None  # [R, T] the episode of each row, when split rows weigh as their one episode
    if algo.cfg.split_weight == "episode" and not rows.identity:
        episode = torch.tensor(rows.episode, dtype=torch.long).unsqueeze(1).expand(-1, width).contiguous()
    batch = replace(
        with_advantages(base, rows.to_rows(adv.advantages, width), keep),
        returns=rows.to_rows(adv.returns, width),
        old_values=old_v,
        ref_logprobs=ref,
        episode_index=episode,
    )
    return batch, adv


def _refuse_filtered_mu(filtered: bool, c: AlgoConfig) -> None:
    """Rollout correction and DPPO compare the trainer with mu: not with a top-k / top-p sampler."""
    if filtered and c.needs_sampler_logprobs:
        raise ValueError(
            "rollout correction and DPPO compare the trainer with the sampler's recorded log-probs, but "
            "with top-k / top-p those are of the filtered distribution (pi_old / mu would be the nucleus "
            "mass, not a mismatch): sample with rollout.top_p=1 and rollout.top_k=0"
        )


def _recompute_old_logprobs(model: Any, base: TokenBatch, temperature: float) -> TokenBatch:
    """``base`` with pi_old [N, T] taken from ``model`` on the sampled tokens (top-k / top-p, rollout
    correction); other positions keep their recorded numbers (zeroed by the loss mask)."""
    if model is None:
        raise ValueError("recomputing the old log-probs (top-k/top-p, rollout correction) needs model=...")
    with torch.no_grad():
        old, _ = token_logprobs(
            model,
            base.input_ids,
            base.attention_mask,
            temperature=temperature,
            first_position=first_loss_position(base.loss_mask),
            **base.extras,
        )
    # rounded to float32 as collate stores log-probs; positions off the mask stay 0
    return replace(base, old_logprobs=torch.where(base.loss_mask.bool(), old.float(), base.old_logprobs))


def _correct_rollout(
    batch: TokenBatch, sampler_lp: torch.Tensor, c: AlgoConfig
) -> tuple[TokenBatch, dict[str, float]]:
    """Rollout correction: IS weights pi_old / mu (truncated or masked) and the geometric sequence
    mask; what it drops leaves the loss mask and the advantages."""
    weights, keep, stats = rollout_correction(
        batch.old_logprobs,
        sampler_lp * batch.loss_mask,
        batch.loss_mask,
        token=c.rollout_is,
        cap=c.rollout_is_cap,
        low=c.rollout_is_low,
        high=c.rollout_is_high,
        seq_mask=c.rollout_seq_mask,
        seq_low=c.rollout_seq_low,
        seq_high=c.rollout_seq_high,
        segments=batch.turn_index if c.sequence_unit == "turn" else None,
        episodes=batch.episode_index,
    )
    kept = keep.to(batch.loss_mask.dtype)
    batch = replace(
        batch,
        loss_mask=batch.loss_mask * kept,
        advantages=batch.advantages * kept,
        sampler_logprobs=sampler_lp * batch.loss_mask,
        is_weights=weights * kept,
    )
    return batch, stats
