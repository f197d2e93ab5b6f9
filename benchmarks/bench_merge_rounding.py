"""How much of a LoRA run's update a sampler sees through merged, rounded weights.

Not a test. A sampler that cannot run the adapter as such (vLLM on a CPU, the HF engine while it
samples) gets the base weights with the adapter folded in, ``W + (alpha/r) B A``, in its own dtype.
This script takes a finished LoRA run (its warm-up adapter ``RUN/sft/final`` and its final one
``RUN/final``), samples ``--prompts`` level-1 math questions from the final policy (fp32, the exact
weights), and scores those tokens in fp32 with each way of building the sampler's weights:

* ``exact``: the bf16 base (as bf16 mixed precision stores it) plus the adapter, not rounded;
* ``bf16_nearest``: that sum rounded to the nearest bf16 (what the samplers did before);
* ``bf16_dithered``: :func:`veriloop.agents.precision.merge_delta` (what they do now);
* ``fp32_base_nearest``: the fp32 base plus the adapter, rounded to bf16 (an fp32 trainer's weights
  loaded by a bf16 sampler; its own exact policy is the fp32 base plus the adapter).

For each, against its exact policy: the RL update it shows (each token's log-prob change from the
warm-up adapter to the final one, regressed on the exact change: slope and correlation) and how far
its final policy is (mean |log-prob difference| and k3 KL over the tokens). Writes
``benchmarks/results/merge_rounding.json``.

    python benchmarks/bench_merge_rounding.py runs/bench_learning/math_gain/grpo_p16_v2_bf16_rerun-s0
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from veriloop.agents.default_model import default_model_path
from veriloop.agents.precision import merge_delta

KINDS = ("exact", "bf16_nearest", "bf16_dithered", "fp32_base_nearest", "fp32_base_exact")
OUT = Path(__file__).parent / "results" / "merge_rounding.json"


def adapter_deltas(folder: Path) -> dict[str, torch.Tensor]:
    """``{weight name: (alpha/r) B A}`` of a saved peft adapter, in fp32."""
    weights = load_file(folder / "adapter_model.safetensors")
    config = json.loads((folder / "adapter_config.json").read_text())
    scale = config["lora_alpha"] / config["r"]
    return {
        name.replace("base_model.model.", "").replace(".lora_A.weight", ".weight"): scale
        * weights[name.replace("lora_A", "lora_B")].float()
        @ weights[name].float()
        for name in weights
        if "lora_A" in name
    }


def sampler_weights(base: dict[str, torch.Tensor], deltas: dict[str, torch.Tensor], kind: str) -> dict:
    """The full state dict (fp32 values) a sampler of ``kind`` computes with."""
    out = {}
    for name, w32 in base.items():
        w16 = w32.to(torch.bfloat16)
        delta = deltas.get(name)
        if kind.startswith("fp32_base"):
            w = w32 if delta is None else w32 + delta
            out[name] = w if kind == "fp32_base_exact" else w.to(torch.bfloat16).float()
        elif delta is None:
            out[name] = w16.float()
        elif kind == "exact":
            out[name] = w16.float() + delta
        elif kind == "bf16_nearest":
            out[name] = (w16.float() + delta).to(torch.bfloat16).float()
        else:
            out[name] = merge_delta(w16, delta, key=name).float()
    return out


def sample_tokens(model, tokenizer, prompts: int, new_tokens: int, seed: int) -> tuple:
    """``prompts`` chat-formatted level-1 questions and the final policy's sampled answers."""
    import numpy as np

    from veriloop.envs.math_data import generate_problem

    rng = np.random.default_rng(seed)
    questions = [generate_problem(rng, level=1).question for _ in range(prompts)]
    texts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True
        )
        for q in questions
    ]
    enc = tokenizer(texts, return_tensors="pt", padding=True, padding_side="left")
    torch.manual_seed(seed)
    with torch.no_grad():
        ids = model.generate(
            **enc,
            max_new_tokens=new_tokens,
            do_sample=True,
            temperature=1.0,
            pad_token_id=tokenizer.pad_token_id,
        )
    prompt_len = enc.input_ids.shape[1]
    mask = torch.cat([enc.attention_mask, (ids[:, prompt_len:] != tokenizer.pad_token_id).long()], 1)
    return ids, mask, prompt_len


def answer_logprobs(
    model, state: dict, ids: torch.Tensor, mask: torch.Tensor, prompt_len: int
) -> torch.Tensor:
    model.load_state_dict(state)
    with torch.no_grad():
        logits = model(ids, attention_mask=mask).logits[:, prompt_len - 1 : -1].float()
    picked = torch.log_softmax(logits, -1).gather(-1, ids[:, prompt_len:, None])[..., 0]
    return picked[mask[:, prompt_len:].bool()].double()


def compare(seen: torch.Tensor, true: torch.Tensor, final: torch.Tensor, exact_final: torch.Tensor) -> dict:
    diff = final - exact_final
    return {
        "update_slope": float((seen * true).sum() / (true * true).sum()),
        "update_corr": float(torch.corrcoef(torch.stack([seen, true]))[0, 1]),
        "final_mean_abs_logp_diff": float(diff.abs().mean()),
        "final_k3_kl": float((torch.exp(-diff) - 1 + diff).mean()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("run", type=Path, help="a finished LoRA run folder (with sft/final and final)")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = str(default_model_path())
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    base = {k: v.clone() for k, v in model.state_dict().items()}
    start, end = adapter_deltas(args.run / "sft" / "final"), adapter_deltas(args.run / "final")
    model.load_state_dict(sampler_weights(base, end, "exact"))
    ids, mask, prompt_len = sample_tokens(model, tokenizer, args.prompts, args.new_tokens, args.seed)
    scores = {
        kind: [
            answer_logprobs(model, sampler_weights(base, d, kind), ids, mask, prompt_len)
            for d in (start, end)
        ]
        for kind in KINDS
    }
    rows = {}
    for kind in KINDS[1:]:
        reference = "fp32_base_exact" if kind.startswith("fp32_base") else "exact"
        if kind == reference:
            continue
        (r0, r1), (k0, k1) = scores[reference], scores[kind]
        rows[kind] = compare(k1 - k0, r1 - r0, k1, r1)
    true_update = scores["exact"][1] - scores["exact"][0]
    result = {
        "run": str(args.run),
        "tokens": int(true_update.numel()),
        "prompts": args.prompts,
        "seed": args.seed,
        "exact_update_mean_abs_logp": float(true_update.abs().mean()),
        "kinds": rows,
    }
    results = json.loads(OUT.read_text()) if OUT.exists() else {}
    results[args.run.name] = result
    OUT.write_text(json.dumps(results, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
