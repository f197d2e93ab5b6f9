"""fp32 vs bf16 mixed precision (``policy.precision``) on a CUDA GPU: training-pass speed, peak memory,
gradient agreement.

Not a test; needs a CUDA GPU. The model has the default model's shape (SmolLM2-135M: 30 layers,
d 576, 9 query / 3 key-value heads, MLP 1536, tied 49,152-token head) with random weights, because
the default model's package cannot be carried to a lent GPU machine; speed and memory depend on the
shape, not on the weights. Arms: LoRA (r 16, all linear layers, B ~ N(0, 0.02)) and full fine-tuning,
each in fp32 and bf16, built from one fp32 model. One training pass = forward and backward of a
policy-gradient loss with an entropy term over ``rows x tokens`` tokens (the last ``tokens - 64``
of each row scored), as a training micro-batch. Per shape and arm:

* ``ms``: median (and min) of ``--reps`` passes timed with CUDA events, arms alternating;
* ``tflops``: the FLOP model over the median: per token 2 N (forward) + 2 N (input gradients)
  [+ 2 N (weight gradients), full only] over the N matmul weights of the layers and the head, plus
  attention: 2 T d per token per layer forward (QK^T and AV, 2 x 2 T d, halved by the causal
  mask), three times that with the backward; the LoRA adapters' FLOPs are left out (under 2%);
* ``pct_of_peak``: against this GPU's matmul peak in the pass's precision, measured in the same run
  (8192^3 products, fp32 without TF32);
* ``peak_mb``: the peak memory allocated during the pass above what was allocated before it, and
  ``weights_mb``: the arm's parameters;
* ``grad_cosine`` / ``grad_rel_err``: bf16's gradient of the trained weights against fp32's.

    python benchmarks/bench_precision_gpu.py [--reps 10] [--out benchmarks/results/precision_gpu.json]
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from veriloop.agents.forward import token_logprobs
from veriloop.agents.loading import LoraSettings, build_policy
from veriloop.agents.precision import apply_precision

OUT = Path(__file__).parent / "results" / "precision_gpu.json"
SMOLLM2_135M = dict(
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
    vocab_size=49152,
    tie_word_embeddings=True,
    max_position_embeddings=8192,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
SHAPES = [(8, 512), (32, 1024)]


def matmul_peak(dtype: torch.dtype, n: int = 8192, reps: int = 10) -> float:
    """TFLOP/s of an n^3 product on random data in ``dtype`` (TF32 off for fp32)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    a, b = torch.randn(n, n, device="cuda", dtype=dtype), torch.randn(n, n, device="cuda", dtype=dtype)
    for _ in range(3):
        a @ b
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        a @ b
    end.record()
    torch.cuda.synchronize()
    return 2 * n**3 * reps / (start.elapsed_time(end) / 1e3) / 1e12


def arms(seed: int = 0) -> dict[str, Any]:
    from transformers import LlamaConfig, LlamaForCausalLM

    from veriloop.agents.testing import tiny_tokenizer

    out = {}
    for mode in ("lora", "full"):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(LlamaConfig(**SMOLLM2_135M)).cuda().eval()
        lora = LoraSettings(r=16, alpha=32) if mode == "lora" else None
        fp32 = build_policy(model, tiny_tokenizer(), lora=lora, name=f"smollm2-shape-{mode}")
        with torch.no_grad():
            for name, param in fp32.model.named_parameters():
                if "lora_B" in name:
                    param.normal_(0, 0.02)
        out[f"{mode}_fp32"] = fp32
        out[f"{mode}_bf16"] = apply_precision(copy.deepcopy(fp32), "bf16")
    return out


def train_pass(model: Any, ids: torch.Tensor, first: int) -> None:
    model.zero_grad(set_to_none=True)
    logp, ent = token_logprobs(model, ids, torch.ones_like(ids), with_entropy=True, first_position=first)
    adv = torch.linspace(1.0, -1.0, ids.shape[0], device=ids.device)[:, None]  # [B, 1]
    (-(adv * logp[:, first:]).mean() - 1e-3 * ent[:, first:].mean()).backward()


def flops(rows: int, tokens: int, full: bool) -> float:
    """The FLOP model of the module docstring for one pass."""
    c = SMOLLM2_135M
    d, layers, kv = c["hidden_size"], c["num_hidden_layers"], c["num_key_value_heads"] * c["head_dim"]
    per_layer = d * d * 2 + d * kv * 2 + 3 * d * c["intermediate_size"]  # q, o, k, v, MLP
    n = layers * per_layer + d * c["vocab_size"]
    per_token = n * (6 if full else 4) + layers * 2 * tokens * d * 3
    return rows * tokens * per_token


def grad(model: Any) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.requires_grad]).double()


def bench_shape(pols: dict[str, Any], rows: int, tokens: int, reps: int, peaks: dict[str, float]) -> dict:
    ids = torch.randint(0, 49000, (rows, tokens), generator=torch.Generator().manual_seed(1)).cuda()
    first = 64
    out: dict[str, Any] = {}
    grads = {}
    for name, policy in pols.items():  # warm-up, memory and gradients, one arm at a time
        train_pass(policy.model, ids, first)
        policy.model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        train_pass(policy.model, ids, first)
        torch.cuda.synchronize()
        weights = sum(p.numel() * p.element_size() for p in policy.model.parameters())
        out[name] = {
            "peak_mb": (torch.cuda.max_memory_allocated() - before) / 2**20,
            "weights_mb": weights / 2**20,
        }
        grads[name] = grad(policy.model)
        policy.model.zero_grad(set_to_none=True)
    for mode in ("lora", "full"):
        g32, g16 = grads[f"{mode}_fp32"], grads[f"{mode}_bf16"]
        out[f"{mode}_bf16"]["grad_cosine"] = torch.nn.functional.cosine_similarity(g32, g16, dim=0).item()
        out[f"{mode}_bf16"]["grad_rel_err"] = ((g16 - g32).norm() / g32.norm()).item()
    del grads
    times: dict[str, list[float]] = {k: [] for k in pols}
    for rep in range(reps):
        for name in list(pols) if rep % 2 == 0 else list(pols)[::-1]:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            train_pass(pols[name].model, ids, first)
            end.record()
            torch.cuda.synchronize()
            times[name].append(start.elapsed_time(end))
            pols[name].model.zero_grad(set_to_none=True)
    for name, ms in times.items():
        med = statistics.median(ms)
        tf = flops(rows, tokens, name.startswith("full")) / (med / 1e3) / 1e12
        precision = name.split("_")[1]
        out[name].update(ms=med, ms_min=min(ms), tflops=tf, pct_of_peak=100 * tf / peaks[precision])
    for mode in ("lora", "full"):
        out[f"{mode}_speedup_bf16"] = out[f"{mode}_fp32"]["ms"] / out[f"{mode}_bf16"]["ms"]
        out[f"{mode}_memory_bf16_over_fp32"] = (
            out[f"{mode}_bf16"]["peak_mb"] + out[f"{mode}_bf16"]["weights_mb"]
        ) / (out[f"{mode}_fp32"]["peak_mb"] + out[f"{mode}_fp32"]["weights_mb"])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU and a CUDA build of torch (torch.cuda.is_available() is False)")
    peaks = {"fp32": matmul_peak(torch.float32), "bf16": matmul_peak(torch.bfloat16)}
    print("matmul peaks TFLOP/s", {k: round(v, 1) for k, v in peaks.items()})
    pols = arms()
    report: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "reps": args.reps,
        "matmul_peak_tflops": peaks,
        "shapes": {},
    }
    for rows, tokens in SHAPES:
        key = f"{rows}x{tokens}"
        report["shapes"][key] = bench_shape(pols, rows, tokens, args.reps, peaks)
        print(key, json.dumps(report["shapes"][key], indent=None)[:1500])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"-> {args.out}")


if __name__ == "__main__":
    main()
