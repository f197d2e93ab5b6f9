"""Credit: a rollout batch's rewards turned into per-token advantages (``compute_advantages``).

The rewards an estimator learns from are read here, per turn, from each environment's learner
contract (``turn.signal``) and shaped (R1's format reward, DAPO's soft overlong punishment, the KL
reward); the estimator that ``algorithm.resolve`` picked once turns them into advantages, and the
episodes the batch does not train on (verifier failures, DAPO's overlong filter) get sample mask 0.
``learning_signal`` is the same reading for one episode: what dynamic sampling and the curriculum
judge a group by.

The estimators themselves are pure functions over tensors in ``veriloop.algos.maths.advantages``;
this module is the learner's side of them: trajectories and the config in, tensors out.
``prepare_batch`` (``veriloop.algos.learner.prepare``) calls ``compute_advantages`` once per
rollout batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from veriloop.agents.trajectory import Trajectory
from veriloop.algos.learner.algorithm import Algorithm, RewardInputs
from veriloop.algos.learner.batch import TokenBatch, collate
from veriloop.algos.learner.signal import verifier_failed
from veriloop.algos.maths import advantages as A
from veriloop.algos.maths.shaping import (
    class_balanced_rewards,
    format_reward,
    kl_reward_penalty,
    overlong_filter_mask,
    overlong_penalty,
)
from veriloop.configs.algo import AlgoConfig


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


def _reward_classes(trajs: Sequence[Trajectory], k: int, valid: torch.Tensor) -> torch.Tensor:
    """[N, K] class index of every judgement action (``turn.signal.reward_class``, numbered in sorted
    order of the names), -1 for other actions, padding and the episodes left out (``valid`` False)."""
    names = sorted({t.signal.reward_class for tr in trajs for t in tr.turns if t.signal.reward_class})
    classes = torch.full((len(trajs), k), -1, dtype=torch.long)
    for i, tr in enumerate(trajs):
        for j, turn in enumerate(tr.turns):
            if valid[i] and turn.signal.reward_class is not None:
                classes[i, j] = names.index(turn.signal.reward_class)
    return classes


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
    valid = torch.tensor([not verifier_failed(t) for t in trajectories])
    if cfg.balance_reward_classes:
        turn_r = class_balanced_rewards(turn_r, _reward_classes(trajectories, turn_r.shape[1], valid))
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
        valid=valid,
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
    group whose signals are all equal carries no advantage, whatever its ``total_reward`` says.
    ``balance_reward_classes`` weighs rewards by shares of the whole batch, which one episode does not
    know: its rewards are read here unweighted."""
    turn_r, turn_m = _turn_tensors([traj], cfg)
    if cfg.estimator.signal == "action" or cfg.reward_level == "turn":
        return tuple(float(x) for x in turn_r[0, : traj.num_turns])
    return (float(A.episode_rewards(turn_r, turn_m, cfg.reward_level)[0]),)
