"""Fixtures for the algorithm tests (builders live in algo_builders.py)."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def tiny_llama():
    """A seeded 2-layer Llama with a 64-token vocabulary (fresh per test)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64
    )
    return LlamaForCausalLM(cfg).eval()
