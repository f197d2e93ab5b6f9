"""What Gemma 3 270M's 262,144-token vocabulary costs the trainer's log-prob pass.

Not a test. The same Gemma 3 body (random weights, the config of the converted ``gemma3-270m``
checkpoint in veriloop's cache) is given each vocabulary of ``--vocabs`` in turn (its own 262,144,
SmolLM2's 49,152, and 1,024, where the head is nearly free) and timed on one quickstart-shaped
micro-batch: 8 rows of an 80-token shared prompt and 128 sampled tokens (1,024 scored rows), LoRA
r=16, bf16 mixed precision, ``token_logprobs`` forward and backward as the trainer runs them.
Process CPU seconds (all threads) are reported beside wall seconds: on a shared machine they are
the steadier measure. The logits' size is computed (rows x vocabulary x 2 bytes in bf16).

    python benchmarks/bench_gemma_vocab.py            # needs the model converted once (make setup,
                                                      # then any run with policy.model=gemma3-270m)

Writes benchmarks/results/gemma_vocab.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path
from typing import Any

OUT = Path(__file__).parent / "results" / "gemma_vocab.json"
ROWS, PROMPT, NEW = 8, 80, 128


def time_vocab(folder: Path, vocab: int, reps: int) -> dict[str, Any]:
    """CPU and wall seconds of the log-prob pass with the Gemma body and a ``vocab``-token head."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from veriloop.agents.forward import token_logprobs
    from veriloop.agents.loading import LoraSettings, build_policy
    from veriloop.agents.precision import apply_precision

    config = AutoConfig.from_pretrained(folder)
    config.vocab_size = vocab
    torch.manual_seed(0)
    body = AutoModelForCausalLM.from_config(config)
    net = apply_precision(build_policy(body, None, lora=LoraSettings(r=16, alpha=32)), "bf16").model
    prompt = torch.randint(10, 1000, (1, PROMPT)).expand(ROWS, -1)
    ids = torch.cat([prompt, torch.randint(10, 1000, (ROWS, NEW))], 1)
    runs = []
    for _ in range(reps):
        wall, cpu = time.perf_counter(), time.process_time()
        lp, _ = token_logprobs(net, ids, torch.ones_like(ids), first_position=PROMPT, shared_prefix=PROMPT)
        cpu_fwd, wall_fwd = time.process_time() - cpu, time.perf_counter() - wall
        lp[:, PROMPT:].sum().backward()
        runs.append(
            {
                "cpu_fwd": round(cpu_fwd, 2),
                "cpu_fwd_bwd": round(time.process_time() - cpu, 2),
                "wall_fwd": round(wall_fwd, 2),
                "wall_fwd_bwd": round(time.perf_counter() - wall, 2),
            }
        )
        net.zero_grad(set_to_none=True)
    logits_mib = ROWS * NEW * vocab * 2 / 2**20
    return {"vocab": vocab, "runs": runs, "logits_bf16_mib": logits_mib, "load_after": os.getloadavg()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vocabs", nargs="+", type=int, default=[262144, 49152, 1024])
    ap.add_argument("--reps", type=int, default=1, help="repetitions per vocabulary")
    args = ap.parse_args()
    from veriloop.agents.models.gemma import gemma_model_path

    folder = gemma_model_path()  # converts it on first use (the PyPI packages must be installed)
    load_before = os.getloadavg()
    rows = []
    for vocab in args.vocabs:
        rows.append(time_vocab(folder, vocab, args.reps))
        print(json.dumps(rows[-1]), flush=True)
    report = {
        "machine": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "load_before": load_before,
        "shape": {"rows": ROWS, "prompt": PROMPT, "new": NEW},
        "results": rows,
    }
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
