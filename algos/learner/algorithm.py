"""An algorithm, picked once: the estimators and objectives every ``AlgoConfig`` choice names.

The choices and their traits are one record each in ``configs.algo`` (``ADVANTAGES``,
``POLICY_LOSSES``); each row names its pure function as ``"module:function"`` and which
``AlgoConfig`` fields bind to which of its parameters. ``resolve(cfg)``
validates an ``AlgoConfig`` and looks its three parts up, once per run, into a frozen
:class:`Algorithm` record that the learner reads on every batch (the estimator in
``algos/learner/credit.py``, the objective and the aggregation in ``algos/learner/update.py``):

    cfg.advantage    -> ADVANTAGE_ESTIMATORS   (cfg, RewardInputs) -> (advantages [N, T], returns | None)
    cfg.policy_loss  -> POLICY_LOSS_BUILDERS   (cfg) -> (logp, old, adv, mask, segments, extras) -> (loss [B, T], stats)
    cfg.loss_agg     -> losses.aggregate       (per-token loss [B, T], mask, ...) -> scalar

Every entry shares its table's signature, made here from the row (``build_objective``,
``build_selector``, ``build_estimator``: the row's settings bound, the batch's extras passed by
parameter name), so adding an estimator or an objective is one pure function plus one row in
``configs.algo``. The maths lives in ``maths/advantages.py`` and ``maths/losses.py``; the
estimators below that read the whole batch (``form="batch"``) adapt it to them.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, cast

import torch

from veriloop.agents.trajectory import Trajectory
from veriloop.algos.maths import advantages as A
from veriloop.algos.maths.losses import aggregate
from veriloop.algos.maths.multi_reward import component_normalized
from veriloop.configs.algo import ADVANTAGES, POLICY_LOSSES, AlgoConfig, EstimatorSpec, PolicyLossSpec

#: A policy objective in its table's one signature:
#: (logp, old, adv, mask, segments, extras) -> (per-token loss [B, T], stats); extras may be None.
Objective = Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]


@dataclass(frozen=True)
class ObjectiveExtras:
    """What some objectives read besides (logp, old, adv, mask, segments), all [B, T] or None.

    Attributes:
        is_weights: rollout-correction weights pi_old / mu (detached). A loss that takes
            ``is_weights`` applies them itself (GSPO, both levels, per token of its token form, as
            verl; GMPO as the geometric mean of the sequence's weights, as verl); any other has its
            per-token loss multiplied by them.
        sampler_logprobs: the sampler's recorded log mu (DPPO's ratio is pi_theta / mu).
        cov_select: Clip-Cov / KL-Cov tokens chosen once per mini-batch (``Algorithm.selector``).
        episodes: the episode of each row (``TokenBatch.episode_index``): GSPO / GMPO take the
            rows split from one episode as one sequence; None = each row its own.
    """

    is_weights: torch.Tensor | None = None
    sampler_logprobs: torch.Tensor | None = None
    cov_select: torch.Tensor | None = None
    episodes: torch.Tensor | None = None


def _entry(name: str) -> Any:
    """The function a ``"module:function"`` row names (the rows live in ``configs.algo``)."""
    module, _, attr = name.partition(":")
    return getattr(importlib.import_module(module), attr)


def bound_settings(
    fn: Callable[..., Any], bind: Mapping[str, str], fixed: Mapping[str, Any], cfg: AlgoConfig, row: str
) -> dict[str, Any]:
    """The keyword arguments a row gives ``fn``: ``bind`` (parameter -> ``AlgoConfig`` field, read
    from ``cfg``) and ``fixed`` (parameter -> constant), each checked against ``fn``'s signature
    and ``cfg``'s fields, so that a misspelt row fails when the run is resolved, naming it."""
    params = inspect.signature(fn).parameters
    unknown = [p for p in (*bind, *fixed) if p not in params]
    if unknown:
        raise ValueError(
            f"{row}: {fn.__qualname__} has no parameter {unknown[0]!r}; fix the row's bind/fixed"
        )
    fields = {f.name for f in dataclasses.fields(cfg)}
    missing = [f for f in bind.values() if f not in fields]
    if missing:
        raise ValueError(f"{row}: AlgoConfig has no field {missing[0]!r}; add it or fix the row's bind")
    return {**{p: getattr(cfg, f) for p, f in bind.items()}, **fixed}


#: What the learner hands an objective besides its four tensors and the row's settings, by
#: parameter name: the ``ObjectiveExtras`` field each one reads (``segments`` is its own argument).
OBJECTIVE_EXTRAS = {"is_weights": "is_weights", "episodes": "episodes", "select": "cov_select"}


def _sampler(x: ObjectiveExtras | None, name: str) -> torch.Tensor:
    if x is None or x.sampler_logprobs is None:
        raise ValueError(
            f"policy_loss={name} needs the sampler's log-probs mu (batch.sampler_logprobs): use prepare_batch"
        )
    return x.sampler_logprobs


def build_objective(spec: PolicyLossSpec, cfg: AlgoConfig, name: str = "") -> Objective:
    """A ``POLICY_LOSSES`` row made an objective of the table's one signature, ``(logp, old, adv,
    mask, segments, extras) -> (per-token loss [B, T], stats)``: the row's loss function with its
    settings bound (``bind``, ``fixed``), the extras its signature names (``OBJECTIVE_EXTRAS``,
    ``segments``), log mu in place of log pi_old when the row ``reads_sampler``, and the
    rollout-correction weights multiplied in per token unless the loss takes ``is_weights``."""
    fn = _entry(spec.objective)
    settings = bound_settings(fn, spec.bind, spec.fixed, cfg, f"policy_loss {name or spec.objective}")
    params = inspect.signature(fn).parameters
    extras = {p: f for p, f in OBJECTIVE_EXTRAS.items() if p in params}
    segments, weigh = "segments" in params, "is_weights" not in params

    def objective(lp, old, adv, m, seg, x=None):  # type: ignore[no-untyped-def]
        ref = _sampler(x, name or spec.objective) if spec.reads_sampler else old
        given = {p: None if x is None else getattr(x, f) for p, f in extras.items()}
        if segments:
            given["segments"] = seg
        loss, stats = fn(lp, ref, adv, m, **settings, **given)
        w = None if x is None else x.is_weights
        return (loss * w.detach() if weigh and w is not None else loss), stats

    return objective


def build_selector(spec: PolicyLossSpec, cfg: AlgoConfig) -> Callable[..., torch.Tensor] | None:
    """The row's token selector, ``(advantages, log pi_old, mask) -> [B, T] bool``, with the row's
    settings its signature names bound; None for a row without one. Clip-Cov / KL-Cov choose their
    tokens once per mini-batch (before micro-batching, so that it cannot change the gradient); the
    update passes log pi_old (the sampling policy; pi_theta at the first update)."""
    if not spec.selector:
        return None
    fn = _entry(spec.selector)
    params = inspect.signature(fn).parameters
    bind = {p: f for p, f in spec.bind.items() if p in params}
    fixed = {p: v for p, v in spec.fixed.items() if p in params}
    return partial(fn, **bound_settings(fn, bind, fixed, cfg, f"selector {spec.selector}"))


def pick_policy_loss(cfg: AlgoConfig) -> Objective:
    """The policy objective ``cfg.policy_loss`` names, with its hyperparameters bound."""
    return build_objective(cfg.objective, cfg, cfg.policy_loss)


# ---------------------------------------------------------------------------- advantage estimators


@dataclass(frozen=True)
class RewardInputs:
    """What every advantage estimator reads, built once per batch by ``compute_advantages``.

    Attributes:
        trajectories: the N episodes.
        turn_rewards: [N, K] float64 per-turn rewards after shaping (``credit._turn_tensors``).
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


def build_estimator(spec: EstimatorSpec, name: str = "") -> Estimator:
    """An ``ADVANTAGES`` row made an estimator of the table's one signature (``Estimator``). A
    ``batch`` row names one already; an ``episode`` row names a baseline over episode rewards,
    ``(rewards [N], group_ids [N], *, valid [N], ...) -> [N]``, which ``_critic_free`` runs with the
    row's settings bound (``bind``, ``fixed``), spreads over the tokens and adds the KL reward to
    go to; under ``reward_level=turn`` it runs ``advantages.turn_level`` instead, std-normalised when
    the row fixes ``std_normalize``."""
    fn = _entry(spec.estimator)
    if spec.form == "batch":
        return cast(Estimator, fn)
    row, std = f"advantage {name or spec.estimator}", bool(spec.fixed.get("std_normalize", False))

    def estimator(cfg: AlgoConfig, x: RewardInputs) -> tuple[torch.Tensor, torch.Tensor | None]:
        settings = bound_settings(fn, spec.bind, spec.fixed, cfg, row)
        return _critic_free(cfg, x, partial(fn, **settings), std=std)

    return estimator


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


#: ``cfg.advantage`` -> its estimator, all of one signature (``Estimator``), built from the rows of
#: ``configs.algo.ADVANTAGES`` (a row added later is built when ``resolve`` first meets it).
ADVANTAGE_ESTIMATORS: dict[str, Estimator] = {
    name: build_estimator(spec, name) for name, spec in ADVANTAGES.items()
}
#: ``cfg.policy_loss`` -> (cfg) -> its objective, built from the rows of ``configs.algo.POLICY_LOSSES``.
POLICY_LOSS_BUILDERS: dict[str, Callable[[AlgoConfig], Objective]] = {
    name: partial(build_objective, spec, name=name) for name, spec in POLICY_LOSSES.items()
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
        estimator=ADVANTAGE_ESTIMATORS.get(cfg.advantage) or build_estimator(cfg.estimator, cfg.advantage),
        objective=pick_policy_loss(cfg),
        aggregation=partial(aggregate, mode=cfg.loss_agg),
        per_turn_segments=cfg.sequence_unit == "turn",
        kl_loss_coef=cfg.kl_coef if cfg.kl_coef > 0 and cfg.kl_mode == "loss" else 0.0,
        kl_reward_coef=cfg.kl_coef if cfg.kl_coef > 0 and cfg.kl_mode == "reward" else 0.0,
        selector=build_selector(cfg.objective, cfg),
    )
