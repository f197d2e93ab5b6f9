"""The policy object every other part of veriloop talks to.

A :class:`Policy` bundles the model (plain, or wrapped by peft for LoRA), its tokenizer, the
processor for vision-language models, and the one decision that matters for memory: where the
reference policy for KL comes from (the same model with the adapter disabled for LoRA, a frozen
copy for full fine-tuning).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class Policy:
    """A trainable language (or vision-language) policy.

    Attributes:
        model: The ``transformers`` model, or a ``peft.PeftModel`` when ``is_lora``.
        tokenizer: The tokenizer (for VLMs: ``processor.tokenizer``).
        processor: The ``AutoProcessor`` of a vision-language model, else ``None``.
        is_lora: Whether only LoRA adapter weights are trained.
        name: Where the weights came from (for logs and saved metadata).
        frozen_reference: For full fine-tuning with a KL term, a frozen copy of the initial model;
            ``None`` for LoRA (the adapter is disabled instead) or when no KL is used.
        precision: ``fp32`` or ``bf16`` (mixed precision), set by
            :func:`veriloop.agents.precision.apply_precision`.
    """

    model: Any
    tokenizer: Any
    processor: Any = None
    is_lora: bool = False
    name: str = ""
    frozen_reference: Any = None
    meta: dict[str, Any] = field(default_factory=dict)
    precision: str = "fp32"

    @property
    def is_vision(self) -> bool:
        return self.processor is not None

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def sampler_dtype(self) -> str:
        """The dtype a separate sampling engine (vLLM) should run this policy in: ``bfloat16`` for
        bf16 mixed precision, else the weights' own dtype (e.g. ``float32``)."""
        if self.precision == "bf16":
            return "bfloat16"
        return str(next(self.model.parameters()).dtype).removeprefix("torch.")

    @contextlib.contextmanager
    def reference(self) -> Iterator[Any]:
        """Yield a model that computes the reference policy's logits (no gradients).

        LoRA: the same model with the adapter disabled (no second copy in memory).
        Full: the frozen copy made at load time (``frozen_reference``).
        """
        if self.is_lora:
            with torch.no_grad(), self.model.disable_adapter():
                yield self.model
        elif self.frozen_reference is not None:
            with torch.no_grad():
                yield self.frozen_reference
        else:
            raise RuntimeError(
                "this full-fine-tuning policy has no reference copy: load it with keep_reference=True "
                "(needed when algo.kl_coef > 0)"
            )

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]
