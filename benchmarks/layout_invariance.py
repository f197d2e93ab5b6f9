"""Does the layout change the result? The same run on one process, 2 data-parallel ranks and 2 FSDP
ranks (full fine-tuning and LoRA), compared step by step and by its final weights.

Each run is ``veriloop``'s ``train()`` on the tests' tiny Llama (CPU, fp32, gloo), started as
``torchrun --nproc_per_node 2`` starts its ranks. Rollouts are greedy, so which rank plays a problem
does not decide its tokens (at a temperature > 0 each rank draws from its own sampling stream, so
another layout samples other tokens: see docs/scaling.md); the reward is a deterministic coin on the
lengths of the response and the problem, so problems get different rewards and ``batch_norm`` advantages teach something.
``train.max_staleness=0`` is the synchronous loop itself (the same code), so it is one more layout
row only in name; it is run anyway, as a user would write it.

  python benchmarks/layout_invariance.py     # writes benchmarks/results/layout_invariance.json

``tests/algos/run/test_layout_invariance.py`` runs the same layouts and asserts the bound.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

#: A coin as the math check, greedy rollouts, then veriloop's own train().
WORKER = r"""
import sys
from veriloop.agents.sampling_params import SamplingParams
from veriloop.envs.math_env import MathVerifyEnv
from veriloop.envs.verifiers import Verdict
import veriloop.algos.loop.train as T
from veriloop.configs.loader import load_config

MathVerifyEnv.check = lambda self, r, task: Verdict(correct=(len(r) + len(str(task))) % 2 == 0, reason="coin")
SamplingParams.from_rollout = classmethod(lambda cls, r, *, seed: cls.greedy(r.max_new_tokens))
T.train(load_config(None, sys.argv[2:]), resume=sys.argv[1] == "resume", quiet=True)
"""
STEPS = 4
CONFIG = [
    "policy.model=tiny",
    "env.id=veriloop/MathVerify-v0",
    "env.kwargs={level: 1}",
    "run.algo_preset=rloo",
    "algo.advantage=batch_norm",
    "rollout.prompts_per_step=4",
    "rollout.group_size=2",
    "rollout.max_new_tokens=8",
    "rollout.max_context=256",
    "train.micro_batch_size=1",
    "train.mini_batch_size=4",
    "train.lr=1e-3",
    f"train.steps={STEPS}",
    "run.checkpoint_every=0",
    "eval.every=0",
    "eval.at_start=false",
    "eval.num_problems=1",
    "eval.n_samples=1",
    "eval.k_list=[1]",
    "run.tensorboard=false",
]
#: name -> (processes, config overrides); each row is compared with the one-process run of its kind.
LAYOUTS: dict[str, tuple[int, list[str]]] = {
    "full/1-process": (1, ["policy.lora=false"]),
    "full/1-process-async-K0": (1, ["policy.lora=false", "train.max_staleness=0"]),
    "full/2-data-parallel": (2, ["policy.lora=false", "train.parallel=data"]),
    "full/2-fsdp": (2, ["policy.lora=false", "train.parallel=fsdp"]),
    "lora/1-process": (1, ["policy.lora=true"]),
    "lora/2-data-parallel": (2, ["policy.lora=true", "train.parallel=data"]),
    "lora/2-fsdp": (2, ["policy.lora=true", "train.parallel=fsdp"]),
}
#: Numbers that are a difference of near-equal terms (the policy loss of advantages that sum to ~0,
#: the approximate KL of ratios near 1): their relative difference measures the cancellation, not
#: the layout, so they are bounded absolutely (fp32 rounding of terms of size ~1).
CANCELLING = ("loss/policy", "approx_kl")
#: The per-step numbers compared (metrics.jsonl keys).
COMPARED = ("loss/policy", "grad_norm", "reward/mean", "entropy", "approx_kl", "clip_frac_low", "mean_token_prob",
            "mismatch/tokens")  # fmt: skip


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch(
    out: Path, name: str, ranks: int, extra: list[str], env: dict[str, str] | None = None
) -> list[Any]:
    """Start one run's processes: one plain process, or ``ranks`` ranks as torchrun starts them."""
    args = [sys.executable, "-c", WORKER, "fresh", *CONFIG, *extra, f"run.out_dir={out}", f"run.name={name}"]
    base = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    if ranks == 1:
        return [subprocess.Popen(args, env=base, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)]
    common = {"WORLD_SIZE": str(ranks), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    return [
        subprocess.Popen(
            args,
            env={**base, **common, "RANK": str(r), "LOCAL_RANK": str(r)},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        for r in range(ranks)
    ]


def wait(procs: list[Any], timeout: float = 300) -> None:
    """Wait for every process; on a failure the others are killed (they would wait for it)."""
    try:
        for p in procs:
            _, err = p.communicate(timeout=timeout)
            if p.returncode != 0:
                raise RuntimeError(err.decode()[-3000:])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def run_name(layout: str) -> str:
    return layout.replace("/", "_")


def read_run(run: Path) -> dict[str, Any]:
    """Per-step metrics (the ``COMPARED`` keys) and the final trained weights of one run folder."""
    from safetensors.torch import load_file

    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line]
    steps = {r["step"]: {k: r[k] for k in COMPARED if k in r} for r in rows if "grad_norm" in r}
    final = run / "final"
    if (final / "adapter_model.safetensors").exists():
        weights = load_file(final / "adapter_model.safetensors")
    else:
        from veriloop.agents.loading import load_policy

        weights = {n: p.detach() for n, p in load_policy(str(final)).model.named_parameters()}
    return {"steps": steps, "weights": weights}


def relative(a: float, b: float) -> float:
    return abs(a - b) / max(abs(a), abs(b), 1e-12)


def compare(ref: dict[str, Any], other: dict[str, Any]) -> dict[str, Any]:
    """The largest relative and absolute difference of each per-step number, and of the final
    weights (relative per tensor: max |a - b| / max |a|, then the largest over tensors)."""
    if sorted(ref["steps"]) != sorted(other["steps"]):
        raise AssertionError(f"steps differ: {sorted(ref['steps'])} vs {sorted(other['steps'])}")
    out: dict[str, Any] = {}
    for key in COMPARED:
        pairs = [(ref["steps"][s].get(key), other["steps"][s].get(key)) for s in sorted(ref["steps"])]
        pairs = [(a, b) for a, b in pairs if a is not None and b is not None]
        out[key] = max(relative(a, b) for a, b in pairs)
        out[f"{key} abs"] = max(abs(a - b) for a, b in pairs)
    wa, wb = ref["weights"], other["weights"]
    if wa.keys() != wb.keys():
        raise AssertionError(f"the final weights name other tensors: {sorted(wa.keys() ^ wb.keys())[:4]}")
    out["weights"] = max(float((wa[k] - wb[k]).abs().max() / wa[k].abs().max().clamp_min(1e-12)) for k in wa)
    out["weights abs"] = max(float((wa[k] - wb[k]).abs().max()) for k in wa)
    return out


def run_all(out: Path, layouts: dict[str, tuple[int, list[str]]] = LAYOUTS) -> dict[str, Any]:
    """Run every layout one after another; compare each with its kind's one-process run."""
    seconds: dict[str, float] = {}
    for name, (ranks, extra) in layouts.items():
        t0 = time.perf_counter()
        wait(launch(out, run_name(name), ranks, extra))
        seconds[name] = round(time.perf_counter() - t0, 1)
    runs = {name: read_run(out / run_name(name)) for name in layouts}
    table = {}
    for name in layouts:
        ref = f"{name.split('/')[0]}/1-process"
        if name != ref:
            table[name] = {"against": ref, **compare(runs[ref], runs[name])}
    return {"table": table, "seconds": seconds, "steps": {n: r["steps"] for n, r in runs.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--out", default=str(Path(__file__).resolve().parent / "results" / "layout_invariance.json")
    )
    args = ap.parse_args()
    import platform

    import torch

    with tempfile.TemporaryDirectory() as tmp:
        res = run_all(Path(tmp))
    res["setup"] = {
        "model": "tiny Llama of the tests (2 layers, hidden 64, fp32)",
        "steps": STEPS,
        "config": CONFIG,
        "rollouts": "greedy",
        "torch": torch.__version__,
        "machine": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "load_avg": os.getloadavg(),
    }
    Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
    print(table(res["table"]))


def table(rows: dict[str, Any]) -> str:
    """The invariance table (markdown): per layout, the largest relative difference of each number,
    and the absolute one of the two cancellations (``CANCELLING``) and of the weights."""
    cols = [*COMPARED, "weights", *(f"{k} abs" for k in CANCELLING), "weights abs"]
    lines = ["| layout | against | " + " | ".join(cols) + " |", "|---|---|" + "---|" * len(cols)]
    for name, row in rows.items():
        lines.append(f"| {name} | {row['against']} | " + " | ".join(f"{row[k]:.1e}" for k in cols) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
