"""Asynchronous training (``train.max_staleness``): what K buys, simulated and (optionally) measured.

Two parts, both written to ``benchmarks/results/async.json`` (the file is read back first and an
arm already there is skipped, so a killed run continues where it stopped; ``--fresh`` starts over):

* ``simulated`` (always, ~1 s): the bounded-staleness scheduler itself
  (``benchmarks/staleness_sim.py``) with a simulated trainer and generator on *separate devices*
  (the GPU setting: generation does not slow the update down): fixed ``--train-s`` per update and
  ``--sync-s`` per weight sync, long-tail generation times (lognormal, median ``--gen-s`` per
  group, ``--sigma``), ``--groups`` groups per step, K = 0, 1, 2, 4, ``--seeds`` seeds. Reports the
  wall time per step, the speed-up over K = 0, both idle shares and the staleness histogram.
* ``real`` (only with ``--real``; long): ``veriloop train quickstart`` with K in ``--ks`` on
  ``--backends`` (``vllm``: the in-process engine; ``hf``: the HF engine's worker thread), each
  in its own process, ``--seeds`` seeds: wall time per step, the idle shares (``async/*``), the
  held-out accuracy after the same number of samples. K > 0 runs with ``algo.rollout_is=truncate``
  (decoupled PPO; K = 0 runs the same for a fair comparison). Run it in the vLLM venv for vllm.

    python benchmarks/bench_async.py                       # simulated part only
    .venv-vllm/bin/python benchmarks/bench_async.py --real --backends vllm hf --ks 0 1 2 --seeds 0
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from staleness_sim import long_tail_lengths, simulate

from veriloop.cli.serve import running_server

OUT = Path(__file__).parent / "results" / "async.json"
SIM_KS = (0, 1, 2, 4)


def simulated(args: argparse.Namespace) -> dict[str, Any]:
    """Every K on the same generation times (per seed); means over seeds."""
    arms: dict[str, Any] = {}
    for k in SIM_KS:
        runs = [
            simulate(
                k,
                steps=args.steps,
                groups_per_step=args.groups,
                train_s=args.train_s,
                sync_s=args.sync_s,
                length=long_tail_lengths(seed, base_s=args.gen_s, sigma=args.sigma),
            ).summary(args.steps, k)
            for seed in range(args.seeds)
        ]
        arms[str(k)] = {
            "wall_s_per_step": statistics.mean(r["wall_s_per_step"] for r in runs),  # type: ignore[misc]
            "trainer_wait_fraction": statistics.mean(r["trainer_wait_fraction"] for r in runs),  # type: ignore[misc]
            "generator_wait_fraction": statistics.mean(r["generator_wait_fraction"] for r in runs),  # type: ignore[misc]
            "staleness_mean": statistics.mean(r["staleness_mean"] for r in runs),  # type: ignore[misc]
            "staleness_hist": [sum(h) for h in zip(*(r["staleness_hist"] for r in runs))],  # type: ignore[call-overload]
            "in_flight_max": max(r["in_flight_max"] for r in runs),  # type: ignore[type-var]
        }
    base = arms["0"]["wall_s_per_step"]
    for arm in arms.values():
        arm["speedup_vs_k0"] = base / arm["wall_s_per_step"]
    settings = {
        k: getattr(args, k) for k in ("steps", "groups", "train_s", "sync_s", "gen_s", "sigma", "seeds")
    }
    return {"settings": settings, "arms": arms}


def real_arm(backend: str, k: int, seed: int, out_dir: Path, extra: list[str]) -> dict[str, Any]:
    """One ``veriloop train quickstart`` run in its own process (``--resume``: a killed arm continues);
    its per-step numbers and final evaluation. ``vllm_server``: one ``veriloop serve-vllm`` process
    beside the trainer (started for the arm, stopped after it; LoRA merged into the pushed weights)."""
    name = f"async-{backend}-k{k}-s{seed}"
    over = [
        "policy.precision=fp32",
        f"train.max_staleness={k}",
        "algo.rollout_is=truncate",
        f"rollout.backend={backend}",
        f"rollout.seed={seed * 10_000}",
        *extra,
        f"run.out_dir={out_dir}",
        f"run.name={name}",
    ]
    t0 = time.perf_counter()
    cmd = [sys.executable, "-m", "veriloop.cli", "train", "quickstart", *over]
    if (out_dir / name).is_dir():  # a killed arm continues (--resume of nothing is refused)
        cmd.append("--resume")
    with contextlib.ExitStack() as stack:
        if backend == "vllm_server":
            url = stack.enter_context(running_server(log=out_dir / f"{name}.server.log", ready_s=900)).url
            cmd += [f"rollout.server.urls=[{url}]", "rollout.server.lora_sync=merge"]
        proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        return {"error": (proc.stderr or proc.stdout)[-2000:]}
    rows = [json.loads(line) for line in (out_dir / name / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "time/train_s" in r]
    evals = [r for r in rows if "eval/id/avg@n" in r]
    # wall time of a step: between two consecutive step rows, neither of which evaluated
    walls = [
        b["time"] - a["time"]
        for a, b in zip(steps, steps[1:])
        if b["step"] == a["step"] + 1 and "eval/id/avg@n" not in a and "eval/id/avg@n" not in b
    ]

    def mean(key: str) -> float | None:
        vals = [r[key] for r in steps if r.get(key) is not None]
        return statistics.mean(vals) if vals else None

    return {
        "wall_s": time.perf_counter() - t0,
        "steps": len(steps),
        "step_wall_s_median": statistics.median(walls) if walls else None,
        "trainer_wait_fraction": mean("async/trainer_wait_fraction"),
        "generator_wait_fraction": mean("async/generator_wait_fraction"),
        "staleness_mean": mean("async/staleness_mean"),
        "rollout_s_mean": mean("time/rollout_s"),
        "train_s_mean": mean("time/train_s"),
        "final_eval_avg@n": evals[-1]["eval/id/avg@n"] if evals else None,
        "final_eval_step": evals[-1]["step"] if evals else None,
        "load_at_end": os.getloadavg(),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--groups", type=int, default=8, help="groups (problems) per step")
    p.add_argument(
        "--train-s", type=float, default=1.0, help="seconds per update (forward + backward + step)"
    )
    p.add_argument("--sync-s", type=float, default=0.05, help="seconds per weight sync (generation paused)")
    p.add_argument("--gen-s", type=float, default=1.0, help="median generation seconds of one group")
    p.add_argument("--sigma", type=float, default=1.0, help="lognormal sigma of generation times (the tail)")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--real", action="store_true", help="also run the real (long) measurement")
    p.add_argument("--backends", nargs="+", default=["vllm"], choices=["vllm", "hf", "vllm_server"])
    p.add_argument("--ks", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--real-seeds", nargs="+", type=int, default=[0])
    p.add_argument("--runs-dir", type=Path, default=Path("runs/bench_async"))
    p.add_argument("--override", nargs="*", default=[], help="more config overrides for every real run")
    p.add_argument("--fresh", action="store_true", help="ignore results already in the JSON")
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args()
    result: dict[str, Any] = {} if args.fresh or not args.out.is_file() else json.loads(args.out.read_text())
    result["machine"] = {"platform": platform.platform(), "cpus": os.cpu_count(), "load": os.getloadavg()}
    result["simulated"] = simulated(args)
    for k, arm in result["simulated"]["arms"].items():
        print(
            f"simulated K={k}: {arm['wall_s_per_step']:.3f} s/step (x{arm['speedup_vs_k0']:.2f}), trainer idle "
            f"{arm['trainer_wait_fraction']:.2f}, generator idle {arm['generator_wait_fraction']:.2f}, "
            f"staleness {arm['staleness_hist']}"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    if not args.real:
        return
    real = result.setdefault("real", {})
    for seed in args.real_seeds:
        for backend in args.backends:
            for k in args.ks:
                key = f"{backend}/k{k}/seed{seed}"
                if key in real and "error" not in real[key]:
                    continue  # done in an earlier (killed) invocation
                real[key] = real_arm(backend, k, seed, args.runs_dir, args.override)
                print(key, real[key])
                args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
