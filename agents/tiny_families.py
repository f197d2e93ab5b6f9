"""Tiny random models of the architecture families veriloop is tested on, with the SmolLM2 tokenizer.

Each is built offline from transformers' own config class (2 layers, hidden 64, head_dim 16) in
well under a second, with the feature that sets its family apart switched on at a size the tests
reach: Gemma 3's sliding window of 16 tokens beside a global layer, its final-logit soft-capping
and query scaling; Mistral's sliding window; Phi-3's fused q-k-v and gate-up projections; Granite's
embedding, residual, attention and logit multipliers; SmolLM3's layer without RoPE; Qwen3-MoE's
4 experts (2 per token); Qwen3.5's Gated DeltaNet linear-attention layer beside a full-attention one.
``tests/agents/test_model_matrix.py`` runs every family through the HF engine and the trainer, and
``docs/models.md``'s support table is generated from its results.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from veriloop.agents.loading import build_policy
from veriloop.agents.policy import Policy

#: Sliding window (tokens) of the tiny Gemma 3 and Mistral: shorter than a test's conversations.
TINY_WINDOW = 16


def _common(tokenizer: Any) -> dict[str, Any]:
    from veriloop.agents.testing import tiny_text_settings

    return tiny_text_settings(tokenizer, head_dim=16)


def _build(config_name: str, model_name: str, **extra: Any) -> Callable[..., Any]:
    def build(tokenizer: Any, **overrides: Any) -> Any:
        import transformers

        config = getattr(transformers, config_name)(**{**_common(tokenizer), **extra, **overrides})
        return getattr(transformers, model_name)(config)

    return build


#: family -> builder(tokenizer) of a tiny random causal LM; keys are what the tests and docs name.
TINY_FAMILIES: dict[str, Callable[..., Any]] = {
    "llama": _build("LlamaConfig", "LlamaForCausalLM"),
    "qwen2": _build("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": _build("Qwen3Config", "Qwen3ForCausalLM"),
    "qwen3_moe": _build(
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        moe_intermediate_size=32,
        num_experts=4,
        num_experts_per_tok=2,
    ),
    "qwen3_5": _build(
        "Qwen3_5TextConfig",
        "Qwen3_5ForCausalLM",
        layer_types=["linear_attention", "full_attention"],
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
    ),
    "gemma3": _build(
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        sliding_window=TINY_WINDOW,
        layer_types=["sliding_attention", "full_attention"],
        query_pre_attn_scalar=16,
        final_logit_softcapping=30.0,
        attn_logit_softcapping=None,
    ),
    "mistral": _build("MistralConfig", "MistralForCausalLM", sliding_window=TINY_WINDOW),
    "phi3": _build("Phi3Config", "Phi3ForCausalLM"),
    "olmo2": _build("Olmo2Config", "Olmo2ForCausalLM"),
    "granite": _build(
        "GraniteConfig",
        "GraniteForCausalLM",
        embedding_multiplier=12.0,
        residual_multiplier=0.22,
        attention_multiplier=0.0625,
        logits_scaling=4.0,
    ),
    "smollm3": _build("SmolLM3Config", "SmolLM3ForCausalLM", no_rope_layers=[1, 0], no_rope_layer_interval=2),
}


#: Families tests/agents/test_vllm_families.py runs on vLLM's CPU build (``make test-vllm``), with
#: head_dim 64; Qwen3.5 cannot be loaded by vLLM 0.32.
VLLM_FAMILIES = ("gemma3", "qwen3")


def tiny_family_policy(family: str, *, lora: bool = False, seed: int = 0, **overrides: Any) -> Policy:
    """A tiny random ``family`` policy (fp32, CPU), LoRA (r 8, all linear layers, ``B`` drawn from
    N(0, 0.1) so the adapter changes the outputs) or full fine-tuning. ``overrides`` change the
    config (e.g. ``head_dim=64``, the smallest vLLM's CPU attention takes)."""
    from veriloop.agents.testing import TINY_LORA, tiny_tokenizer

    if family not in TINY_FAMILIES:
        raise ValueError(f"unknown tiny family {family!r}; choose one of {sorted(TINY_FAMILIES)}")
    tokenizer = tiny_tokenizer()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = TINY_FAMILIES[family](tokenizer, **overrides).eval()
        policy = build_policy(model, tokenizer, lora=TINY_LORA if lora else None, name=f"tiny-{family}")
        for name, param in policy.model.named_parameters():
            if "lora_B" in name:
                param.data.normal_(0, 0.1)
    return policy


def tiny_family_base(family: str, seed: int = 0, **overrides: Any) -> Any:
    """The base model :func:`tiny_family_policy` wraps (same seed, same weights), without an adapter."""
    from veriloop.agents.testing import tiny_tokenizer

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return TINY_FAMILIES[family](tiny_tokenizer(), **overrides).eval()
