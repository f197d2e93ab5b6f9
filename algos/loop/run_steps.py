"""The one step body: ``run_steps(run, source)`` runs RL steps ``state.step .. train.steps - 1`` for
every ``train.max_staleness``, drawing each step's batch from a
:class:`~veriloop.algos.loop.source.BatchSource` (synchronous for K = 0, asynchronous for K > 0).

One step, top to bottom::

    batch = source.next_batch(step)                 K = 0: play the groups now; K > 0: take finished ones
    -> metrics of every episode played              -> the first step's report (the base policy)
    -> train_on_batch (the learner), or no update
    -> source.hand_over(step)                       the weights become version step + 1, probed
    -> schedule -> timing -> source.step_metrics    -> non-finite guard
    -> a few episodes as text (samples.jsonl)       -> evaluate and log
    -> learning guard -> checkpoint

The step schedule, the non-finite guard and the log / checkpoint cadence are
:class:`~veriloop.algos.run.phase.StepLoop`, the machinery the SFT warm-up runs on too.
"""

from __future__ import annotations

import sys
import time
import warnings
from typing import Any

import torch

import veriloop.algos.eval.in_training as in_training
from veriloop.agents.trajectory import Trajectory
from veriloop.algos.learner.train_batch import no_update, train_on_batch
from veriloop.algos.loop.async_eval import EvalBeside, eval_due
from veriloop.algos.loop.metrics import STEP_LEGEND, rollout_metrics, step_summary, step_timing
from veriloop.algos.loop.mixture import per_env_metrics
from veriloop.algos.loop.parts import RunParts, TrainerState, checkpoint_run, whole_weights
from veriloop.algos.loop.source import BatchSource
from veriloop.algos.run.guards import LearningGuard, first_step_check
from veriloop.algos.run.nonfinite import NonFiniteGuard
from veriloop.algos.run.phase import StepLoop
from veriloop.algos.run.progress import say
from veriloop.configs.schema import ExperimentConfig


def run_steps(run: RunParts, source: BatchSource) -> None:
    """RL steps ``state.step .. train.steps - 1``, each one ``_step`` over ``source``'s batches."""
    loop = step_loop(run)
    say(quiet=run.quiet, text=f"{rl_intro(run.cfg, run.state)}\n{STEP_LEGEND}")
    source.start()
    finished = False
    try:
        for step in loop.steps(run.state.step):
            _step(run, source, loop, step)
        finished = True
    finally:
        source.close(finished)


def rl_intro(cfg: ExperimentConfig, state: TrainerState) -> str:
    """The RL phase in one line: steps left, episodes per step, the algorithm, the mode."""
    left, r = cfg.train.steps - state.step, cfg.rollout
    k = cfg.train.max_staleness
    mode = f" (asynchronous, max_staleness={k})" if k > 0 else ""
    evals = f", evaluated every {cfg.eval.every} steps" if cfg.eval.every else ""
    return (
        f"RL{mode}: {left} steps of {r.batch_size} episodes ({r.prompts_per_step} problems x {r.group_size}) "
        f"= {left * r.batch_size} episodes, algorithm {cfg.algo.name}{evals}"
    )


def _step(run: RunParts, source: BatchSource, loop: StepLoop, step: int) -> None:
    """One step (the module docstring's drawing)."""
    cfg, state, t0 = run.cfg, run.state, time.perf_counter()
    batch = source.next_batch(step)
    t_rollout = time.perf_counter() - t0
    metrics: dict[str, Any] = dict(batch.metrics)
    metrics.update(_episode_metrics(run, batch.sampled))  # every episode played, kept or not
    report_first_step(run, step, metrics)  # the base policy's groups, before the first update
    t1 = time.perf_counter()
    # dynamic sampling may keep no group at all (every group had equal rewards): nothing to learn
    if batch.trajs:
        metrics.update(
            train_on_batch(
                cfg, run.policy, run.critic, run.optimizer, batch.trajs, run.generator, run.dist, run.algo
            )
        )
    else:
        metrics.update(no_update())
    metrics.update(source.hand_over(step, trained=bool(batch.trajs)))
    t_train = time.perf_counter() - t1
    advance_schedule(run.scheduler)  # once per RL step, whatever the number of optimizer steps in it
    lr = run.scheduler.get_last_lr()[0]
    metrics.update(source.step_metrics(step, batch, time.perf_counter() - t0))
    metrics.update(step_timing(metrics, lr, batch.sampled, t_rollout, t_train))
    guard_nonfinite(loop, state, metrics)  # a skipped step is counted; too many in a row stop the run
    state.step = step + 1
    if run.samples is not None:  # rank 0: a few of the step's episodes as text, for the user
        run.samples.write(state.step, batch.sampled, batch.trajs)
    evaluate_and_log(run, source, loop, metrics)
    loop.show(step_summary(metrics))
    line = f"step {state.step:4d}/{cfg.train.steps} | {step_summary(metrics)}{source.step_note(metrics)}"
    say(quiet=run.quiet, text=line)
    guard_learning(run, metrics)  # no informative group for too long: stop (the rows are logged)
    if (run.dist.is_main or run.dist.sharded) and loop.checkpoint_due(state.step):
        source.before_checkpoint()
        checkpoint_run(run)  # sharded: every rank writes its shards


def _episode_metrics(run: RunParts, sampled: list[Trajectory]) -> dict[str, float]:
    """``rollout_metrics`` of the episodes played, and per environment under a mixture."""
    if not sampled:
        return {}
    metrics = rollout_metrics(sampled, run.policy.tokenizer)
    if run.cfg.env.mixture:
        envs = {n: (str(e.id), e.kwargs) for n, e in run.cfg.env.training_envs.items()}
        metrics.update(per_env_metrics(sampled, envs))
    return metrics


def evaluate_and_log(run: RunParts, source: BatchSource, loop: StepLoop, metrics: dict[str, Any]) -> None:
    """Evaluate every ``eval.every`` steps and after the last one, then log the step as ``loop`` says.

    In line (rank 0) into the step's row; or, when the source evaluates beside training
    (``source.evals``), started there and logged in its own row at the step it evaluated once
    done. The last step's evaluation is always in line, after every one in flight is logged."""
    cfg, step = run.cfg, run.state.step
    due, beside, last = eval_due(cfg, step), source.evals, step == cfg.train.steps
    if beside is not None and due and not last:
        beside.start(step)  # the trainer goes on; the result comes back in a later row
        due = False
    if beside is not None and last:
        beside.wait()
        _log_evals(loop, beside)
    with whole_weights(run, due):  # sharded: all ranks gather, rank 0 evaluates
        if run.dist.is_main and due:
            with source.evaluating():  # the engine serves the trained weights (a frozen sampler's too)
                metrics.update(
                    in_training.evaluate_step(cfg, run.policy, step, run.quiet, backend=source.eval_backend)
                )
            if beside is not None:
                metrics["async/eval_version"] = float(step)
    loop.log_metrics(step, metrics)  # rank 0 only: the others have no log
    if beside is not None:
        _log_evals(loop, beside)


def _log_evals(loop: StepLoop, evals: EvalBeside) -> None:
    """The evaluations done beside training since the last call, each in its own row."""
    for version, metrics in evals.finished():
        if loop.log is not None:
            loop.log.log(version, metrics)


def step_loop(run: RunParts) -> StepLoop:
    """The RL phase's ``StepLoop``: ``train.steps``, the guard's counts as ``run.state`` holds them
    (a resumed run keeps them), ``train.log_every`` and ``run.checkpoint_every``."""
    cfg, state = run.cfg, run.state
    guard = NonFiniteGuard(
        cfg.train.max_consecutive_nonfinite, state.consecutive_nonfinite, state.skipped_steps
    )
    advice = (
        "lower train.lr, set train.max_grad_norm, or resume from the last checkpoint (non-finite weights "
        "are never checkpointed)"
    )
    return StepLoop(
        cfg.train.steps,
        "train",
        guard,
        log_every=cfg.train.log_every,
        checkpoint_every=cfg.run.checkpoint_every,
        log=run.log,
        advice=advice,
        quiet=run.quiet,
    )


def advance_schedule(scheduler: torch.optim.lr_scheduler.LRScheduler) -> None:
    """One RL step of the learning-rate schedule, whether or not the step updated anything (a step
    that kept no group trains nothing; PyTorch's warning about a schedule that moves before the
    optimizer does is about a mistake this is not)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step")
        scheduler.step()


def guard_nonfinite(loop: StepLoop, state: TrainerState, metrics: dict[str, Any]) -> None:
    """Count the step in ``loop``'s guard (``NonFiniteTrainingError`` after ``train.max_consecutive_nonfinite``
    skipped steps in a row) and copy its counts into ``state``, which checkpoints them."""
    try:
        loop.observe(skipped=metrics.get("skipped", 0.0) > 0)
    finally:  # also when it raises: the state says how the run ended
        state.consecutive_nonfinite, state.skipped_steps = loop.guard.in_a_row, loop.guard.total
        metrics["nonfinite_skipped_total"] = float(state.skipped_steps)


def guard_learning(run: RunParts, metrics: dict[str, Any]) -> None:
    """Count the logged step in the learning guard (``guards.LearningGuard``: ``UninformativeRunError``
    after ``train.max_uninformative_steps`` steps in a row without an informative group, one warning
    when ``truncation_rate`` passes ``train.warn_truncation_above``); ``run.state`` keeps its counts."""
    cfg, state = run.cfg, run.state
    guard = LearningGuard(
        cfg.train.max_uninformative_steps,
        cfg.train.warn_truncation_above,
        cfg.rollout.group_size,
        state.uninformative_in_a_row,
        state.truncation_warned,
        cfg.algo.estimator.group_based,
    )
    try:
        guard.observe(metrics) if run.dist.is_main else guard.observe(metrics, warn=lambda _: None)
    finally:  # also when it raises: the state says how the run ended
        state.uninformative_in_a_row, state.truncation_warned = guard.in_a_row, guard.truncation_warned


def report_first_step(run: RunParts, step: int, metrics: dict[str, Any]) -> None:
    """Before the run's first update (step 0, rank 0): the base policy's groups in one line
    (``guards.first_step_check``); on stderr as a warning when a share is extreme."""
    if step != 0 or not run.dist.is_main:
        return
    line, extreme = first_step_check(metrics, run.cfg.rollout.group_size)
    if extreme:
        print(f"veriloop: warning: {line}", file=sys.stderr, flush=True)
    else:
        say(quiet=run.quiet, text=line)
