"""Two trainer ranks with K = 1 against the 1-process synchronous run, both against one vLLM server.

Run in the vLLM environment: ``.venv-vllm/bin/python benchmarks/bench_async_ranks.py OUT``. It starts
one ``veriloop serve-vllm`` process, runs the quickstart (default model, no warm-up, 5 GRPO steps
of 2 problems x 2 samples) once as one synchronous process and once as
``torchrun --nproc_per_node 2`` with ``train.max_staleness=1``, and writes per-step times
(``time`` gaps between rows), weight-sync times and idle shares, with the machine's load, to
``OUT/measure.json`` (docs/async.md, "Two trainer ranks, one server").
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from veriloop.cli.serve import running_server

COMMON = ["policy.precision=fp32", "rollout.prompts_per_step=2", "rollout.group_size=2", "rollout.max_new_tokens=16",
          "train.steps=5", "train.micro_batch_size=4", "sft.steps=0", "eval.every=0", "eval.at_start=false",
          "eval.num_problems=2", "eval.n_samples=1", "eval.k_list=[1]", "run.checkpoint_every=0",
          "rollout.backend=vllm_server", "rollout.server.lora_sync=merge"]  # fmt: skip
KEYS = ("step", "time", "time/rollout_s", "time/train_s", "time/weight_sync_s", "async/trainer_wait_fraction",
        "async/generator_wait_fraction", "async/staleness_mean")  # fmt: skip
ARMS = {
    "sync_1proc": ([sys.executable, "-m", "veriloop.cli"], ["train.max_staleness=0"]),
    "async_2ranks": (
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "-m", "veriloop.cli"],
        ["train.max_staleness=1", "algo.rollout_is=truncate"],
    ),
}


def arm(out: Path, name: str, url: str) -> dict[str, Any]:
    """One arm's run and its numbers."""
    launch, extra = ARMS[name]
    load0, t0 = os.getloadavg()[0], time.time()
    cmd = [
        *launch,
        "train",
        "quickstart",
        *COMMON,
        *extra,
        f"rollout.server.urls=[{url}]",
        f"run.out_dir={out}",
        f"run.name={name}",
    ]
    done = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True)
    if done.returncode != 0:
        raise SystemExit(done.stderr.decode()[-3000:])
    rows = [json.loads(x) for x in (out / name / "metrics.jsonl").read_text().splitlines()]
    steps = [{k: r[k] for k in KEYS if k in r} for r in rows if "grad_norm" in r]
    gaps = [b["time"] - a["time"] for a, b in zip(steps, steps[1:])]
    return {
        "wall_s": time.time() - t0,
        "load_1min_start": load0,
        "load_1min_end": os.getloadavg()[0],
        "s_per_step_after_first": sum(gaps) / len(gaps),
        "per_step": steps,
    }


def main() -> None:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    with running_server(log=out / "server.log") as server:
        results = {name: arm(out, name, server.url) for name in ARMS}
    (out / "measure.json").write_text(json.dumps(results, indent=1))
    print(json.dumps({k: round(v["s_per_step_after_first"], 1) for k, v in results.items()}))


if __name__ == "__main__":
    main()
