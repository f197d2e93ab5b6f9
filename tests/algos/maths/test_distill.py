"""On-policy distillation's reverse-KL loss: hand-computed values, gradient and mask."""

from __future__ import annotations

import math

import pytest
import torch

from veriloop.algos.maths.distill import reverse_kl_distill_loss


def test_reverse_kl_loss_by_hand():
    # two sampled tokens and one padding position; the student is still the sampler (ratio 1)
    old = torch.log(torch.tensor([[0.5, 0.2, 0.9]]))
    teacher = torch.log(torch.tensor([[0.25, 0.4, 1e-30]]))
    lp = old.clone().requires_grad_(True)
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    loss, stats = reverse_kl_distill_loss(lp, old, teacher, mask)
    # k_t = log pi_old - log pi_T = log 2, log 0.5; loss_t = -A_t = k_t at ratio 1
    assert loss[0, 0].item() == pytest.approx(math.log(2))
    assert loss[0, 1].item() == pytest.approx(math.log(0.5))
    assert loss[0, 2].item() == 0.0
    assert stats["reverse_kl"].item() == pytest.approx((math.log(2) + math.log(0.5)) / 2, abs=1e-6)
    assert stats["teacher_better_frac"].item() == pytest.approx(0.5)
    loss.sum().backward()
    # d loss_t / d log pi_theta = -A_t * ratio = k_t: the token the teacher dislikes goes down
    assert lp.grad[0].tolist() == pytest.approx([math.log(2), math.log(0.5), 0.0])


def test_ratio_weights_the_advantage_and_teacher_gets_no_gradient():
    mu = torch.log(torch.tensor([[0.5]]))
    teacher = torch.log(torch.tensor([[0.25]])).requires_grad_(True)
    lp = torch.log(torch.tensor([[0.75]])).requires_grad_(True)  # ratio 1.5
    loss, _ = reverse_kl_distill_loss(lp, mu, teacher, torch.ones(1, 1))
    # A = log pi_T - log pi_theta = log(0.25 / 0.75) = -log 3, weighted by pi_theta / mu = 1.5
    assert loss.item() == pytest.approx(1.5 * math.log(3))
    loss.sum().backward()
    assert teacher.grad is None or float(teacher.grad.abs().sum()) == 0.0
    assert lp.grad.item() == pytest.approx(1.5 * math.log(3))


def test_identical_teacher_gives_zero_loss_and_shapes_are_checked():
    x = torch.log(torch.rand(2, 5).clamp(min=1e-3))
    loss, stats = reverse_kl_distill_loss(x.clone().requires_grad_(True), x, x, torch.ones(2, 5))
    assert float(loss.detach().abs().sum()) == 0.0 and stats["reverse_kl"].item() == 0.0
    with pytest.raises(ValueError, match="teacher_logprobs"):
        reverse_kl_distill_loss(x, x, x[:, :3], torch.ones(2, 5))


def test_sampled_reverse_kl_gradient_brings_the_student_to_the_teacher():
    # a one-step "model": student logits theta over 6 tokens, a fixed teacher; each step samples 64
    # tokens from the student (on-policy), scores them with the loss and takes one Adam step. The
    # one-sample estimate's expected gradient is grad KL(pi_theta || pi_T), so the exact KL must fall.
    gen = torch.Generator().manual_seed(0)
    teacher = torch.log_softmax(torch.tensor([2.0, 1.0, 0.0, -1.0, -1.0, -3.0]), dim=0)
    theta = torch.zeros(6, requires_grad=True)
    opt = torch.optim.Adam([theta], lr=0.05)

    def exact_kl() -> float:
        p = torch.log_softmax(theta.detach(), dim=0)
        return float((p.exp() * (p - teacher)).sum())

    start = exact_kl()
    for _ in range(300):
        logp_all = torch.log_softmax(theta, dim=0)
        x = torch.multinomial(logp_all.detach().exp(), 64, replacement=True, generator=gen).view(8, 8)
        lp = logp_all[x]
        loss, _ = reverse_kl_distill_loss(lp, lp.detach(), teacher[x], torch.ones(8, 8))
        opt.zero_grad()
        loss.mean().backward()
        opt.step()
    assert start > 0.9  # uniform student against a peaked teacher
    assert exact_kl() < 0.02 * start


def test_ratio_cap_truncates_the_weight_by_hand():
    """A student that moved away from a frozen sampler: teacher log 0.4 on both tokens, cap c = 2.
    Token 0: mu = 0.1, pi = 0.5, r = 5 > 2: weight 2, loss -2 log(0.4 / 0.5), gradient -2 log 0.8
    (the weight's factor, not r: d/d log pi of r * (c / sg(r)) is c).
    Token 1: mu = 0.5, pi = 0.6, r = 1.2 < 2: uncapped, loss and gradient -1.2 log(0.4 / 0.6)."""
    mu = torch.log(torch.tensor([[0.1, 0.5]]))
    teacher = torch.log(torch.tensor([[0.4, 0.4]]))
    mask = torch.ones(1, 2)
    lp = torch.log(torch.tensor([[0.5, 0.6]])).requires_grad_(True)
    loss, stats = reverse_kl_distill_loss(lp, mu, teacher, mask, ratio_cap=2.0)
    assert loss[0].tolist() == pytest.approx([-2 * math.log(0.8), -1.2 * math.log(0.4 / 0.6)], rel=1e-5)
    assert stats["ratio_capped_frac"].item() == pytest.approx(0.5)
    loss.sum().backward()
    assert lp.grad[0].tolist() == pytest.approx([-2 * math.log(0.8), -1.2 * math.log(0.4 / 0.6)], rel=1e-5)
    # without the cap token 0 weighs r = 5; the cap never acts at r <= c (an on-policy batch: r = 1)
    uncapped, off = reverse_kl_distill_loss(lp.detach(), mu, teacher, mask)
    assert (
        uncapped[0, 0].item() == pytest.approx(-5 * math.log(0.8), rel=1e-5) and off["ratio_capped_frac"] == 0
    )
    on_policy, _ = reverse_kl_distill_loss(lp.detach(), lp.detach(), teacher, mask, ratio_cap=2.0)
    same, _ = reverse_kl_distill_loss(lp.detach(), lp.detach(), teacher, mask)
    assert torch.equal(on_policy, same)
    with pytest.raises(ValueError, match="ratio_cap"):
        reverse_kl_distill_loss(lp.detach(), mu, teacher, mask, ratio_cap=0.0)
