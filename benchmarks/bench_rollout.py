"""Rollout throughput on the default model (SmolLM2-135M-Instruct, CPU): not a test.

Three ways to produce tokens, in one run, reported in generated tokens per second:

    (a) raw   ``model.generate`` at batch 32, 64 new tokens each, from the first Points24 prompts;
    (b) naive 32 concurrent Points24-text episodes (up to 3 attempts), calling ``model.generate``
              on every episode's full re-rendered conversation each turn;
    (c) ours  ``veriloop.agents.engine`` on the same 32 episodes (KV reuse across turns,
              finished rows dropped, inverse-CDF sampling).

Also: RSS after every turn of (b) and (c), the sampling-cost micro-benchmark (multinomial vs
exponential race vs our inverse-CDF ``sample_next``) and the drift rate of the sampled text. Writes benchmarks/results/rollout.json.

    OMP_PROC_BIND=true OMP_PLACES=cores python benchmarks/bench_rollout.py [--episodes 32] [--threads 1]

Measured on a shared 2-core machine: one torch thread was 5-10x faster than two while other jobs
ran (OpenMP threads spin-wait for a busy core), so ``--threads 1`` is the default.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import gymnasium as gym
import torch

import veriloop.envs  # noqa: F401
from veriloop.agents import load_policy
from veriloop.agents.backends.hf import HFBackend
from veriloop.agents.drift import drift_rate
from veriloop.agents.engine import EpisodeSpec, RolloutLimits, rollout
from veriloop.agents.sampling_params import SamplingParams, sample_next

ENV = "veriloop/Points24-text-v0"
OUT = Path(__file__).parent / "results" / "rollout.json"


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def first_prompts(tokenizer, n: int) -> list[str]:
    out = []
    for seed in range(n):
        obs, _ = gym.make(ENV, max_attempts=3).reset(seed=seed)
        out.append(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": obs}], tokenize=False, add_generation_prompt=True
            )
        )
    return out


def hf_generate(policy, prompts: list[str], new_tokens: int, *, force_length: bool, seed: int):
    tok = policy.tokenizer
    tok.padding_side = "left"
    batch = tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    torch.manual_seed(seed)
    out = policy.model.generate(
        **batch,
        do_sample=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens if force_length else 0,
        pad_token_id=tok.pad_token_id,
    )
    return out[:, batch["input_ids"].shape[1] :]


def bench_raw(policy, n: int, new_tokens: int) -> dict:
    prompts = first_prompts(policy.tokenizer, n)
    start = time.perf_counter()
    gen = hf_generate(policy, prompts, new_tokens, force_length=True, seed=0)
    secs = time.perf_counter() - start
    return {"seconds": secs, "generated_tokens": int(gen.numel()), "tokens_per_s": gen.numel() / secs}


def bench_naive(policy, n: int, new_tokens: int, attempts: int) -> dict:
    """Re-render and re-encode every episode's whole conversation with model.generate each turn."""
    tok = policy.tokenizer
    eos = set(policy.model.generation_config.eos_token_id)
    envs = [gym.make(ENV, max_attempts=attempts) for _ in range(n)]
    convs = [[{"role": "user", "content": e.reset(seed=s)[0]}] for s, e in enumerate(envs)]
    live, generated, rss, start = list(range(n)), 0, [rss_mb()], time.perf_counter()
    for turn in range(attempts):
        prompts = [
            tok.apply_chat_template(convs[i], tokenize=False, add_generation_prompt=True) for i in live
        ]
        gen = hf_generate(policy, prompts, new_tokens, force_length=False, seed=turn)
        still = []
        for row, i in enumerate(live):
            ids = gen[row].tolist()
            cut = next((k + 1 for k, t in enumerate(ids) if t in eos), len(ids))
            generated += cut
            text = tok.decode(ids[: cut - 1] if ids[cut - 1] in eos else ids[:cut], skip_special_tokens=False)
            obs, _, term, trunc, _ = envs[i].step(text)
            convs[i] += [{"role": "assistant", "content": text}]
            if not (term or trunc):
                convs[i].append({"role": "user", "content": obs})
                still.append(i)
        live = still
        rss.append(rss_mb())
        if not live:
            break
    secs = time.perf_counter() - start
    return {
        "seconds": secs,
        "generated_tokens": generated,
        "tokens_per_s": generated / secs,
        "rss_mb_per_turn": rss,
    }


def bench_engine(policy, n: int, new_tokens: int, attempts: int, **backend_kwargs) -> dict:
    backend = HFBackend(policy, **backend_kwargs)
    rss, sizes, live = [rss_mb()], [], [0.0]
    inner = backend.generate

    def spy(reqs, *args):
        sizes.append(len(reqs))
        out = inner(reqs, *args)
        rss.append(rss_mb())
        live.append(
            sum(
                t.numel() * t.element_size() for slot in backend._slots.values() for kv in slot.kv for t in kv
            )
            / 2**20
        )
        return out

    backend.generate = spy
    specs = [EpisodeSpec(ENV, {"max_attempts": attempts}, seed, seed) for seed in range(n)]
    start = time.perf_counter()
    trajs = rollout(
        policy,
        specs,
        sampling=SamplingParams(max_new_tokens=new_tokens, seed=0),
        limits=RolloutLimits(max_turns=attempts),
        backend=backend,
    )
    secs = time.perf_counter() - start
    generated = sum(t.num_generated_tokens for t in trajs)
    drift = [drift_rate(policy.tokenizer, t) for t in trajs]
    return {
        "seconds": secs,
        "generated_tokens": generated,
        "tokens_per_s": generated / secs,
        "batch_sizes_per_turn": sizes,
        "rss_mb_per_turn": rss,
        # the episodes' cached keys/values held between turns, and what the process holds beyond them
        "live_kv_mb_per_turn": live,
        "rss_minus_live_kv_mb_per_turn": [r - k for r, k in zip(rss, live)],
        "backend_stats": dict(backend.stats),
        "mean_drift_rate_sampled_text": sum(drift) / len(drift),
        "episodes_with_drift": sum(d > 0 for d in drift),
        "hit_token_limit_turns": sum(t.hit_token_limit for tr in trajs for t in tr.turns),
        "turns": sum(tr.num_turns for tr in trajs),
        "mean_reward": sum(t.total_reward for t in trajs) / len(trajs),
    }


def bench_sampling(batch: int, vocab: int, reps: int = 50) -> dict:
    logits = torch.randn(batch, vocab)
    gen = torch.Generator().manual_seed(0)

    def timed(fn) -> float:
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        return (time.perf_counter() - start) / reps * 1e3

    multinomial = timed(lambda: torch.multinomial(torch.softmax(logits, -1), 1, generator=gen))
    race = timed(
        lambda: torch.argmax(
            torch.log_softmax(logits, -1) - torch.empty_like(logits).exponential_(generator=gen).log(), -1
        )
    )
    ours = timed(lambda: sample_next(logits, SamplingParams(), gen))  # inverse CDF, what the engine uses
    return {
        "batch": batch,
        "vocab": vocab,
        "multinomial_ms": multinomial,
        "exponential_race_ms": race,
        "sample_next_inverse_cdf_ms": ours,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--attempts", type=int, default=3)
    parser.add_argument("--no-kv-ablation", action="store_true", help="skip (c) without KV reuse")
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads (1 is fastest on a busy 2-core box)"
    )
    parser.add_argument(
        "--engine-memory-only",
        action="store_true",
        help="only (c), for its RSS after each turn -> results/rollout_memory.json (timings not comparable)",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    policy = load_policy("default")
    policy.model.eval()
    n, k, a = args.episodes, args.new_tokens, args.attempts
    if args.engine_memory_only:
        c = bench_engine(policy, n, k, a)
        keep = (
            "rss_mb_per_turn",
            "live_kv_mb_per_turn",
            "rss_minus_live_kv_mb_per_turn",
            "batch_sizes_per_turn",
            "backend_stats",
            "generated_tokens",
            "turns",
        )
        out = {
            "settings": {"episodes": n, "new_tokens_per_turn": k, "attempts": a},
            "threads": args.threads,
            "load_avg": os.getloadavg(),
            **{key: c[key] for key in keep},
        }
        (OUT.parent / "rollout_memory.json").write_text(json.dumps(out, indent=1))
        print(json.dumps(out))
        return
    results: dict = {
        "model": policy.name,
        "dtype": str(next(policy.model.parameters()).dtype),
        "machine": {
            "cpus": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "platform": platform.platform(),
            "OMP_PROC_BIND": os.environ.get("OMP_PROC_BIND"),
            "load_avg_at_start": os.getloadavg(),
        },
        "settings": {"episodes": n, "new_tokens_per_turn": k, "attempts": a, "temperature": 1.0},
    }
    with torch.inference_mode():
        hf_generate(policy, first_prompts(policy.tokenizer, 2), 4, force_length=True, seed=0)  # warm-up
        results["a_raw_generate"] = bench_raw(policy, n, k)
        print("a", results["a_raw_generate"], flush=True)
        results["b_naive_multiturn"] = bench_naive(policy, n, k, a)
        print("b", results["b_naive_multiturn"]["tokens_per_s"], flush=True)
    results["c_engine"] = bench_engine(policy, n, k, a)
    print("c", results["c_engine"]["tokens_per_s"], flush=True)
    if not args.no_kv_ablation:
        results["c_engine_no_kv_reuse"] = bench_engine(policy, n, k, a, reuse_kv=False)
        print("c-noKV", results["c_engine_no_kv_reuse"]["tokens_per_s"], flush=True)
    results["sampling_cost"] = bench_sampling(n, policy.model.config.vocab_size)
    tps = {key: results[key]["tokens_per_s"] for key in ("a_raw_generate", "b_naive_multiturn", "c_engine")}
    results["ratios"] = {
        "c_over_b": tps["c_engine"] / tps["b_naive_multiturn"],
        "c_over_a": tps["c_engine"] / tps["a_raw_generate"],
        "targets": {
            "c_over_b>=1.3": tps["c_engine"] / tps["b_naive_multiturn"] >= 1.3,
            "c_over_a>=1.0": tps["c_engine"] / tps["a_raw_generate"] >= 1.0,
        },
    }
    results["machine"]["load_avg_at_end"] = os.getloadavg()
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results["ratios"], indent=2))


if __name__ == "__main__":
    main()
