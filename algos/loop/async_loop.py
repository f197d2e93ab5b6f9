"""The RL loop with generation beside the update (``train.max_staleness`` K > 0).

The synchronous loop alternates: collect a step's groups, then train on them; K = 0 runs it and
never reaches this module. Here a :class:`~veriloop.algos.loop.async_worker.GenerationWorker` thread
keeps admitting and playing groups while the trainer updates, under the bound of
:mod:`veriloop.algos.loop.staleness`. One step, top to bottom:

    wait for the step's groups (oldest first; the bound says when to wait)
    -> train on them (decoupled PPO: pi_prox recomputed by the trainer, pi_prox / mu by TIS/MIS)
    -> hand the new weights to the generator (version v + 1) -> metrics -> eval / log / checkpoint

Resume: a checkpoint keeps the data cursor (``TrainerState.next_seed``: the next new problem) and
the seeds admitted but not yet trained (``history["async"]["pending"]``, oldest first). In-flight
episodes are *redone*, not restored: a resumed run plays the pending problems again from their
start, under the restored weights, before it takes new ones. So no admitted problem is lost and
none is trained twice. ``prompts.jsonl`` in the run folder records every trained or dropped
problem (a resumed run first drops the records made after its checkpoint).
"""

from __future__ import annotations

import json
import threading
import time
from functools import partial
from pathlib import Path
from typing import Any

from veriloop.agents.backends import eos_token_ids
from veriloop.agents.chat import ChatFormat
from veriloop.agents.compaction import make_compactor
from veriloop.agents.engine import EpisodeSpec
from veriloop.agents.trajectory import Trajectory
from veriloop.algos.loop.async_eval import EvalBeside, eval_due
from veriloop.algos.loop.async_worker import GenerationWorker, HFWeights, LiveWeights
from veriloop.algos.loop.staleness import Group, Scheduler, count_metrics, idle_shares, staleness_metrics
from veriloop.algos.run.progress import say
from veriloop.configs.schema import ConfigError, ExperimentConfig

LEDGER = "prompts.jsonl"


class Ledger:
    """``prompts.jsonl``: one row per problem trained (``event: trained``) or dropped (with ``reason``).

    Each row carries the version it happened at; a run resumed at step s keeps only rows with
    version < s (the later ones are redone)."""

    def __init__(self, run_dir: Path, resume_step: int) -> None:
        self.path = run_dir / LEDGER
        rows = read_ledger(run_dir) if self.path.is_file() else []
        kept = [r for r in rows if r["version"] < resume_step]
        self.path.write_text("".join(json.dumps(r) + "\n" for r in kept))

    def write(self, event: str, group: Group, version: int, reason: str | None = None) -> None:
        row = {"event": event, "seed": group.seed, "v_start": group.v_start, "v_end": group.v_end,
               "version": version, "reason": reason}  # fmt: skip
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")


def read_ledger(run_dir: Path) -> list[dict[str, Any]]:
    """The rows of a run's ``prompts.jsonl``, in order."""
    return [json.loads(line) for line in (run_dir / LEDGER).read_text().splitlines() if line.strip()]


def check_async(cfg: ExperimentConfig, dist: Any) -> None:
    """What asynchronous training cannot do yet, refused before the loop starts."""
    if dist.enabled:
        raise ConfigError(
            f"train.max_staleness={cfg.train.max_staleness} runs in one process; with several processes "
            "(torchrun / accelerate) use train.max_staleness=0"
        )


def check_adapter_slots(slots: int | None, max_staleness: int) -> None:
    """LoRA adapters on vLLM (servers or in-process): running episodes use up to K + 2 versions at once,
    which one batch can mix only with ``max_loras`` >= K + 2 (``slots``; None = the servers do not say)."""
    need = max_staleness + 2
    if slots is not None and slots < need:
        raise ConfigError(
            f"train.max_staleness={max_staleness} with LoRA adapters on vLLM keeps up to {need} adapter "
            f"versions in use, but one batch mixes at most {slots} (max_loras): start the servers with "
            f"`veriloop serve-vllm --lora-rank R -- --max-loras {need}` (vllm_server) or set "
            f"rollout.vllm_kwargs.max_loras={need} (vllm); or sync merged weights (lora_sync: merge); or lower "
            "train.max_staleness"
        )


def _budget(cfg: ExperimentConfig, cursor: int, pending: list[int]) -> int:
    """Admissions left: the run's problems ((steps x rounds + K) x n, as ``train_seed_range`` counts
    them) minus those already taken from the cursor, plus the pending ones played again."""
    stop = cfg.train_seed_range.stop
    return len(pending) + max(0, stop - cursor)


def _specs(cfg: ExperimentConfig) -> Any:
    from veriloop.algos.loop.mixture import assign_envs

    envs, g = cfg.env.training_envs, cfg.rollout.group_size

    def specs(seed: int) -> list[EpisodeSpec]:
        name = assign_envs(cfg.env.mixture_weights, [seed], cfg.rollout.seed)[0]  # from the seed alone
        return [
            EpisodeSpec(envs[name].id or cfg.env.id, dict(envs[name].kwargs), seed, seed) for _ in range(g)
        ]

    return specs


def _drop_rule(cfg: ExperimentConfig) -> Any:
    """Dynamic sampling: a group whose learning signals are all equal is dropped (``uninformative``)."""
    from veriloop.algos.learner.signal import group_informative
    from veriloop.algos.learner.update import learning_signal

    def drop(trajs: list[Trajectory]) -> str | None:
        if cfg.algo.dynamic_sampling and not group_informative(trajs, partial(learning_signal, cfg=cfg.algo)):
            return "uninformative"
        return None

    return drop


def build_worker(run: Any, ledger: Ledger) -> GenerationWorker:
    """The scheduler (at the restored version, with the restored pending problems) and its worker."""
    from veriloop.algos.loop import step as T

    cfg, state, policy = run.cfg, run.state, run.policy
    pending = list(state.history.get("async", {}).get("pending", []))
    sched = Scheduler(cfg.train.max_staleness, cfg.rollout.prompts_per_step,
                      budget=_budget(cfg, state.next_seed, pending), version=state.step)  # fmt: skip
    sched.accepted = state.step * cfg.rollout.prompts_per_step  # the groups trained before a resume
    k = cfg.train.max_staleness
    weights = (
        HFWeights(policy, state.step) if run.backend is None else LiveWeights(run.backend, state.step, k)
    )
    if isinstance(weights, LiveWeights) and weights.lora:
        check_adapter_slots(run.backend.adapter_slots(), k)
    fmt = ChatFormat(policy.tokenizer, cfg.env.system_prompt, processor=policy.processor)
    worker = GenerationWorker(sched=sched, cond=threading.Condition(), weights=weights, specs=_specs(cfg),
                              drop=_drop_rule(cfg), fmt=fmt, eos=eos_token_ids(policy.tokenizer, policy.model),
                              sampling=T.sampling_for(cfg, T.sampling_stream(state.step, 0, 0)), limits=T.rollout_limits(cfg),
                              cursor=state.next_seed, pending=pending,
                              compactor=make_compactor(cfg.rollout.compaction, cfg.rollout.compaction_keep))  # fmt: skip
    worker.on_drop = lambda g: ledger.write("dropped", g, sched.version, g.dropped)
    return worker


def async_loop(run: Any) -> None:
    """RL steps ``state.step .. train.steps - 1`` with generation beside the update (module docstring)."""
    from veriloop.algos.loop import step as T

    cfg, state = run.cfg, run.state
    check_async(cfg, run.dist)
    loop = T.step_loop(run)
    ledger = Ledger(run.run_dir, state.step)
    worker = build_worker(run, ledger)
    say(quiet=run.quiet, text=f"RL (asynchronous, max_staleness={cfg.train.max_staleness}): {cfg.train.steps - state.step} "
                      f"steps of {cfg.rollout.batch_size} episodes, algorithm {cfg.algo.name}\n{T.STEP_LEGEND}")  # fmt: skip
    evals = EvalBeside(run.policy, lambda policy, v: T.evaluate_step(cfg, policy, v, run.quiet, backend=None))
    if state.history.get("async", {}).get("eval_pending") == state.step:
        evals.start(state.step)  # killed while evaluating this checkpoint's weights: evaluate them now
    worker.start()
    finished = False
    try:
        for step in loop.steps(state.step):
            _async_step(run, loop, worker, ledger, step, evals)
        finished = True
    finally:
        worker.stop()
        if finished:  # a crash leaves the pending problems to the checkpoint: a resume plays them
            with worker.cond:
                for g in worker.sched.close():
                    ledger.write("dropped", g, worker.sched.version, g.dropped)


def _async_step(
    run: Any, loop: Any, worker: GenerationWorker, ledger: Ledger, step: int, evals: EvalBeside
) -> None:
    """One step: wait for its groups, train, hand the weights over, then metrics / eval / log / save."""
    from veriloop.algos.loop import step as T

    cfg, state, t0 = run.cfg, run.state, time.perf_counter()
    batch, waited = worker.wait_batch(step)
    with worker.cond:
        sampled, worker.sampled = worker.sampled, []  # every episode finished since the last step
    trajs = [t for g in batch for t in g.payload]  # type: ignore[union-attr]
    metrics: dict[str, Any] = _sampling_metrics(cfg, batch, sampled)
    shown = sampled or trajs
    if shown:
        metrics.update(T.rollout_metrics(shown, run.policy.tokenizer))
    if shown and cfg.env.mixture:  # per environment, as the synchronous loop logs them
        from veriloop.algos.loop.mixture import per_env_metrics

        metrics.update(
            per_env_metrics(shown, {n: (str(e.id), e.kwargs) for n, e in cfg.env.training_envs.items()})
        )
    T.report_first_step(run, step, metrics)  # the base policy's groups, before the first update
    t1 = time.perf_counter()
    if trajs:
        metrics.update(T.train_on_batch(cfg, run.policy, run.critic, run.optimizer, trajs, run.generator,
                                        run.dist, run.algo))  # fmt: skip
    else:
        metrics.update(T.no_update())
    metrics["time/weight_sync_s"] = _hand_over_weights(run, worker, step + 1)
    for g in batch:
        ledger.write("trained", g, step)
    t_train = time.perf_counter() - t1
    T.advance_schedule(run.scheduler)
    with worker.cond:
        metrics.update(count_metrics(worker.sched))
        gen_wait, worker.clock.waited_s = worker.clock.waited_s, 0.0
    metrics.update(staleness_metrics(step, batch))
    metrics.update(idle_shares(waited, gen_wait, time.perf_counter() - t0))
    metrics["async/weight_versions_held"] = float(worker.weights.most_held)
    metrics.update(T.step_timing(metrics, run.scheduler.get_last_lr()[0], shown, waited, t_train))
    T.guard_nonfinite(loop, state, metrics)
    state.step = step + 1
    _evaluate_and_log(run, loop, metrics, evals)
    loop.show(T.step_summary(metrics))
    say(quiet=run.quiet, text=f"step {state.step:4d}/{cfg.train.steps} | {T.step_summary(metrics)} | "
                      f"stale={metrics['async/staleness_mean']}")  # fmt: skip
    T.guard_learning(run, metrics)  # no informative group for too long: stop (the rows are logged)
    if loop.checkpoint_due(state.step):
        state.history.setdefault("async", {})["eval_pending"] = evals.in_flight
        T.checkpoint_run(run)


def _hand_over_weights(run: Any, worker: GenerationWorker, version: int) -> float:
    """The trained weights become version ``version`` for the generator, and the scheduler's v moves
    to it; in the same critical section the checkpointed resume point (cursor, pending) is taken."""
    t0 = time.perf_counter()
    w = worker.weights
    if isinstance(w, HFWeights):
        w.publish(version, run.policy)  # the worker loads it between two turns
    elif w.lora:  # adapters on servers: a new adapter beside the ones in use, no pause
        run.backend.sync()
        w.served(version)
    else:
        worker.pause()  # the worker holds between two turns
        try:
            run.backend.sync()  # pushes the weights; vLLM resets its prefix cache
            w.loaded = version
        finally:
            worker.resume()
    with worker.cond:
        worker.sched.trained()
        run.state.next_seed = worker.cursor
        run.state.history["async"] = {"pending": worker.sched.pending_seeds() + list(worker.pending)}
        worker.cond.notify_all()
    return time.perf_counter() - t0


def _sampling_metrics(
    cfg: ExperimentConfig, batch: list[Group], sampled: list[Trajectory]
) -> dict[str, float]:
    """The synchronous loop's ``sampling/*`` keys, over the groups that finished since the last step."""
    from veriloop.algos.learner.signal import informative_fraction
    from veriloop.algos.learner.update import learning_signal

    g = cfg.rollout.group_size
    groups = [sampled[i : i + g] for i in range(0, len(sampled), g)]
    informative = informative_fraction(groups, partial(learning_signal, cfg=cfg.algo))
    n = cfg.rollout.prompts_per_step
    kept = informative if cfg.algo.dynamic_sampling else 1.0  # dynamic sampling drops the rest
    return {
        "sampling/rounds": len(groups) / n,
        "sampling/kept_fraction": kept if groups else 0.0,
        "sampling/informative_fraction": informative,
        "sampling/short_batch": float(len(batch) < n),
    }


def _evaluate_and_log(run: Any, loop: Any, metrics: dict[str, Any], evals: EvalBeside) -> None:
    """Log the step. A due evaluation starts beside training (``algos.loop.async_eval``) and every one
    done by now is logged in its own row, at the step (version) it evaluated; the last step's is
    run by the trainer, after the ones in flight, into the step's own row (nothing is left to overlap)."""
    from veriloop.algos.loop import step as T

    cfg, step = run.cfg, run.state.step
    if step == cfg.train.steps:
        evals.wait()
        _log_evals(loop, evals)
        metrics.update(T.evaluate_step(cfg, run.policy, step, run.quiet, backend=None))
        metrics["async/eval_version"] = float(step)
    elif eval_due(cfg, step):
        evals.start(step)
    loop.log_metrics(step, metrics)
    _log_evals(loop, evals)


def _log_evals(loop: Any, evals: EvalBeside) -> None:
    for version, metrics in evals.finished():
        if loop.log is not None:
            loop.log.log(version, metrics)
