"""Algorithm settings: one typed field per choice, with its meaning documented once.

An algorithm is a combination of parts chosen here (advantage estimator, loss clipping, loss
aggregation, KL, shaping, sampling); presets in ``configs/algos/*.yaml`` fill these fields the
way each paper describes. See the paper references in each part's
docstring.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from typing import Any, Literal

Advantage = Literal[
    "group_norm", "group_mean", "rloo", "batch_norm", "group_mean_batch_norm", "gae", "process", "gdpo"
]
#: The on-policy distillation teacher: the policy given the env's privileged context, or another model.
DistillTeacher = Literal["privileged", "model"]
PolicyLoss = Literal["ppo_clip", "gspo", "gspo_token", "cispo", "sapo", "gmpo", "clip_cov", "kl_cov", "dppo"]
DPPODivergence = Literal["tv", "kl"]
SequenceUnit = Literal["episode", "turn"]
RolloutIS = Literal["none", "truncate", "mask"]
#: How an episode's per-turn rewards become one number: the last turn's (``outcome``) or their sum.
EpisodeLevel = Literal["outcome", "sum"]
#: ``EpisodeLevel`` or one reward per turn (``turn``).
RewardLevel = Literal[EpisodeLevel, "turn"]
ProcessBaseline = Literal["position_kind", "kind", "group"]
LossAgg = Literal["token_mean", "seq_mean_token_mean", "seq_sum_constant"]
KLEstimator = Literal["k1", "k2", "k3"]
KLMode = Literal["loss", "reward"]
Critic = Literal["none", "value_head", "separate"]
#: How a split episode's samples weigh: as parts of their episode, or each as its own sequence.
SplitWeight = Literal["episode", "sample"]
#: The weights the rollouts are sampled with: the trained ones (on-policy) or those RL started from.
SamplerWeights = Literal["current", "initial"]


# ------------------------------------------------------------------------ the tables of choices
#
# One record per advantage estimator and per policy objective: the pure function it runs (a
# ``"module:function"`` entry point, imported by ``veriloop.algos.learner.algorithm``; settings never
# import the trainer), which ``AlgoConfig`` fields bind to which of its keyword parameters, and the
# traits the config checks and the update read. Adding one is its function plus one row here (and
# its name in the ``Literal`` above, which a test holds equal to the table's keys): the learner
# binds the row's settings itself, no adapter is written by hand.

#: What an estimator's advantages vary with: one value per episode (``episode``; per turn under
#: ``reward_level=turn``), one per action from the env's process rewards (``action``), one per
#: token (``token``, bootstrapped by a critic).
SignalLevel = Literal["episode", "action", "token"]
#: What an estimator's function takes: the episode rewards of a batch (``episode``:
#: ``(rewards [N], group_ids [N], *, valid [N], ...) -> [N]``, a baseline per episode that the
#: learner spreads over the tokens, with the KL reward to go added) or the whole batch (``batch``:
#: ``(AlgoConfig, RewardInputs) -> (advantages [N, T], returns [N, T] | None)``, for estimators that
#: read the critic, the trajectories or the token layout).
EstimatorForm = Literal["episode", "batch"]


@dataclass(frozen=True)
class EstimatorSpec:
    """One advantage estimator.

    Attributes:
        estimator: ``"module:function"``, of the shape ``form`` says.
        group_based: its baseline is the other samples of the same prompt (``group_size >= 2``).
        needs_critic: it bootstraps from a learned value (``algo.critic`` must be set).
        signal: :data:`SignalLevel`: ``action`` reads ``signal.process_reward`` per turn.
        turn_rewards: it accepts ``reward_level=turn`` (per-turn credit). An ``episode`` form then
            runs ``advantages.turn_level`` (each turn's return to go against the group's other
            episodes at that turn), std-normalised when ``fixed`` sets ``std_normalize``.
        form: :data:`EstimatorForm`.
        bind: keyword parameter of the function -> the ``AlgoConfig`` field passed to it.
        fixed: keyword parameter of the function -> a constant passed to it.
    """

    estimator: str
    group_based: bool
    needs_critic: bool = False
    signal: SignalLevel = "episode"
    turn_rewards: bool = True
    form: EstimatorForm = "episode"
    bind: dict[str, str] = field(default_factory=dict)
    fixed: dict[str, Any] = field(default_factory=dict)


_ALGO = "veriloop.algos.learner.algorithm"
_ADV = "veriloop.algos.maths.advantages"
ADVANTAGES: dict[str, EstimatorSpec] = {
    "group_norm": EstimatorSpec(f"{_ADV}:group_normalized", group_based=True, fixed={"std_normalize": True}),
    "group_mean": EstimatorSpec(f"{_ADV}:group_normalized", group_based=True, fixed={"std_normalize": False}),
    "rloo": EstimatorSpec(f"{_ADV}:leave_one_out", group_based=True),
    "batch_norm": EstimatorSpec(f"{_ALGO}:batch_norm", group_based=False, form="batch"),
    "group_mean_batch_norm": EstimatorSpec(f"{_ALGO}:group_mean_batch_norm", group_based=True, form="batch"),
    "gae": EstimatorSpec(f"{_ALGO}:gae", group_based=False, needs_critic=True, signal="token", form="batch"),
    "process": EstimatorSpec(f"{_ALGO}:process", group_based=True, signal="action", form="batch"),
    "gdpo": EstimatorSpec(f"{_ALGO}:gdpo", group_based=True, turn_rewards=False, form="batch"),
}


@dataclass(frozen=True)
class PolicyLossSpec:
    """One policy objective.

    Attributes:
        objective: ``"module:function"`` of the pure per-token loss, ``(logprobs, old_logprobs,
            advantages, mask, *, ...) -> (loss [B, T], stats)``. Besides ``bind`` and ``fixed`` the
            learner passes the keyword parameters it declares of ``segments`` (the turn index under
            ``sequence_unit=turn``), ``episodes`` (the episode of each row), ``select`` (the
            tokens ``selector`` chose) and ``is_weights`` (the rollout-correction weights); a
            function without ``is_weights`` has its per-token loss multiplied by them.
        bind: keyword parameter of the loss -> the ``AlgoConfig`` field passed to it.
        fixed: keyword parameter of the loss -> a constant passed to it.
        sequence_level: one loss per sequence, put on each of its tokens: only
            ``loss_agg=seq_mean_token_mean`` weighs sequences equally.
        per_sequence_advantage: it needs one advantage per sequence (``sequence_unit``).
        reads_sampler: its ratio is against the sampler's recorded mu (no top-p / top-k, no
            rollout correction on top): the loss's second argument is log mu, not log pi_old.
        selector: ``"module:function"`` choosing the tokens it acts on once per mini-batch,
            ``(advantages, log pi_old, mask, *, ...) -> [B, T] bool``, given the row's ``bind`` and
            ``fixed`` entries its signature names; or None.
    """

    objective: str
    bind: dict[str, str] = field(default_factory=dict)
    fixed: dict[str, Any] = field(default_factory=dict)
    sequence_level: bool = False
    per_sequence_advantage: bool = False
    reads_sampler: bool = False
    selector: str | None = None


_LOSS = "veriloop.algos.maths.losses"
_CLIP = {"clip_low": "clip_low", "clip_high": "clip_high"}
_COV = {"cov_ratio": "cov_ratio", "cov_lb": "cov_lb", "cov_ub": "cov_ub"}
_DPPO = {
    "divergence": "dppo_divergence",
    "delta_low": "dppo_low",
    "delta_high": "dppo_high",
    "tau": "dppo_tau",
    "ratio_cap": "dppo_ratio_cap",
}
POLICY_LOSSES: dict[str, PolicyLossSpec] = {
    "ppo_clip": PolicyLossSpec(f"{_LOSS}:clipped_pg_loss", bind={**_CLIP, "dual_clip": "dual_clip"}),
    "gspo": PolicyLossSpec(
        f"{_LOSS}:gspo_loss", bind=_CLIP, sequence_level=True, per_sequence_advantage=True
    ),
    "gspo_token": PolicyLossSpec(
        f"{_LOSS}:gspo_loss", bind=_CLIP, fixed={"level": "token"}, sequence_level=True
    ),
    "cispo": PolicyLossSpec(f"{_LOSS}:cispo_loss", bind=_CLIP),
    "sapo": PolicyLossSpec(f"{_LOSS}:sapo_loss", bind={"tau_pos": "sapo_tau_pos", "tau_neg": "sapo_tau_neg"}),
    "gmpo": PolicyLossSpec(
        f"{_LOSS}:gmpo_loss", bind=_CLIP, sequence_level=True, per_sequence_advantage=True
    ),
    "clip_cov": PolicyLossSpec(
        f"{_LOSS}:clip_cov_loss", bind={**_CLIP, **_COV}, selector=f"{_LOSS}:clip_cov_select"
    ),
    "kl_cov": PolicyLossSpec(
        f"{_LOSS}:kl_cov_loss",
        bind={"cov_ratio": "cov_ratio", "kl_coef": "cov_kl_coef"},
        selector=f"{_LOSS}:kl_cov_select",
    ),
    "dppo": PolicyLossSpec(f"{_LOSS}:dppo_loss", bind=_DPPO, reads_sampler=True),
}
#: Policy objectives whose loss is one number per sequence: they take the per-sequence mean only.
SEQUENCE_LEVEL_LOSSES = tuple(name for name, spec in POLICY_LOSSES.items() if spec.sequence_level)


@dataclass
class AlgoConfig:
    """How one RL update is computed.

    Attributes:
        name: Preset name, for logs.
        advantage: Estimator. ``group_norm`` = GRPO (R - mean) / std over the group;
            ``group_mean`` = Dr. GRPO (R - mean); ``rloo`` = leave-one-out baseline;
            ``batch_norm`` = REINFORCE++ (return whitened over the batch's tokens);
            ``group_mean_batch_norm`` = REINFORCE++-baseline (reward minus the group mean, then
            whitened over the batch's tokens); ``gae`` = PPO with a critic; ``gdpo`` = GDPO: each
            reward component (``info["reward_components"]``, plus the trainer's own shaping as
            one more) normalised within its group, summed, then whitened over the batch (with
            one component: GRPO, as the authors' code);
            ``process`` = S2R process-level (per-action rewards, per-action baselines).
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
        balance_reward_classes: For ``advantage="process"``: weigh each judgement action's reward
            (an S2R verify, whose ``LearnerSignal.reward_class`` names the truth of the solve it
            judges) by the inverse share of its class in the batch, so that the verify reward is
            balanced accuracy, not plain accuracy: a verifier that always says the same thing then
            earns what chance does instead of the majority class's share
            (``shaping.class_balanced_rewards``). Off by default (the S2R paper's reward).
        gamma, lam: GAE discount and trace parameters (token level, PPO only).
        whiten_advantages: Normalise advantages over the batch after estimation (PPO).
        clip_low, clip_high: Ratio clip range [1 - clip_low, 1 + clip_high]; DAPO's clip-higher
            is clip_high > clip_low. GSPO clips its sequence ratio with them (narrow: 3e-4 / 4e-4),
            CISPO its detached IS weight; GMPO reads them in log space, [e^-clip_low, e^clip_high].
            CISPO's cap is *relative*, 1 + clip_high (MiniMax's eps_high); TRL's CISPO cap is the
            absolute upper bound of the weight: TRL's cap c is clip_high = c - 1 here.
        dual_clip: Dual-clip constant c > 1 bounding the loss for negative advantages; None = off.
        policy_loss: The policy objective (``algos.losses``). ``ppo_clip`` (PPO / GRPO / DAPO
            clipped surrogate); ``gspo`` (one clipped geometric-mean ratio per sequence, Zheng et
            al. 2025) and ``gspo_token`` (its token-level form, for per-token advantages);
            ``cispo`` (clipped, detached IS weight times A log pi; MiniMax-M1); ``sapo`` (soft
            sigmoid gate, temperature by the sign of A); ``gmpo`` (geometric mean of token ratios,
            clipped in log space); ``clip_cov`` / ``kl_cov`` (Cui et al. 2025: detach / KL-penalise
            the tokens with the highest advantage-log-prob covariance); ``dppo`` (Qi et al. 2026:
            ratio against the sampler's mu, a binary TV / KL trust-region mask and a small
            squared log-ratio penalty; ``dppo_*``). ``gspo``, ``gspo_token`` and ``gmpo`` are
            sequence-level: they need ``loss_agg=seq_mean_token_mean``.
        sequence_unit: What "the sequence" is for sequence-level objectives (gspo, gmpo) and the
            geometric rollout mask: ``episode`` = all sampled tokens of the episode, every turn
            (environment tokens between turns are not part of it); ``turn`` = each turn's sampled
            tokens on their own (use it with per-turn credit: ``reward_level=turn``, ``process``);
            the sequence modes of ``loss_agg`` then average per (episode, turn) too.
        sapo_tau_pos, sapo_tau_neg: SAPO gate temperatures for A > 0 and A < 0 (paper: 1.0, 1.05).
        cov_ratio: Clip-Cov / KL-Cov share of tokens acted on (paper: 2e-4; KL-Cov 2e-3 at 7B).
        cov_lb, cov_ub: Clip-Cov covariance window from which tokens are detached (paper: 1, 5).
        cov_kl_coef: KL-Cov weight of |log ratio| on the selected tokens (paper: 1).
            Clip-Cov / KL-Cov choose their tokens once per mini-batch, with log pi_old (the policy
            the batch was sampled from; pi_theta at the first update), so micro-batching leaves the
            gradient unchanged.
        dppo_divergence: DPPO's trust-region divergence, ``tv`` (pi - mu of the sampled token) or
            ``kl`` (the binary KL of mu vs pi on {token, rest}).
        dppo_low, dppo_high: DPPO's bounds on that divergence for A < 0 / A > 0 (prime-rl's TV
            default 0.2 / 0.2; a KL bound is on another scale, e.g. 0.05).
        dppo_tau: Weight of DPPO's squared log-ratio penalty tau (log pi / mu)^2 (prime-rl: 1e-3).
        rollout_is: Rollout correction per token, with mu the sampler's recorded probability and
            pi_old the trainer's own (recomputed before the update): ``truncate`` weighs the loss
            by min(pi_old / mu, rollout_is_cap) (TIS); ``mask`` by pi_old / mu, dropping tokens
            whose ratio leaves [rollout_is_low, rollout_is_high] (MIS / IcePop); ``none``.
            The bounds are on pi_old / mu; verl's are on mu / pi_old (its [a, b] is [1/b, 1/a]
            here: the same only for bounds symmetric in log space, such as [0.5, 2]). Not with
            top-p / top-k sampling (the config check refuses it): mu is then the filtered
            distribution's and pi_old / mu is the nucleus mass, not a mismatch.
        rollout_is_cap: C of truncated IS.
        rollout_is_low, rollout_is_high: Masked IS bounds.
        rollout_seq_mask: Drop a whole sequence (``sequence_unit``) when the geometric mean of its
            pi_old / mu leaves [rollout_seq_low, rollout_seq_high]. Combines with ``rollout_is``.
        rollout_seq_low, rollout_seq_high: Geometric sequence-mask bounds.
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
        distill_coef: Weight of the on-policy distillation term: the per-token reverse KL to a
            teacher on the student's own samples (``maths.distill``); 0 = off.
        distill_teacher: ``privileged`` = the policy itself, reading the environment's
            ``privileged_context`` (the gold answer, a solver's formula) in its prompt, which the
            student never sees; ``model`` = another model (``distill_teacher_model``), reading the
            student's own context.
        distill_teacher_model: The teacher for ``distill_teacher=model`` (a saved policy folder).
        rl_coef: Weight of the RL objective beside the distillation term (0 = distillation only).
        split_weight: How an episode split into several samples (compaction, a template that
            rewrites history) weighs in the sequence modes of ``loss_agg`` and in GSPO / GMPO.
            ``episode`` (default, every paper's per-episode mean): the episode is one sequence, its
            samples weighted by their share of its tokens, 1/G per episode, one sequence ratio per
            episode; ``sample``: each sample its own sequence (an episode of k samples weighs k
            times). An episode of one sample is the same under both.
        dppo_ratio_cap: Cap c on DPPO's policy-gradient weight, min(pi / mu, c) (verl's 20, the
            paper's section 5.4); None = no cap (prime-rl).
        distill_trust_low: The distillation term's trust region (prime-rl's ``opsd``): drop the
            tokens whose pi_theta - mu < -distill_trust_low (prime-rl: 0.2); None = off.
        distill_tau: Weight of the distillation term's tau (log pi_theta / mu)^2 (prime-rl: 1e-3).
        distill_ratio_cap: Cap c on the distillation term's weight, min(pi_theta / mu, c), detached
            above c (truncated IS, as ``rollout_is_cap``); None = no cap. On-policy (one update per
            batch) pi_theta / mu stays ~1 and the cap never acts; under ``sampler_weights=initial``
            the student moves away from mu during the run and the cap bounds the weight.
        sampler_weights: The weights the rollouts are sampled with. ``current`` (default): the
            sampler is handed the trained weights after every update (on-policy). ``initial``:
            the sampler keeps the weights RL started from (after any SFT warm-up) for the whole
            run, so every step draws fresh problems from the frozen initial student: distillation
            on the initial student's rollouts (preset ``semi_opd``). Distillation only (needs
            ``distill_coef > 0`` and ``rl_coef = 0``), synchronous, without top-k / top-p.
    """

    name: str = "grpo"
    advantage: Advantage = "group_norm"
    reward_level: RewardLevel = "sum"
    turn_gamma: float = 1.0
    process_baseline: ProcessBaseline = "position_kind"
    balance_reward_classes: bool = False
    gamma: float = 1.0
    lam: float = 0.95
    whiten_advantages: bool = False
    clip_low: float = 0.2
    clip_high: float = 0.2
    dual_clip: float | None = None
    policy_loss: PolicyLoss = "ppo_clip"
    sequence_unit: SequenceUnit = "episode"
    sapo_tau_pos: float = 1.0
    sapo_tau_neg: float = 1.05
    cov_ratio: float = 2e-4
    cov_lb: float = 1.0
    cov_ub: float = 5.0
    cov_kl_coef: float = 1.0
    dppo_divergence: DPPODivergence = "tv"
    dppo_low: float = 0.2
    dppo_high: float = 0.2
    dppo_tau: float = 1e-3
    rollout_is: RolloutIS = "none"
    rollout_is_cap: float = 2.0
    rollout_is_low: float = 0.5
    rollout_is_high: float = 2.0
    rollout_seq_mask: bool = False
    rollout_seq_low: float = 0.999
    rollout_seq_high: float = 1.001
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
    distill_coef: float = 0.0
    distill_teacher: DistillTeacher = "privileged"
    distill_teacher_model: str | None = None
    rl_coef: float = 1.0
    # split samples, DPPO's ratio cap, the distillation trust region
    split_weight: SplitWeight = "episode"
    dppo_ratio_cap: float | None = None
    distill_trust_low: float | None = None
    distill_tau: float = 0.0
    # distillation on the frozen initial student's rollouts
    distill_ratio_cap: float | None = None
    sampler_weights: SamplerWeights = "current"

    @property
    def needs_reference(self) -> bool:
        """A reference forward pass is needed only when a KL term is on."""
        return self.kl_coef > 0.0

    @property
    def estimator(self) -> EstimatorSpec:
        """The row of :data:`ADVANTAGES` that ``advantage`` names (a clear error for an unknown one)."""
        return _row("advantage estimator", self.advantage, ADVANTAGES)

    @property
    def objective(self) -> PolicyLossSpec:
        """The row of :data:`POLICY_LOSSES` that ``policy_loss`` names."""
        return _row("policy_loss", self.policy_loss, POLICY_LOSSES)

    @property
    def needs_critic(self) -> bool:
        return self.estimator.needs_critic

    @property
    def needs_old_recompute(self) -> bool:
        """Rollout correction compares the trainer's pi_old with the sampler's recorded mu."""
        return self.rollout_is != "none" or self.rollout_seq_mask

    @property
    def needs_sampler_logprobs(self) -> bool:
        """The update reads the sampler's recorded log-probs mu as such (rollout correction, DPPO):
        they must be of the trainer's distribution, so top-p / top-k sampling is refused."""
        return self.needs_old_recompute or self.objective.reads_sampler

    def validate(self) -> None:
        """Cross-field checks, each with a fix-it message."""
        if self.estimator.needs_critic and self.critic == "none":
            raise ValueError(
                f"advantage={self.advantage!r} (PPO) needs a critic: set algo.critic=value_head or separate"
            )
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
        if self.balance_reward_classes and self.estimator.signal != "action":
            raise ValueError(
                f"balance_reward_classes weighs per-action (process) rewards, but advantage={self.advantage} "
                "learns from episode rewards: use advantage=process (preset s2r_process_grpo_balanced)"
            )
        if self.format_reward < 0:
            raise ValueError(
                f"format_reward is a bonus for well-formed turns: need >= 0, got {self.format_reward}"
            )
        if self.objective.per_sequence_advantage:
            per_token = self.estimator.signal == "token" or (self.kl_mode == "reward" and self.kl_coef > 0)
            per_turn = self.estimator.signal == "action" or self.reward_level == "turn"
            if per_token or (per_turn and self.sequence_unit != "turn"):
                raise ValueError(
                    f"policy_loss={self.policy_loss} needs one advantage per sequence, but advantage="
                    f"{self.advantage}, reward_level={self.reward_level}, kl_mode={self.kl_mode} give "
                    "per-token or per-turn advantages: use policy_loss=gspo_token"
                    + (", or sequence_unit=turn" if per_turn and not per_token else "")
                )
        self._validate_objective()
        if min(self.sapo_tau_pos, self.sapo_tau_neg) <= 0:
            raise ValueError(f"sapo temperatures must be > 0, got {self.sapo_tau_pos}, {self.sapo_tau_neg}")
        if not 0 < self.cov_ratio <= 1 or self.cov_lb >= self.cov_ub:
            raise ValueError(
                f"need 0 < cov_ratio <= 1 and cov_lb < cov_ub, got {self.cov_ratio}, {self.cov_lb}, {self.cov_ub}"
            )
        if self.rollout_is_cap <= 0 or not 0 <= self.rollout_is_low < 1 < self.rollout_is_high:
            raise ValueError(
                "rollout correction needs rollout_is_cap > 0 and 0 <= rollout_is_low < 1 < rollout_is_high, "
                f"got {self.rollout_is_cap}, {self.rollout_is_low}, {self.rollout_is_high}"
            )
        if not 0 <= self.rollout_seq_low <= 1 <= self.rollout_seq_high:
            raise ValueError(
                "rollout_seq_mask needs 0 <= rollout_seq_low <= 1 <= rollout_seq_high, got "
                f"{self.rollout_seq_low}, {self.rollout_seq_high}"
            )
        if self.epochs < 1:
            raise ValueError(f"epochs must be >= 1, got {self.epochs}")
        self._validate_distill()
        self._validate_split_cap_trust()

    def _validate_split_cap_trust(self) -> None:
        """The split-sample weighting, DPPO's ratio cap and the distillation trust region."""
        if self.split_weight not in ("episode", "sample"):
            raise ValueError(f"split_weight must be 'episode' or 'sample', got {self.split_weight!r}")
        if self.dppo_ratio_cap is not None and self.dppo_ratio_cap <= 0:
            raise ValueError(f"dppo_ratio_cap must be > 0 (verl: 20) or null, got {self.dppo_ratio_cap}")
        if (self.distill_trust_low is not None and self.distill_trust_low <= 0) or self.distill_tau < 0:
            raise ValueError(
                "need distill_trust_low > 0 (prime-rl: 0.2) or null and distill_tau >= 0 (prime-rl: 1e-3), "
                f"got {self.distill_trust_low}, {self.distill_tau}"
            )

    def _validate_distill(self) -> None:
        """The distillation term's weights and teacher; GDPO's reward level."""
        if not self.estimator.turn_rewards and self.reward_level == "turn":
            raise ValueError(
                f"advantage={self.advantage} normalises episode rewards: use reward_level=sum or outcome"
            )
        if self.distill_coef < 0 or self.rl_coef < 0 or self.distill_coef + self.rl_coef == 0:
            raise ValueError(
                f"need distill_coef >= 0 and rl_coef >= 0, not both 0, got {self.distill_coef}, {self.rl_coef}"
            )
        if self.distill_coef > 0 and self.distill_teacher == "model" and not self.distill_teacher_model:
            raise ValueError("distill_teacher=model needs distill_teacher_model (a saved policy folder)")
        if self.distill_ratio_cap is not None and self.distill_ratio_cap <= 0:
            raise ValueError(
                f"distill_ratio_cap must be > 0 (e.g. 2.0) or null, got {self.distill_ratio_cap}"
            )
        self._validate_sampler_weights()

    @property
    def frozen_sampler(self) -> bool:
        """The rollouts come from the initial student for the whole run (``sampler_weights=initial``)."""
        return self.sampler_weights == "initial"

    def _validate_sampler_weights(self) -> None:
        """A frozen sampler trains the distillation term alone: every other part reads pi_old."""
        if self.sampler_weights not in ("current", "initial"):
            raise ValueError(f"sampler_weights must be 'current' or 'initial', got {self.sampler_weights!r}")
        if not self.frozen_sampler:
            return
        if self.distill_coef == 0 or self.rl_coef > 0:
            raise ValueError(
                f"sampler_weights=initial samples every step from the initial student, but rl_coef={self.rl_coef} "
                f"(distill_coef={self.distill_coef}): the RL term's ratio pi_theta / pi_old would be taken "
                "against a policy the trainer has left, where its clip stops the gradient; set distill_coef > 0 "
                "and rl_coef=0 (preset semi_opd), or sampler_weights=current"
            )
        if self.needs_sampler_logprobs:
            raise ValueError(
                "sampler_weights=initial trains the distillation term alone, which weighs each token by "
                "pi_theta / mu itself: the rollout correction and DPPO act on the RL term it turns off; set "
                f"rollout_is=none, rollout_seq_mask=false and policy_loss=ppo_clip (got rollout_is={self.rollout_is}, "
                f"rollout_seq_mask={self.rollout_seq_mask}, policy_loss={self.policy_loss})"
            )

    def _validate_objective(self) -> None:
        """Choices that only some objectives accept."""
        if self.policy_loss in SEQUENCE_LEVEL_LOSSES and self.loss_agg != "seq_mean_token_mean":
            raise ValueError(
                f"policy_loss={self.policy_loss} puts one loss per sequence on each of its tokens: "
                f"loss_agg={self.loss_agg} would weigh each sequence by its length. Use "
                "loss_agg=seq_mean_token_mean (the paper's mean over sequences, as verl hard-codes)"
            )
        if self.objective.reads_sampler:
            if self.needs_old_recompute:
                raise ValueError(
                    "policy_loss=dppo already takes its ratio against the sampler's mu; the rollout "
                    "correction's pi_old / mu weights would correct twice: set rollout_is=none and "
                    "rollout_seq_mask=false"
                )
            if self.dppo_low <= 0 or self.dppo_high <= 0 or self.dppo_tau < 0:
                raise ValueError(
                    f"dppo needs dppo_low > 0, dppo_high > 0 and dppo_tau >= 0, got {self.dppo_low}, "
                    f"{self.dppo_high}, {self.dppo_tau}"
                )
            if self.dppo_divergence not in ("tv", "kl"):
                raise ValueError(f"dppo_divergence must be 'tv' or 'kl', got {self.dppo_divergence!r}")


def _row(field: str, name: str, table: dict[str, Any]) -> Any:
    """``table[name]``, or a ValueError naming the choices (and the closest one)."""
    if name not in table:
        close = difflib.get_close_matches(str(name), list(table), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(f"unknown {field} {name!r}{hint}; choose one of {tuple(table)}")
    return table[name]
