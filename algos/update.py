"""The one place where ``AlgoConfig`` picks the parts: advantages, the loss, and one update step.

Flow per rollout batch (the training loop calls these in order)::

    batch, m = prepare_batch(trajectories, cfg, critic=critic, ref_model=..., pad_id=...)
    for epoch in range(cfg.epochs):
        for mb in minibatches(batch, size):
            metrics = update_step(model, optimizer, mb, cfg, micro_batch_size=..., max_grad_norm=...)

Every metric name is the same for every algorithm (zeros where a part is off).
"""

from __future__ import annotations

import contextlib
import difflib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

import torch

from veriloop.agents.forward import first_loss_position, shared_prefix_length, token_logprobs
from veriloop.agents.trajectory import Trajectory
from veriloop.algos import advantages as A
from veriloop.algos import losses as L
from veriloop.algos.batch import TokenBatch, collate, minibatches
from veriloop.algos.correction import rollout_correction
from veriloop.algos.critic import ValueModel, values
from veriloop.algos.losses import aggregate, entropy_bonus, kl_penalty, value_loss
from veriloop.algos.sampling import verifier_failed
from veriloop.algos.shaping import format_reward, kl_reward_penalty, overlong_filter_mask, overlong_penalty
from veriloop.configs.algo import AlgoConfig

METRIC_NAMES = (
    "loss/policy", "loss/kl", "loss/entropy", "loss/value", "clip_frac_low", "clip_frac_high",
    "approx_kl", "entropy", "mean_token_prob", "grad_norm",
)  # fmt: skip
#: Shortest common prompt worth running once for a whole micro-batch (see ``token_logprobs``).
MIN_SHARED_PREFIX = 8
_SUMMED = ("loss/policy", "loss/kl", "loss/entropy", "loss/value")  # already globally normalised

#: Critic-free episode-level estimators: (rewards [N], group_ids [N], valid [N]) -> [N].
EPISODE_ESTIMATORS: dict[str, Callable[..., torch.Tensor]] = {
    "group_norm": partial(A.group_normalized, std_normalize=True),
    "group_mean": partial(A.group_normalized, std_normalize=False),
    "rloo": A.leave_one_out,
}
#: REINFORCE++ family: a raw per-token return (after an optional group-mean baseline) plus the KL
#: penalty to go, whitened over the batch's valid *tokens* whatever ``kl_coef`` is (OpenRLHF's and
#: verl's ``masked_whiten``). (cfg, turn_r [N, K], turn_m, groups [N], valid [N], turn_index
#: [N, T], loss_mask [N, T]) -> [N, T] un-whitened returns.
TOKEN_WHITENED: dict[str, Callable[..., torch.Tensor]] = {
    "batch_norm": lambda cfg, r, m, g, v, ti, lm: _raw_returns(cfg, r, m, ti, lm),
    "group_mean_batch_norm": lambda cfg, r, m, g, v, ti, lm: _group_mean_returns(cfg, r, m, g, v, ti, lm),
}
#: Policy objectives, each built once from the config: (cfg) -> fn(logp, old, adv, mask, segments)
#: -> (per_token_loss [B, T], stats). ``segments`` is the turn index for ``sequence_unit="turn"``.
POLICY_LOSSES: dict[str, Callable[[AlgoConfig], Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]]] = {
    "ppo_clip": lambda c: lambda lp, old, adv, m, seg: L.clipped_pg_loss(
        lp, old, adv, m, clip_low=c.clip_low, clip_high=c.clip_high, dual_clip=c.dual_clip),
    "gspo": lambda c: partial(_with_segments, partial(L.gspo_loss, clip_low=c.clip_low, clip_high=c.clip_high)),
    "gspo_token": lambda c: partial(_with_segments, partial(L.gspo_loss, clip_low=c.clip_low,
                                                            clip_high=c.clip_high, level="token")),
    "cispo": lambda c: lambda lp, old, adv, m, seg: L.cispo_loss(
        lp, old, adv, m, clip_low=c.clip_low, clip_high=c.clip_high),
    "sapo": lambda c: lambda lp, old, adv, m, seg: L.sapo_loss(
        lp, old, adv, m, tau_pos=c.sapo_tau_pos, tau_neg=c.sapo_tau_neg),
    "gmpo": lambda c: partial(_with_segments, partial(L.gmpo_loss, clip_low=c.clip_low, clip_high=c.clip_high)),
    "clip_cov": lambda c: lambda lp, old, adv, m, seg: L.clip_cov_loss(
        lp, old, adv, m, clip_low=c.clip_low, clip_high=c.clip_high, cov_ratio=c.cov_ratio,
        cov_lb=c.cov_lb, cov_ub=c.cov_ub),
    "kl_cov": lambda c: lambda lp, old, adv, m, seg: L.kl_cov_loss(
        lp, old, adv, m, cov_ratio=c.cov_ratio, kl_coef=c.cov_kl_coef),
}  # fmt: skip


def _with_segments(fn: Callable[..., Any], lp, old, adv, m, seg):  # type: ignore[no-untyped-def]
    return fn(lp, old, adv, m, segments=seg)


def pick_policy_loss(cfg: AlgoConfig) -> Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]:
    """The policy objective ``cfg.policy_loss`` names, with its hyperparameters bound."""
    if cfg.policy_loss not in POLICY_LOSSES:
        close = difflib.get_close_matches(str(cfg.policy_loss), POLICY_LOSSES, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(
            f"unknown policy_loss {cfg.policy_loss!r}{hint}; choose one of {tuple(POLICY_LOSSES)}"
        )
    return POLICY_LOSSES[cfg.policy_loss](cfg)


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
    if cfg.advantage == "process":
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
    if cfg.reward_level == "sum" and cfg.advantage != "process":
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


def _token_tensors(trajs: Sequence[Trajectory]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """turn_index [N, T] (-1 pad), loss_mask [N, T] and old log-probs [N, T], right-padded."""
    b = collate(trajs, [[0.0] * len(t.token_ids) for t in trajs])
    return b.turn_index, b.loss_mask, b.old_logprobs


def _turn_end_rewards(trajs: Sequence[Trajectory], per_turn: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """[N, T] token rewards: turn k's reward on its last sampled token (index ``end - 1``)."""
    out = torch.zeros(shape, dtype=torch.float64)
    for i, t in enumerate(trajs):
        for j, turn in enumerate(t.turns):
            if turn.end <= turn.start:
                raise ValueError(f"turn {j} of an episode in group {t.group_id} has no sampled tokens")
            out[i, turn.end - 1] += per_turn[i, j]
    return out


def _action_kinds(trajs: Sequence[Trajectory], k: int) -> torch.Tensor:
    """[N, K] kind index of every action, from ``turn.signal.action_kind`` (the environment names
    the kind; an invalid action is named as the kind it was expected to be, see ``LearnerSignal``).
    Kinds are numbered in sorted order of their names (at most two, as ``process_advantages`` needs)."""
    names = [[turn.signal.action_kind for turn in t.turns] for t in trajs]
    for i, row in enumerate(names):
        for j, kind in enumerate(row):
            if kind is None:
                raise ValueError(
                    "advantage='process' needs every turn's signal.action_kind (LearnerSignal), got None "
                    f"(turn {j}, group {trajs[i].group_id}); use an env that names its action kinds or another estimator"
                )
    order = sorted({kind for row in names for kind in row if kind is not None})
    if len(order) > 2:
        raise ValueError(f"advantage='process' baselines at most two action kinds, got {order}")
    kinds = torch.zeros(len(trajs), k, dtype=torch.long)
    for i, row in enumerate(names):
        for j, kind in enumerate(row):
            kinds[i, j] = order.index(str(kind))
    return kinds


def _critic_free(
    cfg: AlgoConfig, trajs: Sequence[Trajectory], turn_r, turn_m, groups, valid, turn_index, loss_mask
) -> torch.Tensor:
    """Per-token advantages [N, T] for every estimator except GAE (turn tensors [N, K], tokens [N, T])."""
    if cfg.advantage == "process":
        kinds = _action_kinds(trajs, turn_r.shape[1])
        per_turn = A.process_advantages(
            turn_r, turn_m, kinds, groups, baseline=cfg.process_baseline, valid=valid
        )
        return A.broadcast_to_tokens(per_turn, turn_index, loss_mask)
    if cfg.reward_level == "turn":
        std = cfg.advantage == "group_norm"
        per_turn = A.turn_level(turn_r, turn_m, groups, gamma=cfg.turn_gamma, std_normalize=std, valid=valid)
        return A.broadcast_to_tokens(per_turn, turn_index, loss_mask)
    r = A.episode_rewards(turn_r, turn_m, cfg.reward_level)
    return A.broadcast_to_tokens(
        EPISODE_ESTIMATORS[cfg.advantage](r, groups, valid=valid), turn_index, loss_mask
    )


def compute_advantages(
    trajectories: Sequence[Trajectory],
    cfg: AlgoConfig,
    *,
    values: torch.Tensor | None = None,
    ref_logprobs: torch.Tensor | None = None,
) -> Advantages:
    """Per-token advantages for a rollout batch, with the estimator chosen by ``cfg.advantage``.

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
    """
    if not trajectories:
        raise ValueError("compute_advantages needs at least one trajectory")
    cfg.validate()
    known = (*EPISODE_ESTIMATORS, *TOKEN_WHITENED, "gae", "process")
    if cfg.advantage not in known:
        close = difflib.get_close_matches(str(cfg.advantage), known, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(f"unknown advantage estimator {cfg.advantage!r}{hint}; choose one of {known}")
    turn_r, turn_m = _turn_tensors(trajectories, cfg)
    turn_index, loss_mask, old_lp = _token_tensors(trajectories)
    groups = torch.tensor([t.group_id for t in trajectories], dtype=torch.long)
    valid = torch.tensor([not verifier_failed(t) for t in trajectories])
    keep = valid.clone()
    if cfg.overlong_filter:
        hit = torch.tensor([any(tr.hit_token_limit for tr in t.turns) for t in trajectories])
        keep &= overlong_filter_mask(hit).bool()
    kl_tokens = torch.zeros_like(loss_mask, dtype=torch.float64)
    if cfg.kl_mode == "reward" and cfg.kl_coef > 0:
        if ref_logprobs is None or ref_logprobs.shape != loss_mask.shape:
            raise ValueError(f"kl_mode='reward' needs ref_logprobs of shape {tuple(loss_mask.shape)}")
        kl_tokens = kl_reward_penalty(kl_tokens, old_lp.double(), ref_logprobs.double(), loss_mask,
                                      coef=cfg.kl_coef, kind=cfg.kl_estimator)  # fmt: skip
    returns = None
    if cfg.advantage == "gae":
        if values is None or values.shape != loss_mask.shape:
            got = None if values is None else tuple(values.shape)
            raise ValueError(f"advantage='gae' needs values of shape {tuple(loss_mask.shape)}, got {got}")
        per_turn = turn_r * turn_m if cfg.reward_level != "outcome" else _last_turn_only(turn_r, turn_m)
        tok_r = (_turn_end_rewards(trajectories, per_turn, loss_mask.shape) + kl_tokens) * loss_mask
        adv, returns = A.gae(tok_r, values.double(), loss_mask, gamma=cfg.gamma, lam=cfg.lam)
    else:
        kl_to_go, _ = A.gae(kl_tokens * loss_mask, torch.zeros_like(kl_tokens), loss_mask, gamma=1.0, lam=1.0)
        if cfg.advantage in TOKEN_WHITENED:
            # REINFORCE++: normalise (reward + KL penalty to go) over tokens, with or without KL
            raw = TOKEN_WHITENED[cfg.advantage](cfg, turn_r, turn_m, groups, valid, turn_index, loss_mask)
            adv = A.whiten(raw + kl_to_go, loss_mask * valid.unsqueeze(1).to(loss_mask.dtype), eps=1e-6)
        else:
            adv = _critic_free(cfg, trajectories, turn_r, turn_m, groups, valid, turn_index, loss_mask)
            adv = adv.double() + kl_to_go
    tok_keep = loss_mask * keep.unsqueeze(1).to(loss_mask.dtype)
    if cfg.whiten_advantages:
        adv = A.whiten(adv, tok_keep.double(), eps=1e-6)
    metrics = {
        "samples/verifier_failed": float((~valid).sum()),
        "samples/overlong_filtered": float((valid & ~keep).sum()),
        "adv/mean": float((adv * tok_keep).sum() / tok_keep.sum().clamp(min=1)),
    }
    adv = (adv * tok_keep).float()
    ret = None if returns is None else (returns * tok_keep).float()
    return Advantages(adv, ret, keep.float(), metrics)


def _raw_returns(
    cfg: AlgoConfig,
    turn_r: torch.Tensor,
    turn_m: torch.Tensor,
    turn_index: torch.Tensor,
    loss_mask: torch.Tensor,
) -> torch.Tensor:
    """[N, T] un-normalised return of every sampled token: its episode's reward (``outcome`` /
    ``sum``) or its turn's discounted return-to-go (``turn``); turn tensors are [N, K]."""
    if cfg.reward_level == "turn":
        per = A.turn_returns(turn_r, turn_m, gamma=cfg.turn_gamma)
    else:
        per = A.episode_rewards(turn_r, turn_m, cfg.reward_level)
    return A.broadcast_to_tokens(per, turn_index, loss_mask).double()


def _group_mean_returns(
    cfg: AlgoConfig,
    turn_r: torch.Tensor,
    turn_m: torch.Tensor,
    groups: torch.Tensor,
    valid: torch.Tensor,
    turn_index: torch.Tensor,
    loss_mask: torch.Tensor,
) -> torch.Tensor:
    """[N, T] REINFORCE++-baseline return before whitening: the episode reward minus its group's
    mean (``reward_level`` outcome / sum), or each turn's return-to-go minus the mean of the
    other episodes' at that turn (``turn``, ``advantages.turn_level``)."""
    if cfg.reward_level == "turn":
        per = A.turn_level(turn_r, turn_m, groups, gamma=cfg.turn_gamma, valid=valid)
    else:
        r = A.episode_rewards(turn_r, turn_m, cfg.reward_level)
        per = A.group_normalized(r, groups, std_normalize=False, valid=valid)
    return A.broadcast_to_tokens(per, turn_index, loss_mask).double()


def learning_signal(traj: Trajectory, cfg: AlgoConfig) -> tuple[float, ...]:
    """The rewards of one episode that ``cfg``'s estimator learns from (``_turn_reward`` plus
    shaping): one number for ``reward_level`` outcome / sum, one per turn (action) for ``turn``
    and ``process``. Dynamic sampling judges a group on this, not on the raw step rewards: a
    group whose signals are all equal carries no advantage, whatever its ``total_reward`` says."""
    turn_r, turn_m = _turn_tensors([traj], cfg)
    if cfg.advantage == "process" or cfg.reward_level == "turn":
        return tuple(float(x) for x in turn_r[0, : traj.num_turns])
    return (float(A.episode_rewards(turn_r, turn_m, cfg.reward_level)[0]),)


def _last_turn_only(turn_r: torch.Tensor, turn_m: torch.Tensor) -> torch.Tensor:
    """[N, K] keeping only the last real turn's reward (reward_level='outcome')."""
    last = (turn_m.sum(1).long() - 1).clamp(min=0)
    out = torch.zeros_like(turn_r)
    out[torch.arange(turn_r.shape[0]), last] = A.episode_rewards(turn_r, turn_m, "outcome")
    return out


def _ref_logprobs(
    model: Any,
    batch: TokenBatch,
    ref_model: Any,
    ref_model_ctx: Callable[[], Any] | None,
    temperature: float = 1.0,
) -> torch.Tensor:
    """Reference log-probs [B, T] at the sampling ``temperature``: from ``ref_model``, or from
    ``model`` inside ``ref_model_ctx()`` (e.g. ``peft_model.disable_adapter``: the LoRA base model
    is the reference)."""
    if ref_model is not None:
        net, ctx = ref_model, contextlib.nullcontext()
    elif ref_model_ctx is not None:
        net, ctx = model, ref_model_ctx()
    else:
        raise ValueError(
            "kl_coef > 0 needs a reference: precompute batch.ref_logprobs, or pass ref_model or ref_model_ctx"
        )
    with ctx as yielded, torch.no_grad():
        if yielded is not None and ref_model is None and callable(yielded):
            net = yielded  # a context that yields the reference model uses it
        lp, _ = token_logprobs(net, batch.input_ids, batch.attention_mask, temperature=temperature,
                               first_position=first_loss_position(batch.loss_mask), **batch.extras)  # fmt: skip
    return lp.detach()


def policy_loss(
    model: Any,
    batch: TokenBatch,
    cfg: AlgoConfig,
    *,
    ref_model_ctx: Callable[[], Any] | None = None,
    critic: ValueModel | None = None,
    agg_constant: float | None = None,
    total_tokens: float | None = None,
    total_seqs: float | None = None,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Loss of one (micro-)batch: aggregate(w * policy objective + kl_coef KL - entropy_coef H)
    + vf_coef V-loss.

    The policy objective is ``cfg.policy_loss`` (``POLICY_LOSSES``: PPO clip, GSPO, CISPO, SAPO,
    GMPO, Clip-Cov, KL-Cov); w is the rollout-correction weight ``batch.is_weights`` (1 when off).
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
        scalar loss (with grad) and the metrics named in ``METRIC_NAMES`` (except grad_norm),
        plus ``cov_frac`` for Clip-Cov / KL-Cov.
    """
    mask = batch.loss_mask
    first = first_loss_position(mask)
    # rows of one group share their prompt: run it once (same numbers and gradients, less compute)
    prefix = shared_prefix_length(batch.input_ids, batch.attention_mask, limit=first)
    logp, ent = token_logprobs(model, batch.input_ids, batch.attention_mask, with_entropy=True,
                               temperature=temperature, first_position=first,
                               shared_prefix=prefix if prefix >= MIN_SHARED_PREFIX else 0, **batch.extras)  # fmt: skip
    assert ent is not None
    constant = cfg.loss_agg_constant or agg_constant
    agg = partial(aggregate, mask=mask, mode=cfg.loss_agg, constant=constant,
                  total_tokens=total_tokens, total_seqs=total_seqs)  # fmt: skip
    segments = batch.turn_index if cfg.sequence_unit == "turn" else None
    pg, stats = pick_policy_loss(cfg)(logp, batch.old_logprobs, batch.advantages, mask, segments)
    if batch.is_weights is not None:  # rollout correction: pi_old / mu, truncated or masked
        pg = pg * batch.is_weights.detach()
    loss_pg = agg(pg)
    zero = loss_pg.new_zeros(())
    loss_kl = zero
    if cfg.kl_coef > 0 and cfg.kl_mode == "loss":
        ref = (
            batch.ref_logprobs
            if batch.ref_logprobs is not None
            else _ref_logprobs(model, batch, None, ref_model_ctx, temperature)
        )
        ref = torch.where(mask.bool(), ref, logp.detach())  # d = 0 off the mask: no inf * 0 = nan
        loss_kl = cfg.kl_coef * agg(kl_penalty(logp, ref, cfg.kl_estimator))
    loss_ent = agg(entropy_bonus(ent, coef=cfg.entropy_coef)) if cfg.entropy_coef > 0 else zero
    loss_v = zero
    if critic is not None:
        if batch.returns is None or batch.old_values is None:
            raise ValueError("a critic needs batch.returns and batch.old_values (use prepare_batch)")
        v = critic(batch.input_ids, batch.attention_mask, **batch.extras)
        vl = value_loss(v, batch.old_values, batch.returns, mask, clip=cfg.value_clip)
        loss_v = cfg.vf_coef * aggregate(vl, mask, "token_mean", total_tokens=total_tokens)
    loss = loss_pg + loss_kl + loss_ent + loss_v
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
    return loss, metrics


def loss_normalisers(batch: TokenBatch) -> dict[str, float]:
    """``update_step(**loss_normalisers(mini_batch))`` on each data-parallel rank: the whole
    mini-batch's token and sequence counts, so every rank's loss (policy *and* value) is already
    in the mini-batch's units and the ranks' gradients are simply summed (``grad_sync(1.0)``).
    Weighting each rank by one share instead cannot be right for both the sequence-normalised
    policy loss and the token-normalised value loss at once."""
    lengths = batch.loss_mask.sum(1)
    return {"global_tokens": float(lengths.sum()), "global_seqs": float((lengths > 0).sum())}


def update_step(
    model: Any,
    optimizer: torch.optim.Optimizer,
    batch: TokenBatch,
    cfg: AlgoConfig,
    *,
    micro_batch_size: int,
    max_grad_norm: float,
    micro_batch_tokens: int = 0,
    ref_model_ctx: Callable[[], Any] | None = None,
    critic: ValueModel | None = None,
    max_new_tokens: int | None = None,
    on_before_step: Callable[[list[torch.nn.Parameter], bool], bool] | None = None,
    temperature: float = 1.0,
    global_tokens: float | None = None,
    global_seqs: float | None = None,
) -> dict[str, float]:
    """One optimizer step on ``batch``: gradient accumulation over micro-batches, grad-norm clipping
    over the optimizer's parameters, and a non-finite guard (a NaN/inf loss or gradient norm skips
    the step and reports ``skipped=1``). The accumulated gradient equals the full-batch gradient:
    each micro-batch loss is normalised by the whole batch's token / sequence counts.

    ``on_before_step(params, finite) -> finite`` runs after the last backward and before clipping
    (data parallelism: the gradient all-reduce, see ``DistContext.grad_sync``); it receives every
    trainable parameter of the optimizer and whether this process's loss was finite.
    ``temperature``: the rollout's sampling temperature (see ``policy_loss``).
    ``global_tokens`` / ``global_seqs``: the loss normalisers when ``batch`` is this rank's part
    of a larger mini-batch (``loss_normalisers``); None = ``batch``'s own counts.

    Returns:
        ``METRIC_NAMES`` metrics (losses summed over micro-batches, rates token-weighted) + ``skipped``.
    """
    optimizer.zero_grad(set_to_none=True)
    lengths = batch.loss_mask.sum(1)
    total_tokens = float(lengths.sum()) if global_tokens is None else global_tokens
    total_seqs = float((lengths > 0).sum()) if global_seqs is None else global_seqs
    own_tokens = float(lengths.sum())
    sums = dict.fromkeys(METRIC_NAMES, 0.0)
    finite = True
    # similar lengths, little padding; at most micro_batch_tokens padded tokens each when set
    for mb in minibatches(batch, micro_batch_size, by_length=True, max_tokens=micro_batch_tokens):
        n_tok = float(mb.loss_mask.sum())
        if n_tok == 0:
            continue  # nothing to train on in these rows
        loss, m = policy_loss(model, mb, cfg, ref_model_ctx=ref_model_ctx, critic=critic, agg_constant=max_new_tokens,
                              total_tokens=total_tokens, total_seqs=total_seqs, temperature=temperature)  # fmt: skip
        if not torch.isfinite(loss):
            finite = False
            break
        loss.backward()
        for k, v in m.items():
            sums[k] = sums.get(k, 0.0) + (v if k in _SUMMED else v * n_tok / max(own_tokens, 1.0))
    if on_before_step is not None:
        trainable = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
        finite = on_before_step(trainable, finite)
    params = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
    grad_norm = float(torch.nn.utils.clip_grad_norm_(params, max_grad_norm)) if params else 0.0
    skipped = not finite or not math.isfinite(grad_norm)
    if not skipped:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    sums["grad_norm"] = grad_norm
    sums["skipped"] = float(skipped)
    return sums


def prepare_batch(
    trajectories: Sequence[Trajectory],
    cfg: AlgoConfig,
    *,
    model: Any = None,
    critic: ValueModel | None = None,
    ref_model: Any = None,
    ref_model_ctx: Callable[[], Any] | None = None,
    pad_id: int = 0,
    temperature: float = 1.0,
    recompute_old_logprobs: bool = False,
) -> tuple[TokenBatch, dict[str, float]]:
    """Collate a rollout batch and attach everything the update needs, once per rollout:
    reference log-probs (if ``cfg.needs_reference``), rollout-time values (if a critic), the
    advantages and returns from ``compute_advantages``, the sample mask, and the rollout
    correction. ``temperature``: the rollout's sampling temperature, used for the reference
    log-probs (see ``policy_loss``).

    ``recompute_old_logprobs``: replace the recorded sampling log-probs with ``model``'s own at
    ``temperature``. Needed when the sampler truncated the distribution (top-k / top-p): the
    recorded numbers are then log-probs of the *filtered* distribution, which the update's
    forward pass (unfiltered) cannot reproduce, so the ratio would start away from 1.

    Rollout correction (``cfg.needs_old_recompute``): pi_old is always recomputed by ``model``
    and the recorded log-probs are kept as mu (``batch.sampler_logprobs``); the correction's
    weights go to ``batch.is_weights`` and the tokens / sequences it drops leave the loss mask.
    Its stats (``rollout_corr/*``, ``mismatch/*``) join the returned metrics.
    """
    base = collate(trajectories, [[0.0] * len(t.token_ids) for t in trajectories], pad_id=pad_id)
    sampler_lp = base.old_logprobs
    if recompute_old_logprobs or cfg.needs_old_recompute:
        if model is None:
            raise ValueError(
                "recomputing the old log-probs (top-k/top-p, rollout correction) needs model=..."
            )
        with torch.no_grad():
            old, _ = token_logprobs(model, base.input_ids, base.attention_mask, temperature=temperature,
                                    first_position=first_loss_position(base.loss_mask), **base.extras)  # fmt: skip
        trajectories = [
            replace(t, logprobs=[float(x) if m else lp for x, m, lp in zip(row, t.loss_mask, t.logprobs)])
            for t, row in zip(trajectories, old.tolist())
        ]
        base = collate(trajectories, [[0.0] * len(t.token_ids) for t in trajectories], pad_id=pad_id)
    ref = (
        _ref_logprobs(model, base, ref_model, ref_model_ctx, temperature) * base.loss_mask
        if cfg.needs_reference
        else None
    )
    old_v = None
    if cfg.needs_critic:
        if critic is None:
            raise ValueError(
                "advantage='gae' needs a critic: pass critic=ValueModel(policy) or ValueModel.separate(...)"
            )
        with torch.no_grad():
            old_v = values(critic, base).detach()
    adv = compute_advantages(trajectories, cfg, values=old_v, ref_logprobs=ref)
    batch = collate(trajectories, adv.advantages, pad_id=pad_id, sample_mask=adv.sample_mask)
    batch = replace(batch, returns=adv.returns, old_values=old_v, ref_logprobs=ref)
    if not cfg.needs_old_recompute:
        return batch, adv.metrics
    weights, keep, stats = rollout_correction(
        batch.old_logprobs, sampler_lp * batch.loss_mask, batch.loss_mask, token=cfg.rollout_is,
        cap=cfg.rollout_is_cap, low=cfg.rollout_is_low, high=cfg.rollout_is_high, seq_mask=cfg.rollout_seq_mask,
        seq_low=cfg.rollout_seq_low, seq_high=cfg.rollout_seq_high,
        segments=batch.turn_index if cfg.sequence_unit == "turn" else None,
    )  # fmt: skip
    kept = keep.to(batch.loss_mask.dtype)
    batch = replace(batch, loss_mask=batch.loss_mask * kept, advantages=batch.advantages * kept,
                    sampler_logprobs=sampler_lp * batch.loss_mask, is_weights=weights * kept)  # fmt: skip
    return batch, {**adv.metrics, **stats}
