"""A faster forward for peft's LoRA linear layers: ``base(x) + B(A(x)) * s`` as one ``addmm``.

peft computes the adapter's contribution as a [tokens, out] product, scales it in a second
pass and adds it to the base output in a third; with autograd the scale runs again in the
backward pass. On a CPU those full-width elementwise passes cost about as much as the rank-r
matmuls themselves. ``addmm`` folds the scale into the matmul and accumulates into the base
output: the same numbers up to float rounding, the same gradients (tests/agents/test_lora_fused.py),
~4% off a training micro-batch of the default model with r = 16 on all linear layers. Only the
plain case is taken -- one active adapter, not merged, not disabled, no dropout, no LoRA bias or
variant (DoRA...), the input in the base layer's dtype (or fp32 over a bf16 base, below); anything
else runs peft's own forward.

Mixed precision (``policy.precision: bf16``, :mod:`veriloop.agents.precision`): the frozen base
weights are bf16 and the adapters fp32. The base product and the input's projection onto the
adapter's rank-r space run in bf16 (the adapter matrix cast to bf16 by autograd, so its gradient
arrives in fp32); the rank-r product is added to the upcast base output in fp32 and the layer
returns fp32. Rounding that sum to bf16 lost what the adapter contributed while it was small: a
bf16 SFT warm-up of the default model trailed fp32's from its second step, and with the fp32 sum
it follows fp32's losses (docs/precision.md has the measurement).
"""

from __future__ import annotations

from typing import Any

import torch
from peft.tuners.lora.layer import Linear as LoraLinear


class FusedLoraLinear(LoraLinear):
    """peft's ``lora.Linear`` with the fused forward; existing layers get it as their class."""

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        plain = _plain_adapter(self, x) if not (args or kwargs) else None
        if plain is None:
            return super().forward(x, *args, **kwargs)
        a, b, scaling = plain
        if _is_mixed(self.base_layer.weight, a):  # fp32 adapter over a bf16 base: mixed precision
            return _mixed(self, x, a, b, scaling)
        a, b = a.to(x.dtype), b.to(x.dtype)  # no-ops unless the adapter's dtype is not the base's
        base = self.base_layer(x)
        low = x.reshape(-1, x.shape[-1]) @ a.t()  # [tokens, r]
        out = torch.addmm(base.reshape(-1, base.shape[-1]), low, b.t(), alpha=scaling)
        return out.view(base.shape)


def _mixed(
    layer: LoraLinear, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: float
) -> torch.Tensor:
    """``base(x) + s * B(A(x))`` with the bf16 base: the base product and the projection onto the
    rank-r space in bf16 (fp32 accumulation inside), the adapter's [tokens, r] x [r, out] product
    added to the upcast base output in fp32, and the result fp32. A bf16 result would round away the adapter's contribution while it is
    smaller than the rounding step of the base output (2^-8 of it), as it is early in training;
    the model's residual stream stays fp32 (its forward runs under autocast, see
    :mod:`veriloop.agents.precision`)."""
    half = torch.bfloat16
    with torch.autocast(x.device.type, enabled=False):
        xh = x.to(half)
        base = layer.base_layer(xh)  # [..., out], bf16
        low = xh.reshape(-1, xh.shape[-1]) @ a.to(half).t()  # [tokens, r], bf16
        out = torch.addmm(base.reshape(-1, base.shape[-1]).float(), low.float(), b.t(), alpha=scaling)
    return out.view(*base.shape[:-1], out.shape[-1])


def _is_mixed(base_weight: Any, adapter_weight: Any) -> bool:
    """A bf16 base with an fp32 adapter: ``policy.precision: bf16``."""
    return bool(base_weight.dtype == torch.bfloat16 and adapter_weight.dtype == torch.float32)


def fuse_lora_linears(model: torch.nn.Module) -> int:
    """Give every peft ``lora.Linear`` in ``model`` the fused forward; returns how many."""
    count = 0
    for module in model.modules():
        if type(module) is LoraLinear:
            module.__class__ = FusedLoraLinear
            count += 1
    return count


def _plain_adapter(layer: LoraLinear, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, float] | None:
    """(A weight, B weight, scaling) when ``layer`` is one plain active LoRA, else None."""
    if layer.disable_adapters or layer.merged or len(layer.active_adapters) != 1:
        return None
    name = layer.active_adapters[0]
    if name not in layer.lora_A or name in getattr(layer, "lora_variant", {}):
        return None
    lora_a, lora_b = layer.lora_A[name], layer.lora_B[name]
    if not isinstance(layer.lora_dropout[name], torch.nn.Identity):
        return None
    if lora_a.bias is not None or lora_b.bias is not None:
        return None
    base_weight = getattr(layer.base_layer, "weight", None)
    if base_weight is None or lora_a.weight.dtype != lora_b.weight.dtype:
        return None
    mixed = _is_mixed(base_weight, lora_a.weight)
    if x.dtype != base_weight.dtype and not (mixed and x.dtype == torch.float32):
        return None
    return lora_a.weight, lora_b.weight, float(layer.scaling[name])
