"""Training through vLLM where it is installed: ``rollout.backend: auto``
resolves to the in-process vLLM engine for the default model, the SFT warm-up's weights are pushed
into it, and evaluation samples with it (``eval.backend: rollout``). Runs under ``make test-vllm``;
skipped elsewhere unless ``VERILOOP_REQUIRE_VLLM=1`` makes a missing vLLM a failure."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path
from typing import Any

import pytest

requires_vllm = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None and os.environ.get("VERILOOP_REQUIRE_VLLM") != "1",
    reason="needs vLLM: `make setup-vllm`, then `make test-vllm`",
)

SHORT = ["policy.precision=fp32", "rollout.prompts_per_step=2", "rollout.group_size=2", "rollout.max_new_tokens=16", "train.steps=1",
         "train.micro_batch_size=4", "sft.steps=1", "sft.examples=4", "eval.num_problems=2", "eval.n_samples=1",
         "eval.k_list=[1]", "eval.every=1", "eval.before_sft=false", "run.checkpoint_every=0"]  # fmt: skip


@requires_vllm
def test_quickstart_defaults_to_vllm_and_evaluates_with_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import veriloop.algos.eval.in_training as in_training
    import veriloop.algos.loop.train as T
    from veriloop.agents.backends.vllm import VLLMBackend
    from veriloop.configs.loader import load_config

    made: list[Any] = []
    evals: list[Any] = []
    build, evaluate = T._rollout_backend, in_training.evaluate_step
    monkeypatch.setattr(T, "_rollout_backend", lambda *a: made.append(build(*a)) or made[-1])
    monkeypatch.setattr(
        in_training, "evaluate_step", lambda *a, **k: evals.append(k.get("backend")) or evaluate(*a, **k)
    )
    cfg = load_config("quickstart", [*SHORT, f"run.out_dir={tmp_path}", "run.name=v"])
    assert cfg.rollout.backend == "auto"
    run = T.train(cfg, quiet=True)
    (engine,) = made
    assert isinstance(engine, VLLMBackend)
    assert len(evals) == 2 and all(b is engine for b in evals)  # start (after SFT) and step 1
    row = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()][-1]
    # the engine sampled with the trainer's weights (fp32, synced after SFT): log-probs agree
    assert row["mismatch/tokens"] > 0 and row["mismatch/k3_kl"] < 1e-5
    assert 0.0 <= row["eval/id/avg@n"] <= 1.0
    assert "llm" not in vars(engine)  # closed at the end


@requires_vllm
def test_dppo_takes_its_ratio_against_the_log_probs_vllm_recorded(tmp_path: Path) -> None:
    """DPPO with the vLLM sampler: mu is what vLLM recorded (processed log-probs), kept by
    prepare_batch as ``sampler_logprobs``; the step trains and the mismatch is measured against it."""
    import veriloop.algos.loop.train as T
    from veriloop.configs.loader import load_config

    over = [
        *SHORT,
        "sft.steps=0",
        "eval.every=0",
        "eval.at_start=false",
        "algo.preset=dppo",
        "algo.epochs=2",
        "rollout.backend=vllm",
    ]
    run = T.train(load_config("quickstart", [*over, f"run.out_dir={tmp_path}", "run.name=d"]), quiet=True)
    row = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()][-1]
    assert row["updates"] == 2 and row["skipped"] == 0 and row["mismatch/tokens"] > 0
    assert row["mismatch/k3_kl"] < 1e-3  # fp32 vLLM-CPU vs the trainer, same weights
    assert 0.0 <= row["clip_frac_high"] <= 1.0 and 0.0 <= row["clip_frac_low"] <= 1.0


@requires_vllm
def test_veriloop_eval_samples_with_the_configs_vllm_engine_and_closes_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import veriloop.cli.eval as E
    from veriloop.agents.backends.vllm import VLLMBackend

    used: list[Any] = []
    evaluate = E.evaluate_config
    monkeypatch.setattr(
        E, "evaluate_config", lambda *a, **k: used.append(k.get("backend")) or evaluate(*a, **k)
    )
    overrides = ["eval.num_problems=2", "eval.n_samples=1", "eval.k_list=[1]", "rollout.max_new_tokens=16"]
    reports = E.run_eval_cli("quickstart", ["base"], overrides, tmp_path)
    (engine,) = used
    assert isinstance(engine, VLLMBackend) and "llm" not in vars(engine)  # used, then closed
    assert 0.0 <= reports["base"]["splits"]["id"]["avg@n"] <= 1.0
    # eval.backend=hf keeps the HF engine, as in training
    used.clear()
    E.run_eval_cli("quickstart", ["base"], [*overrides, "eval.backend=hf"], tmp_path / "hf")
    assert used == [None]


def test_veriloop_eval_without_vllm_uses_the_hf_engine(tmp_path: Path) -> None:
    from veriloop.cli.eval import _cli_backend
    from veriloop.configs.loader import load_config

    cfg = load_config("quickstart", ["rollout.backend=hf"])
    assert _cli_backend(cfg, policy=None) is None


@requires_vllm
def test_semi_opd_keeps_the_engine_at_the_initial_weights_across_evaluations_and_a_resume(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``algo.sampler_weights=initial`` on in-process vLLM: the engine is never synced after an
    update; an evaluation on it loads the trained weights, then the initial ones back (probed); a
    resumed run's engine, built from the checkpoint's weights, is loaded with the saved initial ones.
    Every step's recorded log-probs are the initial (post-warm-up) student's."""
    import torch

    import veriloop.algos.loop.run_steps as R
    import veriloop.algos.loop.train as T
    import veriloop.algos.run.setup as S
    from veriloop.algos.learner.algorithm import resolve
    from veriloop.algos.learner.prepare import prepare_batch
    from veriloop.algos.loop.frozen_sampler import INITIAL_FILE, _put
    from veriloop.configs.algo import AlgoConfig
    from veriloop.configs.loader import load_config

    seen: list[Any] = []
    real = R.train_on_batch
    monkeypatch.setattr(
        R, "train_on_batch", lambda c, p, cr, o, t, *a, **k: seen.append(t) or real(c, p, cr, o, t, *a, **k)
    )
    over = [
        *SHORT,
        "algo.preset=semi_opd",
        "rollout.backend=vllm",
        "train.lr=1e-2",
        "run.checkpoint_every=1",
        f"run.out_dir={tmp_path}",
        "run.name=s",
    ]
    run = T.train(load_config("quickstart", [*over, "train.steps=2"]), quiet=True)
    cfg = load_config("quickstart", [*over, "train.steps=3"])
    T.train(cfg, resume=True, quiet=True)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r["step"] > 0 and "frozen_sampler/tokens" in r]
    assert [r["step"] for r in steps] == [1, 2, 3] and all(r["mismatch/k3_kl"] is None for r in steps)
    # step 2 and 3 logged the probe of the initial weights loaded back (after step 1's evaluation; at the resume)
    assert all(0 <= r["sync/probe_gap"] < 1e-3 for r in steps[1:])
    policy = S.build_policy(cfg)
    _put(policy.model, torch.load(run / INITIAL_FILE, weights_only=True))

    def gap(trajs: Any) -> float:
        _, m = prepare_batch(trajs, resolve(AlgoConfig(rollout_is="truncate")), model=policy.model, pad_id=0)
        return float(m["mismatch/abs_log_ratio"])

    assert len(seen) == 3 and all(gap(t) < 1e-3 for t in seen)  # fp32 vLLM-CPU vs the trainer: ~1e-5
    assert steps[-1]["frozen_sampler/abs_log_ratio"] > 10 * gap(
        seen[-1]
    )  # the trainer did move away from them
