"""The asynchronous batch source (``train.max_staleness`` K > 0): generation beside the update.

The step body is the synchronous one (:func:`~veriloop.algos.loop.run_steps.run_steps`); K = 0
draws from :class:`~veriloop.algos.loop.source.SyncSource` and never reaches this module. Here
:class:`AsyncSource` runs a :class:`~veriloop.algos.loop.async_worker.GenerationWorker` thread that
keeps admitting and playing groups while the trainer updates, under the bound of
:mod:`veriloop.algos.loop.staleness`. What it does in a step:

    next_batch: wait for the step's groups (oldest first; the bound says when to wait)
    (the step body trains on them: decoupled PPO, pi_prox recomputed by the trainer, pi_prox / mu by TIS/MIS)
    hand_over: the new weights go to the generator (version v + 1), the sampler is probed
    step_metrics: async/* (staleness, counts, idle shares); evaluations run beside training

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
from typing import Any, cast

import veriloop.algos.eval.in_training as in_training
from veriloop.agents.backends import eos_token_ids
from veriloop.agents.chat import ChatFormat
from veriloop.agents.compaction import make_compactor
from veriloop.agents.trajectory import Trajectory
from veriloop.algos.learner.credit import learning_signal
from veriloop.algos.learner.signal import group_informative
from veriloop.algos.loop.async_eval import EvalBeside
from veriloop.algos.loop.async_worker import Finished, GenerationWorker, HFWeights, Judge, LiveWeights
from veriloop.algos.loop.parts import RunParts
from veriloop.algos.loop.sampling import rollout_limits, sampling_for, sampling_stream
from veriloop.algos.loop.source import BatchSource, StepBatch, group_specs, probe_sampler
from veriloop.algos.loop.staleness import Group, Scheduler, count_metrics, idle_shares, staleness_metrics
from veriloop.algos.run.distributed import DistContext
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
        row = {
            "event": event,
            "seed": group.seed,
            "v_start": group.v_start,
            "v_end": group.v_end,
            "version": version,
            "reason": reason,
        }
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")


def read_ledger(run_dir: Path) -> list[dict[str, Any]]:
    """The rows of a run's ``prompts.jsonl``, in order."""
    return [json.loads(line) for line in (run_dir / LEDGER).read_text().splitlines() if line.strip()]


def check_async(cfg: ExperimentConfig, dist: DistContext) -> None:
    """What asynchronous training cannot do yet, refused before the loop starts. Several ranks train
    asynchronously (``async_ranks``: rank 0 generates); sharded ones only against vLLM servers."""
    if dist.enabled and dist.sharded and cfg.rollout.backend != "vllm_server":
        raise ConfigError(
            f"train.max_staleness={cfg.train.max_staleness} with train.parallel=fsdp generates on vLLM "
            f"servers only (rollout.backend={cfg.rollout.backend} would need a whole copy of the sharded "
            "weights): set rollout.backend=vllm_server (servers from `veriloop serve-vllm`), or use "
            "train.parallel=data, or train.max_staleness=0"
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


def group_judge(cfg: ExperimentConfig) -> Judge:
    """Whether a finished group teaches something: ``signal.group_informative`` of its learning
    signals, the test every mode shares. The worker asks it once per group, when the group finishes;
    the drop rule and the ``sampling/*`` metrics read the answer."""
    signal = partial(learning_signal, cfg=cfg.algo)
    return lambda trajs: group_informative(trajs, signal)


def sampling_metrics(cfg: ExperimentConfig, finished: list[Finished], taken: int) -> dict[str, float]:
    """The synchronous source's ``sampling/*`` keys, over the groups ``finished`` since the last step
    (each judged once, when it finished); ``taken``: the groups the step trains on."""
    n = cfg.rollout.prompts_per_step
    informative = sum(f.informative for f in finished) / len(finished) if finished else 0.0
    kept = informative if cfg.algo.dynamic_sampling else 1.0  # dynamic sampling drops the rest
    return {
        "sampling/rounds": len(finished) / n,
        "sampling/kept_fraction": kept if finished else 0.0,
        "sampling/informative_fraction": informative,
        "sampling/short_batch": float(taken < n),
    }


def build_worker(run: RunParts, ledger: Ledger) -> GenerationWorker:
    """The scheduler (at the restored version, with the restored pending problems) and its worker."""
    cfg, state, policy = run.cfg, run.state, run.policy
    pending = list(state.history.get("async", {}).get("pending", []))
    k = cfg.train.max_staleness
    sched = Scheduler(
        k, cfg.rollout.prompts_per_step, budget=_budget(cfg, state.next_seed, pending), version=state.step
    )
    sched.accepted = state.step * cfg.rollout.prompts_per_step  # the groups trained before a resume
    weights: HFWeights | LiveWeights
    if run.backend is None:
        weights = HFWeights(policy, state.step)
    else:
        weights = LiveWeights(run.backend, state.step, k)
        if weights.lora:
            check_adapter_slots(run.backend.adapter_slots(), k)
    worker = GenerationWorker(
        sched=sched,
        cond=threading.Condition(),
        weights=weights,
        specs=lambda seed: group_specs(cfg, [seed]),
        judge=group_judge(cfg),
        drop_uninformative=cfg.algo.dynamic_sampling,
        fmt=ChatFormat(
            policy.tokenizer,
            cfg.env.system_prompt,
            processor=policy.processor,
            assistant_prefix=cfg.env.assistant_prefix,
        ),
        eos=eos_token_ids(policy.tokenizer, policy.model),
        sampling=sampling_for(cfg, sampling_stream(state.step, 0, 0)),
        limits=rollout_limits(cfg),
        cursor=state.next_seed,
        pending=pending,
        compactor=make_compactor(cfg.rollout.compaction, cfg.rollout.compaction_keep),
    )
    worker.on_drop = lambda g: ledger.write("dropped", g, sched.version, g.dropped)
    return worker


class AsyncSource(BatchSource):
    """K > 0: a generation worker plays groups beside the update (module docstring); a step takes
    the finished ones the staleness bound allows, and hands the trained weights to the worker.

    Owns the ledger (``prompts.jsonl``), the worker and the evaluations beside training."""

    def __init__(self, run: RunParts) -> None:
        check_async(run.cfg, run.dist)
        self.run = run
        self.ledger = Ledger(run.run_dir, run.state.step)
        self.worker = build_worker(run, self.ledger)
        self.beside = EvalBeside(
            run.policy,
            lambda policy, v: in_training.evaluate_step(run.cfg, policy, v, run.quiet, backend=None),
        )
        self.evals = self.beside  # the step body starts due evaluations here and logs them when done
        self.eval_backend = None  # the worker uses the rollout engine: the last evaluation runs on HF
        self._groups: list[Group] = []
        self._waited = 0.0

    def start(self) -> None:
        if self.run.state.history.get("async", {}).get("eval_pending") == self.run.state.step:
            self.beside.start(self.run.state.step)  # killed while evaluating these weights: evaluate them now
        self.worker.start()

    def next_batch(self, step: int) -> StepBatch:
        worker = self.worker
        self._groups, self._waited = worker.wait_batch(step)
        with worker.cond:
            finished, worker.finished = worker.finished, []  # every group finished since the last step
        trajs = [t for g in self._groups for t in cast(list[Trajectory], g.payload)]
        sampled = [t for f in finished for t in f.trajs]
        return StepBatch(trajs, sampled or trajs, sampling_metrics(self.run.cfg, finished, len(self._groups)))

    def hand_over(self, step: int, trained: bool) -> dict[str, float]:
        """The trained weights become version ``step + 1`` for the worker (every step, trained or not:
        the scheduler's version moves), the sampler is probed, and the step's groups are recorded
        trained. In the same critical section the checkpointed resume point (cursor, pending) is taken."""
        run, worker, version, t0 = self.run, self.worker, step + 1, time.perf_counter()
        w = worker.weights
        probe: dict[str, float] = {}
        if isinstance(w, HFWeights):
            w.publish(version, run.policy)  # the worker loads it between two turns
        else:
            probe = self._sync_live(w, version)
        synced = {"time/weight_sync_s": time.perf_counter() - t0}
        with worker.cond:
            worker.sched.trained()
            run.state.next_seed = worker.cursor
            run.state.history["async"] = {"pending": worker.sched.pending_seeds() + list(worker.pending)}
            worker.cond.notify_all()
        for g in self._groups:
            self.ledger.write("trained", g, step)
        return {**synced, **probe}

    def _sync_live(self, w: LiveWeights, version: int) -> dict[str, float]:
        """An engine with its own weights: ``sync``, then the probe (``source.probe_sampler``). Full
        weights: with the worker held between two turns. Adapters: a new adapter beside the ones in
        use, no pause; in-process vLLM alone pauses while the probe runs (its engine serves one caller
        at a time), servers take the probe beside the worker's requests."""
        backend = self.run.backend
        assert backend is not None
        cfg = self.run.cfg
        pause = not w.lora or (cfg.train.sync_probe and cfg.rollout.backend != "vllm_server")
        if pause:
            self.worker.pause()  # the worker holds between two turns
        try:
            backend.sync()  # pushes the weights (a new adapter, or merged ones); vLLM resets its prefix cache
            if w.lora:
                w.served(version)
            else:
                w.loaded = version
            return probe_sampler(self.run, version)  # it really serves them, or the run stops
        finally:
            if pause:
                self.worker.resume()

    def step_metrics(self, step: int, batch: StepBatch, wall_s: float) -> dict[str, float | None]:
        worker = self.worker
        with worker.cond:
            metrics: dict[str, float | None] = {**count_metrics(worker.sched)}
            gen_wait, worker.clock.waited_s = worker.clock.waited_s, 0.0
        metrics.update(staleness_metrics(step, self._groups))
        metrics.update(idle_shares(self._waited, gen_wait, wall_s))
        metrics["async/weight_versions_held"] = float(worker.weights.most_held)
        return metrics

    def step_note(self, metrics: dict[str, object]) -> str:
        return f" | stale={metrics['async/staleness_mean']}"

    def before_checkpoint(self) -> None:
        self.run.state.history.setdefault("async", {})["eval_pending"] = self.beside.in_flight

    def close(self, finished: bool) -> None:
        worker = self.worker
        worker.stop()
        if finished:  # a crash leaves the pending problems to the checkpoint: a resume plays them
            with worker.cond:
                for g in worker.sched.close():
                    self.ledger.write("dropped", g, worker.sched.version, g.dropped)
