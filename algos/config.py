"""Algorithm settings: one typed field per choice, with its meaning documented once.

An algorithm is a combination of parts chosen here (advantage estimator, loss clipping, loss
aggregation, KL, shaping, sampling); presets in ``configs/algos/*.yaml`` fill these fields the
way each paper describes. See ``../shared/docs/papers.md``-style references in each part's
docstring.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Advantage = Literal["group_norm", "group_mean", "rloo", "batch_norm", "gae", "process"]
RewardLevel = Literal["outcome", "sum", "turn"]
ProcessBaseline = Literal["position_kind", "kind", "group"]
LossAgg = Literal["token_mean", "seq_mean_token_mean", "seq_sum_constant"]
KLEstimator = Literal["k1", "k2", "k3"]
KLMode = Literal["loss", "reward"]
Critic = Literal["none", "value_head", "separate"]


@dataclass
class AlgoConfig:
    """How one RL update is computed.

    Attributes:
        name: Preset name, for logs.
        advantage: Estimator. ``group_norm`` = GRPO (R - mean) / std over the group;
            ``group_mean`` = Dr. GRPO (R - mean); ``rloo`` = leave-one-out baseline;
            ``batch_norm`` = REINFORCE++ (normalised over the whole batch); ``gae`` = PPO with a
            critic; ``process`` = S2R process-level (per-action rewards, per-action baselines).
        reward_level: How per-turn rewards become the learning signal. ``outcome``: the last
            turn's reward for the whole episode (its ``info["outcome_reward"]`` when the
            environment reports one, as S2R's does); ``sum``: the sum of turn rewards for the
            whole episode; ``turn``: each turn credited with its discounted return-to-go, against
            a leave-one-out baseline by turn index (``advantages.turn_level``).
        turn_gamma: Discount across turns for ``reward_level="turn"``.
        process_baseline: For ``advantage="process"`` (rewards from ``info["process_reward"]``
            when present, else the step reward): which actions share a baseline.
            ``position_kind`` (default) = same problem, same action index and kind (solve/verify);
            ``kind`` = same problem and kind; ``group`` = all actions of the problem's group.
        gamma, lam: GAE discount and trace parameters (token level, PPO only).
        whiten_advantages: Normalise advantages over the batch after estimation (PPO).
        clip_low, clip_high: Ratio clip range [1 - clip_low, 1 + clip_high]; DAPO's clip-higher
            is clip_high > clip_low.
        dual_clip: Dual-clip constant c > 1 bounding the loss for negative advantages; None = off.
        loss_agg: ``token_mean`` (DAPO, every token weighs the same), ``seq_mean_token_mean``
            (GRPO, mean per sequence then over sequences), ``seq_sum_constant`` (Dr. GRPO, token
            sum per sequence divided by ``loss_agg_constant``, then mean over sequences).
        loss_agg_constant: Divisor for ``seq_sum_constant``; None = the rollout's max new tokens.
        kl_coef: Weight of the KL to the reference policy (0 = off, no reference pass).
        kl_estimator: ``k1`` log-ratio, ``k2`` squared log-ratio / 2, ``k3`` (Schulman's unbiased,
            non-negative) estimator.
        kl_mode: ``loss`` adds the KL term to the loss (GRPO); ``reward`` subtracts it from the
            token rewards (PPO, REINFORCE++).
        entropy_coef: Entropy bonus weight.
        critic: ``none``, ``value_head`` on the policy backbone, or a ``separate`` value model.
        vf_coef: Value loss weight.
        value_clip: Clip range for the value loss (None = unclipped).
        overlong_filter: Mask out the loss of samples whose generation was truncated (DAPO).
        overlong_penalty: Add DAPO's soft overlong punishment to the reward.
        overlong_max_len, overlong_cache_len: L_max and L_cache of the soft punishment (tokens).
        format_reward: DeepSeek-R1-Zero format reward added to every turn whose text is
            ``<think>...</think><answer>...</answer>`` (0 = off). For environments that do not
            score format themselves (MathVerify's ``reward="r1"`` does: do not use both).
        dynamic_sampling: Keep only groups whose rewards are not all equal, resampling until the
            batch holds the requested number of groups (DAPO).
        max_sampling_rounds: Cap on rollout rounds per step under dynamic sampling.
        epochs: Passes over each rollout batch (PPO-style reuse); mini-batching is a train setting.
    """

    name: str = "grpo"
    advantage: Advantage = "group_norm"
    reward_level: RewardLevel = "sum"
    turn_gamma: float = 1.0
    process_baseline: ProcessBaseline = "position_kind"
    gamma: float = 1.0
    lam: float = 0.95
    whiten_advantages: bool = False
    clip_low: float = 0.2
    clip_high: float = 0.2
    dual_clip: float | None = None
    loss_agg: LossAgg = "seq_mean_token_mean"
    loss_agg_constant: int | None = None
    kl_coef: float = 0.0
    kl_estimator: KLEstimator = "k3"
    kl_mode: KLMode = "loss"
    entropy_coef: float = 0.0
    critic: Critic = "none"
    vf_coef: float = 0.5
    value_clip: float | None = None
    overlong_filter: bool = False
    overlong_penalty: bool = False
    overlong_max_len: int = 256
    overlong_cache_len: int = 64
    format_reward: float = 0.0
    dynamic_sampling: bool = False
    max_sampling_rounds: int = 4
    epochs: int = 1

    @property
    def needs_reference(self) -> bool:
        """A reference forward pass is needed only when a KL term is on."""
        return self.kl_coef > 0.0

    @property
    def needs_critic(self) -> bool:
        return self.advantage == "gae"

    def validate(self) -> None:
        """Cross-field checks, each with a fix-it message."""
        if self.advantage == "gae" and self.critic == "none":
            raise ValueError("advantage='gae' (PPO) needs a critic: set algo.critic=value_head or separate")
        if self.clip_low < 0 or self.clip_high < 0:
            raise ValueError(
                f"clip bounds must be >= 0, got clip_low={self.clip_low}, clip_high={self.clip_high}"
            )
        if self.dual_clip is not None and self.dual_clip <= 1.0:
            raise ValueError(f"dual_clip must be > 1 (e.g. 3.0) or null, got {self.dual_clip}")
        if self.overlong_penalty and not 0 < self.overlong_cache_len < self.overlong_max_len:
            raise ValueError(
                "overlong_penalty needs 0 < overlong_cache_len < overlong_max_len, got "
                f"{self.overlong_cache_len} and {self.overlong_max_len}"
            )
        if self.format_reward < 0:
            raise ValueError(
                f"format_reward is a bonus for well-formed turns: need >= 0, got {self.format_reward}"
            )
        if self.epochs < 1:
            raise ValueError(f"epochs must be >= 1, got {self.epochs}")
