"""Difficulty-aware sampling: which problems are drawn, and which groups are kept.

Every training problem is an env seed, and seeds only move forward (training never repeats a
problem), so difficulty is tracked per *bucket*, not per problem: the value of a task field that
the environment reports at reset (``info["task"]``; ``level`` for math, ``target`` for Points24),
prefixed by the mixture entry the problem comes from (``math/3``, ``p24/24``). An environment
without such a field is one bucket.

Three parts, each deterministic in the run's seed and what the run has seen:

* :class:`SuccessStats`: per bucket, a running (exponential moving average) success rate of the
  groups played from it. Every rank updates it with the same gathered groups, and it is saved
  with the trainer state, so ranks and a resumed run agree on it exactly.
* :func:`draw_problems`: offers the next seeds in order; a seed whose bucket is in pool ``p``
  is taken with probability ``w_p / max_q w_q`` (``pool_weights``), by a draw that depends only
  on ``(run seed, env seed)``. A seed not taken is skipped for good. The scan is bounded: after
  ``max_scan * n`` seeds the batch is filled with the first skipped ones (``forced``).
* :func:`gate_accepts`: the group gate. A group is rejected when its learning signals are all
  equal (every advantage is 0) or its success rate is outside ``[low, high]``; the sampler then
  draws a replacement (``sampling.dynamic_sampling``) until the batch is full or the rounds run
  out. What the rejected groups cost is counted (``paid_metrics``).

prime-rl's buffer keeps "easy / normal / hard" pools by each problem's running reward and samples
by pool; DAPO's dynamic sampling drops zero-advantage groups after paying for them.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from veriloop.agents.trajectory import Trajectory
from veriloop.algos.learner.signal import informative_fraction, is_informative, verifier_failed
from veriloop.algos.loop.mixture import assign_envs
from veriloop.algos.loop.sampling import dynamic_sampling
from veriloop.configs.curriculum import Pool, check_pools  # noqa: F401  (re-exported: they live with the settings)
from veriloop.configs.schema import ExperimentConfig
from veriloop.envs.json_safe import jsonable

#: Salt of the acceptance draw, so it never coincides with the mixture draw of the same seed.
_SALT = 0x637572


def pool_of(rate: float, pools: Sequence[Pool]) -> Pool:
    """The first pool whose range holds ``rate``."""
    for p in pools:
        if p.low <= rate <= p.high:
            return p
    raise ValueError(f"success rate {rate} is in no pool (check_pools makes sure this cannot happen)")


@dataclass
class SuccessStats:
    """Running success rate per bucket: ``r <- (1 - alpha) r + alpha s`` for each group's success
    rate ``s``; the first group of a bucket sets ``r = s``. ``prior`` is the rate of an unseen one.

    Attributes:
        alpha: EMA step in (0, 1].
        prior: Assumed success rate of a bucket never played.
        rates, groups: Per bucket: the running rate and how many groups it has seen.
    """

    alpha: float = 0.2
    prior: float = 0.5
    rates: dict[str, float] | None = None
    groups: dict[str, int] | None = None

    def __post_init__(self) -> None:
        self.rates = dict(self.rates or {})
        self.groups = dict(self.groups or {})

    def rate(self, bucket: str) -> float:
        assert self.rates is not None
        return self.rates.get(bucket, self.prior)

    def update(self, bucket: str, success: float) -> None:
        """One group of ``bucket`` with success rate ``success`` (in [0, 1])."""
        assert self.rates is not None and self.groups is not None
        old = self.rates.get(bucket)
        self.rates[bucket] = success if old is None else (1 - self.alpha) * old + self.alpha * success
        self.groups[bucket] = self.groups.get(bucket, 0) + 1

    def state(self) -> dict[str, Any]:
        """Plain data for the checkpoint (``from_state`` inverts it)."""
        return {"rates": dict(self.rates or {}), "groups": dict(self.groups or {})}

    @classmethod
    def from_state(cls, state: Mapping[str, Any] | None, *, alpha: float, prior: float) -> SuccessStats:
        state = state or {}
        return cls(
            alpha=alpha, prior=prior, rates=dict(state.get("rates", {})), groups=dict(state.get("groups", {}))
        )


def accept_draw(run_seed: int, seed: int) -> float:
    """The uniform number in [0, 1) that decides whether env seed ``seed`` is taken: a function
    of ``(run_seed, seed)`` alone, so every rank and every resumed run draws the same."""
    return float(np.random.default_rng([int(run_seed) & 0xFFFFFFFF, int(seed) & 0xFFFFFFFF, _SALT]).random())


@dataclass(frozen=True)
class Draw:
    """What :func:`draw_problems` chose.

    Attributes:
        seeds: The ``n`` env seeds to play, ascending.
        next_seed: The first seed not yet offered (the trainer's next ``next_seed``).
        skipped: Seeds offered and not taken (lost for good: training never repeats a problem).
        forced: Seeds taken after the scan bound was hit (the batch is filled anyway).
        pools: How many of ``seeds`` came from each pool.
    """

    seeds: tuple[int, ...]
    next_seed: int
    skipped: int
    forced: int
    pools: dict[str, int]


def draw_problems(
    first_seed: int,
    n: int,
    *,
    bucket_of: Callable[[int], str],
    stats: SuccessStats,
    pools: Sequence[Pool],
    run_seed: int,
    max_scan: int,
) -> Draw:
    """Choose ``n`` problems from the seeds ``first_seed, first_seed + 1, ...`` by difficulty pool.

    Seed ``s`` of bucket ``b`` is taken iff ``u(run_seed, s) < w_p / max_q w_q`` with ``p`` the pool
    of ``stats.rate(b)``. At most ``max_scan * n`` seeds are offered; if fewer than ``n`` were taken
    by then, the first skipped ones fill the batch (counted as ``forced``).

    Args:
        first_seed: The first seed to offer (the trainer's ``next_seed``).
        n: Problems wanted (>= 1).
        bucket_of: ``seed -> bucket`` (deterministic: the env's reset with that seed).
        stats, pools: The running success rates and the pools (``check_pools``).
        run_seed: Salt of the acceptance draw (``rollout.seed``).
        max_scan: Seeds offered per problem wanted, at most (>= 1).
    """
    if n < 1 or max_scan < 1:
        raise ValueError(f"draw_problems needs n >= 1 and max_scan >= 1, got {n} and {max_scan}")
    top = max(p.weight for p in pools)
    taken: list[int] = []
    skipped: list[int] = []
    counts = {p.name: 0 for p in pools}
    seed = first_seed
    while len(taken) < n and seed < first_seed + max_scan * n:
        pool = pool_of(stats.rate(bucket_of(seed)), pools)
        if accept_draw(run_seed, seed) < pool.weight / top:
            taken.append(seed)
            counts[pool.name] += 1
        else:
            skipped.append(seed)
        seed += 1
    forced = skipped[: n - len(taken)]
    for s in forced:
        counts[pool_of(stats.rate(bucket_of(s)), pools).name] += 1
    return Draw(tuple(sorted(taken + forced)), seed, len(skipped) - len(forced), len(forced), counts)


def bucket_name(env_name: str, task: Mapping[str, Any], keys: Sequence[str]) -> str:
    """``<env name>/<value of the first of keys in task>``, or ``<env name>`` when none is there."""
    for k in keys:
        if k in task:
            return f"{env_name}/{task[k]}"
    return env_name


def episode_success(traj: Trajectory) -> float:
    """1.0 when the episode's last step solved its task (``LearnerSignal.solved``), else 0.0."""
    return float(bool(traj.turns) and traj.turns[-1].signal.solved)


def gate_accepts(signals: Sequence[Any], successes: Sequence[float], *, low: float, high: float) -> bool:
    """Keep a group only if its learning signals differ (some advantage is not 0) and its success
    rate ``mean(successes)`` is in ``[low, high]``.

    Args:
        signals: One learning signal per episode (a number or a tuple; ``credit.learning_signal``).
        successes: One 0/1 success per episode, same order.
        low, high: The accepted success-rate range ([0, 1] = only the all-equal test).
    """
    if len(signals) != len(successes):
        raise ValueError(f"{len(signals)} signals but {len(successes)} successes")
    if not is_informative(signals):
        return False
    rate = sum(successes) / len(successes)
    return low <= rate <= high


def record_groups(
    stats: SuccessStats, groups: Sequence[Sequence[Trajectory]], bucket_of_traj: Callable[[Trajectory], str]
) -> None:
    """Feed every played group (kept or rejected: each is an observation) into ``stats``."""
    for group in groups:
        if group:
            stats.update(bucket_of_traj(group[0]), sum(episode_success(t) for t in group) / len(group))


def pool_metrics(stats: SuccessStats, pools: Sequence[Pool], draw: Draw) -> dict[str, float]:
    """``curriculum/pool/<name>/{buckets,drawn}``, ``curriculum/{buckets,skipped,forced}``."""
    assert stats.rates is not None
    out: dict[str, float] = {
        "curriculum/buckets": float(len(stats.rates)),
        "curriculum/skipped": float(draw.skipped),
        "curriculum/forced": float(draw.forced),
    }
    sizes = {p.name: 0 for p in pools}
    for rate in stats.rates.values():
        sizes[pool_of(rate, pools).name] += 1
    for p in pools:
        out[f"curriculum/pool/{p.name}/buckets"] = float(sizes[p.name])
        out[f"curriculum/pool/{p.name}/drawn"] = float(draw.pools[p.name])
    return out


def paid_metrics(
    sampled: Sequence[Trajectory], kept: int, gate_stats: Mapping[str, float]
) -> dict[str, float]:
    """What the gate cost: ``curriculum/{rejected_groups,refills,paid_episodes,paid_tokens,wasted_episodes}``.

    Args:
        sampled: Every episode played this step (rejected groups included).
        kept: Episodes trained on.
        gate_stats: ``dynamic_sampling``'s stats (``rounds``, ``sampled_groups``, ``kept_groups``).
    """
    return {
        "curriculum/rejected_groups": gate_stats["sampled_groups"] - gate_stats["kept_groups"],
        "curriculum/refills": gate_stats["rounds"] - 1.0,
        "curriculum/paid_episodes": float(len(sampled)),
        "curriculum/paid_tokens": float(sum(t.num_generated_tokens for t in sampled)),
        "curriculum/wasted_episodes": float(len(sampled) - kept),
    }


# ------------------------------------------------------------------------------ one training step


@functools.lru_cache(maxsize=16)
def _bucket_env(env_id: str, kwargs_json: str) -> Any:
    """One environment per (id, kwargs), kept: a bucket lookup is a reset, not a rebuild."""
    import gymnasium as gym

    return gym.make(env_id, **json.loads(kwargs_json))


class Buckets:
    """A problem's bucket from its seed (before playing it) or from its episode (after).

    Both give ``<mixture entry>/<task field>`` (``bucket_name``); the seed's comes from the same
    mixture draw and the same reset as the rollout's, so they agree.
    """

    def __init__(self, cfg: ExperimentConfig) -> None:
        self.cfg, self.keys = cfg, list(cfg.curriculum.bucket_keys)
        self.envs = {n: (str(e.id or cfg.env.id), dict(e.kwargs)) for n, e in cfg.env.training_envs.items()}
        self.names = {(i, _canonical(k)): n for n, (i, k) in self.envs.items()}

    def of_seed(self, seed: int) -> str:
        (name,) = assign_envs(self.cfg.env.mixture_weights, [seed], self.cfg.rollout.seed)
        env_id, kwargs = self.envs[name]
        _, info = _bucket_env(env_id, _canonical(kwargs)).reset(seed=seed)
        return bucket_name(name, jsonable(info.get("task", {})), self.keys)

    def of_traj(self, traj: Trajectory) -> str:
        name = self.names.get((traj.env_id, _canonical(traj.env_kwargs)), traj.env_id)
        return bucket_name(name, traj.task, self.keys)


def _canonical(kwargs: Mapping[str, Any]) -> str:
    return json.dumps(dict(kwargs), sort_keys=True, default=str)


def merge_draws(draws: Sequence[Draw], pools: Sequence[Pool]) -> Draw:
    """The draws of one step's rounds as one (seeds joined, counts summed)."""
    if not draws:
        return Draw((), 0, 0, 0, {p.name: 0 for p in pools})
    counts = {p.name: sum(d.pools[p.name] for d in draws) for p in pools}
    seeds = tuple(s for d in draws for s in d.seeds)
    return Draw(
        seeds, draws[-1].next_seed, sum(d.skipped for d in draws), sum(d.forced for d in draws), counts
    )


def curriculum_step(
    cfg: ExperimentConfig,
    sampler: Any,
    history: dict[str, Any],
    signal_fn: Callable[[Trajectory], Any],
) -> tuple[list[list[Trajectory]], dict[str, float]]:
    """One step's groups under ``cfg.curriculum``: pool draws and / or the refilling gate.

    Args:
        cfg: The experiment (its ``curriculum``, ``env`` and ``rollout`` sections are read).
        sampler: ``n -> groups`` (``source.GroupSampler``); under pools its ``choose`` is set to the
            difficulty draw. Every rank gets every rank's groups from it, so the statistics
            below are the same on every rank.
        history: ``TrainerState.history``: the running rates live in ``history["curriculum"]``
            (saved with the checkpoint, so a resumed run draws as an uninterrupted one).
        signal_fn: The learning signal of an episode (``credit.learning_signal``).

    Returns:
        The groups to train on and the ``sampling/*`` and ``curriculum/*`` metrics.
    """
    cur, n = cfg.curriculum, cfg.rollout.prompts_per_step
    stats = SuccessStats.from_state(history.get("curriculum"), alpha=cur.alpha, prior=cur.prior)
    buckets, pools, draws = Buckets(cfg), cur.pool_list(), []
    if cur.pools_enabled:

        def choose(first: int, k: int) -> tuple[tuple[int, ...], int]:
            d = draw_problems(
                first,
                k,
                bucket_of=buckets.of_seed,
                stats=stats,
                pools=pools,
                run_seed=cfg.rollout.seed,
                max_scan=cur.max_scan,
            )
            draws.append(d)
            return d.seeds, d.next_seed

        sampler.choose = choose
    played: list[list[Trajectory]] = []

    def sample(k: int) -> list[list[Trajectory]]:
        groups = sampler(k)
        played.extend(groups)
        return groups

    def accept(group: list[Trajectory]) -> bool:
        return gate_accepts(
            [signal_fn(t) for t in group],
            [episode_success(t) for t in group],
            low=cur.gate_low,
            high=cur.gate_high,
        )

    groups, gs = dynamic_sampling(
        sample,
        num_groups=n,
        max_rounds=cur.rounds,
        reward_fn=signal_fn,
        accept=accept if cur.gate else lambda g: True,
        name="the curriculum gate" if cur.gate else "curriculum sampling",
    )
    # every played group is an observation of its bucket (rejected ones too); failed verifications are not
    record_groups(stats, [[t for t in g if not verifier_failed(t)] for g in played], buckets.of_traj)
    history["curriculum"] = stats.state()
    kept = sum(len(g) for g in groups)
    sampled = [t for g in played for t in g]
    # the plain loop's formula over every group played (the gate's acceptances are kept_fraction)
    metrics = {
        "sampling/rounds": gs["rounds"],
        "sampling/kept_fraction": gs["kept_fraction"],
        "sampling/informative_fraction": informative_fraction(played, signal_fn),
        "sampling/short_batch": gs["short_batch"],
        **pool_metrics(stats, pools, merge_draws(draws, pools)),
        **paid_metrics(sampled, kept, gs),
    }
    return groups, metrics
