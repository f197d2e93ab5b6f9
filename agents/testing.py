"""Tiny randomly initialised policies for tests, with the real SmolLM2 tokenizer.

The models are small enough to build in well under a second, but they use SmolLM2's tokenizer and
ChatML template, so chat formatting, special tokens and end-of-turn handling behave exactly as
with the default model. The tokenizer is read once from the GGUF (~10 s) and cached under
``cache_root()/tokenizers/SmolLM2``; later loads take a fraction of a second.

    tiny_policy()                     text model (Llama, hidden 64, 2 layers), full fine-tuning
    tiny_policy(lora=True)            same, wrapped with a LoRA adapter (r=8, all linear layers)
    tiny_policy(vision=True)          Llava-style VLM: tiny CLIP vision tower + tiny Llama
    tiny_processor()                  the VLM's processor (image processor + tokenizer + template)

API is stable: the rollout engine's tests depend on it.
"""

from __future__ import annotations

import copy
import functools
from typing import Any

import torch

from veriloop.agents.loading import LoraSettings, build_policy
from veriloop.agents.policy import Policy
from veriloop.agents.vision import CHATML_VISION_TEMPLATE

#: ChatML, Qwen3-style: an assistant turn before the last user message loses its ``<think>`` block
#: (a template that rewrites history, so each turn of a multi-turn episode starts a new sample).
THINKING_TEMPLATE = (
    "{%- set ns = namespace(last_user=-1) -%}"
    "{%- for m in messages -%}{%- if m['role'] == 'user' -%}{%- set ns.last_user = loop.index0 -%}"
    "{%- endif -%}{%- endfor -%}"
    "{%- for m in messages -%}{%- set content = m['content'] -%}"
    "{%- if m['role'] == 'assistant' and loop.index0 < ns.last_user and '</think>' in content -%}"
    "{%- set content = content.split('</think>')[-1].lstrip() -%}{%- endif -%}"
    "{{- '<|im_start|>' + m['role'] + '\\n' + content + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)
#: Placeholder token the VLM's chat template emits for each ``{"type": "image"}`` content part.
IMAGE_TOKEN = "<image>"
#: Side length (pixels) images are resized to for the tiny VLM; patch 8 → 16 image tokens each.
TINY_IMAGE_SIZE = 32
TINY_PATCH_SIZE = 8
TINY_LORA = LoraSettings(r=8, alpha=16, dropout=0.0)

#: ChatML like SmolLM2's, extended to list-of-parts content (the built default-vision model's own).
VISION_CHAT_TEMPLATE = CHATML_VISION_TEMPLATE
#: The smallest GRPO run on level-1 math with the tiny text model: the overrides the training tests
#: start from (each adds its own steps, learning rate and evaluation).
TINY_MATH_GRPO = [
    "policy.model=tiny",
    "env.id=veriloop/MathVerify-v0",
    "env.kwargs={level: 1}",
    "run.algo_preset=grpo",
    "rollout.prompts_per_step=2",
    "rollout.group_size=2",
    "rollout.max_new_tokens=8",
    "rollout.max_context=256",
]


@functools.lru_cache(maxsize=1)
def _cached_tokenizer() -> Any:
    from veriloop.agents.models.text import load_default_tokenizer

    return load_default_tokenizer()


def tiny_tokenizer() -> Any:
    """A fresh copy of the SmolLM2 tokenizer (pad ``<|endoftext|>``, eos ``<|im_end|>``)."""
    return copy.deepcopy(_cached_tokenizer())


def tiny_text_settings(tokenizer: Any, **extra: Any) -> dict[str, Any]:
    """The tiny test models' text settings (two layers of width 64), for any family's config class:
    ``extra`` adds or replaces a setting (``head_dim``, ``rope_parameters``, ...)."""
    from veriloop.agents.models.text import end_of_turn_ids

    settings: dict[str, Any] = dict(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=end_of_turn_ids(tokenizer)[0],
        pad_token_id=tokenizer.pad_token_id,
    )
    return {**settings, **extra}


def _text_config(tokenizer: Any, vocab_size: int) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(**tiny_text_settings(tokenizer, vocab_size=vocab_size))


def _set_generation_eos(model: Any, tokenizer: Any) -> None:
    from veriloop.agents.models.text import end_of_turn_ids

    model.generation_config.eos_token_id = end_of_turn_ids(tokenizer)
    model.generation_config.pad_token_id = tokenizer.pad_token_id


def tiny_processor() -> Any:
    """A ``LlavaProcessor`` built locally: CLIP image processor (32×32), SmolLM2 tokenizer + ``<image>``."""
    from transformers import LlavaProcessor

    try:  # the PIL backend; the default one wants torchvision, which is not a dependency
        from transformers import CLIPImageProcessorPil as ImageProcessor
    except ImportError:  # older transformers
        from transformers import CLIPImageProcessor as ImageProcessor  # type: ignore[assignment]

    tokenizer = tiny_tokenizer()
    tokenizer.add_tokens([IMAGE_TOKEN], special_tokens=True)
    image_processor = ImageProcessor(
        size={"height": TINY_IMAGE_SIZE, "width": TINY_IMAGE_SIZE},
        do_center_crop=False,
        do_convert_rgb=True,
    )
    return LlavaProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=TINY_PATCH_SIZE,
        vision_feature_select_strategy="default",  # drop CLIP's CLS token ...
        num_additional_image_tokens=1,  # ... which the vision tower adds: 16 tokens per image
        image_token=IMAGE_TOKEN,
        chat_template=VISION_CHAT_TEMPLATE,
    )


def _tiny_vlm(processor: Any) -> Any:
    from transformers import CLIPVisionConfig, LlavaConfig, LlavaForConditionalGeneration

    tokenizer = processor.tokenizer
    vision = CLIPVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=TINY_IMAGE_SIZE,
        patch_size=TINY_PATCH_SIZE,
        projection_dim=32,
    )
    config = LlavaConfig(
        vision_config=vision,
        text_config=_text_config(tokenizer, len(tokenizer)),
        image_token_index=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN),
        vision_feature_select_strategy="default",
        vision_feature_layer=-1,
        projector_hidden_act="gelu",
    )
    return LlavaForConditionalGeneration(config)


def tiny_policy(
    *, lora: bool = False, vision: bool = False, seed: int = 0, keep_reference: bool = False
) -> Policy:
    """A randomly initialised tiny policy (deterministic given ``seed``), CPU, float32.

    Args:
        lora: Wrap with a LoRA adapter (:data:`TINY_LORA`) instead of full fine-tuning.
        vision: Build the Llava-style VLM and its processor (``policy.processor``).
        seed: Seeds the weight initialisation (the global torch RNG state is restored after).
        keep_reference: Full fine-tuning only: keep a frozen copy for ``policy.reference()``.
    """
    from transformers import LlamaForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if vision:
            processor = tiny_processor()
            tokenizer = processor.tokenizer
            model = _tiny_vlm(processor)
        else:
            processor = None
            tokenizer = tiny_tokenizer()
            model = LlamaForCausalLM(_text_config(tokenizer, len(tokenizer)))
    _set_generation_eos(model, tokenizer)
    model.eval()  # no dropout in tests unless a test asks for train()
    return build_policy(
        model,
        tokenizer,
        processor=processor,
        lora=TINY_LORA if lora else None,
        keep_reference=keep_reference,
        name=f"tiny-{'vlm' if vision else 'llama'}-seed{seed}",
    )


def precision_pair(lora: bool, device: str = "cpu") -> tuple[Policy, Policy]:
    """The same tiny policy on ``device`` in fp32 and in bf16 mixed precision, with a non-zero LoRA
    adapter (B ~ N(0, 0.1), so the adapter matters) or, for full fine-tuning, a frozen reference."""
    from veriloop.agents.precision import apply_precision

    torch.manual_seed(0)
    fp32 = tiny_policy(lora=lora, keep_reference=not lora)
    for name, param in fp32.model.named_parameters():
        if "lora_B" in name:
            param.data.normal_(0, 0.1)
    fp32.model.to(device)
    if fp32.frozen_reference is not None:
        fp32.frozen_reference.to(device)
    return apply_precision(fp32, "fp32"), apply_precision(copy.deepcopy(fp32), "bf16")


def policy_gradient_step(
    model: Any, ids: torch.Tensor, first: int = 5, signed: bool = True
) -> tuple[float, torch.Tensor, torch.Tensor]:
    """Backward of a policy-gradient loss with an entropy term on ``ids`` [B, T]: advantages from +1
    to -1 over the rows (``signed``), else all +1. Returns the mean log-prob of the scored tokens,
    the flat gradient of the trained weights (asserted fp32) and the log-probs [B, T - first]."""
    from veriloop.agents.forward import token_logprobs

    model.zero_grad(set_to_none=True)
    logp, ent = token_logprobs(model, ids, torch.ones_like(ids), with_entropy=True, first_position=first)
    assert ent is not None  # asked for with_entropy
    adv = torch.linspace(1.0, -1.0 if signed else 1.0, ids.shape[0], device=ids.device)[:, None]  # [B, 1]
    (-(adv * logp[:, first:]).mean() - 0.01 * ent[:, first:].mean()).backward()
    params = [p for p in model.parameters() if p.requires_grad]
    grads = [p.grad for p in params if p.grad is not None]
    assert len(grads) == len(params) and all(g.dtype == torch.float32 for g in grads)  # accumulated in fp32
    grad = torch.cat([g.flatten() for g in grads])
    return logp[:, first:].mean().item(), grad, logp[:, first:].detach()


def gradient_agreement(g32: torch.Tensor, g16: torch.Tensor) -> tuple[float, float]:
    """(cosine, relative error ||g16 - g32|| / ||g32||) of two flat gradients, in float64."""
    cos = torch.nn.functional.cosine_similarity(g32.double(), g16.double(), dim=0).item()
    return cos, ((g16 - g32).double().norm() / g32.double().norm()).item()


def check_bf16_step(lora: bool, device: str = "cpu") -> None:
    """One policy-gradient step of :func:`precision_pair` on ``device`` in bf16 agrees with fp32 within
    the stated tolerances (raises AssertionError otherwise): gradient cosine >= 0.999 and relative
    error <= 0.05 (and > 0: bf16 really ran), per-token log-prob error <= 0.05 nats, mean log-prob
    within 1%, everything finite."""
    fp32, bf16 = precision_pair(lora, device)
    ids = torch.randint(0, 1000, (3, 24), generator=torch.Generator().manual_seed(1)).to(device)
    m32, g32, lp32 = policy_gradient_step(fp32.model, ids)
    m16, g16, lp16 = policy_gradient_step(bf16.model, ids)
    cos, rel = gradient_agreement(g32, g16)
    assert torch.isfinite(g16).all() and torch.isfinite(lp16).all()
    assert cos >= 0.999 and rel <= 0.05, (cos, rel)
    assert (lp16 - lp32).abs().max().item() <= 0.05
    assert abs(m16 - m32) <= 0.01 * abs(m32)
    assert rel > 0  # bf16 really ran: not the fp32 numbers under another name
