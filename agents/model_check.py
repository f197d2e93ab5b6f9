"""Log-prob equality checks of veriloop's fast paths against a plain forward pass.

The HF engine samples through a batched, left-padded KV cache reused between turns (with LoRA
merged into the weights), and the trainer packs a micro-batch behind its shared prompt. On an
architecture they were never run on, either could compute different numbers than a plain
``model(input_ids)`` of one sequence. These functions measure the gaps;
``tests/agents/test_model_matrix.py`` runs them over every tested family, and
:func:`check_unknown_family` runs them at start-up on a model whose family is outside that matrix.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import torch

from veriloop.agents.architecture import family

#: ``config.model_type`` of the families the architecture matrix tests (agents/tiny_families.py),
#: and of the built default models (SmolLM2 is a Llama; the default VLM a Llava over a Llama).
KNOWN_FAMILIES = frozenset(
    {
        "llama",
        "qwen2",
        "qwen3",
        "qwen3_moe",
        "qwen3_5_text",
        "gemma3_text",
        "mistral",
        "phi3",
        "olmo2",
        "granite",
        "smollm3",
    }
)
#: Largest |log-prob| gap the start-up check accepts (bf16: the sampler's dithered LoRA merge and
#: bf16 rounding move single log-probs by up to ~1e-2 on the matrix's models).
STARTUP_TOLERANCE = {"fp32": 1e-3, "bf16": 5e-2}

CHECK_PROMPT = "Make 24 from the numbers 3, 4, 6 and 8 using + - * / and brackets. Answer:"
CHECK_TAILS = (" (8 - 4) * 6 = 24, so the answer", " 6 * 4 = 24 yes", " 24")


def plain_logprobs(model: Any, ids: list[int]) -> torch.Tensor:
    """log p(x_t | x_<t) for t >= 1 from one unpadded ``model(input_ids)`` forward (fp32 log-softmax)."""
    device = next(model.parameters()).device
    logits = model(input_ids=torch.tensor([ids], device=device)).logits[0, :-1].float().cpu()
    return logits.log_softmax(-1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]


def check_batch(tokenizer: Any) -> tuple[torch.Tensor, torch.Tensor, int, list[list[int]]]:
    """3 rows behind a shared prompt, continuations of different lengths, right-padded: ids [3, T],
    attention mask [3, T], the prompt's length and the unpadded rows."""
    prompt = tokenizer.encode(CHECK_PROMPT)
    rows = [prompt + tokenizer.encode(t) for t in CHECK_TAILS]
    width = max(map(len, rows))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    ids = torch.full((3, width), pad)
    mask = torch.zeros(3, width, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)], mask[i, : len(r)] = torch.tensor(r), 1
    return ids, mask, len(prompt), rows


def trainer_gap(policy: Any, *, backward: bool = True) -> tuple[float, float]:
    """Max |log-prob| gap between the trainer's path (the micro-batch sharing its prompt) and
    per-sequence forwards, and (``backward``) the cosine between the two gradients of one
    policy-gradient loss (1.0 without ``backward``)."""
    from veriloop.agents.forward import token_logprobs, usable_shared_prefix

    ids, mask, first, rows = check_batch(policy.tokenizer)
    adv = torch.tensor([1.0, -0.5, 0.25])
    model, params = policy.model, [p for p in policy.model.parameters() if p.requires_grad]
    with torch.set_grad_enabled(backward):
        prefix = usable_shared_prefix(ids, mask, first)
        logp, _ = token_logprobs(model, ids, mask, first_position=first, shared_prefix=prefix)
        gap, loss = 0.0, torch.zeros(())
        for i, row in enumerate(rows):
            plain = plain_logprobs(model, row)[first - 1 :]
            gap = max(gap, (plain.detach() - logp[i, first : len(row)].detach()).abs().max().item())
            loss = loss - adv[i] * plain.sum()
    if not backward:
        return gap, 1.0
    (-(adv[:, None] * logp[:, first:] * mask[:, first:]).sum()).backward()
    packed = torch.cat([p.grad.flatten().cpu() for p in params])  # type: ignore[union-attr]
    model.zero_grad(set_to_none=True)
    loss.backward()
    reference = torch.cat([p.grad.flatten().cpu() for p in params])  # type: ignore[union-attr]
    model.zero_grad(set_to_none=True)
    return gap, torch.nn.functional.cosine_similarity(packed, reference, dim=0).item()


def engine_gap(policy: Any, turns: int = 2, tokens: int = 5) -> tuple[float, dict[str, int]]:
    """A group of 3 sharing a prompt, ``turns`` turns of ``tokens`` sampled tokens on the HF engine
    (shared prefill, KV reuse between turns): the max |gap| between its recorded log-probs and the
    trainer's recompute of each whole conversation, and the engine's counters."""
    from veriloop.agents.backends.base import GenRequest
    from veriloop.agents.backends.hf import HFBackend
    from veriloop.agents.forward import token_logprobs
    from veriloop.agents.sampling_params import SamplingParams

    tok = policy.tokenizer
    backend = HFBackend(policy)
    sampling = SamplingParams(max_new_tokens=tokens, temperature=1.0)
    gen = torch.Generator().manual_seed(0)
    contexts: dict[Hashable, list[int]] = {k: tok.encode(CHECK_PROMPT) for k in range(3)}
    worst = 0.0
    for turn in range(turns):
        reqs = [
            GenRequest(key=k, context_ids=c, max_new_tokens=tokens, turn=turn) for k, c in contexts.items()
        ]
        for req, res in zip(reqs, backend.generate(reqs, sampling, gen), strict=True):
            seq, n = list(req.context_ids) + res.token_ids, len(req.context_ids)
            with torch.no_grad():
                ref = token_logprobs(
                    policy.model,
                    torch.tensor([seq]),
                    torch.ones(1, len(seq), dtype=torch.long),
                    first_position=n,
                )[0][0, n:]
            worst = max(worst, (torch.tensor(res.logprobs) - ref).abs().max().item())
            contexts[req.key] = seq + tok.encode(f" {turn} more, then")  # the environment's reply
    return worst, dict(backend.stats)


def needs_startup_check(model: str) -> bool:
    """Whether :func:`check_unknown_family` could refuse ``model`` (a folder or Hub id), read from
    its ``config.json`` alone (nothing loads): False for a family of the matrix or a VLM; True for
    any other family, and for an adapter folder (its base is known only once loaded)."""
    from transformers import AutoConfig

    from veriloop.agents.loading import _hub_file, _resolve, _source

    ref = _resolve(model)
    if _hub_file(ref, "config.json") is None:
        return True
    source, extra = _source(ref)
    config = AutoConfig.from_pretrained(source, **extra)
    if getattr(config, "vision_config", None) is not None:
        return False
    text = config.get_text_config() if callable(getattr(config, "get_text_config", None)) else config
    return str(getattr(text, "model_type", "")) not in KNOWN_FAMILIES


def check_unknown_family(policy: Any) -> str | None:
    """For a model whose family the architecture matrix does not cover (text models only): run the
    trainer's and the HF engine's log-prob checks on one short batch. Returns None when the family
    is known or both agree with a plain forward within :data:`STARTUP_TOLERANCE`, else a one-line
    message naming the family, the gap and what to do."""
    name = family(policy.model)
    if name in KNOWN_FAMILIES or policy.is_vision:
        return None
    bound = STARTUP_TOLERANCE["bf16" if policy.precision == "bf16" else "fp32"]
    gap, _ = trainer_gap(policy, backward=False)
    where = "the trainer's batched forward"
    if gap <= bound:
        gap, _ = engine_gap(policy, turns=2, tokens=3)
        where = "the HF engine's cached sampling"
    if gap <= bound:
        return None
    return (
        f"policy.model: model family {name!r} is untested by veriloop and {where} gives log-probs "
        f"{gap:.2g} away from a plain forward pass (tolerance {bound:g}); it cannot train correctly "
        "here: use a family listed in docs/models.md"
    )
