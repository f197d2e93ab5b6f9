"""bf16 mixed precision on CUDA: the same stated tolerances as on the CPU (tests/agents/test_precision.py).

* one policy-gradient step of the tiny random Llama: gradient cosine to fp32 >= 0.999, relative
  error <= 0.05, per-token log-prob error <= 0.05 nats, mean log-prob within 1%;
* eight AdamW steps on one batch: every step's mean log-prob within 0.1% of fp32's, the weight change
  with cosine >= 0.995 to fp32's (relative error <= 0.10); optimizer state fp32.
On CUDA attention stays in bf16 (SDPA), unlike the CPU's fp32 attention.
"""

from __future__ import annotations

import copy

import pytest
import torch

from veriloop.agents.forward import token_logprobs
from veriloop.agents.precision import apply_precision
from veriloop.agents.testing import tiny_policy


def _pair(lora: bool):  # type: ignore[no-untyped-def]
    """The same tiny policy on the GPU in fp32 and in bf16 (a non-zero adapter, so it matters)."""
    torch.manual_seed(0)
    fp32 = tiny_policy(lora=lora, keep_reference=not lora)
    for name, param in fp32.model.named_parameters():
        if "lora_B" in name:
            param.data.normal_(0, 0.1)
    fp32.model.cuda()
    if fp32.frozen_reference is not None:
        fp32.frozen_reference.cuda()
    return apply_precision(fp32, "fp32"), apply_precision(copy.deepcopy(fp32), "bf16")


def _step(model, ids: torch.Tensor, signed: bool = True, first: int = 5):  # type: ignore[no-untyped-def]
    """Mean log-prob, flat fp32 gradient and log-probs of a policy-gradient loss with an entropy term."""
    model.zero_grad(set_to_none=True)
    logp, ent = token_logprobs(model, ids, torch.ones_like(ids), with_entropy=True, first_position=first)
    adv = torch.linspace(1.0, -1.0 if signed else 1.0, ids.shape[0], device=ids.device)[:, None]  # [B, 1]
    (-(adv * logp[:, first:]).mean() - 0.01 * ent[:, first:].mean()).backward()
    params = [p for p in model.parameters() if p.requires_grad]
    assert all(p.grad.dtype == torch.float32 and p.grad.is_cuda for p in params)
    grad = torch.cat([p.grad.flatten() for p in params])
    return logp[:, first:].mean().item(), grad, logp[:, first:].detach()


def _agreement(g32: torch.Tensor, g16: torch.Tensor) -> tuple[float, float]:
    cos = torch.nn.functional.cosine_similarity(g32.double(), g16.double(), dim=0).item()
    return cos, ((g16 - g32).norm() / g32.norm()).item()


@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
def test_bf16_step_on_gpu_agrees_with_fp32(lora: bool) -> None:
    fp32, bf16 = _pair(lora)
    ids = torch.randint(0, 1000, (3, 24), generator=torch.Generator().manual_seed(1)).cuda()
    m32, g32, lp32 = _step(fp32.model, ids)
    m16, g16, lp16 = _step(bf16.model, ids)
    cos, rel = _agreement(g32, g16)
    assert torch.isfinite(g16).all() and torch.isfinite(lp16).all()
    assert cos >= 0.999 and rel <= 0.05, (cos, rel)
    assert (lp16 - lp32).abs().max().item() <= 0.05
    assert abs(m16 - m32) <= 0.01 * abs(m32)
    assert rel > 0  # bf16 really ran


@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
def test_bf16_optimizer_steps_on_gpu_follow_fp32(lora: bool) -> None:
    fp32, bf16 = _pair(lora)
    ids = torch.randint(0, 1000, (3, 24), generator=torch.Generator().manual_seed(2)).cuda()
    curves, moved = [], []
    for policy in (fp32, bf16):
        params = policy.trainable_parameters()
        start = [p.detach().clone() for p in params]
        optimizer = torch.optim.AdamW(params, lr=1e-3)
        curve = []
        for _ in range(8):
            curve.append(_step(policy.model, ids, signed=False)[0])
            optimizer.step()
        assert all(s["exp_avg"].dtype == torch.float32 for s in optimizer.state.values())
        curves.append(curve)
        moved.append(torch.cat([(p.detach() - s).flatten() for p, s in zip(params, start)]))
    assert curves[0][-1] > curves[0][0] + 0.01  # the steps really train
    for m32, m16 in zip(*curves, strict=True):
        assert abs(m16 - m32) <= 1e-3 * abs(m32), curves
    cos, rel = _agreement(*moved)
    assert cos >= 0.995 and rel <= 0.10, (cos, rel)
