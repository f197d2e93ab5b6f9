"""On-policy distillation in the update and the training loop (preset opsd)."""

from __future__ import annotations

import math

import pytest
import torch

from veriloop.algos.learner.algorithm import resolve
from veriloop.algos.learner.batch import with_teacher
from veriloop.algos.learner.prepare import prepare_batch
from veriloop.algos.learner.update import policy_loss
from veriloop.configs.algo import AlgoConfig


def _batch(tiny_llama, make_traj, cfg):
    trajs = [make_traj([([10, 11, 12], [], 1.0)]), make_traj([([13, 14], [], 0.0)])]
    # pi_old = the model's own log-probs, so every ratio starts at exactly 1
    batch, _ = prepare_batch(trajs, resolve(cfg), model=tiny_llama, recompute_old_logprobs=True)
    return trajs, batch


def test_distillation_term_by_hand(tiny_llama, make_traj):
    cfg = AlgoConfig(distill_coef=1.0, rl_coef=0.0, loss_agg="token_mean")
    trajs, batch = _batch(tiny_llama, make_traj, cfg)
    # a teacher one nat above the student on every sampled token: A_t = 1, loss_t = -1, token mean -1
    teacher = [
        [lp + 1.0 if m else 0.0 for lp, m in zip(row.tolist(), mask.tolist())]
        for row, mask in zip(batch.old_logprobs, batch.loss_mask)
    ]
    loss, metrics = policy_loss(tiny_llama, with_teacher(batch, teacher), resolve(cfg))
    assert loss.item() == pytest.approx(-1.0, abs=1e-5)
    assert metrics["distill/reverse_kl"] == pytest.approx(-1.0, abs=1e-5)
    assert metrics["distill/teacher_better_frac"] == 1.0
    # the same teacher as the student: the distillation term is 0, and with rl_coef 1 only GRPO is left
    same = with_teacher(batch, [row.tolist() for row in batch.old_logprobs])
    both = AlgoConfig(distill_coef=0.5, rl_coef=1.0, loss_agg="token_mean")
    grpo, _ = policy_loss(tiny_llama, same, resolve(AlgoConfig(loss_agg="token_mean")))
    mixed, m = policy_loss(tiny_llama, same, resolve(both))
    assert mixed.item() == pytest.approx(grpo.item(), abs=1e-6) and m["distill/reverse_kl"] == 0.0
    with pytest.raises(ValueError, match="teacher"):
        policy_loss(tiny_llama, batch, resolve(cfg))  # distillation on without the teacher's log-probs
    with pytest.raises(ValueError, match="teacher rows"):
        with_teacher(batch, teacher[:1])


def test_distillation_settings_are_checked():
    with pytest.raises(ValueError, match="not both 0"):
        AlgoConfig(distill_coef=0.0, rl_coef=0.0).validate()
    with pytest.raises(ValueError, match="distill_teacher_model"):
        AlgoConfig(distill_coef=1.0, distill_teacher="model").validate()


def test_opsd_preset_trains_with_privileged_self_distillation(tmp_path, monkeypatch):
    import veriloop.agents.teacher as teacher
    import veriloop.algos.loop.train as T
    from veriloop.algos.run.log import read_metrics
    from veriloop.configs.loader import load_config

    seen: list[str] = []
    real = teacher.privileged_text

    def spy(traj):  # the teacher's text is the gold answer, and never in the student's tokens
        hint = real(traj)
        seen.append(hint)
        assert str(traj.task["answer"]) in hint
        return hint

    monkeypatch.setattr(teacher, "privileged_text", spy)
    cfg = load_config(
        None,
        [
            "policy.model=tiny",
            "env.id=veriloop/MathVerify-v0",
            "env.kwargs={level: 1}",
            "run.algo_preset=opsd",
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
            "run.checkpoint_every=1",
            f"run.out_dir={tmp_path}",
            "run.name=opsd",
        ],
    )
    assert cfg.algo.distill_coef == 1.0 and cfg.algo.rl_coef == 0.0
    run_dir = T.train(cfg, quiet=True)
    rows = [r for r in read_metrics(run_dir) if r["step"] > 0]
    # 2 steps x 4 training episodes; the evaluations (before training and at the end) never build a teacher
    assert [r["step"] for r in rows] == [1, 2] and len(seen) == 8
    assert any(k.startswith("eval/") for r in read_metrics(run_dir) for k in r)
    assert all(math.isfinite(r["distill/reverse_kl"]) and r["skipped"] == 0 for r in rows)
    # a random tiny model is far from its privileged self: the KL to the teacher is not 0
    assert any(abs(r["distill/reverse_kl"]) > 1e-4 for r in rows)
    assert torch.isfinite(torch.tensor([r["grad_norm"] for r in rows])).all()
    # the teacher's forward passes are timed, as a part of the update's time
    assert all(0 < r["time/teacher_s"] <= r["time/train_s"] for r in rows)
