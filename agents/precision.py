"""Mixed precision for a :class:`~veriloop.agents.policy.Policy`: ``policy.precision: fp32 | bf16``.

``fp32``: every weight and every operation in float32 (what the tests pin).

``bf16`` (mixed precision, the way peers train): matmuls run in bfloat16, with fp32 accumulation
inside the kernels, while everything that is trained or summed stays float32:

* LoRA: the frozen base weights are *stored* in bf16 (no cast per call; half the memory), the
  adapters stay fp32 parameters. The fused LoRA layer (:mod:`veriloop.agents.lora_fused`) runs
  the base product in bf16 and adds the adapter's rank-r product to it in fp32, returning fp32:
  the residual stream between the layers is fp32 (as under autocast over fp32 weights), and the
  model's forward runs under ``torch.autocast(bfloat16)`` for the other products (the head).
  Summed in bf16, the adapter's early, small contribution was rounded away (the bf16 SFT
  warm-up trailed fp32's). Autograd casts the adapters' gradients back to fp32, so ``.grad``,
  gradient accumulation over micro-batches, clipping and AdamW's state are fp32.
* Full fine-tuning: the weights stay fp32 (the master copy AdamW updates) and the model's forward
  runs under ``torch.autocast(bfloat16)`` (what accelerate does for ``mixed_precision="bf16"``,
  which TRL's ``bf16=True`` uses). The frozen reference copy is stored in bf16.
* The log-prob / entropy head keeps fp32 numerics: the vocabulary projection is a bf16 matmul, and
  its logits are read in fp32 chunks for the log-softmax (:func:`veriloop.agents.forward.token_logprobs`).
  The projection is run as one 2-D matmul (transformers' slice for ``logits_to_keep`` is not
  contiguous and took a batched matmul that copies the 49k x d weight per row in bf16).
* RMSNorm computes in fp32 (transformers upcasts it), rotary embeddings are computed in fp32.
* Attention on CPU runs in fp32 (q, k, v upcast; out cast back): PyTorch's CPU flash-attention
  kernel is ~2.6x slower in bf16 than in fp32 on AVX-512 machines (tests/agents/test_precision.py
  states the measurement); on GPUs it stays bf16 (FlashAttention's own dtype).
* The sampler uses the same dtype by default (:attr:`Policy.sampler_dtype`), so the
  sampler-trainer gap measures the engines, not two precisions. A LoRA adapter reaches a sampler
  folded into the bf16 base weights by :func:`merge_delta`, whose rounding is dithered: rounded to
  nearest, every adapter change smaller than half a bf16 step of its weight would be dropped.

Saved adapters and checkpoints hold the fp32 parameters (the adapters, or the full fp32 weights).
A saved merged model (``save_policy(merge=True)``) of a bf16 LoRA policy is bf16, like its base,
with the adapter folded in by :func:`merge_delta`.
"""

from __future__ import annotations

import functools
import zlib
from typing import Any, Literal, cast

import torch

from veriloop.agents.policy import Policy

Precision = Literal["fp32", "bf16"]
PRECISIONS: tuple[str, ...] = ("fp32", "bf16")
#: transformers attention implementation registered by :func:`_fp32_attention_name`.
FP32_ATTENTION = "veriloop_sdpa_fp32"


def check_precision(precision: str) -> None:
    """Refuse an unknown precision name, saying what each known one does."""
    if precision not in PRECISIONS:
        raise ValueError(
            f"precision must be one of {list(PRECISIONS)}, got {precision!r}: fp32 computes everything in "
            "float32; bf16 is mixed precision (bf16 matmuls, fp32 trained weights, gradients and optimizer state)"
        )


def apply_precision(policy: Policy, precision: str) -> Policy:
    """Set ``policy`` up for ``precision`` in place (see the module docstring) and return it.

    ``fp32`` changes nothing (the weights keep the dtype they were loaded in: ``policy.dtype``);
    ``bf16`` expects float32 trained weights (the default ``policy.dtype``) and converts the frozen
    ones. Applying ``bf16`` twice is harmless; going back to ``fp32`` is refused.
    """
    check_precision(precision)
    dtypes = {p.dtype for p in policy.model.parameters() if p.is_floating_point() and p.requires_grad}
    if precision == "fp32":
        if policy.precision != "fp32":
            raise ValueError(
                f"this policy is set up for {policy.precision} (its frozen weights were converted): load it again for fp32"
            )
        return policy
    if dtypes - {torch.float32}:
        raise ValueError(
            f"precision bf16 keeps the trained weights in float32, but they are {sorted(map(str, dtypes))}: "
            "load the model in float32 (policy.dtype: float32) and let the precision convert the frozen ones"
        )
    device_type = policy.device.type
    _frozen_to_bf16(policy.model)
    # full fine-tuning: bf16 compute over the fp32 master weights comes from autocast; LoRA: the
    # adapted layers return fp32 (lora_fused), so the residual stream stays fp32 and autocast
    # casts the inputs of every other bf16 product (the head, layers without an adapter)
    _autocast_forward(causal_lm(policy.model), device_type)
    for model in (policy.model, policy.frozen_reference):
        if model is None:
            continue
        if model is policy.frozen_reference:
            model.to(torch.bfloat16)
        _contiguous_head(model)
        if device_type == "cpu":
            _set_attention(model, _fp32_attention_name())
    policy.precision = "bf16"
    return policy


#: round(2^16 / golden ratio): steps of 0.618 of the offsets' range, each run of 2^16 a permutation.
_GOLDEN_16 = 40503


def merge_delta(weight: torch.Tensor, delta: torch.Tensor, *, key: str) -> torch.Tensor:
    """``weight + delta`` as a new tensor in ``weight``'s dtype: a LoRA adapter's ``delta`` (its
    scaled ``B A``, or a sum of them) folded into a frozen base weight for a sampler.

    Into a float32 (or other) weight the sum is plain. Into a **bf16** weight it is computed in
    fp32 and rounded with a fixed dither: each element rounds up (away from zero) when the fp32
    sum's 16 bits below bf16's mantissa, plus a pseudo-random 16-bit offset of its own, carry into
    bf16's last bit. An element whose delta is 0 keeps its bf16 value bit-exactly (its low bits are
    0); of the elements changed by a fraction f of a bf16 step, a fraction f moves one step, so
    over the elements the merged weight equals ``weight + delta`` on average.

    Why: the base weight already lies on bf16's grid, so rounding to nearest maps ``weight + delta``
    back to ``weight`` wherever ``|delta|`` is under half a step (2^-9 of the weight) -- for a
    trained LoRA adapter of the default model, half of the elements. The sampler then misses a
    systematic part of the update: on two GRPO runs' adapters (benchmarks/bench_merge_rounding.py),
    the sampler's log-probs against the trainer's exact policy gave k3 KL 1.6-3.1e-3 rounded to
    nearest and 1.2-1.3e-4 dithered (an fp32 base rounded by a bf16 sampler, whose own low bits
    dither: 3.5-4.9e-4); docs/results/precision.md has the runs.

    The offsets are a golden-ratio (Weyl) sequence over the flattened elements, started at a hash
    of ``key`` (the weight's name): evenly spread (any run of elements gets offsets spread over the
    whole range), the same for a weight at every sync (the sampler's policy moves only where the
    adapter does, and a resumed run samples with the same weights), and ~15x cheaper than drawing
    random numbers (0.04 s against 0.63 s for the default model's 106M adapted weights on 2 cores;
    the whole merge costs ~0.3 s more per sync than rounding to nearest).
    """
    if weight.dtype != torch.bfloat16:
        return weight + delta.to(weight.dtype)
    # a new fp32 tensor, whose bits are ours to edit (fp32 += fp32: PyTorch's CPU add of a bf16 and
    # an fp32 tensor is ~10x slower)
    total = weight.float().add_(delta.float())
    start = zlib.crc32(key.encode()) & 0xFFFF
    offset = torch.arange(start, start + total.numel(), dtype=torch.int32, device=total.device)
    offset = offset.view(total.shape).mul_(_GOLDEN_16).bitwise_and_(0xFFFF)
    bits = total.view(torch.int32)
    bits.add_(offset).bitwise_and_(-(1 << 16))  # sign-magnitude: a carry moves away from zero
    return total.to(torch.bfloat16)  # exact: the low 16 bits are 0


def base_weight(layer: Any) -> torch.Tensor:
    """The frozen tensor a peft LoRA layer adapts: its base ``nn.Linear``'s ``weight``, or for a
    wrapped parameter (peft's ``ParamWrapper``, e.g. a mixture-of-experts block's stacked expert
    weights [E, d_out, d_in]) the parameter it names."""
    return cast(
        torch.Tensor, getattr(layer.get_base_layer(), getattr(layer, "parameter_name", None) or "weight")
    )


def lora_delta(layer: Any) -> torch.Tensor | None:
    """The sum of a peft LoRA layer's active adapters' ``scale * B A`` (in the adapters' dtype),
    or None when it has none active."""
    deltas = [layer.get_delta_weight(a) for a in layer.active_adapters if a in layer.lora_A]
    return functools.reduce(torch.add, deltas) if deltas else None


@torch.no_grad()
def fold_bf16_lora(peft_model: Any) -> None:
    """Fold every active adapter over a bf16 base weight into that weight with :func:`merge_delta`,
    in place, and zero the adapter's ``B`` (so peft's ``merge_and_unload`` then adds nothing and
    rounds nothing): for a merged copy of a bf16 LoRA policy. One layer's delta at a time."""
    for name, layer in causal_lm(peft_model).named_modules():
        if not hasattr(layer, "lora_A") or layer.merged or getattr(layer, "disable_adapters", False):
            continue
        weight = base_weight(layer)
        if weight.dtype != torch.bfloat16 or (delta := lora_delta(layer)) is None:
            continue
        weight.copy_(merge_delta(weight, delta, key=f"{name}.weight"))
        for adapter in layer.active_adapters:
            if adapter in layer.lora_B:
                layer.lora_B[adapter].weight.zero_()


def _frozen_to_bf16(model: torch.nn.Module) -> None:
    """Store every frozen floating-point parameter in bf16 but the norms' (a few vectors, kept fp32:
    a LayerNorm over the fp32 residual stream needs fp32 weights); trained ones stay fp32."""
    for module in model.modules():
        if _is_norm(module):
            for param in module.parameters(recurse=False):
                _own_storage(param)
            continue
        for param in module.parameters(recurse=False):
            if not param.requires_grad and param.is_floating_point() and param.dtype != torch.bfloat16:
                param.data = param.data.to(torch.bfloat16)


def _own_storage(param: torch.nn.Parameter) -> None:
    """Give a kept fp32 weight a storage of its own. A checkpoint loaded by memory-mapping its
    safetensors file hands out tensors whose storages keep the whole file's mapping alive: one kept
    norm weight would keep the fp32 pages read while converting the other weights to bf16 (the
    model's size again) resident for the whole run."""
    param.data = param.data.clone()


def _is_norm(module: torch.nn.Module) -> bool:
    """LayerNorm, RMSNorm, GroupNorm and the models' own norm classes (named ``...Norm``)."""
    norms = (torch.nn.LayerNorm, torch.nn.GroupNorm, torch.nn.RMSNorm)
    return isinstance(module, norms) or type(module).__name__.endswith("Norm")


def causal_lm(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model inside a peft wrapper (whose ``generate`` calls it directly), else ``model``."""
    get = getattr(model, "get_base_model", None)
    return get() if callable(get) else model


def _autocast_forward(model: torch.nn.Module, device_type: str) -> None:
    """Run ``model``'s forward under bf16 autocast, by giving it a subclass (survives ``deepcopy``)."""
    cls: Any = type(model)
    if getattr(cls, "_veriloop_autocast", False):
        return
    model.__class__ = _autocast_class(cls, device_type)


@functools.cache
def _autocast_class(cls: Any, device_type: str) -> type:
    """``cls`` with its forward under bf16 autocast (one subclass per class and device type)."""

    @functools.wraps(cls.forward)  # the signature too: generate() checks its kwargs against it
    def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        with torch.autocast(device_type, dtype=torch.bfloat16):
            return cls.forward(self, *args, **kwargs)

    return type(
        cls.__name__, (cls,), {"forward": forward, "_veriloop_autocast": True, "__module__": cls.__module__}
    )


class _ContiguousHead(torch.nn.Linear):
    """The output projection as one [tokens, d] x [d, V] matmul, whatever the input's strides."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        flat = hidden.reshape(-1, hidden.shape[-1])  # copies a non-contiguous slice: [N, d], small
        out = torch.nn.functional.linear(flat, self.weight, self.bias)  # [N, V]
        return out.view(*hidden.shape[:-1], out.shape[-1])


def _contiguous_head(model: torch.nn.Module) -> None:
    get = getattr(model, "get_output_embeddings", None)
    head = get() if get is not None else None
    if type(head) is torch.nn.Linear:
        head.__class__ = _ContiguousHead


@functools.cache
def _fp32_attention_name() -> str:
    """Register (once) transformers' SDPA attention with q, k, v upcast to fp32, and return its name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    def attention(
        module: Any,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Any,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, Any]:
        dtype = query.dtype
        sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]  # transformers' (a packed sequence's blocks: packed_attention)
        with torch.autocast(query.device.type, enabled=False):
            out, weights = sdpa(module, query.float(), key.float(), value.float(), attention_mask, **kwargs)
        return out.to(dtype), weights

    AttentionInterface.register(FP32_ATTENTION, attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(FP32_ATTENTION, sdpa_mask)
    return FP32_ATTENTION


def _set_attention(model: torch.nn.Module, name: str) -> None:
    """Point every config in ``model`` that uses SDPA at ``name`` (other choices are left alone)."""
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None and getattr(config, "_attn_implementation", None) == "sdpa":
            config._attn_implementation_internal = name
