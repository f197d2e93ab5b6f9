"""An algorithm, picked once: the estimators and objectives every ``AlgoConfig`` choice names.

The choices and their traits are one record each in ``configs.algo`` (``ADVANTAGES``,
``POLICY_LOSSES``); each row names its function here as ``"module:function"``. ``resolve(cfg)``
validates an ``AlgoConfig`` and looks its three parts up, once per run, into a frozen
:class:`Algorithm` record that the update (``algos/learner/update.py``) reads on every batch:

    cfg.advantage    -> ADVANTAGE_ESTIMATORS   (cfg, RewardInputs) -> (advantages [N, T], returns | None)
    cfg.policy_loss  -> POLICY_LOSS_BUILDERS   (cfg) -> (logp, old, adv, mask, segments, extras) -> (loss [B, T], stats)
    cfg.loss_agg     -> losses.aggregate       (per-token loss [B, T], mask, ...) -> scalar

Every entry shares its table's signature, so adding an estimator or an objective is one function
plus one row in ``configs.algo``. The maths lives in ``maths/advantages.py`` and ``maths/losses.py``
(pure functions over tensors); the functions below only adapt their arguments.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from veriloop.agents.trajectory import Trajectory
from veriloop.algos.maths import advantages as A
from veriloop.algos.maths import losses as L
from veriloop.algos.maths.losses import aggregate
from veriloop.algos.maths.multi_reward import component_normalized
from veriloop.configs.algo import ADVANTAGES, POLICY_LOSSES, AlgoConfig

#: A policy objective in its table's one signature:
#: (logp, old, adv, mask, segments, extras) -> (per-token loss [B, T], stats); extras may be None.
Objective = Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]


@dataclass(frozen=True)
class ObjectiveExtras:
    """What some objectives read besides (logp, old, adv, mask, segments), all [B, T] or None.

    Attributes:
        is_weights: rollout-correction weights pi_old / mu (detached). Each objective applies them
            itself: token-level losses per token; GSPO (both levels) per token of its token form,
            as verl; GMPO as the geometric mean of the sequence's weights, as verl.
        sampler_logprobs: the sampler's recorded log mu (DPPO's ratio is pi_theta / mu).
        cov_select: Clip-Cov / KL-Cov tokens chosen once per mini-batch (``Algorithm.selector``).
        episodes: the episode of each row (``TokenBatch.episode_index``): GSPO / GMPO take the
            rows split from one episode as one sequence; None = each row its own.
    """

    is_weights: torch.Tensor | None = None
    sampler_logprobs: torch.Tensor | None = None
    cov_select: torch.Tensor | None = None
    episodes: torch.Tensor | None = None


def _weighted(fn: Objective) -> Objective:
    """A token-level objective with the rollout-correction weights applied per token."""

    def objective(lp, old, adv, m, seg, x=None):  # type: ignore[no-untyped-def]
        loss, stats = fn(lp, old, adv, m, seg, x)
        w = None if x is None else x.is_weights
        return (loss if w is None else loss * w.detach()), stats

    return objective


def _sampler(x: ObjectiveExtras | None) -> torch.Tensor:
    if x is None or x.sampler_logprobs is None:
        raise ValueError(
            "policy_loss=dppo needs the sampler's log-probs mu (batch.sampler_logprobs): use prepare_batch"
        )
    return x.sampler_logprobs


def _select(x: ObjectiveExtras | None) -> torch.Tensor | None:
    return None if x is None else x.cov_select


def _weights(x: ObjectiveExtras | None) -> torch.Tensor | None:
    return None if x is None else x.is_weights


def _episodes(x: ObjectiveExtras | None) -> torch.Tensor | None:
    return None if x is None else x.episodes


# ------------------------------------------------------------------------------ policy objectives

# One builder per ``configs.algo.POLICY_LOSSES`` row: (cfg) -> fn(logp, old, adv, mask, segments,
# extras) -> (per_token_loss [B, T], stats). ``segments`` is the turn index for
# ``sequence_unit="turn"``; ``extras`` an ``ObjectiveExtras`` (or None).


def ppo_clip(c: AlgoConfig) -> Objective:
    return _weighted(lambda lp, old, adv, m, seg, x: L.clipped_pg_loss(
        lp, old, adv, m, clip_low=c.clip_low, clip_high=c.clip_high, dual_clip=c.dual_clip))  # fmt: skip


def gspo(c: AlgoConfig) -> Objective:
    return lambda lp, old, adv, m, seg, x=None: L.gspo_loss(
        lp, old, adv, m, clip_low=c.clip_low, clip_high=c.clip_high, segments=seg, is_weights=_weights(x),
        episodes=_episodes(x))  # fmt: skip


def gspo_token(c: AlgoConfig) -> Objective:
    return lambda lp, old, adv, m, seg, x=None: L.gspo_loss(
        lp, old, adv, m, clip_low=c.clip_low, clip_high=c.clip_high, level="token", segments=seg,
        is_weights=_weights(x), episodes=_episodes(x))  # fmt: skip


def cispo(c: AlgoConfig) -> Objective:
    return _weighted(lambda lp, old, adv, m, seg, x: L.cispo_loss(
        lp, old, adv, m, clip_low=c.clip_low, clip_high=c.clip_high))  # fmt: skip


def sapo(c: AlgoConfig) -> Objective:
    return _weighted(lambda lp, old, adv, m, seg, x: L.sapo_loss(
        lp, old, adv, m, tau_pos=c.sapo_tau_pos, tau_neg=c.sapo_tau_neg))  # fmt: skip


def gmpo(c: AlgoConfig) -> Objective:
    return lambda lp, old, adv, m, seg, x=None: L.gmpo_loss(
        lp, old, adv, m, clip_low=c.clip_low, clip_high=c.clip_high, segments=seg, is_weights=_weights(x),
        episodes=_episodes(x))  # fmt: skip


def clip_cov(c: AlgoConfig) -> Objective:
    return _weighted(lambda lp, old, adv, m, seg, x: L.clip_cov_loss(
        lp, old, adv, m, clip_low=c.clip_low, clip_high=c.clip_high, cov_ratio=c.cov_ratio,
        cov_lb=c.cov_lb, cov_ub=c.cov_ub, select=_select(x)))  # fmt: skip


def kl_cov(c: AlgoConfig) -> Objective:
    return _weighted(lambda lp, old, adv, m, seg, x: L.kl_cov_loss(
        lp, old, adv, m, cov_ratio=c.cov_ratio, kl_coef=c.cov_kl_coef, select=_select(x)))  # fmt: skip


def dppo(c: AlgoConfig) -> Objective:
    return _weighted(lambda lp, old, adv, m, seg, x: L.dppo_loss(
        lp, _sampler(x), adv, m, divergence=c.dppo_divergence, delta_low=c.dppo_low,
        delta_high=c.dppo_high, tau=c.dppo_tau, ratio_cap=c.dppo_ratio_cap))  # fmt: skip


# Token selectors (a row's ``selector``): objectives that act on a share of the batch's tokens,
# chosen once per mini-batch (before micro-batching, so that it cannot change the gradient):
# (cfg) -> fn(advantages, logprobs, mask) -> [B, T] bool. The update passes log pi_old (the
# sampling policy; pi_theta at the first update).


def clip_cov_selector(c: AlgoConfig) -> Callable[..., torch.Tensor]:
    return partial(L.clip_cov_select, cov_ratio=c.cov_ratio, cov_lb=c.cov_lb, cov_ub=c.cov_ub)


def kl_cov_selector(c: AlgoConfig) -> Callable[..., torch.Tensor]:
    return partial(L.kl_cov_select, cov_ratio=c.cov_ratio)


def _entry(name: str) -> Any:
    """The function a ``"module:function"`` row names (the rows live in ``configs.algo``)."""
    module, _, attr = name.partition(":")
    return getattr(importlib.import_module(module), attr)


def pick_policy_loss(cfg: AlgoConfig) -> Objective:
    """The policy objective ``cfg.policy_loss`` names, with its hyperparameters bound."""
    builder: Callable[[AlgoConfig], Objective] = _entry(cfg.objective.objective)
    return builder(cfg)


# ---------------------------------------------------------------------------- advantage estimators


@dataclass(frozen=True)
class RewardInputs:
    """What every advantage estimator reads, built once per batch by ``compute_advantages``.

    Attributes:
        trajectories: the N episodes.
        turn_rewards: [N, K] float64 per-turn rewards after shaping (``_turn_tensors``).
        turn_mask: [N, K] 1 for a real turn.
        groups: [N] group id (episodes of one start state share it).
        valid: [N] bool, False where the verifier failed (left out of every baseline).
        turn_index: [N, T] turn of each token, -1 on padding and env tokens.
        loss_mask: [N, T] 1 on sampled tokens.
        kl_tokens: [N, T] float64 per-token KL reward (``kl_mode="reward"``), else zeros.
        values: [N, T] rollout-time critic values (GAE only), else None.
    """

    trajectories: Sequence[Trajectory]
    turn_rewards: torch.Tensor
    turn_mask: torch.Tensor
    groups: torch.Tensor
    valid: torch.Tensor
    turn_index: torch.Tensor
    loss_mask: torch.Tensor
    kl_tokens: torch.Tensor
    values: torch.Tensor | None


#: One signature for every estimator: (cfg, inputs) -> (advantages [N, T] float64, returns [N, T] | None).
Estimator = Callable[[AlgoConfig, RewardInputs], tuple[torch.Tensor, torch.Tensor | None]]


def _kl_to_go(x: RewardInputs) -> torch.Tensor:
    """[N, T] sum_{s >= t} of the per-token KL reward: what critic-free estimators add to A_t."""
    kl_to_go, _ = A.gae(
        x.kl_tokens * x.loss_mask, torch.zeros_like(x.kl_tokens), x.loss_mask, gamma=1.0, lam=1.0
    )
    return kl_to_go


def gae(cfg: AlgoConfig, x: RewardInputs) -> tuple[torch.Tensor, torch.Tensor | None]:
    """GAE: each turn's reward on its last sampled token (``reward_level="outcome"``: only the last
    turn's), the KL reward in the token chain, bootstrapped by the critic's ``values``."""
    shape = x.loss_mask.shape
    if x.values is None or x.values.shape != shape:
        got = None if x.values is None else tuple(x.values.shape)
        raise ValueError(f"advantage='gae' needs values of shape {tuple(shape)}, got {got}")
    turn_r, turn_m = x.turn_rewards, x.turn_mask
    per_turn = turn_r * turn_m if cfg.reward_level != "outcome" else _last_turn_only(turn_r, turn_m)
    tok_r = (_turn_end_rewards(x.trajectories, per_turn, shape) + x.kl_tokens) * x.loss_mask
    return A.gae(tok_r, x.values.double(), x.loss_mask, gamma=cfg.gamma, lam=cfg.lam)


def batch_norm(cfg: AlgoConfig, x: RewardInputs) -> tuple[torch.Tensor, torch.Tensor | None]:
    """REINFORCE++: the raw return of every token (``_raw_returns``), whitened with the KL to go."""
    return _token_whitened(x, _raw_returns(cfg, x.turn_rewards, x.turn_mask, x.turn_index, x.loss_mask))


def group_mean_batch_norm(cfg: AlgoConfig, x: RewardInputs) -> tuple[torch.Tensor, torch.Tensor | None]:
    """REINFORCE++-baseline: the return minus its group's mean (``_group_mean_returns``), whitened."""
    raw = _group_mean_returns(cfg, x.turn_rewards, x.turn_mask, x.groups, x.valid, x.turn_index, x.loss_mask)
    return _token_whitened(x, raw)


def _token_whitened(x: RewardInputs, raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """REINFORCE++ family: a raw per-token return (after an optional group-mean baseline) plus the
    KL penalty to go, whitened over the batch's valid *tokens* whatever ``kl_coef`` is (OpenRLHF's
    and verl's ``masked_whiten``)."""
    valid_tokens = x.loss_mask * x.valid.unsqueeze(1).to(x.loss_mask.dtype)
    return A.whiten(raw + _kl_to_go(x), valid_tokens, eps=1e-6), None


def process(cfg: AlgoConfig, x: RewardInputs) -> tuple[torch.Tensor, torch.Tensor | None]:
    """S2R process level: each action against the comparable actions (``process_baseline``)."""
    kinds = _action_kinds(x.trajectories, x.turn_rewards.shape[1])
    per_turn = A.process_advantages(
        x.turn_rewards, x.turn_mask, kinds, x.groups, baseline=cfg.process_baseline, valid=x.valid
    )
    adv = A.broadcast_to_tokens(per_turn, x.turn_index, x.loss_mask)
    return adv.double() + _kl_to_go(x), None


def group_norm(cfg: AlgoConfig, x: RewardInputs) -> tuple[torch.Tensor, torch.Tensor | None]:
    """GRPO: (R - mean) / std over the group."""
    return _critic_free(cfg, x, partial(A.group_normalized, std_normalize=True), std=True)


def group_mean(cfg: AlgoConfig, x: RewardInputs) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Dr. GRPO: R - mean over the group."""
    return _critic_free(cfg, x, partial(A.group_normalized, std_normalize=False), std=False)


def rloo(cfg: AlgoConfig, x: RewardInputs) -> tuple[torch.Tensor, torch.Tensor | None]:
    """RLOO: R minus the mean of the group's other samples."""
    return _critic_free(cfg, x, A.leave_one_out, std=False)


def _critic_free(
    cfg: AlgoConfig, x: RewardInputs, episode: Callable[..., torch.Tensor], std: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Group baselines: per turn (``reward_level="turn"``, ``turn_level``, std-normalised with
    ``std``) or per episode (``episode``: (rewards [N], group_ids [N], valid [N]) -> [N]), plus the
    KL return-to-go."""
    turn_r, turn_m, groups, valid = x.turn_rewards, x.turn_mask, x.groups, x.valid
    if cfg.reward_level == "turn":
        per_turn = A.turn_level(turn_r, turn_m, groups, gamma=cfg.turn_gamma, std_normalize=std, valid=valid)
        adv = A.broadcast_to_tokens(per_turn, x.turn_index, x.loss_mask)
    else:
        r = A.episode_rewards(turn_r, turn_m, cfg.reward_level)
        per = episode(r, groups, valid=valid)
        adv = A.broadcast_to_tokens(per, x.turn_index, x.loss_mask)
    return adv.double() + _kl_to_go(x), None


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
    other episodes' at that turn (``turn``, ``advantages.turn_level``).

    Two stated choices where verl differs (tested): a group with a single valid episode gets raw
    return 0 (its reward minus its own mean) before the batch whitening, where verl keeps that
    episode's raw score (a lone sample has no baseline, and a raw score would sit on another
    scale than every centred one); and the KL penalty's return-to-go is added *after* the group
    mean (``_token_whitened``), where verl folds the KL into the score before centring: the group
    baseline then compares rewards only, and each token keeps its own KL to go."""
    if cfg.reward_level == "turn":
        per = A.turn_level(turn_r, turn_m, groups, gamma=cfg.turn_gamma, valid=valid)
    else:
        r = A.episode_rewards(turn_r, turn_m, cfg.reward_level)
        per = A.group_normalized(r, groups, std_normalize=False, valid=valid)
    return A.broadcast_to_tokens(per, turn_index, loss_mask).double()


def _last_turn_only(turn_r: torch.Tensor, turn_m: torch.Tensor) -> torch.Tensor:
    """[N, K] keeping only the last real turn's reward (reward_level='outcome')."""
    last = (turn_m.sum(1).long() - 1).clamp(min=0)
    out = torch.zeros_like(turn_r)
    out[torch.arange(turn_r.shape[0]), last] = A.episode_rewards(turn_r, turn_m, "outcome")
    return out


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


def episode_components(trajs: Sequence[Trajectory], rewards: torch.Tensor, level: str) -> torch.Tensor:
    """[N, C] reward components per episode: each name in ``info["reward_components"]`` (summed
    over the turns for ``level="sum"``, the last turn's for ``outcome``; 0 where absent), in name
    order, plus one column for whatever else the learning reward ``rewards`` [N] holds (the
    trainer's format bonus or overlong penalty), so that the components add up to it."""
    per = []
    for t in trajs:
        turns = t.turns[-1:] if level == "outcome" else t.turns
        parts: dict[str, float] = {}
        for turn in turns:
            for name, value in (turn.info.get("reward_components") or {}).items():
                parts[name] = parts.get(name, 0.0) + float(value)
        per.append(parts)
    names = sorted({n for parts in per for n in parts})
    comp = torch.tensor([[parts.get(n, 0.0) for n in names] for parts in per], dtype=torch.float64)
    comp = comp.reshape(len(trajs), len(names))
    rest = rewards.double() - comp.sum(1)
    return torch.cat([comp, rest[:, None]], 1) if bool((rest.abs() > 1e-6).any()) or not names else comp


def gdpo(cfg: AlgoConfig, x: RewardInputs) -> tuple[torch.Tensor, torch.Tensor | None]:
    """GDPO: each reward component normalised in its group, summed, whitened over the batch; an
    environment that gives a single component (and no shaping) gets GRPO with the authors' eps
    1e-4 (``component_normalized``)."""
    r = A.episode_rewards(x.turn_rewards, x.turn_mask, cfg.reward_level)  # type: ignore[arg-type]
    comp = episode_components(x.trajectories, r, cfg.reward_level)
    per = component_normalized(comp, x.groups, valid=x.valid)
    return A.broadcast_to_tokens(per, x.turn_index, x.loss_mask).double() + _kl_to_go(x), None


#: ``cfg.advantage`` -> its estimator, all of one signature (``Estimator``): the functions the rows
#: of ``configs.algo.ADVANTAGES`` name.
ADVANTAGE_ESTIMATORS: dict[str, Estimator] = {
    name: _entry(spec.estimator) for name, spec in ADVANTAGES.items()
}
#: ``cfg.policy_loss`` -> its objective's builder (the rows of ``configs.algo.POLICY_LOSSES``).
POLICY_LOSS_BUILDERS: dict[str, Callable[[AlgoConfig], Objective]] = {
    name: _entry(spec.objective) for name, spec in POLICY_LOSSES.items()
}


@dataclass(frozen=True)
class Algorithm:
    """The parts an ``AlgoConfig`` names, looked up once (``resolve``) and read by every batch.

    Attributes:
        cfg: the config they came from (hyperparameters the parts read).
        estimator: ``ADVANTAGE_ESTIMATORS[cfg.advantage]``: (cfg, RewardInputs) -> (adv, returns).
        objective: ``POLICY_LOSS_BUILDERS[cfg.policy_loss](cfg)``, hyperparameters bound:
            (logp, old, adv, mask, segments) -> (per-token loss [B, T], stats).
        aggregation: ``losses.aggregate`` with ``mode=cfg.loss_agg``: (per_token, mask=..., constant=...,
            total_tokens=..., total_seqs=...) -> scalar.
        per_turn_segments: GSPO / GMPO / the sequence mask / the sequence modes of ``loss_agg``
            treat each turn as its own sequence (of its episode: with ``TokenBatch.episode_index``
            the rows split from one episode are one sequence, ``split_weight="episode"``).
        selector: the row's ``selector`` bound to its settings (Clip-Cov, KL-Cov),
            else None: (advantages, log pi_old, mask) -> [B, T] bool.
        kl_loss_coef: the KL term's weight in the loss (``kl_mode="loss"``), 0 when it is off.
        kl_reward_coef: the KL penalty's weight in the reward (``kl_mode="reward"``), 0 when off.
    """

    cfg: AlgoConfig
    estimator: Estimator
    objective: Objective
    aggregation: Callable[..., torch.Tensor]
    per_turn_segments: bool
    kl_loss_coef: float
    kl_reward_coef: float
    selector: Callable[..., torch.Tensor] | None = None


def resolve(cfg: AlgoConfig | Algorithm) -> Algorithm:
    """Validate ``cfg`` and look its parts up in the tables, once (an ``Algorithm`` passes through)."""
    if isinstance(cfg, Algorithm):
        return cfg
    cfg.validate()  # unknown names included: cfg.estimator / cfg.objective say which, with a suggestion
    return Algorithm(
        cfg=cfg,
        estimator=ADVANTAGE_ESTIMATORS[cfg.advantage],
        objective=pick_policy_loss(cfg),
        aggregation=partial(aggregate, mode=cfg.loss_agg),
        per_turn_segments=cfg.sequence_unit == "turn",
        kl_loss_coef=cfg.kl_coef if cfg.kl_coef > 0 and cfg.kl_mode == "loss" else 0.0,
        kl_reward_coef=cfg.kl_coef if cfg.kl_coef > 0 and cfg.kl_mode == "reward" else 0.0,
        selector=_entry(cfg.objective.selector)(cfg) if cfg.objective.selector else None,
    )
