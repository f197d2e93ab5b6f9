"""The fused LoRA forward (agents/lora_fused.py) computes what peft's does, and steps aside otherwise."""

from __future__ import annotations

import copy

import pytest
import torch
from peft.tuners.lora.layer import Linear as LoraLinear

from veriloop.agents.lora_fused import FusedLoraLinear, fuse_lora_linears
from veriloop.agents.testing import tiny_policy


def _pair() -> tuple[torch.nn.Module, torch.nn.Module]:
    """The same LoRA model twice (B made non-zero so the adapter matters): peft's forward, fused."""
    model = tiny_policy(lora=True).model
    torch.manual_seed(0)
    for name, param in model.named_parameters():
        if "lora_B" in name:
            param.data.normal_(0, 0.1)
    plain = copy.deepcopy(model)
    for module in plain.modules():
        if isinstance(module, FusedLoraLinear):
            module.__class__ = LoraLinear  # back to peft's class
    assert not any(isinstance(m, FusedLoraLinear) for m in plain.modules())
    return plain, model


def test_policies_with_lora_get_the_fused_forward():
    model = tiny_policy(lora=True).model
    assert sum(isinstance(m, FusedLoraLinear) for m in model.modules()) > 0
    assert fuse_lora_linears(model) == 0  # already fused: nothing left to do


def test_same_outputs_and_gradients_as_peft():
    plain, fused = _pair()
    ids = torch.randint(0, 100, (3, 7))
    outs, grads = [], []
    for model in (plain, fused):
        logits = model(input_ids=ids).logits
        loss = (logits.float() ** 2).mean()
        names = [n for n, p in model.named_parameters() if p.requires_grad]
        g = torch.autograd.grad(loss, [p for p in model.parameters() if p.requires_grad])
        outs.append(logits)
        grads.append(dict(zip(names, g, strict=True)))
    torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=1e-5)
    assert grads[0].keys() == grads[1].keys() and any("lora_A" in n for n in grads[0])
    for name in grads[0]:
        torch.testing.assert_close(grads[0][name], grads[1][name], atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize("state", ["disabled", "merged"])
def test_disabled_or_merged_adapters_run_peft_own_path(state):
    plain, fused = _pair()
    ids = torch.randint(0, 100, (2, 5))
    with torch.no_grad():
        with_adapter = plain(input_ids=ids).logits
        if state == "disabled":  # the reference model of LoRA training
            with fused.disable_adapter():
                got = fused(input_ids=ids).logits
            with plain.disable_adapter():
                torch.testing.assert_close(got, plain(input_ids=ids).logits)
            assert not torch.allclose(got, with_adapter)
        else:  # sampling: adapters folded into the base weights
            fused.merge_adapter()
            got = fused(input_ids=ids).logits
            fused.unmerge_adapter()
            torch.testing.assert_close(got, with_adapter, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(fused(input_ids=ids).logits, with_adapter, atol=1e-5, rtol=1e-5)
