"""The training loop on a tiny model: every preset trains, metrics are real, failures are data.

Fast settings: 2 level-1 math problems x 2 samples, 8 new tokens, 2 steps. A random tiny model
never answers correctly, so ``varied_rewards`` replaces the math verifier's check with a
deterministic rule on the response (even length = correct): groups then have differing rewards,
advantages are non-zero and the weights must move.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

import veriloop.algos.eval.in_training as in_training
import veriloop.algos.learner.train_batch as train_batch
import veriloop.algos.loop.source as source_module
import veriloop.algos.loop.train as T
import veriloop.algos.run.setup as S
from veriloop.algos.run.log import read_metrics
from veriloop.algos.run.nonfinite import NonFiniteTrainingError
from veriloop.configs.loader import load_config
from veriloop.envs.math_env import MathVerifyEnv
from veriloop.envs.verifiers import Verdict

FAST = [
    "policy.model=tiny",
    "env.id=veriloop/MathVerify-v0",
    "env.kwargs={level: 1}",
    "rollout.prompts_per_step=2",
    "rollout.group_size=2",
    "rollout.max_new_tokens=8",
    "rollout.max_context=256",
    "train.steps=2",
    "train.micro_batch_size=2",
    "train.lr=1e-2",
    "eval.num_problems=1",
    "eval.n_samples=1",
    "eval.k_list=[1]",
    "eval.greedy=false",
    "eval.every=0",
    "run.tensorboard=false",
    "run.checkpoint_every=0",
]
S2R = ["env.id=veriloop/SolveVerify-v0", "rollout.max_context=512", "rollout.max_turns=4"]
PRESETS = {
    "ppo": [],
    "grpo": [],
    "rloo": [],
    "dapo": ["algo.overlong_max_len=8", "algo.overlong_cache_len=2", "algo.max_sampling_rounds=2"],
    "dr_grpo": [],
    "reinforce_pp": [],
    "s2r_outcome_rloo": [*S2R, "env.kwargs={task: math, reward_mode: outcome, max_attempts: 1, level: 1}"],
    "s2r_process_grpo": [*S2R, "env.kwargs={task: math, reward_mode: process, max_attempts: 1, level: 1}"],
}
#: Logged every step under the same name for every algorithm.
STEP_METRICS = (
    "reward/mean",
    "reward/std",
    "success_rate",
    "response_length/mean",
    "response_length/max",
    "truncation_rate",
    "format_rate",
    "entropy",
    "mean_token_prob",
    "clip_frac_low",
    "clip_frac_high",
    "approx_kl",
    "kl_ref",
    "grad_norm",
    "sampling/kept_fraction",
    "sampling/rounds",
    "verifier/errors",
    "verifier/timeouts",
    "drift_rate",
    "throughput/rollout_tokens_per_s",
    "throughput/train_tokens_per_s",
    "time/rollout_s",
    "time/train_s",
    "time/rollout_fraction",
    "lr",
    "nonfinite_skipped_total",
)


def config(tmp_path: Path, preset: str, *extra: str):  # type: ignore[no-untyped-def]
    return load_config(
        None,
        [
            *FAST,
            f"run.algo_preset={preset}",
            *PRESETS.get(preset, []),
            f"run.out_dir={tmp_path}",
            f"run.name={preset}",
            *extra,
        ],
    )


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def varied_rewards(monkeypatch: pytest.MonkeyPatch) -> None:
    """The math check says 'correct' for responses of even length (a deterministic coin)."""

    def check(self, response: str, task) -> Verdict:  # type: ignore[no-untyped-def]
        ok = len(response) % 2 == 0
        return Verdict(correct=ok, reason="correct" if ok else "wrong_value", parsed=response[:8])

    monkeypatch.setattr(MathVerifyEnv, "check", check)


@pytest.fixture
def no_eval(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Evaluation is tested in test_evaluate.py; here only record when the loop asks for it."""
    calls: list[int] = []
    monkeypatch.setattr(
        in_training, "evaluate_step", lambda cfg, policy, step, quiet, **kw: calls.append(step) or {}
    )
    return calls


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    step = max((run_dir / "checkpoints").glob("step-*"))
    return torch.load(step / "model" / "model.pt", weights_only=True)


def initial_weights(cfg) -> dict[str, torch.Tensor]:  # type: ignore[no-untyped-def]
    torch.manual_seed(cfg.rollout.seed)
    policy = S.build_policy(cfg)
    critic = S.build_critic(cfg, policy)
    return {k: v.clone() for k, v in S.trainable_state(policy, critic).items()}


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_every_preset_trains_two_steps(tmp_path, preset, varied_rewards, no_eval) -> None:
    cfg = config(tmp_path, preset)
    run_dir = T.train(cfg, quiet=True)
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        missing = [k for k in STEP_METRICS if k not in row]
        assert not missing, f"{preset}: metrics missing {missing}"
        assert row["response_length/max"] <= 8 * cfg.rollout.max_turns and 0 <= row["truncation_rate"] <= 1
    assert no_eval == [0, 2]  # the base policy, then only at the end (eval.every=0)
    before, after = initial_weights(cfg), final_weights(run_dir)
    assert before.keys() == after.keys()
    updated = [k for k in before if not torch.equal(before[k], after[k])]
    if any(r["updates"] > 0 and r["grad_norm"] for r in rows):
        assert updated, f"{preset}: a non-zero gradient was applied but no weight changed"
    else:  # dynamic sampling found no informative group twice: allowed, but then nothing moved
        assert preset == "dapo" and not updated
    assert (run_dir / "final").is_dir()


def test_eval_at_start_can_be_skipped(tmp_path, varied_rewards, no_eval) -> None:
    T.train(config(tmp_path, "grpo", "eval.at_start=false"), quiet=True)
    assert no_eval == [2]  # only at the end: the starting policy was measured elsewhere


def test_metrics_are_correct(tmp_path, varied_rewards) -> None:
    """Real evaluation, KL to the reference (GRPO with LoRA: adapter disabled), values in range."""
    cfg = config(tmp_path, "grpo", "train.steps=1")
    run_dir = T.train(cfg, quiet=True)
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [0, 1]  # step 0 = the base policy's evaluation
    assert any(k.startswith("eval/") for k in rows[0])
    row = rows[1]
    assert any(k.startswith("eval/") for k in row)
    # one update at the policy that sampled: old == new, the reference is the same base weights
    assert row["approx_kl"] == pytest.approx(0.0, abs=1e-6)
    assert row["kl_ref"] == pytest.approx(0.0, abs=1e-6)  # LoRA B starts at 0: policy == reference
    assert row["clip_frac_low"] == row["clip_frac_high"] == 0.0
    assert 0 < row["mean_token_prob"] < 1 and 0 < row["entropy"] <= math.log(50_000)
    assert 0 <= row["success_rate"] <= 1
    assert row["train_tokens"] == pytest.approx(4 * row["response_length/mean"])
    assert row["sampling/rounds"] == 1 and row["sampling/kept_fraction"] == 1
    assert row["verifier/errors"] == row["verifier/timeouts"] == 0
    assert 0 <= row["time/rollout_fraction"] <= 1 and row["throughput/rollout_tokens_per_s"] > 0


def test_kl_to_reference_grows_after_updates(tmp_path, varied_rewards, no_eval) -> None:
    """Full fine-tuning keeps a frozen copy: after step 1 the sampling policy differs from it."""
    cfg = config(tmp_path, "grpo", "policy.lora=false", "train.lr=3e-2")
    rows = read_metrics(T.train(cfg, quiet=True))
    assert rows[0]["kl_ref"] == pytest.approx(0.0, abs=1e-6)
    assert rows[1]["kl_ref"] > 1e-6


def test_no_reference_logs_null_kl(tmp_path, varied_rewards, no_eval) -> None:
    rows = read_metrics(T.train(config(tmp_path, "rloo", "train.steps=1"), quiet=True))
    assert rows[0]["kl_ref"] is None


def test_verifier_timeouts_are_counted_not_scored(tmp_path, monkeypatch, no_eval) -> None:
    """A timed-out check never stops training, is counted, and is left out of the baselines."""

    def check(self, response: str, task) -> Verdict:  # type: ignore[no-untyped-def]
        if len(response) % 3 == 0:
            return Verdict(correct=False, error="timeout", reason="timeout")
        return Verdict(correct=len(response) % 2 == 0, reason="checked")

    monkeypatch.setattr(MathVerifyEnv, "check", check)
    rows = read_metrics(T.train(config(tmp_path, "grpo"), quiet=True))
    assert len(rows) == 2
    for row in rows:
        assert row["verifier/errors"] == row["verifier/timeouts"] == row["samples/verifier_failed"]
    assert sum(r["verifier/timeouts"] for r in rows) > 0, "the fake verifier never timed out: change its rule"


def test_nonfinite_loss_skips_then_stops(tmp_path, monkeypatch, varied_rewards, no_eval) -> None:
    """NaN losses skip the step (weights untouched, counted); too many in a row stop the run."""
    real = train_batch.update_step
    state = {"calls": 0}

    def nan_on_second(model, optimizer, batch, algo, settings, **kw):  # type: ignore[no-untyped-def]
        state["calls"] += 1
        if state["calls"] >= 2:  # poison every update from the second step on
            with torch.no_grad():
                batch.advantages.fill_(float("nan"))
        return real(model, optimizer, batch, algo, settings, **kw)

    monkeypatch.setattr(train_batch, "update_step", nan_on_second)
    cfg = config(
        tmp_path, "rloo", "train.steps=5", "train.max_consecutive_nonfinite=2", "run.checkpoint_every=1"
    )
    with pytest.raises(NonFiniteTrainingError, match="2 consecutive steps"):
        T.train(cfg, quiet=True)
    run_dir = tmp_path / "rloo"
    rows = read_metrics(run_dir)
    assert [r["skipped"] for r in rows] == [0.0, 1.0]  # step 3 raised before logging
    assert rows[1]["nonfinite_skipped_total"] == 1.0
    ckpts = sorted((run_dir / "checkpoints").glob("step-*"))
    assert [p.name for p in ckpts] == ["step-000001", "step-000002"]
    w1, w2 = (torch.load(p / "model" / "model.pt", weights_only=True) for p in ckpts)
    assert all(torch.equal(w1[k], w2[k]) for k in w1)  # the skipped step changed nothing
    assert all(torch.isfinite(v).all() for v in w2.values())


def test_rl_seeds_start_after_sft_examples(tmp_path, monkeypatch, no_eval) -> None:
    """SFT demonstrations use seeds 0..examples-1; the first RL problem is seed ``examples``."""
    import veriloop.algos.sft.train as sft

    warmups: list[Path] = []
    monkeypatch.setattr(
        sft, "warmup_from_config", lambda cfg, policy, run_dir: warmups.append(run_dir) or {}, raising=False
    )
    seen: list[int] = []
    real = source_module.rollout

    def spy(policy, specs, **kw):  # type: ignore[no-untyped-def]
        seen.extend(s.seed for s in specs)
        return real(policy, specs, **kw)

    monkeypatch.setattr(source_module, "rollout", spy)
    T.train(
        config(tmp_path, "grpo", "train.steps=1", "sft.steps=1", "sft.source=generator", "sft.examples=5"),
        quiet=True,
    )
    assert len(warmups) == 1
    assert sorted(set(seen)) == [5, 6]
