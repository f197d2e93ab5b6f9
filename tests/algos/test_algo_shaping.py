"""DAPO overlong shaping and the KL-in-reward penalty."""

from __future__ import annotations

import math

import pytest
import torch

from veriloop.algos.shaping import kl_reward_penalty, overlong_filter_mask, overlong_penalty


def test_overlong_penalty_piecewise():
    # L_max 20, L_cache 4: free up to 16, linear to -1 at 20, -1 beyond
    got = overlong_penalty(torch.tensor([10, 16, 17, 18, 20, 21, 500]), max_len=20, cache_len=4)
    assert torch.allclose(got, torch.tensor([0.0, 0.0, -0.25, -0.5, -1.0, -1.0, -1.0]))
    with pytest.raises(ValueError, match="cache_len"):
        overlong_penalty(torch.tensor([1]), max_len=4, cache_len=4)


def test_overlong_filter_mask():
    assert torch.equal(overlong_filter_mask(torch.tensor([True, False, True])), torch.tensor([0.0, 1.0, 0.0]))


def test_kl_reward_penalty_only_on_sampled_tokens():
    r = torch.tensor([[0.0, 0.0, 1.0]])
    lp = torch.tensor([[0.0, math.log(2.0), math.log(2.0)]])
    ref = torch.zeros(1, 3)
    m = torch.tensor([[0.0, 1.0, 1.0]])
    got = kl_reward_penalty(r, lp, ref, m, coef=0.1, kind="k1")
    d = math.log(2.0)
    assert torch.allclose(got, torch.tensor([[0.0, -0.1 * d, 1.0 - 0.1 * d]]))
