"""Images in multi-turn chats: from environment observations to model inputs.

A vision-language policy must see the image of *every* turn, not only the first. The rule used
throughout veriloop: the conversation so far is re-encoded as a whole by the processor's chat
template, with one ``{"type": "image"}`` content part per image, and the images passed in the
order their parts appear. The processor then expands each placeholder into the model's image
tokens and stacks all images into ``pixel_values``:

    messages (k user turns, one image each)  →  input_ids [1, T] with k blocks of image tokens
                                              →  pixel_values [k, C, H, W] (+ model extras)

Message format (what the rollout engine builds, and what :func:`user_content` returns)::

    {"role": "user", "content": [{"type": "image", "image": <PIL.Image>}, {"type": "text", "text": "..."}]}

The ``"image"`` key is optional when ``images`` is passed explicitly. :func:`without_images`
replaces image objects by placeholders for logging (``Trajectory.messages`` stays JSON-ready).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

#: SmolLM2's ChatML extended to list-of-parts content: text parts are concatenated and each image
#: part becomes one ``<image>`` placeholder (the processor expands it to the model's image tokens).
#: The chat template of the built ``default-vision`` model (:mod:`veriloop.agents.models.vision`).
CHATML_VISION_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\\n' }}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ '<image>' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
#: Processor outputs that are token-level, not vision inputs. ``mm_token_type_ids`` (which tokens
#: are image tokens, for the Qwen-VL families' multimodal RoPE) is rebuilt from the ids of the
#: whole sequence where it is needed (:func:`token_type_inputs`): a turn's delta has its own.
_TEXT_KEYS = ("input_ids", "attention_mask", "token_type_ids", "mm_token_type_ids")


def to_pil(image: Any) -> Any:
    """A ``PIL.Image`` (RGB) from a PIL image or a numpy array [H, W, 3] / [H, W] (uint8, or float in [0, 1])."""
    import numpy as np
    from PIL import Image

    if isinstance(image, Image.Image):
        return image.convert("RGB")
    array = np.asarray(image)
    if array.ndim not in (2, 3) or (array.ndim == 3 and array.shape[-1] not in (1, 3, 4)):
        raise ValueError(
            f"expected an image as PIL.Image or an array [H, W], [H, W, 3] or [H, W, 4]; got shape {array.shape}"
        )
    if array.dtype != np.uint8:
        if array.min() < 0 or array.max() > 1:
            raise ValueError(f"float images must lie in [0, 1]; got range [{array.min()}, {array.max()}]")
        array = (array * 255).round().astype(np.uint8)
    if array.ndim == 3 and array.shape[-1] == 1:
        array = array[..., 0]
    return Image.fromarray(array).convert("RGB")


def user_content(text: str, image: Any = None) -> list[dict[str, Any]]:
    """Content parts of a user message: the image first (if any), then the text."""
    parts: list[dict[str, Any]] = []
    if image is not None:
        parts.append({"type": "image", "image": to_pil(image)})
    parts.append({"type": "text", "text": text})
    return parts


def _image_parts(messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        part
        for message in messages
        if isinstance(message.get("content"), list)
        for part in message["content"]
        if isinstance(part, dict) and part.get("type") == "image"
    ]


def count_images(messages: Sequence[dict[str, Any]]) -> int:
    """Number of ``{"type": "image"}`` content parts across all messages."""
    return len(_image_parts(messages))


def without_images(messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Copy of ``messages`` with image objects dropped (the ``{"type": "image"}`` parts stay)."""
    out = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, list):
            content = [{"type": "image"} if p.get("type") == "image" else dict(p) for p in content]
        out.append({**message, "content": content})
    return out


def _strip_strings(messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Turn plain-string contents into a single text part so every template branch sees lists."""
    return [
        {**m, "content": [{"type": "text", "text": m["content"]}]} if isinstance(m.get("content"), str) else m
        for m in without_images(messages)
    ]


def encode_vision_messages(
    processor: Any,
    messages: Sequence[dict[str, Any]],
    images: Sequence[Any] | None = None,
    *,
    add_generation_prompt: bool = True,
) -> dict[str, Any]:
    """Encode a whole multi-turn conversation, with every turn's image, for a forward pass.

    Args:
        processor: An ``AutoProcessor`` with a chat template that renders image parts.
        messages: Chat messages; user messages carry images as ``{"type": "image"}`` parts.
        images: One image per image part, in order of appearance. ``None``: take them from the
            parts' ``"image"`` keys.
        add_generation_prompt: End with the assistant header (for sampling the next turn).

    Returns:
        The processor's tensors: ``input_ids`` [1, T], ``attention_mask`` [1, T],
        ``pixel_values`` [N_images, C, H, W] and any model-specific extras (``image_sizes``,
        ``pixel_attention_mask``, ...). Pass them all to the model; :func:`vision_inputs` picks
        the non-token ones for ``token_logprobs(..., **extras)``.
    """
    parts = _image_parts(messages)
    if images is None:
        missing = [i for i, p in enumerate(parts) if p.get("image") is None]
        if missing:
            raise ValueError(
                f"image parts {missing} carry no 'image' object; put the image under part['image'] "
                "or pass images=[...] (one per image part, in order)"
            )
        images = [p["image"] for p in parts]
    if len(images) != len(parts):
        raise ValueError(
            f"the messages contain {len(parts)} image part(s) but {len(images)} image(s) were given; "
            "every image part needs exactly one image (earlier turns' images included)"
        )
    text = processor.apply_chat_template(
        _strip_strings(messages), tokenize=False, add_generation_prompt=add_generation_prompt
    )
    pil_images = [to_pil(im) for im in images] or None
    # The template already added the special tokens; don't let the tokenizer add a BOS again.
    return dict(processor(text=text, images=pil_images, return_tensors="pt", add_special_tokens=False))


def vision_inputs(encoded: dict[str, Any]) -> dict[str, Any]:
    """The model inputs of ``encoded`` other than token ids / masks (e.g. ``pixel_values``)."""
    return {k: v for k, v in encoded.items() if k not in _TEXT_KEYS}


def _rope_index_owner(model: Any) -> Any:
    """The module of ``model`` (a VLM, or a peft wrapper of one) with a ``get_rope_index``: the
    Qwen-VL families' multimodal RoPE, whose positions are not the token indices; else None."""
    modules = model.modules() if hasattr(model, "modules") else ()
    return next((m for m in modules if callable(getattr(type(m), "get_rope_index", None))), None)


def _token_types(owner: Any, input_ids: Any) -> Any:
    """``mm_token_type_ids`` [B, T] as the family's processor writes it: 1 on image tokens, 2 on video."""
    config = owner.config
    types = (input_ids == config.image_token_id).long()
    if getattr(config, "video_token_id", None) is not None:
        types += 2 * (input_ids == config.video_token_id).long()
    return types


def token_type_inputs(model: Any, input_ids: Any, model_inputs: dict[str, Any]) -> dict[str, Any]:
    """``model_inputs`` plus the ``mm_token_type_ids`` of ``input_ids`` [B, T] where ``model`` uses
    multimodal RoPE and images are given (without them its forward falls back to 1-D positions:
    other numbers than the processor's own inputs give); unchanged otherwise."""
    if "image_grid_thw" not in model_inputs or "mm_token_type_ids" in model_inputs:
        return model_inputs
    owner = _rope_index_owner(model)
    if owner is None:
        return model_inputs
    return {**model_inputs, "mm_token_type_ids": _token_types(owner, input_ids)}


def mrope_positions(model: Any, input_ids: Any, attention_mask: Any, model_inputs: dict[str, Any]) -> Any:
    """The multimodal-RoPE position ids [3, B, T] of ``input_ids`` [B, T] (left or right padded, as
    ``attention_mask`` [B, T] says) for a Qwen-VL family model with images; None for any other."""
    owner = _rope_index_owner(model) if "image_grid_thw" in model_inputs else None
    if owner is None:
        return None
    positions, _ = owner.get_rope_index(
        input_ids,
        _token_types(owner, input_ids),
        image_grid_thw=model_inputs["image_grid_thw"],
        attention_mask=attention_mask,
    )
    return positions
