"""Folding a LoRA adapter into bf16 base weights for a sampler: dithered rounding (precision.merge_delta)."""

from __future__ import annotations

import torch

from veriloop.agents.backends.hf import merged_lora
from veriloop.agents.backends.vllm import merged_lora_weights
from veriloop.agents.loading import load_policy, save_policy
from veriloop.agents.precision import causal_lm, lora_delta, merge_delta
from veriloop.agents.testing import precision_pair


def _bf16_steps(weight: torch.Tensor) -> torch.Tensor:
    """The bf16 rounding step (ulp) at each element of a bf16 tensor (normal numbers)."""
    exponent = torch.frexp(weight.float()).exponent  # |w| in [2^(e-1), 2^e)
    return torch.ldexp(torch.ones_like(weight, dtype=torch.float32), exponent - 8)


def test_merge_delta_keeps_untouched_weights_and_moves_by_the_delta_on_average():
    torch.manual_seed(0)
    weight = torch.randn(256, 256).to(torch.bfloat16)
    assert torch.equal(merge_delta(weight, torch.zeros(256, 256), key="w"), weight)  # bit-exact
    signs = torch.where(torch.rand(256, 256) < 0.5, -1.0, 1.0)
    delta = 0.1 * signs * _bf16_steps(weight)  # a tenth of a step: inside rounding's dead zone
    nearest = (weight.float() + delta).to(torch.bfloat16)
    assert torch.equal(nearest, weight)  # rounded to nearest, the whole change is lost
    merged = merge_delta(weight, delta, key="w")
    moved = merged.float() - weight.float()
    assert merged.dtype == torch.bfloat16
    assert 0.09 < (moved != 0).float().mean() < 0.11  # a tenth of the elements move one step
    assert torch.all((moved == 0) | (moved.sign() == delta.sign()))  # only in the delta's direction
    for part in (delta > 0, delta < 0):  # unbiased: it moves by the delta on average, both ways
        assert abs(moved[part].sum() / delta[part].sum() - 1) < 0.05
    assert torch.equal(merge_delta(weight, delta, key="w"), merged)  # the same pattern at every sync
    assert not torch.equal(merge_delta(weight, delta, key="v"), merged)  # another weight, another one


def test_merge_delta_into_a_float32_weight_is_the_plain_sum():
    weight, delta = torch.randn(8, 8), torch.randn(8, 8) * 1e-4
    assert torch.equal(merge_delta(weight, delta, key="w"), weight + delta)


def test_samplers_and_a_saved_merge_fold_a_bf16_policy_alike(tmp_path):
    """The HF engine's merge, the weights pushed to vLLM and ``save_policy(merge=True)`` give the
    same dithered bf16 weights; the HF engine gives its bases back bit-exactly."""
    _, bf16 = precision_pair(lora=True)
    base = causal_lm(bf16.model)
    layers = {n: m for n, m in base.named_modules() if hasattr(m, "lora_A")}
    bases = {n: m.get_base_layer().weight.detach().clone() for n, m in layers.items()}
    expected = {
        f"{n}.weight": merge_delta(bases[n], lora_delta(m), key=f"{n}.weight") for n, m in layers.items()
    }
    assert all(w.dtype == torch.bfloat16 for w in bases.values())
    pushed = dict(merged_lora_weights(bf16.model))
    with merged_lora(bf16.model):
        inside = {f"{n}.weight": m.get_base_layer().weight.detach().clone() for n, m in layers.items()}
    for name, weight in expected.items():
        assert torch.equal(pushed[name], weight), name
        assert torch.equal(inside[name], weight), name
    assert any(not torch.equal(expected[f"{n}.weight"], bases[n]) for n in layers)  # the adapter is in
    assert all(torch.equal(m.get_base_layer().weight, bases[n]) for n, m in layers.items())
    saved = load_policy(save_policy(bf16, tmp_path / "merged", merge=True))
    weights = dict(saved.model.named_parameters())
    for name, weight in expected.items():
        assert torch.equal(weights[name].to(torch.bfloat16), weight), name
    assert all(m.lora_B["default"].weight.abs().sum() > 0 for m in layers.values())  # merged a copy
