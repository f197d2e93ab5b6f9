"""`rollout.compaction` under asynchronous training (``train.max_staleness`` K > 0): the generation
worker plays its turns with the engine's own ``Player``, so a history that outgrows
``max_context`` is compacted exactly as the synchronous ``rollout`` (K = 0) compacts it."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

from veriloop.agents.chat import ChatFormat
from veriloop.agents.compaction import KeepLastTurns, PolicySummary
from veriloop.agents.engine import EpisodeSpec, RolloutLimits, rollout
from veriloop.agents.sampling_params import SamplingParams
from veriloop.agents.scripted import ScriptedPolicy
from veriloop.agents.testing import tiny_tokenizer
from veriloop.agents.trajectory import Trajectory
from veriloop.algos.loop.async_worker import GenerationWorker, LiveWeights
from veriloop.algos.loop.staleness import Scheduler

ENV = "veriloop/Points24-text-v0"
WRONG = '{"cards": ["A", "2", "3", "4"], "formula": "1+2+3+4"} ' + "Let me explain my reasoning. " * 6


class _Serving(ScriptedPolicy):
    """The script as an engine with its own weights (``backends.base.ServingBackend``), full weights."""

    serves_adapter, keep_adapters, model_name = False, 1, "base"

    def sync(self) -> None:
        """A script has no weights to load."""

    def close(self) -> None:
        """Nothing to shut down."""

    def pin(self, key: Any, adapter: str) -> None:
        assert self.serves_adapter, "full weights: no request is pinned to an adapter"
        self.pins[key] = adapter

    def generate(self, requests: Any, sampling: Any, generator: Any = None) -> Any:
        self.keys += [r.key for r in requests]
        return super().generate(requests, sampling, generator)

    def adapter_slots(self) -> int | None:
        return None


def _policy(adapters: bool = False) -> _Serving:
    policy = _Serving(lambda turn, obs, task: WRONG, tiny_tokenizer())
    policy.serves_adapter, policy.pins, policy.keys = adapters, {}, []  # type: ignore[attr-defined]
    return policy


def _specs(seed: int) -> list[EpisodeSpec]:
    return [EpisodeSpec(ENV, {}, seed, seed) for _ in range(2)]


def _worker_groups(
    policy: _Serving, limits: RolloutLimits, sampling: SamplingParams, compactor: Any
) -> list[list[Trajectory]]:
    """Step 0's two groups (seeds 0 and 1) as the asynchronous worker plays them, K = 1."""
    sched = Scheduler(1, 2, budget=2)
    worker = GenerationWorker(
        sched=sched,
        cond=threading.Condition(),
        weights=LiveWeights(policy, 0, 1),
        specs=_specs,
        judge=lambda trajs: True,
        fmt=ChatFormat(policy.tokenizer),
        eos=(int(policy.tokenizer.eos_token_id),),
        sampling=sampling,
        limits=limits,
        cursor=0,
        compactor=compactor,
    )
    worker.start()
    try:
        batch, _ = worker.wait_batch(0)
    finally:
        worker.stop()
    return [list(g.payload) for g in sorted(batch, key=lambda g: g.seed)]  # type: ignore[arg-type]


def _shape(t: Trajectory) -> tuple[Any, ...]:
    return (
        t.seed,
        t.token_ids,
        t.loss_mask,
        t.turn_index,
        t.sample_starts,
        t.split_reasons,
        t.stop_reason,
        t.truncated,
        [turn.text for turn in t.turns],
    )


def test_compaction_under_async_shortens_histories_as_the_synchronous_rollout() -> None:
    """The same episodes at K = 1 (the worker) and K = 0 (``rollout``): the same tokens, the same
    sample starts and split reasons; and compaction did happen (the worker without it is cut)."""
    policy, sampling = _policy(), SamplingParams(max_new_tokens=64)
    limits = RolloutLimits(max_turns=5, max_context=400)
    sync = rollout(
        policy, [*_specs(0), *_specs(1)], sampling=sampling, limits=limits, compactor=KeepLastTurns(1)
    )
    played = [t for g in _worker_groups(policy, limits, sampling, KeepLastTurns(1)) for t in g]
    assert [_shape(t) for t in played] == [_shape(t) for t in sync]
    assert all("compaction" in t.split_reasons and t.num_turns == 5 for t in played)
    cut = [t for g in _worker_groups(policy, limits, sampling, None) for t in g]
    assert all(t.stop_reason == "max_context" and t.num_samples == 1 for t in cut)


def test_compaction_replies_sample_with_the_episodes_adapter_version() -> None:
    """LoRA served as adapters: every request the worker sends, the compactor's summary requests
    included, carries the version in its cache key and is pinned to that version's adapter."""
    policy, limits = _policy(adapters=True), RolloutLimits(max_turns=5, max_context=400)
    played = [
        t
        for g in _worker_groups(policy, limits, SamplingParams(max_new_tokens=64), PolicySummary())
        for t in g
    ]
    assert all("compaction" in t.split_reasons for t in played)
    keys = policy.keys  # type: ignore[attr-defined]
    assert any(isinstance(k[0], tuple) and k[0][0] == "compaction" for k in keys)  # summaries were asked for
    assert all(k[1] == 0 and policy.pins[k] == "base" for k in keys)  # type: ignore[attr-defined]


def test_compaction_in_an_asynchronous_training_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`rollout.compaction=keep_last` through the real loop at K = 1: every episode plays its three
    turns in two samples, as the synchronous step does (``test_train_compaction``)."""
    import veriloop.algos.eval.in_training as S
    from veriloop.algos.loop.train import train
    from veriloop.algos.run.log import read_metrics
    from veriloop.configs.loader import load_config

    monkeypatch.setattr(S, "evaluate_step", lambda cfg, policy, step, quiet, **kw: {})
    cfg = load_config(
        None,
        [
            "policy.model=tiny",
            "env.id=veriloop/MathVerifyRetry-v0",
            "env.kwargs={level: 1}",
            "rollout.prompts_per_step=2",
            "rollout.group_size=2",
            "rollout.max_new_tokens=8",
            "rollout.max_turns=3",
            "rollout.max_context=150",
            "train.steps=1",
            "train.micro_batch_size=2",
            "eval.at_start=false",
            "eval.every=0",
            "run.tensorboard=false",
            "run.checkpoint_every=0",
            "train.max_staleness=1",
            "algo.rollout_is=truncate",
            "rollout.compaction=keep_last",
            "rollout.compaction_keep=0",
            f"run.out_dir={tmp_path}",
            "run.name=ac",
        ],
    )
    (row,) = [r for r in read_metrics(train(cfg, quiet=True)) if "updates" in r]
    assert row["updates"] == 1.0
    assert (row["turns/mean"], row["samples/split_rate"], row["samples/per_episode"]) == (3.0, 1.0, 2.0)
