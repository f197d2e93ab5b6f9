"""vLLM's CPU build on the architecture matrix's Qwen3 and Gemma 3 (``make test-vllm``).

For each, LoRA (merged into full weights at sync) and full fine-tuning: one optimizer step on the
trainer's policy, a weight sync, then every log-prob vLLM records for a group of samples equals the
trainer's recompute of the same tokens (fp32 on both sides). head_dim is 64 here: vLLM's CPU
attention refuses 16 ("Unsupported CPU attention configuration"). Qwen3.5 is not here: vLLM 0.32
cannot load it (its architecture inspection fails), so the HF engine is its only sampler on CPU.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import torch

from veriloop.agents.backends import GenRequest
from veriloop.agents.tiny_families import VLLM_FAMILIES

HAS_VLLM = importlib.util.find_spec("vllm") is not None
#: Recorded vs recomputed log-prob, per token (fp32 on both sides), as tests/agents/test_vllm_backend.py.
ATOL = 1e-4

pytestmark = pytest.mark.skipif(
    not HAS_VLLM and os.environ.get("VERILOOP_REQUIRE_VLLM") != "1",
    reason="needs vLLM: `make setup-vllm`, then `make test-vllm`",
)


def _trainer_logprobs(policy, context: list[int], sampled: list[int]) -> torch.Tensor:
    from veriloop.agents.forward import token_logprobs

    ids = torch.tensor([context + sampled])
    with torch.no_grad():
        lp, _ = token_logprobs(policy.model, ids, torch.ones_like(ids), first_position=len(context))
    return lp[0, len(context) :]


def _step(policy, context: list[int]) -> None:
    """One AdamW step that moves every trained weight (a stand-in for any update)."""
    from veriloop.agents.forward import token_logprobs

    params = [p for p in policy.model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.0)
    ids = torch.tensor([context])
    lp, _ = token_logprobs(policy.model, ids, torch.ones_like(ids))
    (-lp.sum()).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


@pytest.mark.parametrize("mode", ["full", "lora"])
@pytest.mark.parametrize("family", VLLM_FAMILIES)
def test_sampler_logprobs_match_the_trainer_after_a_sync(family: str, mode: str, tmp_path: Path) -> None:
    from veriloop.agents.backends.vllm import VLLMBackend
    from veriloop.agents.sampling_params import SamplingParams
    from veriloop.agents.tiny_families import tiny_family_base, tiny_family_policy

    dims = {"head_dim": 64, **({"query_pre_attn_scalar": 64} if family == "gemma3" else {})}
    policy = tiny_family_policy(family, lora=mode == "lora", **dims)
    folder = tmp_path / "base"
    tiny_family_base(family, **dims).save_pretrained(folder)
    policy.tokenizer.save_pretrained(folder)
    backend = VLLMBackend(policy, model_path=str(folder), max_model_len=512)
    try:
        context = policy.tokenizer.encode("Make 24 from 3, 4, 6 and 8. Answer:")
        old = [_trainer_logprobs(policy, context, list(range(100, 106)))]
        _step(policy, context)
        backend.sync()
        reqs = [GenRequest(i, context, 8) for i in range(3)]
        out = backend.generate(reqs, SamplingParams(max_new_tokens=8), torch.Generator().manual_seed(0))
    finally:
        backend.close()
    assert (
        _trainer_logprobs(policy, context, list(range(100, 106))) - old[0]
    ).abs().max() > 10 * ATOL  # it moved
    for r in out:
        fresh = _trainer_logprobs(policy, context, r.token_ids)
        torch.testing.assert_close(torch.tensor(r.logprobs), fresh, atol=ATOL, rtol=0)
