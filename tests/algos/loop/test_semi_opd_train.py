"""Distillation on the initial student's rollouts (preset semi_opd, ``algo.sampler_weights=initial``):
the sampler keeps the initial weights while the trainer's move, across a resume too."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

import veriloop.algos.eval.in_training as in_training
import veriloop.algos.loop.run_steps as R
import veriloop.algos.loop.source as source
import veriloop.algos.loop.train as T
import veriloop.algos.run.setup as S
from veriloop.algos.learner.algorithm import resolve
from veriloop.algos.learner.prepare import prepare_batch
from veriloop.algos.loop.frozen_sampler import INITIAL_FILE
from veriloop.algos.run.log import read_metrics
from veriloop.algos.run.sync_probe import SamplerMismatchError
from veriloop.configs.algo import AlgoConfig
from veriloop.configs.loader import load_config
from veriloop.configs.schema import ConfigError

FAST = [
    "policy.model=tiny",
    "env.id=veriloop/MathVerify-v0",
    "env.kwargs={level: 1}",
    "run.algo_preset=semi_opd",
    "rollout.prompts_per_step=2",
    "rollout.group_size=2",
    "rollout.max_new_tokens=8",
    "rollout.max_context=256",
    "train.micro_batch_size=2",
    "train.lr=1e-2",
    "eval.num_problems=1",
    "eval.n_samples=1",
    "eval.k_list=[1]",
    "eval.greedy=false",
    "eval.every=0",
    "run.tensorboard=false",
    "run.checkpoint_every=1",
]


def _config(tmp_path: Path, steps: int, *extra: str):  # type: ignore[no-untyped-def]
    return load_config(
        None, [*FAST, f"train.steps={steps}", f"run.out_dir={tmp_path}", "run.name=semi", *extra]
    )


@pytest.fixture
def spy(monkeypatch: pytest.MonkeyPatch) -> dict[str, list]:
    """Each step's training episodes, and the sources the loop built (no evaluations: not tested here)."""
    seen: dict[str, list] = {"trajs": [], "sources": []}
    real_train, real_start = R.train_on_batch, source.SyncSource.start

    def train_on_batch(cfg, policy, critic, opt, trajs, *a, **kw):  # type: ignore[no-untyped-def]
        seen["trajs"].append(list(trajs))
        return real_train(cfg, policy, critic, opt, trajs, *a, **kw)

    def start(self):  # type: ignore[no-untyped-def]
        seen["sources"].append(self)
        return real_start(self)

    monkeypatch.setattr(R, "train_on_batch", train_on_batch)
    monkeypatch.setattr(source.SyncSource, "start", start)
    monkeypatch.setattr(in_training, "evaluate_step", lambda *a, **kw: {})
    torch.set_num_threads(1)
    return seen


def _initial(cfg):  # type: ignore[no-untyped-def]
    torch.manual_seed(cfg.rollout.seed)  # as train() builds it: the tiny model's init is seeded
    return S.build_policy(cfg)


def _gap(model, trajs) -> float:  # type: ignore[no-untyped-def]
    """Mean |log mu - log pi_model| over the recorded tokens (the rollout correction measures it)."""
    algo = resolve(AlgoConfig(rollout_is="truncate"))
    _, metrics = prepare_batch(trajs, algo, model=model, pad_id=0)
    return float(metrics["mismatch/abs_log_ratio"])


def _trained(run_dir: Path) -> dict[str, torch.Tensor]:
    step = max((run_dir / "checkpoints").glob("step-*"))
    return torch.load(step / "model" / "model.pt", weights_only=True)


def test_sampler_keeps_the_initial_weights_while_the_trainer_moves(tmp_path, spy) -> None:
    cfg = _config(tmp_path, 3)
    run_dir = T.train(cfg, quiet=True)
    initial = _initial(cfg)
    start = S.trainable_state(initial, None)
    after = _trained(run_dir)
    assert any(not torch.equal(start[k], after[k]) for k in start)  # the trainer moved
    (src,) = spy["sources"]
    sampler = {f"policy.{n}": p for n, p in src.initial.policy.model.named_parameters()}
    assert all(torch.equal(sampler[k], start[k]) for k in start)  # the sampler did not, after 3 updates
    saved = torch.load(run_dir / INITIAL_FILE, weights_only=True)
    assert all(torch.equal(saved[k.removeprefix("policy.")], start[k]) for k in start)
    # every step's recorded log-probs are the initial student's (fp32 HF engine: ~1e-7), not the trained one's
    trained = _initial(cfg)
    S.load_trainable_state(trained, None, after)
    assert len(spy["trajs"]) == 3
    for trajs in spy["trajs"]:
        assert _gap(initial.model, trajs) < 1e-4
    assert _gap(trained.model, spy["trajs"][-1]) > 1e-2
    rows = [r for r in read_metrics(run_dir) if r["step"] > 0]
    # the trainer against the frozen mu is the student's drift: logged as frozen_sampler/*, never as mismatch/*
    assert all(r["mismatch/k3_kl"] is None and r["frozen_sampler/tokens"] > 0 for r in rows)
    assert rows[0]["frozen_sampler/abs_log_ratio"] < 1e-4 < rows[-1]["frozen_sampler/abs_log_ratio"]
    assert all(
        math.isfinite(r["distill/reverse_kl"]) and 0 <= r["distill/ratio_capped_frac"] <= 1 for r in rows
    )


def test_a_resumed_run_samples_with_the_initial_weights_again(tmp_path, spy) -> None:
    T.train(_config(tmp_path, 2), quiet=True)
    cfg = _config(tmp_path, 4)
    run_dir = T.train(cfg, resume=True, quiet=True)
    initial = _initial(cfg)
    assert len(spy["trajs"]) == 4  # steps 1-2, then 3-4 after the resume (from the step-2 checkpoint)
    for trajs in spy["trajs"][2:]:
        assert _gap(initial.model, trajs) < 1e-4  # not the checkpoint's weights
    resumed = spy["sources"][1].initial.policy.model
    start = S.trainable_state(initial, None)
    assert all(
        torch.equal(dict(resumed.named_parameters())[k.removeprefix("policy.")], v) for k, v in start.items()
    )
    # without the saved initial weights a resume cannot know them: it says so
    (run_dir / INITIAL_FILE).unlink()
    with pytest.raises(ConfigError, match=INITIAL_FILE):
        T.train(_config(tmp_path, 5), resume=True, quiet=True)


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        (["algo.rl_coef=1.0"], "rl_coef=0"),
        (["algo.rollout_is=truncate"], "rollout_is=none"),
        (["train.max_staleness=1"], "max_staleness=0"),
        (["rollout.top_p=0.9"], "top_p=1.0"),
        (["train.parallel=fsdp"], "parallel=data"),
    ],
)
def test_incompatible_settings_are_refused_before_the_folder(tmp_path, extra, match) -> None:
    with pytest.raises(ConfigError, match=match):
        T.train(_config(tmp_path, 1, *extra), quiet=True)
    assert not (tmp_path / "semi").exists()


def _engine_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, skip: tuple[int, ...]) -> tuple[Path, list]:
    """semi_opd on an engine with its own copy of the weights (the HF engine on a copy: a
    ServingBackend on CPU), evaluated on it after each of 2 steps; ``skip``: its syncs left stale."""
    from tests.algos.run.test_sync_probe import CopyBackend

    made: list[CopyBackend] = []
    monkeypatch.setattr(
        T, "_rollout_backend", lambda cfg, policy, dist: made.append(CopyBackend(policy, skip)) or made[-1]
    )
    at_eval: list[bool] = []  # the engine held the trained weights at each evaluation

    def evaluate(cfg, policy, step, quiet, **kw):  # type: ignore[no-untyped-def]
        engine = dict(kw["backend"].copy.model.named_parameters())
        at_eval.append(all(torch.equal(engine[n], p) for n, p in policy.model.named_parameters()))
        return {}

    monkeypatch.setattr(in_training, "evaluate_step", evaluate)
    cfg = _config(tmp_path, 2, "eval.every=1", "eval.at_start=false")
    return T.train(cfg, quiet=True), [made, at_eval, cfg]


def test_an_engine_is_never_synced_after_an_update_and_its_reloads_are_probed(
    tmp_path, spy, monkeypatch
) -> None:
    run_dir, (made, at_eval, cfg) = _engine_run(tmp_path, monkeypatch, ())
    (engine,) = made
    # no sync after an update; each evaluation: the trained weights in, then the initial ones back
    assert engine.syncs == 4 and at_eval == [True, True]
    start = S.trainable_state(_initial(cfg), None)
    served = {f"policy.{n}": p for n, p in engine.copy.model.named_parameters()}
    assert all(torch.equal(served[k], v) for k, v in start.items())
    after = _trained(run_dir)
    assert any(not torch.equal(start[k], after[k]) for k in start)  # while the trainer's moved
    rows = [r for r in read_metrics(run_dir) if r["step"] > 0]
    assert rows[1]["sync/probe_gap"] <= 1e-3  # the reload after step 1's evaluation, probed
    for trajs in spy["trajs"]:
        assert _gap(_initial(cfg).model, trajs) < 1e-4


def test_the_probe_names_the_initial_weights_when_the_engine_keeps_the_trained_ones(
    tmp_path, spy, monkeypatch
) -> None:
    """The reload after the first evaluation (the engine's 2nd sync) fails: it still serves the
    trained weights, and the run stops saying it should serve the initial student's."""
    with pytest.raises(SamplerMismatchError, match="initial student's weights"):
        _engine_run(tmp_path, monkeypatch, (2,))
