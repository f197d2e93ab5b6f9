"""advantage=gdpo through compute_advantages: components from the env's info, shaping as one more."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from veriloop.algos.learner.algorithm import episode_components, resolve
from veriloop.algos.learner.credit import compute_advantages
from veriloop.configs.algo import AlgoConfig
from veriloop.configs.presets import load_preset


def _parts(make_traj, accuracy: float, fmt: float, token: int):
    traj = make_traj([([token], [], accuracy + fmt)])
    turn = replace(traj.turns[0], info={"reward_components": {"accuracy": accuracy, "format": fmt}})
    return replace(traj, turns=(turn,))


def test_gdpo_by_hand_through_the_update(make_traj):
    # MathVerify's r1 reward: accuracy 1 / 0 plus a 0.1 format bonus, one group of four
    trajs = [_parts(make_traj, a, f, 10 + i) for i, (a, f) in enumerate([(1, 0.1), (1, 0), (0, 0.1), (0, 0)])]
    out = compute_advantages(trajs, resolve(load_preset("gdpo")))
    # per component +-sqrt(3)/2, summed [sqrt 3, 0, 0, -sqrt 3], whitened by the batch std sqrt 2
    got = [float(out.advantages[i, 3]) for i in range(4)]
    # (eps 1e-4, the authors', on the format's 0.058 std: +-0.001 in the middle)
    assert got == pytest.approx([math.sqrt(1.5), 0.0, 0.0, -math.sqrt(1.5)], abs=2e-3)
    # GRPO on the summed reward puts right-without-format far above wrong-with-format
    grpo = compute_advantages(trajs, resolve(AlgoConfig(advantage="group_norm")))
    assert float(grpo.advantages[1, 3] - grpo.advantages[2, 3]) > 1.5


def test_components_add_up_to_the_learning_reward(make_traj):
    trajs = [_parts(make_traj, 1, 0.1, 10), _parts(make_traj, 0, 0, 11)]
    comp = episode_components(trajs, torch.tensor([1.1, 0.0]), "sum")
    assert torch.allclose(comp, torch.tensor([[1.0, 0.1], [0.0, 0.0]], dtype=torch.float64))  # nothing else
    shaped = episode_components(trajs, torch.tensor([1.6, -0.5]), "sum")  # e.g. a trainer bonus / penalty
    assert torch.allclose(shaped, torch.tensor([[1.0, 0.1, 0.5], [0.0, 0.0, -0.5]], dtype=torch.float64))
    assert torch.allclose(shaped.sum(1), torch.tensor([1.6, -0.5], dtype=torch.float64))
    bare = [make_traj([([10], [], 1.0)]), make_traj([([11], [], 0.0)])]  # no components: the reward itself
    assert episode_components(bare, torch.tensor([1.0, 0.0]), "sum").tolist() == [[1.0], [0.0]]


def test_gdpo_refuses_turn_level_rewards():
    with pytest.raises(ValueError, match="gdpo"):
        AlgoConfig(advantage="gdpo", reward_level="turn").validate()
