"""A rollout batch made ready for the update, once per rollout (``prepare_batch``).

The batch is collated once (one row per sample) and everything the update reads is attached to
it: pi_old recomputed by the model where the recorded log-probs cannot serve (top-k / top-p,
rollout correction), the reference log-probs (``reference_logprobs``, the one reference path),
the critic's rollout-time values, the advantages and returns (``veriloop.algos.learner.credit``,
per episode, moved onto the sample rows) and the rollout correction's weights and mask. The
optimizer steps on its mini-batches are ``veriloop.algos.learner.update``'s.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import torch

from veriloop.agents.forward import first_loss_position, token_logprobs
from veriloop.agents.trajectory import Trajectory
from veriloop.algos.learner.algorithm import Algorithm
from veriloop.algos.learner.batch import SampleRows, TokenBatch, collate, with_advantages
from veriloop.algos.learner.credit import Advantages, compute_advantages
from veriloop.algos.learner.critic import ValueModel, values
from veriloop.algos.maths.correction import rollout_correction
from veriloop.algos.maths.mismatch import mismatch_stats
from veriloop.configs.algo import AlgoConfig


def reference_logprobs(
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
    with ref_model_ctx() as yielded:
        net = yielded if yielded is not None and callable(yielded) else model
        return _sampled_logprobs(net, batch, temperature).detach()


def _sampled_logprobs(net: Any, batch: TokenBatch, temperature: float) -> torch.Tensor:
    """``net``'s log-probs [B, T] of the batch's tokens at ``temperature``, without a graph."""
    with torch.no_grad():
        lp, _ = token_logprobs(
            net,
            batch.input_ids,
            batch.attention_mask,
            temperature=temperature,
            first_position=first_loss_position(batch.loss_mask),
            **batch.extras,
        )
    return lp


def _as_context(ref_model: Any, ref_model_ctx: Callable[[], Any] | None) -> Callable[[], Any] | None:
    """A plain reference model as a context that yields it, so there is one reference path."""
    if ref_model is None:
        return ref_model_ctx
    return lambda: contextlib.nullcontext(ref_model)


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
    ref = (
        reference_logprobs(model, base, ref_ctx, temperature) * base.loss_mask if c.needs_reference else None
    )
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
    old = _sampled_logprobs(model, base, temperature)
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
