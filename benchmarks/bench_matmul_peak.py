"""This machine's fp32 and bf16 matmul peaks (GFLOP/s): the ceilings that training and rollout throughput are judged against.

``torch.matmul`` on square matrices of sizes 512..4096, in each dtype of ``--dtypes`` (default
float32 and bfloat16; bf16 products accumulate in fp32 inside the kernel, as in mixed-precision
training), with a fixed number of torch threads (default 2). One product of two n x n matrices
costs ``2 n^3`` FLOPs (n^3 multiply-adds). For each size: a few warm-up products, then ``--reps``
timed ones; we keep the best and the median rate. A dtype's peak is its best rate over all sizes
(what a well-shaped GEMM can reach here). A run in fp32 is judged against the fp32 peak, a run in
bf16 mixed precision against the bf16 peak.

    OMP_PROC_BIND=true OMP_PLACES=cores python benchmarks/bench_matmul_peak.py [--threads 2]

Writes benchmarks/results/matmul_peak.json (read by bench_vs_trl.py). On a shared machine other
jobs lower the numbers: run it when the machine is quiet, or compare the median with the best.

``--model-shapes`` also times the GEMMs one LoRA training micro-batch of the default model multiplies
(``--tokens`` rows through every linear layer forward and back to its input, ``--scored`` rows through
the output head; the shapes read from the model's config), interleaved with the square sizes, and
reports their FLOP-weighted rate as a fraction of the square peak measured in the same run: the
ceiling a training step's matmuls can reach on this machine, whatever the framework around them.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch

OUT = Path(__file__).parent / "results" / "matmul_peak.json"
SIZES = (512, 1024, 2048, 4096)


#: CPU features that set the matmul peaks: AVX-512 (fp32), its BF16 dot products, AMX tiles (bf16 ~6x fp32).
MATMUL_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16")


def machine_info() -> dict[str, object]:
    """CPU model and matmul features, core count, load and library versions, for the results file."""
    cpu, flags = platform.processor() or "unknown", set()
    try:
        with open("/proc/cpuinfo") as f:
            lines = f.read().splitlines()
        cpu = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), cpu)
        flags = set(next((line.split(":", 1)[1].split() for line in lines if line.startswith("flags")), []))
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cpu_matmul_flags": [f for f in MATMUL_FLAGS if f in flags],
        "logical_cpus": os.cpu_count(),
        "load_avg_1_5_15": list(os.getloadavg()),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
        "omp_env": {k: os.environ.get(k) for k in ("OMP_PROC_BIND", "OMP_PLACES", "OMP_NUM_THREADS")},
    }


def time_matmul(n: int, reps: int, warmup: int = 2, dtype: torch.dtype = torch.float32) -> list[float]:
    """Seconds of each of ``reps`` timed ``[n, n] @ [n, n]`` products in ``dtype``."""
    gen = torch.Generator().manual_seed(n)
    a = torch.randn(n, n, generator=gen).to(dtype)  # [n, n]
    b = torch.randn(n, n, generator=gen).to(dtype)  # [n, n]
    out = torch.empty(n, n, dtype=dtype)
    for _ in range(warmup):
        torch.matmul(a, b, out=out)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        torch.matmul(a, b, out=out)
        times.append(time.perf_counter() - t0)
    return times


def measure(
    sizes: tuple[int, ...], reps: int, dtype: torch.dtype = torch.float32
) -> dict[str, dict[str, float]]:
    """Per size: best and median GFLOP/s (``2 n^3 / seconds / 1e9``) and the raw times."""
    results = {}
    for n in sizes:
        times = time_matmul(n, reps if n < 4096 else max(3, reps // 2), dtype=dtype)
        flops = 2.0 * n**3
        results[str(n)] = {
            "best_gflops": flops / min(times) / 1e9,
            "median_gflops": flops / statistics.median(times) / 1e9,
            "times_s": times,
        }
    return results


def model_gemms(tokens: int, scored: int) -> list[tuple[str, int, int, int, int]]:
    """``(name, m, k, n, count)`` of the ``[m, k] @ [k, n]`` products one LoRA training micro-batch of
    the default model makes through its frozen weights: each linear layer's forward (``tokens`` rows)
    and its input gradient (the weight gradient is skipped: the weights are frozen), the tied output
    head's over the ``scored`` rows; LoRA's own small products and attention's are left out, as the
    4 N FLOPs-per-token model of bench_vs_trl.py leaves them out."""
    from transformers import AutoConfig

    from veriloop.agents.models.text import default_model_path

    c = AutoConfig.from_pretrained(default_model_path())
    h, f, layers = c.hidden_size, c.intermediate_size, c.num_hidden_layers
    kv = c.num_key_value_heads * (h // c.num_attention_heads)
    linears = {
        "q_proj": (h, h),
        "k_proj": (h, kv),
        "v_proj": (h, kv),
        "o_proj": (h, h),
        "gate_proj": (h, f),
        "up_proj": (h, f),
        "down_proj": (f, h),
    }
    out = []
    for name, (d_in, d_out) in linears.items():
        out.append((f"{name} fwd", tokens, d_in, d_out, layers))
        out.append((f"{name} dX", tokens, d_out, d_in, layers))
    out.append(("lm_head fwd", scored, h, c.vocab_size, 1))
    out.append(("lm_head dX", scored, c.vocab_size, h, 1))
    return out


def time_gemm(m: int, k: int, n: int, reps: int, dtype: torch.dtype) -> float:
    """The best of ``reps`` timed ``[m, k] @ [k, n]`` products in ``dtype`` (seconds)."""
    gen = torch.Generator().manual_seed(m * k + n)
    a, b = torch.randn(m, k, generator=gen).to(dtype), torch.randn(k, n, generator=gen).to(dtype)
    out = torch.empty(m, n, dtype=dtype)
    torch.matmul(a, b, out=out)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        torch.matmul(a, b, out=out)
        best = min(best, time.perf_counter() - t0)
    return best


def measure_model_shapes(tokens: int, scored: int, reps: int, dtypes: list[str], rounds: int = 3) -> dict:
    """Per dtype: each GEMM's best GFLOP/s, the square peak (sizes 512..2048) timed in the same rounds,
    and the FLOP-weighted rate of the whole micro-batch (total FLOPs / total best seconds) as a
    fraction of that peak. The rounds alternate square and model shapes, so load hits both alike."""
    gemms = model_gemms(tokens, scored)
    best: dict[str, dict[str, float]] = {d: {} for d in dtypes}
    for _ in range(rounds):
        for d in dtypes:
            dtype = getattr(torch, d)
            for n in (512, 1024, 2048):
                t = time_gemm(n, n, n, reps, dtype)
                best[d][f"square {n}"] = min(best[d].get(f"square {n}", t), t)
            for name, m, k, n, _ in gemms:
                t = time_gemm(m, k, n, reps, dtype)
                best[d][name] = min(best[d].get(name, t), t)
    out = {}
    for d in dtypes:
        peak = max(
            2.0 * int(key.split()[1]) ** 3 / t / 1e9 for key, t in best[d].items() if key.startswith("square")
        )
        flops = sum(2.0 * m * k * n * c for _, m, k, n, c in gemms)
        seconds = sum(best[d][name] * c for name, _, _, _, c in gemms)
        out[d] = {
            "square_peak_gflops": peak,
            "model_gemms_gflops": flops / seconds / 1e9,
            "fraction_of_square_peak": flops / seconds / 1e9 / peak,
            "per_gemm_gflops": {name: 2.0 * m * k * n / best[d][name] / 1e9 for name, m, k, n, _ in gemms},
        }
    return {
        "tokens": tokens,
        "scored": scored,
        "rounds": rounds,
        "reps": reps,
        "gemms": [list(g) for g in gemms],
        "by_dtype": out,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    parser.add_argument("--reps", type=int, default=8, help="timed products per size (half at 4096)")
    parser.add_argument(
        "--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"]
    )
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument(
        "--model-shapes",
        action="store_true",
        help="time the default model's training GEMMs against the square peak instead",
    )
    parser.add_argument("--tokens", type=int, default=640, help="rows through each linear layer (4 x 160)")
    parser.add_argument("--scored", type=int, default=256, help="rows through the output head (4 x 64)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    info = machine_info()
    if args.model_shapes:
        shapes = measure_model_shapes(args.tokens, args.scored, args.reps, args.dtypes)
        out = args.out if args.out != OUT else OUT.with_name("matmul_model_shapes.json")
        report = {
            "benchmark": "the default model's training GEMMs against the square matmul peak",
            "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "machine": info,
            "load_avg_1_5_15_at_end": list(os.getloadavg()),
            "threads": args.threads,
            **shapes,
        }
        out.write_text(json.dumps(report, indent=2) + "\n")
        for d, r in shapes["by_dtype"].items():
            print(
                f"{d}: square peak {r['square_peak_gflops']:.1f} GFLOP/s, the model's GEMMs "
                f"{r['model_gemms_gflops']:.1f} ({r['fraction_of_square_peak']:.0%})"
            )
            for name, g in r["per_gemm_gflops"].items():
                print(f"  {name:>14} {g:8.1f}")
        print(f"-> {out}")
        return
    by_dtype = {}
    for name in args.dtypes:
        results = measure(SIZES, args.reps, getattr(torch, name))
        by_dtype[name] = {
            "peak_gflops": max(r["best_gflops"] for r in results.values()),
            "peak_median_gflops": max(r["median_gflops"] for r in results.values()),
            "sizes": results,
        }
    first = by_dtype.get("float32", next(iter(by_dtype.values())))
    report = {
        "benchmark": "square matmul peak per dtype",
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": info,
        "load_avg_1_5_15_at_end": list(os.getloadavg()),
        "threads": args.threads,
        "flops_per_matmul": "2 * n^3",
        "peak_gflops": first["peak_gflops"],  # fp32's (what older readers of this file expect)
        "peak_median_gflops": first["peak_median_gflops"],
        "peak_gflops_by_dtype": {name: r["peak_gflops"] for name, r in by_dtype.items()},
        "dtypes": by_dtype,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    for name, r in by_dtype.items():
        print(f"{name}\n{'n':>6} {'best GFLOP/s':>13} {'median GFLOP/s':>15}")
        for n, size in r["sizes"].items():
            print(f"{n:>6} {size['best_gflops']:>13.1f} {size['median_gflops']:>15.1f}")
        print(
            f"{name} peak {r['peak_gflops']:.1f} GFLOP/s (best), {r['peak_median_gflops']:.1f} (best median)"
        )
    print(f"{args.threads} threads -> {args.out}")


if __name__ == "__main__":
    main()
