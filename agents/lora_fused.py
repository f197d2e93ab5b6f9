"""A faster forward for peft's LoRA linear layers: ``base(x) + B(A(x)) * s`` as one ``addmm``.

peft computes the adapter's contribution as a [tokens, out] product, scales it in a second
pass and adds it to the base output in a third; with autograd the scale runs again in the
backward pass. On a CPU those full-width elementwise passes cost about as much as the rank-r
matmuls themselves. ``addmm`` folds the scale into the matmul and accumulates into the base
output: the same numbers up to float rounding, the same gradients (tests/agents/test_lora_fused.py),
~4% off a training micro-batch of the default model with r = 16 on all linear layers. Only the
plain case is taken -- one active adapter, not merged, not disabled, no dropout, no LoRA bias or
variant (DoRA...), the input in the base layer's dtype; anything else runs peft's own forward.

Mixed precision (``policy.precision: bf16``, :mod:`veriloop.agents.precision`): the frozen base
weights are bf16 and the adapters fp32. The adapter's two small matrices are cast to the input's
dtype here (an autograd cast: their gradients arrive in fp32, like ``torch.autocast`` does it), so
the whole layer runs as bf16 matmuls with fp32 accumulation inside, and nothing [tokens, d] wide is
cast. peft's own forward would cast the input to fp32 for the adapter instead.
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
        a, b = a.to(x.dtype), b.to(x.dtype)  # no-ops unless the adapter is fp32 under a bf16 base
        base = self.base_layer(x)
        low = x.reshape(-1, x.shape[-1]) @ a.t()  # [tokens, r]
        out = torch.addmm(base.reshape(-1, base.shape[-1]), low, b.t(), alpha=scaling)
        return out.view(base.shape)


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
    if base_weight is None or x.dtype != base_weight.dtype or lora_a.weight.dtype != lora_b.weight.dtype:
        return None
    return lora_a.weight, lora_b.weight, float(layer.scaling[name])
