"""Vision SFT examples: an env's image observations and a demonstration, as the VLM sees them.

An :class:`~veriloop.algos.sft.data.SFTExample` with images (built with ``images=True``) is
tokenised by the same incremental routine as a text example (:func:`~veriloop.algos.sft.loss.build_sft_example`:
the chat template rendered one message at a time, each new piece encoded on its own, loss only on
the trainable assistant turns), through the policy's *processor* instead of its tokenizer:

    user message i with an image  →  [{"type": "image"}, {"type": "text", "text": ...}]
                                     (the image first, as ``agents.chat.observation_message`` does)
    a piece of template text with k image placeholders  →  processor(text=piece, images=next k images)
                                     →  ids with the placeholders expanded to the image tokens,
                                        pixel_values [k, C, H, W] (+ any other per-image inputs)

This is how the rollout engine encodes an observation (``ChatFormat.encode_multimodal`` on the
rendered prompt), so an SFT example's prompt tokens are the tokens RL samples from; the test
checks it token for token.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from veriloop.algos.sft.loss import build_sft_example


class _ProcessorAsTokenizer:
    """A processor dressed as the tokenizer ``build_sft_example`` expects: ``apply_chat_template``
    renders the example's image messages with image parts, and a call encodes one piece of text with
    the images its placeholders stand for (consumed in order), collecting their model inputs."""

    def __init__(self, processor: Any, images: Sequence[Any], image_messages: Sequence[int]) -> None:
        self.processor = processor
        self.image_messages = set(image_messages)
        self.pending = list(images)  # images not yet encoded, in order
        self.token = getattr(processor, "image_token", None) or "<image>"
        self.inputs: list[dict[str, torch.Tensor]] = []

    def apply_chat_template(self, messages: Sequence[dict[str, Any]], **kwargs: Any) -> str:
        parts = []
        for i, m in enumerate(messages):
            text = [{"type": "text", "text": m["content"]}]
            parts.append({**m, "content": [{"type": "image"}, *text] if i in self.image_messages else text})
        return str(self.processor.apply_chat_template(parts, **kwargs))

    def __call__(self, piece: str, add_special_tokens: bool = False) -> dict[str, list[int]]:
        from veriloop.agents.vision import to_pil, vision_inputs

        k = piece.count(self.token)
        if k > len(self.pending):
            raise ValueError(
                f"the template text has {k} image placeholder(s) ({self.token!r}) but only "
                f"{len(self.pending)} image(s) are left; does an observation's text contain {self.token!r}?"
            )
        images, self.pending = [to_pil(im) for im in self.pending[:k]], self.pending[k:]
        out = self.processor(
            text=piece, images=images or None, return_tensors="pt", add_special_tokens=add_special_tokens
        )
        if images:
            self.inputs.append(vision_inputs(dict(out)))
        return {"input_ids": out["input_ids"][0].tolist()}


def build_vision_sft_example(
    processor: Any,
    messages: Sequence[dict[str, Any]],
    trainable_turns: Sequence[bool],
    images: Sequence[Any],
    image_messages: Sequence[int],
) -> tuple[list[int], list[int], dict[str, torch.Tensor]]:
    """Token ids, loss mask and image inputs of a chat whose user messages ``image_messages`` show
    ``images`` (one each, before the text).

    Returns:
        (input_ids, loss_mask, vision): as :func:`~veriloop.algos.sft.loss.build_sft_example`, plus the
        processor's per-image inputs stacked in image order (``pixel_values`` [N_images, C, H, W],
        and e.g. ``image_sizes`` for models that make them); ``{}`` without images.
    """
    if len(images) != len(image_messages):
        raise ValueError(f"{len(images)} images but {len(image_messages)} image_messages")
    enc = _ProcessorAsTokenizer(processor, images, image_messages)
    ids, mask = build_sft_example(enc, messages, trainable_turns)
    if enc.pending:
        raise ValueError(
            f"{len(enc.pending)} image(s) never reached the model: the chat template wrote fewer "
            f"{enc.token!r} placeholders than the example has images"
        )
    keys = set().union(*(d.keys() for d in enc.inputs)) if enc.inputs else set()
    vision = {k: torch.cat([d[k] for d in enc.inputs], dim=0) for k in sorted(keys)}  # [N_images, ...]
    return ids, mask, vision


def image_token_count(processor: Any, ids: Sequence[int]) -> int:
    """How many of ``ids`` are the processor's image token (to check a cut left every image whole)."""
    token = getattr(processor, "image_token", None) or "<image>"
    image_id = processor.tokenizer.convert_tokens_to_ids(token)
    return sum(1 for t in ids if t == image_id)
