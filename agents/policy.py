"""The policy object every other part of veriloop talks to.

A :class:`Policy` bundles the model (plain, or wrapped by peft for LoRA), its tokenizer, the
processor for vision-language models, and the one decision that matters for memory: where the
reference policy for KL comes from (the same model with the adapter disabled for LoRA, a frozen
copy for full fine-tuning).
"""

from __future__ import annotations

import contextlib
import copy
import os
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

    def frozen_copy(self) -> Policy:
        """A copy of this policy for sampling beside the trainer: its own model (deep-copied), in eval
        mode and without gradients, with the same tokenizer, processor, metadata and precision."""
        model = copy.deepcopy(self.model).eval()
        model.requires_grad_(False)
        return Policy(
            model=model,
            tokenizer=self.tokenizer,
            processor=self.processor,
            is_lora=self.is_lora,
            name=self.name,
            meta=dict(self.meta),
            precision=self.precision,
        )

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


def resolve_device(name: str) -> torch.device:
    """Where ``policy.device`` puts the policy: ``auto`` (this process's CUDA device when torch has
    one -- ``cuda:$LOCAL_RANK`` under torchrun --, else the CPU), ``cpu``, ``cuda`` or ``cuda:N``.

    Raises:
        ValueError: a CUDA device was named and this torch has none (or not that many).
    """
    if name == "cpu" or (name == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError(
            f"policy.device is {name!r} but this torch ({torch.__version__}) sees no CUDA device: "
            "use policy.device=cpu (or auto, which picks the GPU only when there is one)"
        )
    count = torch.cuda.device_count()
    device = torch.device(
        name if name.startswith("cuda:") else f"cuda:{int(os.environ.get('LOCAL_RANK', 0)) % count}"
    )
    if device.index is not None and device.index >= count:
        raise ValueError(
            f"policy.device is {name!r} but this machine has {count} CUDA device(s): use cuda:0 .. cuda:{count - 1}"
        )
    return device


def place(policy: Policy, device: torch.device) -> Policy:
    """Move the policy's model (and its frozen reference copy, if any) to ``device``; returned."""
    policy.model.to(device)
    if policy.frozen_reference is not None:
        policy.frozen_reference.to(device)
    return policy
