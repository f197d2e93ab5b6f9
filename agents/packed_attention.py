"""Attention for a packed micro-batch: a shared prompt once, then each row's continuation, in one sequence.

:func:`veriloop.agents.forward.token_logprobs` packs a GRPO group's rows behind their common prompt
into one sequence of ``P + B n`` tokens. A boolean mask over the whole sequence gives each token the
right keys (the prompt and its own row's earlier tokens), but SDPA then computes all ``(P + B n)^2``
scores and throws most of them away. Passed :class:`PackedRows` (the model's forward hands its
extra keyword arguments to the attention function), the SDPA attention computes only the blocks
that are seen: the prompt's causal attention over itself (``P^2 / 2``), and the ``B`` rows as a
batch, each over the prompt's keys and its own (``B n (P + n)``). For the benchmark's micro-batch
(an 80-token prompt, 4 rows of 64) that is 2.6x fewer scores, and the grouped-query keys are not
repeated per head (SDPA's ``enable_gqa``).

:func:`install` wraps transformers' ``"sdpa"`` entry (and with it veriloop's fp32-upcast SDPA,
which calls it): without :data:`KWARG` the wrapper is transformers' function, unchanged. The packed
forward still passes its dense mask, so a model whose attention ignores the keyword (not SDPA)
computes the same numbers the dense way.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch

#: The keyword the packed forward passes its :class:`PackedRows` under.
KWARG = "veriloop_packed"


@dataclass(frozen=True)
class PackedRows:
    """The layout of a packed sequence [1, prompt + rows x length]."""

    prompt: int  #: tokens of the shared prompt, first in the sequence
    rows: int  #: rows (B), each ``length`` tokens after the prompt
    length: int
    #: [B, 1, length, prompt + length] bool: the keys each row's token sees (the whole prompt, its
    #: own row's earlier real tokens)
    mask: torch.Tensor

    @property
    def tokens(self) -> int:
        return self.prompt + self.rows * self.length


def row_mask(attention_mask: torch.Tensor, prompt: int) -> torch.Tensor:
    """:attr:`PackedRows.mask` for the rows of ``attention_mask`` [B, prompt + n] (1 on real tokens)."""
    b, n = attention_mask.shape[0], attention_mask.shape[1] - prompt
    own = (
        torch.ones(n, n, dtype=torch.bool, device=attention_mask.device).tril()[None]
        & attention_mask[:, None, prompt:].bool()
    )  # [B, n, n]: not later, and a real token
    seen_prompt = own.new_ones(b, n, prompt)
    return torch.cat([seen_prompt, own], 2)[:, None]


def block_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    rows: PackedRows,
    scaling: float | None,
    dropout: float,
) -> torch.Tensor:
    """SDPA over a packed sequence's seen blocks: ``query`` [1, H, L, D], ``key``/``value``
    [1, H_kv, L, D] -> [1, L, H, D] (transformers' attention output layout)."""
    p, b, n = rows.prompt, rows.rows, rows.length
    sdpa = functools.partial(
        torch.nn.functional.scaled_dot_product_attention,
        dropout_p=dropout,
        scale=scaling,
        enable_gqa=query.shape[1] != key.shape[1],
    )

    def per_row(t: torch.Tensor) -> torch.Tensor:  # [1, h, L, D] -> [B, h, n, D]
        return t[0, :, p:].unflatten(1, (b, n)).transpose(0, 1)

    def with_prompt(t: torch.Tensor) -> torch.Tensor:  # each row's keys: the prompt's, then its own
        return torch.cat([t[:, :, :p].expand(b, -1, -1, -1), per_row(t)], 2)

    prompt = sdpa(query[:, :, :p], key[:, :, :p], value[:, :, :p], is_causal=True)  # [1, H, P, D]
    out = sdpa(per_row(query), with_prompt(key), with_prompt(value), attn_mask=rows.mask)  # [B, H, n, D]
    out = torch.cat([prompt, out.transpose(0, 1).flatten(1, 2)[None]], 2)  # [1, H, L, D]
    return out.transpose(1, 2).contiguous()


def _packed(inner: Any) -> Any:
    """``inner`` (an attention function of transformers' interface) that computes a packed
    sequence's attention by blocks when given :data:`KWARG`."""

    def attention(
        module: Any,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Any,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, Any]:
        rows = kwargs.pop(KWARG, None)
        if (
            rows is None
            or query.shape[0] != 1
            or query.shape[2] != rows.tokens
            or key.shape[2] != rows.tokens
        ):
            return inner(module, query, key, value, attention_mask, **kwargs)  # type: ignore[no-any-return]
        return block_attention(
            query, key, value, rows, kwargs.get("scaling"), kwargs.get("dropout", 0.0)
        ), None

    attention.veriloop_packed = True  # type: ignore[attr-defined]
    return attention


@functools.cache
def install() -> None:
    """Wrap transformers' registered ``"sdpa"`` attention with :func:`_packed` (once)."""
    from transformers import AttentionInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    current = ALL_ATTENTION_FUNCTIONS["sdpa"]
    if not getattr(current, "veriloop_packed", False):
        AttentionInterface.register("sdpa", _packed(current))
