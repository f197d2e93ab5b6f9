"""pass@k for k = 1 ... 64 of the base model, the SFT warm-up and the RL policy (Yue et al. 2025, "Does
Reinforcement Learning Really Incentivize Reasoning Capacity in LLMs Beyond the Base Model?").

Each checkpoint is evaluated by ``veriloop eval`` on the same held-out problems with ``--samples``
samples each (default 128 problems x 64); per problem, ``c`` of the ``n`` samples are right and
:func:`~veriloop.algos.eval.metrics.pass_at_k_curve` gives the unbiased pass@k and its SE over
problems. The curves, where they cross, and whether RL's pass@64 is below the base's, go to
``benchmarks/results/pass_at_k_<tag>.json`` and ``.png``.

Rerunning the same command continues: a checkpoint whose evaluation is written is not evaluated
again (``runs/bench_pass_at_k/<tag>/<label>/``), and every evaluation's wall time and load are kept.

Usage (from the repository root):
  OMP_PROC_BIND=true OMP_PLACES=cores nice -n 5 /work/main/.venv-vllm/bin/python benchmarks/bench_pass_at_k.py \\
      --tag quickstart --config quickstart --checkpoints base=base sft=RUN/checkpoints/step-000000 rl=RUN/final \\
      -- rollout.backend=vllm
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from veriloop.algos.eval.metrics import paired_difference, pass_at_k, pass_at_k_curve

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
RUNS = ROOT / "runs" / "bench_pass_at_k"


def ks_up_to(n: int) -> list[int]:
    """1, 2, 4, ... up to n (n itself included)."""
    ks, k = [], 1
    while k < n:
        ks.append(k)
        k *= 2
    return [*ks, n]


def evaluate(tag: str, label: str, config: str, checkpoint: str, args: argparse.Namespace) -> Path:
    """``veriloop eval`` of one checkpoint into ``RUNS/tag/label`` unless already there."""
    out = RUNS / tag / label
    done = list(out.glob("*.json"))
    if done and (out / "cost.json").exists():
        return out
    ks = ks_up_to(args.samples)
    exe = shutil.which("veriloop", path=str(Path(sys.executable).parent)) or "veriloop"
    cmd = [
        exe,
        "eval",
        config,
        "--checkpoints",
        checkpoint,
        "--out",
        str(out),
        f"eval.num_problems={args.problems}",
        f"eval.n_samples={args.samples}",
        f"eval.k_list=[{','.join(map(str, ks))}]",
        "eval.greedy=false",
        *args.overrides,
    ]
    out.mkdir(parents=True, exist_ok=True)
    print(f"[{label}] {' '.join(cmd[1:])}", flush=True)
    load0, t0 = os.getloadavg()[0], time.time()
    with (out / "eval.log").open("a") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(proc.pid, 0)
    rc = os.waitstatus_to_exitcode(status)
    if rc != 0:
        raise SystemExit(f"{label}: veriloop eval failed (exit {rc}); see {out / 'eval.log'}")
    cost = {
        "command": " ".join(cmd[1:]),
        "seconds": time.time() - t0,
        "cpu_seconds": usage.ru_utime + usage.ru_stime,
        "maxrss_gb": usage.ru_maxrss / 1e6,
        "load_1min_start_end": [load0, os.getloadavg()[0]],
    }
    (out / "cost.json").write_text(json.dumps(cost, indent=1))
    return out


def counts(out: Path) -> tuple[int, list[int], dict]:
    """``(n, c per problem, report meta)`` from an evaluation folder's report (the id split)."""
    path = next(p for p in out.glob("*.json") if p.name != "cost.json")
    report = json.loads(path.read_text())
    n = int(report["meta"]["n_samples"])
    per = report["per_problem"]["id"]["avg@n"]
    return n, [round(a * n) for a in per], report["meta"]


def paired_at(k: int, n: int, before: list[int], after: list[int]) -> dict[str, float]:
    """pass@k of ``after`` minus ``before`` on the same problems, paired by problem (their
    difficulty cancels): each problem's unbiased pass@k from its ``c`` of ``n``, then
    :func:`~veriloop.algos.eval.metrics.paired_difference`."""
    return paired_difference([pass_at_k(n, c, k) for c in before], [pass_at_k(n, c, k) for c in after])


def crossings(a: dict[int, tuple[float, float]], b: dict[int, tuple[float, float]]) -> list[dict]:
    """The k intervals where curve ``a - b`` changes sign (ties count as no sign)."""
    ks = sorted(a)
    signs = [(k, math.copysign(1, a[k][0] - b[k][0]) if a[k][0] != b[k][0] else 0.0) for k in ks]
    nonzero = [(k, s) for k, s in signs if s]
    return [
        {"between_k": [k0, k1], "before": "a above" if s0 > 0 else "b above"}
        for (k0, s0), (k1, s1) in zip(nonzero, nonzero[1:])
        if s0 != s1
    ]


def plot(curves: dict[str, dict[int, tuple[float, float]]], title: str, path: Path) -> None:
    from veriloop.algos.run.plots import _pyplot

    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4.2))
    for label, curve in curves.items():
        ks = sorted(curve)
        ys = [curve[k][0] for k in ks]
        se = [0.0 if math.isnan(curve[k][1]) else curve[k][1] for k in ks]
        (line,) = ax.plot(ks, ys, marker="o", label=label)
        ax.fill_between(
            ks,
            [y - s for y, s in zip(ys, se)],
            [y + s for y, s in zip(ys, se)],
            color=line.get_color(),
            alpha=0.2,
        )
    ax.set_xscale("log", base=2)
    ax.set_xlabel("k (samples per problem)")
    ax.set_ylabel("pass@k (band: ±1 SE over problems)")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title(title, fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tag", required=True)
    ap.add_argument(
        "--config", default="quickstart", help="the experiment config the checkpoints were trained with"
    )
    ap.add_argument("--checkpoints", nargs="+", required=True, help="LABEL=PATH (or LABEL=base), in order")
    ap.add_argument("--problems", type=int, default=128)
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("overrides", nargs="*", help="eval overrides (after --)")
    args = ap.parse_args()
    pairs = [c.split("=", 1) for c in args.checkpoints]
    if any(len(p) != 2 for p in pairs):
        raise SystemExit("--checkpoints takes LABEL=PATH pairs, e.g. base=base rl=runs/x/final")
    curves, cost, meta, correct = {}, {}, {}, {}
    for label, checkpoint in pairs:
        out = evaluate(args.tag, label, args.config, checkpoint, args)
        n, correct[label], meta[label] = counts(out)
        first = meta[pairs[0][0]]
        if (meta[label].get("first_seed"), n) != (first.get("first_seed"), int(first["n_samples"])):
            raise SystemExit(
                f"{label} was evaluated on other problems or samples than {pairs[0][0]}; remove {out}"
            )
        curves[label] = pass_at_k_curve(n, correct[label], ks_up_to(n))
        cost[label] = json.loads((out / "cost.json").read_text())
        write(args, pairs, curves, cost, meta, correct)


def write(
    args: argparse.Namespace, pairs: list[list[str]], curves: dict, cost: dict, meta: dict, correct: dict
) -> None:
    labels = list(curves)
    cross = {
        f"{a} vs {b}": crossings(curves[a], curves[b]) for i, a in enumerate(labels) for b in labels[i + 1 :]
    }
    kmax = max(curves[labels[0]])
    # later checkpoint minus earlier one, paired by problem, at every k
    paired = {
        f"{b} - {a}": {f"pass@{k}": paired_at(k, kmax, correct[a], correct[b]) for k in ks_up_to(kmax)}
        for i, a in enumerate(labels)
        for b in labels[i + 1 :]
    }
    at_max = {label: {"mean": curves[label][kmax][0], "se": curves[label][kmax][1]} for label in labels}
    out = {
        "command": " ".join(["python benchmarks/bench_pass_at_k.py", *sys.argv[1:]]),
        "checkpoints": dict(pairs),
        "problems": args.problems,
        "samples": args.samples,
        "meta": {
            k: {f: v.get(f) for f in ("first_seed", "temperature", "max_new_tokens", "num_problems")}
            for k, v in meta.items()
        },
        "curves": {
            label: {str(k): {"mean": m, "se": s} for k, (m, s) in sorted(c.items())}
            for label, c in curves.items()
        },
        "crossings": cross,
        f"pass@{kmax}": at_max,
        "paired": paired,
        "cost": cost,
    }
    path = RESULTS / f"pass_at_k_{args.tag}.json"
    path.write_text(json.dumps(out, indent=1, allow_nan=True) + "\n")
    title = f"pass@k on {args.problems} held-out problems x {args.samples} samples ({args.tag})"
    plot(curves, title, path.with_suffix(".png"))
    print(json.dumps({"crossings": cross, f"pass@{kmax}": at_max, "paired": paired}, indent=1), flush=True)


if __name__ == "__main__":
    main()
