"""Tiny random vision-language models of the VLM families veriloop is tested on, besides the built LLaVA.

Each is built offline in seconds from transformers' own config and processor classes, with the
SmolLM2 tokenizer (plus the family's image tokens) and a ChatML template that renders each
``{"type": "image"}`` part the way the family's own template does:

    qwen2_5_vl   Qwen2.5-VL: a windowed ViT whose 2x2 patch merger gives 4 tokens per 32x32 image,
                 and multimodal RoPE (``mrope``): an image's tokens take (time, row, column)
                 positions and the text after it continues from the largest, so a token's
                 position is not its index (``<|vision_start|><|image_pad|>...<|vision_end|>``)
    qwen3_vl     Qwen3-VL: the same markup, interleaved multimodal RoPE, and "deepstack" features of
                 a ViT layer added into the language model's first layers
    idefics3     Idefics3: a SigLIP-style ViT, a pixel-shuffle connector (4 tokens per 32x32
                 image) and a Llama; each image is
                 ``<fake_token_around_image><global-img><image>...<fake_token_around_image>``
    smolvlm      SmolVLM: Idefics3's architecture under its own classes, whose processor needs
                 num2words (the ``vision`` extra) and a video processor (here: images only)

``tests/agents/test_vision_matrix.py`` runs each through the HF engine and the trainer (an image in
every turn), and ``docs/models.md``'s support table is generated from its results.

transformers' Qwen2.5-VL processor also wants a video processor, which needs torchvision (not a
dependency); the processors here take images only
(:func:`veriloop.agents.loading.images_only`, which ``load_policy`` falls back to as well).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from veriloop.agents.loading import build_policy, images_only
from veriloop.agents.policy import Policy

#: Side (pixels) every image is resized to; 16 patches of 8x8, merged 2x2 into 4 image tokens.
TINY_VISION_SIZE = 32
_PATCH = 8

#: SmolLM2's ChatML with each image part rendered by ``{image}`` (the family's image markup).
_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\\n' }}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ '{image}' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def _text(tokenizer: Any, **extra: Any) -> dict[str, Any]:
    from veriloop.agents.testing import tiny_text_settings

    return tiny_text_settings(tokenizer, **extra)


def _qwen_vl_processor(tokenizer: Any, processor_name: str) -> tuple[Any, list[int]]:
    """A Qwen-VL processor (images only) and the ids of its start, end, image and video tokens."""
    import transformers

    marks = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
    tokenizer.add_tokens(marks, special_tokens=True)
    side = TINY_VISION_SIZE * TINY_VISION_SIZE
    image_processor = transformers.Qwen2VLImageProcessorPil(
        min_pixels=side, max_pixels=side, patch_size=_PATCH, merge_size=2, temporal_patch_size=2
    )
    template = _TEMPLATE.replace("{image}", "<|vision_start|><|image_pad|><|vision_end|>")
    processor = images_only(getattr(transformers, processor_name))(
        image_processor=image_processor, tokenizer=tokenizer, chat_template=template
    )
    return processor, tokenizer.convert_tokens_to_ids(marks)


def _qwen_vl(tokenizer: Any, name: str, rope: dict[str, Any], vision: dict[str, Any]) -> tuple[Any, Any]:
    """A tiny ``{name}ForConditionalGeneration`` (Qwen2.5-VL, Qwen3-VL) and its processor."""
    import transformers

    processor, (start, end, image, video) = _qwen_vl_processor(tokenizer, f"{name}Processor")
    vision = dict(
        depth=2,
        hidden_size=32,
        intermediate_size=64,
        num_heads=2,
        patch_size=_PATCH,
        spatial_merge_size=2,
        temporal_patch_size=2,
        out_hidden_size=64,
        **vision,
    )
    config = getattr(transformers, f"{name}Config")(
        text_config=_text(tokenizer, head_dim=16, rope_parameters=rope),
        vision_config=vision,
        image_token_id=image,
        video_token_id=video,
        vision_start_token_id=start,
        vision_end_token_id=end,
        tie_word_embeddings=True,
    )
    return getattr(transformers, f"{name}ForConditionalGeneration")(config), processor


def _qwen2_5_vl(tokenizer: Any) -> tuple[Any, Any]:
    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}  # head_dim 16
    return _qwen_vl(tokenizer, "Qwen2_5_VL", rope, dict(window_size=16, fullatt_block_indexes=[1]))


def _qwen3_vl(tokenizer: Any) -> tuple[Any, Any]:
    rope = {
        "rope_type": "default",
        "rope_theta": 10000.0,
        "mrope_section": [2, 3, 3],
        "mrope_interleaved": True,
    }
    return _qwen_vl(
        tokenizer, "Qwen3VL", rope, dict(num_position_embeddings=16, deepstack_visual_indexes=[0])
    )


def _pixel_shuffle_vlm(tokenizer: Any, name: str) -> tuple[Any, Any]:
    """A tiny ``{name}ForConditionalGeneration`` (Idefics3, SmolVLM: a SigLIP-style ViT, a
    pixel-shuffle connector and a Llama) and its processor (images only, unsplit)."""
    import transformers

    marks = ["<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>"]
    tokenizer.add_tokens(marks, special_tokens=True)
    scale = 2
    image_processor = getattr(transformers, f"{name}ImageProcessorPil")(
        do_image_splitting=False,
        size={"longest_edge": TINY_VISION_SIZE},
        max_image_size={"longest_edge": TINY_VISION_SIZE},
    )
    per_image = (TINY_VISION_SIZE // _PATCH) ** 2 // scale**2
    processor = images_only(getattr(transformers, f"{name}Processor"))(
        image_processor=image_processor,
        tokenizer=tokenizer,
        image_seq_len=per_image,
        chat_template=_TEMPLATE.replace("{image}", "<image>"),
    )
    vision = getattr(transformers, f"{name}VisionConfig")(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=TINY_VISION_SIZE,
        patch_size=_PATCH,
    )
    config = getattr(transformers, f"{name}Config")(
        vision_config=vision,
        text_config=transformers.LlamaConfig(**_text(tokenizer, head_dim=16)),
        scale_factor=scale,
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
        tie_word_embeddings=True,
    )
    return getattr(transformers, f"{name}ForConditionalGeneration")(config), processor


def _idefics3(tokenizer: Any) -> tuple[Any, Any]:
    return _pixel_shuffle_vlm(tokenizer, "Idefics3")


def _smolvlm(tokenizer: Any) -> tuple[Any, Any]:
    return _pixel_shuffle_vlm(tokenizer, "SmolVLM")


#: family -> builder(tokenizer) of (tiny random VLM, its processor); the tokenizer gains image tokens.
TINY_VISION_FAMILIES: dict[str, Callable[[Any], tuple[Any, Any]]] = {
    "qwen2_5_vl": _qwen2_5_vl,
    "qwen3_vl": _qwen3_vl,
    "idefics3": _idefics3,
    "smolvlm": _smolvlm,
}


def tiny_vision_base(family: str, seed: int = 0) -> tuple[Any, Any]:
    """(model, processor) of a tiny random ``family`` VLM (fp32, CPU, eval mode), seeded."""
    from veriloop.agents.testing import _set_generation_eos, tiny_tokenizer

    if family not in TINY_VISION_FAMILIES:
        raise ValueError(
            f"unknown tiny vision family {family!r}; choose one of {sorted(TINY_VISION_FAMILIES)}"
        )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model, processor = TINY_VISION_FAMILIES[family](tiny_tokenizer())
    _set_generation_eos(model, processor.tokenizer)
    return model.eval(), processor


def tiny_vision_policy(family: str, *, lora: bool = False, seed: int = 0) -> Policy:
    """A tiny random ``family`` VLM policy (fp32, CPU), LoRA (r 8, all linear layers, ``B`` drawn
    from N(0, 0.1) so the adapter changes the outputs) or full fine-tuning."""
    from veriloop.agents.testing import TINY_LORA

    model, processor = tiny_vision_base(family, seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        policy = build_policy(
            model,
            processor.tokenizer,
            processor=processor,
            lora=TINY_LORA if lora else None,
            name=f"tiny-{family}",
        )
        for name, param in policy.model.named_parameters():
            if "lora_B" in name:
                param.data.normal_(0, 0.1)
    return policy
