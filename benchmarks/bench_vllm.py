"""HF engine vs vLLM (CPU build) on the same multi-turn rollout: not a test.

The rollout: ``--episodes`` Points24-text episodes (up to ``--attempts`` turns, ``--new-tokens`` per
turn, T = 1) with the default model, through ``veriloop.agents.engine.rollout`` and

    hf          the HF backend (KV reuse across turns), fp32, every core as torch threads
    vllm_fp32   VLLMBackend, fp32 (compiled, in-process engine, cores bound)
    vllm_bf16   VLLMBackend sampling in bf16; the trainer's fp32 log-probs of its tokens give the
                sampler-vs-trainer mismatch (``veriloop.algos.maths.mismatch``)

HF and vLLM runs alternate (hf, vllm, hf, vllm, ...) so a change in the machine's load hits both;
each arm reports every repetition and the best. With ``--lora`` it also times the two LoRA sync
routes on a LoRA policy (r=16, all linear layers) after a perturbation of its adapter: merge +
``reload_weights`` (the CPU default) vs a ``LoRARequest`` (the GPU default), and the rollout speed
each gives. Writes benchmarks/results/vllm_rollout.json. Run in the vLLM venv::

    make setup-vllm && .venv-vllm/bin/python benchmarks/bench_vllm.py [--episodes 32] [--reps 2] [--lora]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path
from typing import Any

import torch

import veriloop.envs  # noqa: F401
from veriloop.agents import load_policy
from veriloop.agents.backends.hf import HFBackend
from veriloop.agents.engine import EpisodeSpec, RolloutLimits, rollout
from veriloop.agents.forward import token_logprobs
from veriloop.agents.loading import LoraSettings
from veriloop.agents.sampling_params import SamplingParams
from veriloop.algos.maths.mismatch import MismatchStats, mismatch_stats

ENV = "veriloop/Points24-text-v0"
OUT = Path(__file__).parent / "results" / "vllm_rollout.json"


def run_rollout(policy: Any, backend: Any, n: int, new_tokens: int, attempts: int, seed: int = 0) -> dict:
    specs = [EpisodeSpec(ENV, {"max_attempts": attempts}, s, s) for s in range(n)]
    start = time.perf_counter()
    trajs = rollout(
        policy,
        specs,
        sampling=SamplingParams(max_new_tokens=new_tokens, seed=seed),
        limits=RolloutLimits(max_turns=attempts),
        backend=backend,
    )
    secs = time.perf_counter() - start
    generated = sum(t.num_generated_tokens for t in trajs)
    return {
        "seconds": secs,
        "generated_tokens": generated,
        "tokens_per_s": generated / secs,
        "turns": sum(t.num_turns for t in trajs),
        "trajectories": trajs,
    }


def mismatch_of(policy: Any, trajs: list) -> dict[str, float]:
    """The trainer's fp32 log-probs of the sampled tokens vs the ones the sampler recorded."""
    total = MismatchStats()
    with torch.no_grad():
        for tr in trajs:
            ids = torch.tensor([tr.token_ids])
            lp, _ = token_logprobs(policy.model, ids, torch.ones_like(ids))  # [1, T]
            total = total + mismatch_stats(lp, torch.tensor([tr.logprobs]), torch.tensor([tr.loss_mask]))
    return total.metrics()


def strip(r: dict) -> dict:
    return {k: v for k, v in r.items() if k != "trajectories"}


def alternate(
    policy: Any, arms: dict[str, Any], reps: int, args: argparse.Namespace
) -> dict[str, list[dict]]:
    """``reps`` rounds; in each, every arm once, in order (so load changes hit all arms alike)."""
    out: dict[str, list[dict]] = {name: [] for name in arms}
    for rep in range(reps):
        for name, backend in arms.items():
            r = run_rollout(policy, backend, args.episodes, args.new_tokens, args.attempts, seed=rep)
            out[name].append(r)
            print(
                f"rep {rep} {name}: {r['tokens_per_s']:.1f} tok/s ({r['generated_tokens']} tokens)",
                flush=True,
            )
    return out


def summary(runs: list[dict]) -> dict:
    return {"best_tokens_per_s": max(r["tokens_per_s"] for r in runs), "runs": [strip(r) for r in runs]}


def timed_engine(make: Any) -> tuple[Any, float]:
    start = time.perf_counter()
    backend = make()
    return backend, time.perf_counter() - start


def bench_lora(args: argparse.Namespace, results: dict) -> None:
    from veriloop.agents.backends.vllm import VLLMBackend

    policy = load_policy("default", lora=LoraSettings(r=16, alpha=32))
    with torch.no_grad():  # an adapter that changes the outputs, as after some training
        for name, p in policy.model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.01)
    lora: dict[str, Any] = {}
    for route in ("merge", "adapter"):
        backend, startup = timed_engine(lambda: VLLMBackend(policy, lora_sync=route))  # noqa: B023
        syncs = []
        for _ in range(3):
            start = time.perf_counter()
            backend.sync()
            syncs.append(time.perf_counter() - start)
        runs = [
            run_rollout(policy, backend, args.episodes, args.new_tokens, args.attempts, seed=r)
            for r in range(args.reps)
        ]
        lora[route] = {"startup_s": startup, "sync_s": syncs, **summary(runs)}
        print(
            f"lora {route}: sync {min(syncs):.2f} s, {lora[route]['best_tokens_per_s']:.1f} tok/s", flush=True
        )
        backend.close()
    results["lora_sync"] = lora


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--attempts", type=int, default=3)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--lora", action="store_true", help="also time the LoRA sync routes")
    args = parser.parse_args()
    from veriloop.agents.backends.vllm import VLLMBackend

    cores = len(os.sched_getaffinity(0))
    torch.set_num_threads(cores)  # the HF arm on every core, as vLLM's bound threads are
    policy = load_policy("default")
    policy.model.eval()
    results: dict[str, Any] = {
        "model": policy.name,
        "machine": {"cpus": cores, "platform": platform.platform(), "load_avg_at_start": os.getloadavg()},
        "settings": {
            "env": ENV,
            "episodes": args.episodes,
            "new_tokens_per_turn": args.new_tokens,
            "attempts": args.attempts,
            "temperature": 1.0,
            "reps": args.reps,
        },
    }
    hf = HFBackend(policy)
    for dtype in ("float32", "bfloat16"):
        backend, startup = timed_engine(lambda: VLLMBackend(policy, dtype=dtype))  # noqa: B023
        name = f"vllm_{'fp32' if dtype == 'float32' else 'bf16'}"
        runs = alternate(policy, {f"hf_vs_{name}": hf, name: backend}, args.reps, args)
        results[name] = {"startup_s": startup, **summary(runs[name])}
        results[f"hf_vs_{name}"] = summary(runs[f"hf_vs_{name}"])
        # fp32: the kernels' own differences; bf16: what sampling in bf16 adds
        results[name]["mismatch_vs_fp32_trainer"] = mismatch_of(policy, runs[name][-1]["trajectories"])
        backend.close()
    if args.lora:
        bench_lora(args, results)
    hf_best = max(
        results["hf_vs_vllm_fp32"]["best_tokens_per_s"], results["hf_vs_vllm_bf16"]["best_tokens_per_s"]
    )
    results["speedup_over_hf"] = {
        "vllm_fp32": results["vllm_fp32"]["best_tokens_per_s"] / hf_best,
        "vllm_bf16": results["vllm_bf16"]["best_tokens_per_s"] / hf_best,
    }
    results["machine"]["load_avg_at_end"] = os.getloadavg()
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results["speedup_over_hf"], indent=2))


if __name__ == "__main__":
    main()
