"""DAPO overlong shaping, the KL-in-reward penalty and class-balanced judgement rewards."""

from __future__ import annotations

import math

import pytest
import torch

from veriloop.algos.learner.algorithm import resolve
from veriloop.algos.maths.shaping import (
    class_balanced_rewards,
    format_reward,
    kl_reward_penalty,
    overlong_filter_mask,
    overlong_penalty,
)


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


def test_format_reward_r1_shape():
    texts = [
        "<think>6*7</think><answer>42</answer>",
        " <think>a</think>\n<answer>b</answer> ",  # whitespace around the tags is allowed
        "<answer>42</answer><think>x</think>",  # wrong order
        "<think>6*7</think> so 42",  # no answer tag
        "42",
    ]
    assert format_reward(texts, bonus=0.1).tolist() == pytest.approx([0.1, 0.1, 0.0, 0.0, 0.0])
    assert format_reward(["ok", "no"], bonus=0.5, check=lambda t: t == "ok").tolist() == [0.5, 0.0]


def test_format_reward_enters_the_advantages(make_traj):
    from dataclasses import replace

    from veriloop.algos.learner.credit import compute_advantages
    from veriloop.configs.algo import AlgoConfig

    a = make_traj([([10], [], 1.0)])
    b = make_traj([([11], [], 1.0)])
    a = replace(a, turns=(replace(a.turns[0], text="<think>t</think><answer>1</answer>"),))
    b = replace(b, turns=(replace(b.turns[0], text="1"),))
    cfg = AlgoConfig(advantage="group_mean", format_reward=0.2)
    # rewards 1.2 and 1.0: R - mean = +0.1 / -0.1 (without the bonus both would be 0)
    assert compute_advantages([a, b], resolve(cfg)).advantages[:, 3].tolist() == pytest.approx([0.1, -0.1])
    with pytest.raises(ValueError, match="format_reward"):
        AlgoConfig(format_reward=-1.0).validate()


def test_class_balanced_rewards_by_hand():
    # four episodes (solve, verify); one right solve (class 0), three wrong (class 1); the verifier
    # always says "incorrect": -1 on the right solve, +1 on the wrong ones (plain accuracy 0.75)
    rewards = torch.tensor([[1.0, -1.0], [-1.0, 1.0], [-1.0, 1.0], [-1.0, 1.0]])
    classes = torch.tensor([[-1, 0], [-1, 1], [-1, 1], [-1, 1]])
    got = class_balanced_rewards(rewards, classes)
    # n = 4 verifies, m = 2 classes: weight 4 / (2 * 1) = 2 on the right class, 4 / (2 * 3) = 2/3 on the wrong
    want = torch.tensor([[1.0, -2.0], [-1.0, 2 / 3], [-1.0, 2 / 3], [-1.0, 2 / 3]], dtype=torch.float64)
    assert torch.allclose(got, want)
    verify = got[:, 1]
    assert float(verify.mean()) == pytest.approx(0.0)  # a constant verdict earns chance: 2 * 0.5 - 1
    # a verifier right on the right solve and on two of three wrong ones: recalls 1 and 2/3,
    # balanced accuracy 5/6, so the mean weighted reward is 2 * 5/6 - 1 = 2/3 (plain: 0.75 * 2 - 1 = 0.5)
    better = class_balanced_rewards(torch.tensor([1.0, 1.0, 1.0, -1.0]), torch.tensor([0, 1, 1, 1]))
    assert float(better.mean()) == pytest.approx(2 / 3)
    # one class present: nothing to balance; no class: untouched
    same = torch.tensor([1.0, -1.0, 1.0])
    assert torch.equal(class_balanced_rewards(same, torch.tensor([1, 1, -1])), same.double())
    with pytest.raises(ValueError, match="shape"):
        class_balanced_rewards(same, torch.tensor([1, 1]))
