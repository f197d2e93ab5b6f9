"""On a lent GPU: seconds per weight sync and generated tokens per second, synchronous (K = 0) and
asynchronous (K = 1), for the default model and a Qwen3-shaped tiny model. Not a test.

Each arm is ``veriloop``'s ``train()`` on the quickstart's task (no SFT warm-up, no evaluation, no
checkpoints) for ``--steps`` steps; the sampler is vLLM's in-process CUDA engine where a CUDA build
of vLLM imports, else the HF engine (named in the results). Per arm: the median
``time/weight_sync_s`` over the steps after the first (the first includes compilation and warm-up),
the median step time, and the generated tokens per second over those steps (episodes x mean
response length / the wall time between the first and the last step's log; the synchronous HF
engine samples with the trained model itself, so it has no sync and its sync time is null). Writes
``benchmarks/results/gpu_<gpu name>.json``. On a machine without CUDA it prints why and writes
nothing. ``benchmarks/gpu_check.sh`` runs it after ``tests/gpu``::

    python benchmarks/bench_gpu.py [--steps 4] [--models default qwen3_tiny] [--ks 0 1]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

RESULTS = Path(__file__).resolve().parent / "results"


def vllm_on_cuda() -> bool:
    if importlib.util.find_spec("vllm") is None:
        return False
    from vllm.platforms import current_platform

    return bool(current_platform.is_cuda())


def qwen3_tiny(folder: Path) -> str:
    """A Qwen3-shaped random model (the tests' tiny family: 2 layers, q/k norms, head_dim 64) with
    the default model's tokenizer, saved as a plain Hugging Face folder."""
    from veriloop.agents.testing import tiny_tokenizer
    from veriloop.agents.tiny_families import tiny_family_base

    model = tiny_family_base("qwen3", head_dim=64)
    model.save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return str(folder)


def arm(model: str, k: int, steps: int, backend: str, out: Path, name: str) -> dict[str, Any]:
    """One run; its sync time, step time and generated tokens per second (steps after the first)."""
    from veriloop.algos.loop.train import train
    from veriloop.configs.loader import load_config

    over = [
        f"policy.model={model}",
        "sft.steps=0",
        f"train.steps={steps}",
        f"train.max_staleness={k}",
        f"rollout.backend={backend}",
        "eval.every=0",
        "eval.at_start=false",
        "eval.num_problems=1",
        "eval.n_samples=1",
        "eval.k_list=[1]",
        "run.checkpoint_every=0",
        "run.tensorboard=false",
        f"run.out_dir={out}",
        f"run.name={name}",
    ]
    if k > 0:
        over.append("algo.rollout_is=truncate")
    t0 = time.perf_counter()
    run = train(load_config("quickstart", over), quiet=True)
    wall = time.perf_counter() - t0
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "grad_norm" in r]
    later = rows[1:] or rows
    tokens = sum(r["samples/episodes"] * r["response_length/mean"] for r in later[1:])
    span = later[-1]["time"] - later[0]["time"] if len(later) > 1 else float("nan")
    syncs = [r["time/weight_sync_s"] for r in later if r.get("time/weight_sync_s") is not None]
    return {
        "model": model,
        "max_staleness": k,
        "backend": backend,
        "steps": len(rows),
        "wall_s": round(wall, 1),
        "weight_sync_s_median": statistics.median(syncs) if syncs else None,
        "weight_sync_s": syncs,
        "step_s_median": span / max(len(later) - 1, 1),
        "generated_tokens_per_s": tokens / span if span else None,
        "response_length_mean": statistics.mean(r["response_length/mean"] for r in rows),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--models", nargs="+", default=["default", "qwen3_tiny"])
    ap.add_argument("--ks", nargs="+", type=int, default=[0, 1])
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_gpu: skipped: torch.cuda.is_available() is False (no GPU, or a CPU build of torch)")
        return 0
    gpu = torch.cuda.get_device_name(0)
    backend = "vllm" if vllm_on_cuda() else "hf"
    res: dict[str, Any] = {
        "gpu": gpu,
        "gpus": torch.cuda.device_count(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "sampler": backend,
        "arms": [],
    }
    if backend == "vllm":
        import vllm

        res["vllm"] = vllm.__version__
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models:
            model = qwen3_tiny(Path(tmp) / "qwen3_tiny") if name == "qwen3_tiny" else name
            for k in args.ks:
                try:
                    res["arms"].append(
                        {"name": name, **arm(model, k, args.steps, backend, Path(tmp), f"{name}-k{k}")}
                    )
                except Exception as e:  # noqa: BLE001 - one arm's failure is recorded, the others still run
                    res["arms"].append(
                        {"name": name, "max_staleness": k, "error": f"{type(e).__name__}: {e}"[:2000]}
                    )
                print(json.dumps(res["arms"][-1]), flush=True)
    out = RESULTS / f"gpu_{re.sub(r'[^a-z0-9]+', '_', gpu.lower()).strip('_')}.json"
    out.write_text(json.dumps(res, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
