"""Where a step's batch comes from: the :class:`BatchSource` the one step body
(:func:`veriloop.algos.loop.run_steps.run_steps`) draws from, and the synchronous source.

A source owns what differs between K = 0 and K > 0 (``train.max_staleness``): how the step's
groups are played (its ``sampling/*`` keys), how the trained weights reach the sampler (its
hand-over), the metrics only it has (``async/*``) and where evaluations run. Everything else of a
step (the update, the guards, logging, checkpoints) is the step body's, the same for both.

* :class:`SyncSource` (K = 0): each step plays its groups now, with the weights just trained
  (``collect``: dynamic sampling and the curriculum when on), then hands the trained weights to a
  backend with its own copy of them (vLLM) and probes it. Under ``algo.sampler_weights=initial``
  it plays them with the initial student's weights instead and hands nothing over
  (``frozen_sampler``).
* ``async_loop.AsyncSource`` (K > 0): a generation worker plays groups beside the update; a step
  takes those that finished, under the staleness bound.
"""

from __future__ import annotations

import contextlib
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from veriloop.agents.backends import Backend
from veriloop.agents.compaction import make_compactor
from veriloop.agents.engine import EpisodeSpec, rollout
from veriloop.agents.policy import Policy
from veriloop.agents.trajectory import Trajectory
from veriloop.algos.learner.credit import learning_signal
from veriloop.algos.learner.signal import informative_fraction
from veriloop.algos.learner.train_batch import SINGLE_PROCESS
from veriloop.algos.loop.async_eval import EvalBeside
from veriloop.algos.loop.curriculum import curriculum_step
from veriloop.algos.loop.mixture import assign_envs
from veriloop.algos.loop.parts import RunParts, TrainerState, eval_backend, whole_weights
from veriloop.algos.loop.sampling import dynamic_sampling, rollout_limits, sampling_for, sampling_stream
from veriloop.algos.run.distributed import DistContext
from veriloop.configs.algo import AlgoConfig
from veriloop.configs.schema import ExperimentConfig

if TYPE_CHECKING:
    from veriloop.algos.loop.frozen_sampler import InitialSampler


@dataclass
class StepBatch:
    """One step's experience as a source hands it to the step body.

    Attributes:
        trajs: the episodes to train on (every kept group, flat, group by group).
        sampled: every episode played for this step, kept or dropped (the step's rollout metrics).
        metrics: the source's ``sampling/*`` keys.
    """

    trajs: list[Trajectory]
    sampled: list[Trajectory]
    metrics: dict[str, float]


class BatchSource(ABC):
    """What the step body asks of a source, in the order it asks (see the module docstring).

    Attributes:
        evals: evaluations run beside training (K > 0), or None: the step body evaluates in line.
        eval_backend: the engine in-line evaluations sample with (None: the HF engine).
    """

    evals: EvalBeside | None = None
    eval_backend: Backend | None = None

    def start(self) -> None:
        """Before the first step (the asynchronous source starts its worker here)."""
        return None

    @abstractmethod
    def next_batch(self, step: int) -> StepBatch:
        """Step ``step``'s batch."""

    @abstractmethod
    def hand_over(self, step: int, trained: bool) -> dict[str, float]:
        """After step ``step``'s update (``trained``: it updated anything): the weights become
        version ``step + 1`` for the sampler, which is probed (``sync_probe``). Returns the
        hand-over's metrics (``time/weight_sync_s``, ``sync/probe_gap``)."""

    def step_metrics(self, step: int, batch: StepBatch, wall_s: float) -> dict[str, float | None]:
        """The source's own metrics of step ``step`` (``async/*``), after the update."""
        return {}

    def step_note(self, metrics: dict[str, object]) -> str:
        """What the source adds to the step's line (empty: nothing)."""
        return ""

    def before_checkpoint(self) -> None:
        """Right before a checkpoint: put what a resume needs into ``run.state``."""
        return None

    def evaluating(self) -> contextlib.AbstractContextManager[None]:
        """Around an in-line evaluation on ``eval_backend``: that engine serves the trained weights
        inside (a frozen sampler's engine is loaded with them, and with its own after)."""
        return contextlib.nullcontext()

    def close(self, finished: bool) -> None:
        """After the last step, or when the loop stops early (``finished`` False)."""
        return None


def probe_sampler(run: RunParts, version: int) -> dict[str, float]:
    """``sync/probe_gap`` (``sync_probe.check_sampler``) and its cost, after a sync to ``run.backend``;
    the run stops when the sampler does not serve the weights just trained."""
    if not run.cfg.train.sync_probe or run.backend is None:
        return {}
    from veriloop.algos.run.sync_probe import check_sampler

    t0 = time.perf_counter()
    gap = check_sampler(
        run.policy, run.backend, version=version, tolerance=run.cfg.train.sync_probe_tolerance
    )
    return {"sync/probe_gap": gap, "time/sync_probe_s": time.perf_counter() - t0}


class StepSignals:
    """``credit.learning_signal`` of each episode of one step, computed once and read by every
    question asked of its group: the dynamic-sampling drop, the curriculum's gate and
    ``sampling/informative_fraction``."""

    def __init__(self, algo: AlgoConfig) -> None:
        self.algo = algo
        self._seen: dict[int, tuple[Trajectory, tuple[float, ...]]] = {}  # id -> (episode, its signal)

    def __call__(self, traj: Trajectory) -> tuple[float, ...]:
        if id(traj) not in self._seen:  # the episode is held too, so its id is never reused meanwhile
            self._seen[id(traj)] = (traj, learning_signal(traj, self.algo))
        return self._seen[id(traj)][1]


def group_specs(cfg: ExperimentConfig, seeds: Sequence[int]) -> list[EpisodeSpec]:
    """The episodes of the groups of ``seeds``, ``group_size`` each, seed by seed: each problem from
    one environment (a mixture draws it by weight, from the seed alone)."""
    names = assign_envs(cfg.env.mixture_weights, list(seeds), cfg.rollout.seed)
    envs = cfg.env.training_envs
    return [
        EpisodeSpec(envs[e].id or cfg.env.id, dict(envs[e].kwargs), s, s)
        for s, e in zip(seeds, names, strict=True)
        for _ in range(cfg.rollout.group_size)
    ]


@dataclass
class GroupSampler:
    """``n -> groups`` for ``dynamic_sampling``: each call plays ``n`` new problems (env seeds from
    ``state.next_seed`` on, this rank's share of them) and gathers every rank's groups.

    Attributes:
        rounds: calls so far this step (the round number of ``sampling_stream``).
        sampled: every episode played this step, for metrics (dropped groups included).
        choose: ``(first seed, n) -> (seeds, next seed)``, the curriculum's draw by difficulty
            (``curriculum.curriculum_step``); None = the next ``n`` seeds.
    """

    cfg: ExperimentConfig
    policy: Policy
    state: TrainerState
    dist: DistContext
    backend: Backend | None
    rounds: int = 0
    sampled: list[Trajectory] = field(default_factory=list)
    choose: Callable[[int, int], tuple[Sequence[int], int]] | None = None

    def __call__(self, n: int) -> list[list[Trajectory]]:
        cfg, g, first = self.cfg, self.cfg.rollout.group_size, self.state.next_seed
        chosen, nxt = self.choose(first, n) if self.choose else (range(first, first + n), first + n)
        seeds = self.dist.shard(chosen)  # this rank's problems
        self.state.next_seed = nxt  # seeds only move forward: training never repeats a problem
        specs = group_specs(cfg, seeds)
        stream = sampling_stream(self.state.step, self.rounds, self.dist.rank)
        compactor = make_compactor(cfg.rollout.compaction, cfg.rollout.compaction_keep)
        mine = []
        if specs:
            mine = rollout(
                self.policy,
                specs,
                sampling=sampling_for(cfg, stream),
                limits=rollout_limits(cfg),
                backend=self.backend,
                system_prompt=cfg.env.system_prompt,
                assistant_prefix=cfg.env.assistant_prefix,
                compactor=compactor,
            )
        self.rounds += 1
        groups = self.dist.gather_shards([mine[i : i + g] for i in range(0, len(mine), g)])  # all ranks'
        self.sampled.extend(t for group in groups for t in group)
        return groups


def collect(
    cfg: ExperimentConfig,
    policy: Policy,
    state: TrainerState,
    dist: DistContext = SINGLE_PROCESS,
    backend: Backend | None = None,
) -> tuple[list[Trajectory], list[Trajectory], dict[str, float]]:
    """One step's experience: ``prompts_per_step`` groups of ``group_size`` episodes.

    Each group is one env seed (same problem); seeds advance monotonically so training never
    repeats a problem and a resumed run continues where it stopped. With dynamic sampling,
    all-equal-reward groups are dropped and more are sampled (DAPO). With several processes each
    rank plays its share of the groups and every rank ends up with all of them, in seed order.

    Returns:
        the episodes to train on, every episode sampled (for metrics: verifier failures that
        dynamic sampling removed still count), and the sampling metrics.
    """
    sampler = GroupSampler(cfg, policy, state, dist, backend)
    n = cfg.rollout.prompts_per_step
    signal = StepSignals(cfg.algo)
    if cfg.curriculum.enabled:  # problems drawn by difficulty pool, groups gated and refilled
        groups, metrics = curriculum_step(cfg, sampler, state.history, signal)
    elif cfg.algo.dynamic_sampling:
        groups, stats = dynamic_sampling(
            sampler, num_groups=n, max_rounds=cfg.algo.max_sampling_rounds, reward_fn=signal
        )
        keys = ("rounds", "kept_fraction", "informative_fraction", "short_batch")
        metrics = {f"sampling/{k}": stats[k] for k in keys}
    else:
        groups = sampler(n)
        # how many groups would have taught something (logged, not acted on, without dynamic sampling)
        metrics = {
            "sampling/rounds": 1.0,
            "sampling/kept_fraction": 1.0,
            "sampling/informative_fraction": informative_fraction(groups, signal),
            "sampling/short_batch": 0.0,
        }
    return [t for group in groups for t in group], sampler.sampled, metrics


class SyncSource(BatchSource):
    """K = 0: each step plays its groups with the weights the last step trained (``collect``), and
    a backend with its own weights (vLLM) is synced and probed after every update. Under
    ``algo.sampler_weights=initial``: with the initial student's weights, every step, and nothing
    is handed over (``frozen_sampler.InitialSampler``)."""

    def __init__(self, run: RunParts) -> None:
        self.run = run
        self.eval_backend = eval_backend(run)
        self.initial: InitialSampler | None = None

    def start(self) -> None:
        if self.run.cfg.algo.frozen_sampler:
            from veriloop.algos.loop.frozen_sampler import InitialSampler

            self.initial = InitialSampler(self.run)  # saved, or read back and loaded into the engine

    def next_batch(self, step: int) -> StepBatch:
        run = self.run
        policy = self.initial.policy if self.initial is not None else run.policy
        with whole_weights(run, run.backend is None):  # the HF engine generates with the policy itself
            trajs, sampled, metrics = collect(run.cfg, policy, run.state, run.dist, run.backend)
        return StepBatch(trajs, sampled, metrics)

    def step_metrics(self, step: int, batch: StepBatch, wall_s: float) -> dict[str, float | None]:
        """The frozen sampler's last load of the initial weights (``sync/probe_gap``), once."""
        if self.initial is None or not self.initial.metrics:
            return {}
        metrics, self.initial.metrics = self.initial.metrics, {}
        return {**metrics}

    def evaluating(self) -> contextlib.AbstractContextManager[None]:
        if self.initial is None or self.eval_backend is None:
            return contextlib.nullcontext()
        return self.initial.trained_on_engine()

    def hand_over(self, step: int, trained: bool) -> dict[str, float]:
        run = self.run
        if not trained or run.backend is None:  # the HF engine samples with the policy itself
            return {}
        if self.initial is not None:  # the frozen sampler keeps the initial weights: no sync, no probe
            return {}
        t0 = time.perf_counter()
        with whole_weights(run):
            run.backend.sync()  # the engine samples the next step with the weights just trained
            synced = {"time/weight_sync_s": time.perf_counter() - t0}
            return {**synced, **probe_sampler(run, step + 1)}  # it really does, or the run stops
