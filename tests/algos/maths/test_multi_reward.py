"""GDPO per-component normalisation: hand-computed numbers and the invariants."""

from __future__ import annotations

import math

import pytest
import torch

from veriloop.algos.maths.advantages import group_normalized
from veriloop.algos.maths.multi_reward import component_normalized

# one group of four: accuracy (1 / 0) and a 0.1 format bonus
COMP = torch.tensor([[1.0, 0.1], [1.0, 0.0], [0.0, 0.1], [0.0, 0.0]])
GROUP = torch.zeros(4, dtype=torch.long)


def test_by_hand_without_batch_normalisation():
    # each component: deviations +-0.5 (+-0.05), sample std sqrt(4 * 0.25 / 3) (sqrt(4 * 0.0025 / 3))
    # -> +-sqrt(3) / 2 per component, whatever its scale
    a = component_normalized(COMP, GROUP, batch_normalize=False)
    h = math.sqrt(3) / 2
    assert a.tolist() == pytest.approx([2 * h, 0.0, 0.0, -2 * h], abs=2e-3)  # eps = 1e-4 on a std of 0.058
    # GRPO on the sum lets accuracy decide: right-without-format far above wrong-with-format
    grpo = group_normalized(COMP.sum(1), GROUP)
    # eps = 1e-4 (the authors') weighs on the 0.058 std a little more than on the 0.58 one: 0.0027
    assert grpo[1] - grpo[2] > 1.5 and float(a[1] - a[2]) == pytest.approx(0.0, abs=3e-3)


def test_by_hand_with_batch_normalisation_and_weights():
    # [sqrt 3, 0, 0, -sqrt 3]: mean 0, sample std sqrt(6 / 3) = sqrt 2
    a = component_normalized(COMP, GROUP)  # eps 1e-4 on the format's 0.058 std: +-0.001 in the middle
    assert a.tolist() == pytest.approx([math.sqrt(1.5), 0.0, 0.0, -math.sqrt(1.5)], abs=2e-3)
    w = component_normalized(COMP, GROUP, weights=torch.tensor([1.0, 0.0]), batch_normalize=False)
    h = 0.5 / (math.sqrt(1 / 3) + 1e-4)  # deviation 0.5 over the Bessel std sqrt(1/3) + eps 1e-4
    assert w.tolist() == pytest.approx([h] * 2 + [-h] * 2, abs=1e-6)


def test_one_component_is_grpo_and_invalid_episodes_are_left_out():
    r = torch.tensor([1.0, 0.0, 0.5, 2.0, 2.0, 1.0])
    g = torch.tensor([0, 0, 0, 1, 1, 1])
    valid = torch.tensor([True, True, False, True, True, True])
    one = component_normalized(r[:, None], g, batch_normalize=False, valid=valid)
    assert torch.allclose(one, group_normalized(r, g, valid=valid, eps=1e-4), atol=1e-6)
    assert one[2] == 0.0
    # a component constant in its group adds nothing; the group's sums are 0 before batch whitening
    both = component_normalized(torch.stack([r, torch.full_like(r, 7.0)], 1), g, batch_normalize=False)
    assert torch.allclose(both, group_normalized(r, g, eps=1e-4), atol=1e-6)
    assert float(both[:3].sum()) == pytest.approx(0.0, abs=1e-6)


def test_shapes_are_checked():
    with pytest.raises(ValueError, match=r"\[N, C\]"):
        component_normalized(torch.zeros(4), GROUP)
    with pytest.raises(ValueError, match="one entry per component"):
        component_normalized(COMP, GROUP, weights=torch.ones(3))
