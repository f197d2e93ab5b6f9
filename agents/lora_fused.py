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
it follows fp32's losses (docs/results/precision.md has the measurement).

Sibling layers that take one input (q/k/v, gate/up; :data:`SIBLINGS`) run as one node over their
concatenated frozen weights, in both precisions (:class:`_Siblings`): fewer, larger products, and
fewer operator calls, whose fixed cost is a large share of a small model's step on a CPU.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from peft.tuners.lora.layer import Linear as LoraLinear


class FusedLoraLinear(LoraLinear):
    """peft's ``lora.Linear`` with the fused forward; existing layers get it as their class."""

    #: The :class:`_Siblings` this layer runs with (q/k/v, gate/up), if any.
    _veriloop_group: _Siblings | None = None

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        plain = _plain_adapter(self, x) if not (args or kwargs) else None
        if plain is None:
            return super().forward(x, *args, **kwargs)
        a, b, scaling = plain
        if self._veriloop_group is not None and (out := self._veriloop_group.output(self, x)) is not None:
            return out
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
    added to the upcast base output in fp32, and the result fp32. A bf16 result would round away
    the adapter's contribution while it is smaller than the rounding step of the base output (2^-8
    of it), as it is early in training; the model's residual stream stays fp32 (its forward runs
    under autocast, see :mod:`veriloop.agents.precision`). One autograd node (:class:`_MixedLora`,
    n = 1) instead of the ~10 that the same products written with tensor operations record."""
    weight, bias = layer.base_layer.weight, layer.base_layer.bias
    if weight.requires_grad or (bias is not None and bias.requires_grad):  # a trained base: autograd's path
        return _mixed_autograd(layer, x, a, b, scaling)
    (out,) = _MixedLora.apply(x, weight, bias, (scaling,), 1, a, b)
    return out.view(*x.shape[:-1], out.shape[-1])


#: Sibling projections that transformers' decoder layers apply to one input (Llama, Qwen, Mistral,
#: Gemma, SmolLM naming): their mixed-precision products run as one.
SIBLINGS: tuple[tuple[str, ...], ...] = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class _Siblings:
    """LoRA layers with frozen bases that take the same input (an attention's q/k/v, an MLP's
    gate/up), run as one :class:`_MixedLora` node: one base product with the concatenated
    weights, one projection onto the concatenated rank spaces, one gradient for the input. In
    mixed precision (bf16 bases, fp32 adapters) and in fp32 (everything fp32).

    The first member called with an input computes every member's output; the others take theirs
    while that input is the same tensor, unchanged, and alive, and gradient mode is as it was. Anything else (another input, a
    member that is not plain mixed LoRA) falls back to the per-layer path, so the result is the same
    either way. The concatenated base weights are built on first use (the members' weights become
    its row blocks) and rebuilt when a member's weight is replaced or changed."""

    def __init__(self, members: list[LoraLinear]) -> None:
        # weak references: each member holds the group, and a cycle would keep a dropped model's
        # memory until the garbage collector's next full pass
        self._members = [weakref.ref(m) for m in members]
        self._reset()

    @property
    def members(self) -> list[LoraLinear]:
        return [ref() for ref in self._members]  # type: ignore[misc]

    def _reset(self) -> None:
        self._weights: tuple[Any, torch.Tensor, torch.Tensor | None] | None = None
        self._pending: tuple[int, bool, Any, list[torch.Tensor | None]] | None = None

    def __getstate__(self) -> dict[str, Any]:  # copies and pickles drop the caches
        return {"members": self.members}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._members = [weakref.ref(m) for m in state["members"]]
        self._reset()

    def output(self, layer: LoraLinear, x: torch.Tensor) -> torch.Tensor | None:
        """``layer``'s output for ``x``, or None when the group cannot run (the caller runs it alone)."""
        members = self.members
        index = next(i for i, m in enumerate(members) if m is layer)
        pending = self._pending
        if pending is not None and pending[:2] == (x._version, torch.is_grad_enabled()) and pending[2]() is x:
            outs = pending[3]
            out, outs[index] = outs[index], None
            if out is not None:
                if all(o is None for o in outs):
                    self._pending = None
                return out
        adapters = [_plain_adapter(m, x) for m in members]
        if any(p is None or not _groupable(m.base_layer.weight, p[0], x) for m, p in zip(members, adapters)):
            return None
        bases = [m.base_layer for m in members]
        if any(b.weight.requires_grad or (b.bias is not None and b.bias.requires_grad) for b in bases):
            return None
        weight, bias = self._concatenated(bases)
        a = [p[0] for p in adapters]  # type: ignore[index]
        b = [p[1] for p in adapters]  # type: ignore[index]
        scalings = tuple(p[2] for p in adapters)  # type: ignore[index]
        flat = _MixedLora.apply(x, weight, bias, scalings, len(a), *a, *b)
        results: list[torch.Tensor | None] = [o.view(*x.shape[:-1], o.shape[-1]) for o in flat]
        mine, results[index] = results[index], None
        self._pending = (x._version, torch.is_grad_enabled(), weakref.ref(x), results)
        return mine

    def _concatenated(self, bases: list[Any]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The members' base weights as one [sum of outs, in] matrix (and their biases as one
        vector). The members' weights become row blocks of it, so it costs no memory of its own."""
        key = tuple((b.weight.data_ptr(), b.weight._version, tuple(b.weight.shape)) for b in bases)
        if self._weights is None or self._weights[0] != key:
            with torch.no_grad():
                weight = torch.cat([b.weight for b in bases])
                for base, block in zip(bases, weight.split([b.weight.shape[0] for b in bases])):
                    base.weight.data = block
                bias = None
                if any(b.bias is not None for b in bases):
                    bias = torch.cat(
                        [
                            b.bias if b.bias is not None else b.weight.new_zeros(b.weight.shape[0])
                            for b in bases
                        ]
                    )
            key = tuple((b.weight.data_ptr(), b.weight._version, tuple(b.weight.shape)) for b in bases)
            self._weights = (key, weight, bias)
        return self._weights[1], self._weights[2]


class _MixedLora(torch.autograd.Function):
    """The LoRA products of n layers that share their input ``x`` (n = 1: one layer), with frozen
    bases ``W_i`` (biases ``c_i``): ``y_i = (x_h W_i^T + c_i) + (s_i x_h A_{i,h}^T) B_i^T``, computed
    as ``x_h [W_1; ...; W_n]^T`` and ``x_h [A_1; ...; A_n]_h^T`` (one product each) and n rank-r
    products. In mixed precision (bf16 ``W``) ``x_h``, ``A_h`` are the bf16 casts and the base
    product is bf16, while the rank-r products, the sums and the outputs are fp32; in fp32 every
    term is fp32. Backward, for the fp32 gradients ``g_i`` of ``y_i``: ``dB_i = g_i^T low_i`` (fp32,
    ``low_i = s_i x_h A_{i,h}^T``), ``d_low = [s_i g_i B_i]`` (cast to ``W``'s dtype), ``dx = [g_1
    ... g_n]_h [W_1; ...; W_n] + d_low [A_1; ...; A_n]_h`` and ``dA = d_low^T x_h`` split by rows
    (returned in the input's and the adapters' dtypes): the products autograd runs for the unfused
    expression, less its casts and adds, with the products the layers share joined."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        scalings: tuple[float, ...],
        n: int,
        *adapters: torch.Tensor,
    ) -> tuple[torch.Tensor, ...]:
        half = weight.dtype  # bf16 (mixed precision) or fp32
        a, b = adapters[:n], adapters[n:]
        ranks = [t.shape[0] for t in a]
        outs = [t.shape[0] for t in b]
        with _no_autocast(x.device.type):
            xh = _bf16_input(x) if half == torch.bfloat16 else x.reshape(-1, x.shape[-1])  # [tokens, in]
            ah = _joined(a, 0).to(half)  # [R, in]
            low = (xh @ ah.t()).float()  # [tokens, R]
            if len(set(scalings)) == 1:
                low.mul_(scalings[0])
            else:  # per-layer scalings (an alpha or rank pattern): one per column of its block
                low.mul_(torch.tensor(scalings).repeat_interleave(torch.tensor(ranks)).to(low.device))
            base = torch.nn.functional.linear(xh, weight, bias).float()  # [tokens, O]
            results = tuple(
                torch.addmm(base_i, low_i, b_i.t())
                for base_i, low_i, b_i in zip(base.split(outs, 1), low.split(ranks, 1), b)
            )
        ctx.save_for_backward(xh, weight, ah, low, *b)
        ctx.scalings, ctx.ranks, ctx.x_dtype, ctx.x_shape = scalings, ranks, x.dtype, x.shape
        ctx.a_dtypes = [t.dtype for t in a]
        return results

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        xh, weight, ah, low, *b = ctx.saved_tensors
        half, n = weight.dtype, len(b)
        with _no_autocast(xh.device.type):
            g = [t.reshape(-1, t.shape[-1]).float() for t in grads]  # [tokens, out_i]
            lows = low.split(ctx.ranks, 1)
            grad_b = [
                g_i.t() @ low_i if ctx.needs_input_grad[5 + n + i] else None
                for i, (g_i, low_i) in enumerate(zip(g, lows))
            ]
            d_low = _joined([(g_i @ b_i).mul_(s) for g_i, b_i, s in zip(g, b, ctx.scalings)], 1).to(half)
            grad_x = None
            if ctx.needs_input_grad[0]:
                grad_x = torch.addmm(_joined(g, 1).to(half) @ weight, d_low, ah)
                grad_x = grad_x.to(ctx.x_dtype).view(ctx.x_shape)
            grad_a: list[Any] = [None] * n
            if any(ctx.needs_input_grad[5 : 5 + n]):
                grad_a = [t.to(dt) for t, dt in zip((d_low.t() @ xh).split(ctx.ranks, 0), ctx.a_dtypes)]
        return (grad_x, None, None, None, None, *grad_a, *grad_b)


def _joined(tensors: list[torch.Tensor] | tuple[torch.Tensor, ...], dim: int) -> torch.Tensor:
    """``torch.cat(tensors, dim)``, without the copy for one tensor."""
    return tensors[0] if len(tensors) == 1 else torch.cat(tensors, dim)


def _mixed_autograd(
    layer: LoraLinear, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: float
) -> torch.Tensor:
    """:func:`_mixed` written with tensor operations (autograd derives the backward), for a base
    layer whose weights are trained."""
    half = torch.bfloat16
    with torch.autocast(x.device.type, enabled=False):
        xh = x.to(half)
        base = layer.base_layer(xh)  # [..., out], bf16
        low = xh.reshape(-1, xh.shape[-1]) @ a.to(half).t()  # [tokens, r], bf16
        out = torch.addmm(base.reshape(-1, base.shape[-1]).float(), low.float(), b.t(), alpha=scaling)
    return out.view(*base.shape[:-1], out.shape[-1])


@contextlib.contextmanager
def _no_autocast(device_type: str) -> Iterator[None]:
    """Autocast off for the block (it would run the fp32 products in bf16); cheaper than
    ``torch.autocast(enabled=False)``, which this runs ~400 times per forward pass."""
    was = torch.is_autocast_enabled(device_type)
    if was:
        torch.set_autocast_enabled(device_type, False)
    try:
        yield
    finally:
        if was:
            torch.set_autocast_enabled(device_type, True)


_cast = threading.local()


def _bf16_input(x: torch.Tensor) -> torch.Tensor:
    """``x`` as a bf16 [tokens, in] matrix. The attention's q/k/v and the MLP's gate/up projections
    take the same input tensor: its cast is made once and reused while the tensor is the same
    object, unchanged (its version counter), and alive (a weak reference: the cache never keeps a
    forward pass's graph)."""
    if x.dtype == torch.bfloat16:
        return x.reshape(-1, x.shape[-1])
    last = getattr(_cast, "last", None)
    if last is not None and last[0]() is x and last[1] == x._version:
        return last[2]
    xh = x.reshape(-1, x.shape[-1]).to(torch.bfloat16)
    _cast.last = (weakref.ref(x), x._version, xh)
    return xh


def _groupable(base_weight: Any, adapter_weight: Any, x: torch.Tensor) -> bool:
    """Whether :class:`_MixedLora` computes this layer: mixed precision, or all of it fp32."""
    fp32 = torch.float32
    return (
        _is_mixed(base_weight, adapter_weight) or base_weight.dtype == adapter_weight.dtype == x.dtype == fp32
    )


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
    _group_siblings(model)
    return count


def _group_siblings(model: torch.nn.Module) -> None:
    """Give each set of :data:`SIBLINGS` that are all fused LoRA layers one :class:`_Siblings`."""
    for parent in model.modules():
        for names in SIBLINGS:
            members = [getattr(parent, n, None) for n in names]
            if all(type(m) is FusedLoraLinear and m._veriloop_group is None for m in members):  # type: ignore[union-attr]
                group = _Siblings(members)  # type: ignore[arg-type]
                for member in members:
                    member._veriloop_group = group  # type: ignore[union-attr]


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
