"""bf16 mixed precision on CUDA: the same stated tolerances as on the CPU (tests/agents/test_precision.py).

* one policy-gradient step of the tiny random Llama: gradient cosine to fp32 >= 0.999, relative
  error <= 0.05, per-token log-prob error <= 0.05 nats, mean log-prob within 1%;
* eight AdamW steps on one batch: every step's mean log-prob within 0.1% of fp32's, the weight change
  with cosine >= 0.995 to fp32's (relative error <= 0.10); optimizer state fp32.
On CUDA attention stays in bf16 (SDPA), unlike the CPU's fp32 attention.
"""

from __future__ import annotations

import pytest
import torch

from veriloop.agents.testing import check_bf16_step, gradient_agreement, policy_gradient_step, precision_pair


@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
def test_bf16_step_on_gpu_agrees_with_fp32(lora: bool) -> None:
    check_bf16_step(lora, device="cuda")


@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
def test_bf16_optimizer_steps_on_gpu_follow_fp32(lora: bool) -> None:
    fp32, bf16 = precision_pair(lora, device="cuda")
    ids = torch.randint(0, 1000, (3, 24), generator=torch.Generator().manual_seed(2)).cuda()
    curves, moved = [], []
    for policy in (fp32, bf16):
        params = policy.trainable_parameters()
        start = [p.detach().clone() for p in params]
        optimizer = torch.optim.AdamW(params, lr=1e-3)
        curve = []
        for _ in range(8):
            curve.append(policy_gradient_step(policy.model, ids, signed=False)[0])
            optimizer.step()
        assert all(s["exp_avg"].dtype == torch.float32 for s in optimizer.state.values())
        curves.append(curve)
        moved.append(torch.cat([(p.detach() - s).flatten() for p, s in zip(params, start)]))
    assert curves[0][-1] > curves[0][0] + 0.01  # the steps really train
    for m32, m16 in zip(*curves, strict=True):
        assert abs(m16 - m32) <= 1e-3 * abs(m32), curves
    cos, rel = gradient_agreement(*moved)
    assert cos >= 0.995 and rel <= 0.10, (cos, rel)
