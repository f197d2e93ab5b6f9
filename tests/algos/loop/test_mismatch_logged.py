"""Sampler-vs-trainer mismatch is logged every step, from the first update's forward."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from veriloop.algos.learner.algorithm import resolve
from veriloop.configs.loader import load_config

TINY = ["policy.precision=fp32", "policy.model=tiny", "rollout.prompts_per_step=2", "rollout.group_size=2", "rollout.max_new_tokens=8",
        "rollout.max_context=512", "train.steps=1", "train.micro_batch_size=2", "eval.num_problems=1",
        "eval.n_samples=1", "eval.k_list=[1]", "eval.greedy=false", "eval.every=0", "eval.before_sft=false",
        "eval.at_start=false", "run.tensorboard=false", "sft.steps=0", "algo.preset=grpo", "algo.epochs=2"]  # fmt: skip


def test_every_step_logs_the_mismatch_of_the_hf_sampler(tmp_path: Path) -> None:
    import veriloop.algos.loop.train as T

    run = T.train(load_config("quickstart", [*TINY, f"run.out_dir={tmp_path}", "run.name=m"]), quiet=True)
    row = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()][-1]
    assert row["mismatch/tokens"] == row["train_tokens"]  # the whole batch, once (not once per epoch)
    assert 0 <= row["mismatch/k3_kl"] < 1e-6  # the HF engine samples what the trainer computes
    assert abs(row["mismatch/ratio_max"] - 1) < 1e-3 and abs(row["mismatch/ratio_min"] - 1) < 1e-3
    assert row["mismatch/outside_frac"] == 0.0


def test_policy_loss_reports_a_known_mismatch() -> None:
    """Recorded log-probs 0.1 above the trainer's: log r = -0.1 on every token."""
    from veriloop.agents.forward import token_logprobs
    from veriloop.agents.testing import tiny_policy
    from veriloop.algos.learner.batch import TokenBatch
    from veriloop.algos.learner.update import policy_loss
    from veriloop.algos.maths.mismatch import MismatchStats
    from veriloop.configs.algo import AlgoConfig

    policy = tiny_policy()
    ids = torch.tensor([[1, 5, 9, 13, 17, 21]])
    with torch.no_grad():
        lp, _ = token_logprobs(policy.model, ids, torch.ones_like(ids))
    mask = torch.tensor([[0, 0, 1, 1, 1, 1]], dtype=torch.float32)
    batch = TokenBatch(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        loss_mask=mask,
        old_logprobs=(lp + 0.1) * mask,
        turn_index=torch.zeros_like(ids),
        advantages=torch.ones_like(mask) * mask,
    )
    stats: list[MismatchStats] = []
    policy_loss(policy.model, batch, resolve(AlgoConfig()), mismatch=stats)
    m = sum(stats, MismatchStats()).metrics()
    assert m["mismatch/tokens"] == 4
    assert math.isclose(m["mismatch/k3_kl"], math.exp(-0.1) - 1 + 0.1, rel_tol=1e-4)
    assert math.isclose(m["mismatch/ratio_max"], math.exp(-0.1), rel_tol=1e-4)
