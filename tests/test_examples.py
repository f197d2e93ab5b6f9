"""The examples run: the one-file GRPO on a tiny random model (seconds)."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import torch

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_grpo_one_file_runs_on_policy(tiny_lora_policy):  # the fixture skips without the tokenizer
    grpo = _load("grpo_one_file")
    history = grpo.main(
        ["--tiny", "--steps", "2", "--problems", "2", "--group", "3", "--max-new-tokens", "8"]
    )
    assert len(history) == 2
    for stats in history:
        assert math.isfinite(stats["loss"]) and math.isfinite(stats["grad_norm"])
        assert -1.0 <= stats["reward"] <= 1.0  # the mean of +1 (correct) / -1 rewards
        # the trainer recomputes exactly what the sampler drew under the same weights (fp32)
        assert stats["logprob_drift"] < 1e-4


def test_grpo_one_file_learns_from_an_informative_group(tiny_lora_policy):
    """With rewards that differ inside a group the step moves the adapter; with equal rewards
    (no signal) the loss and gradient are exactly zero."""
    grpo = _load("grpo_one_file")
    policy = tiny_lora_policy
    optimizer = torch.optim.AdamW(policy.trainable_parameters(), lr=1e-2)
    trajectories = grpo.play(policy, 0, 1, 4, 6)
    batch = grpo.collate(trajectories, policy.tokenizer.pad_token_id or 0)

    flat = torch.zeros(len(trajectories))
    stats = grpo.grpo_step(policy, optimizer, batch, flat)
    assert stats["loss"] == 0.0 and stats["grad_norm"] == 0.0
    before = [p.detach().clone() for p in policy.trainable_parameters()]
    signal = grpo.group_normalized(torch.tensor([1.0, 0.0, 0.0, 1.0]), torch.zeros(4, dtype=torch.long))
    stats = grpo.grpo_step(policy, optimizer, batch, signal)
    assert stats["grad_norm"] > 0.0
    assert any(not torch.equal(a, b.detach()) for a, b in zip(before, policy.trainable_parameters()))
