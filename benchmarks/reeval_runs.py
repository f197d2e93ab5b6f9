"""Re-judge finished runs with today's verifier: their SFT start and their end, on their own held-out set.

A run's logged evaluations used the verifier of the day it ran. When the verifier changes (the
``unevaluated`` screen: ``\\boxed{14 - 26}`` no longer counts for -12), this evaluates each run's SFT
warm-up (``RUN/sft/final``) and its last policy (``RUN/final``) again with ``veriloop eval RUN/config.yaml``
(same problems, same sampling settings), and reports the gain paired by problem next to the gain the
run logged, with the share of answers per verdict reason (``reason/unevaluated``: copied questions).

  OMP_PROC_BIND=true OMP_PLACES=cores .venv-vllm/bin/python benchmarks/reeval_runs.py \\
      runs/bench_learning/math_gain/grpo_p16-s0 ... --name math_gain [--num-problems 512]

Writes ``benchmarks/results/reeval_<name>.json``; a run already re-judged (its reports exist under
``RUN/reeval``) is read back, not evaluated again, so a cut call resumes.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from bench_learning import per_problem_reports

from veriloop.algos.eval.metrics import paired_difference

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
#: The verdict reasons reported (shares of all answers), besides accuracy.
REASONS = ("reason/correct", "reason/unevaluated", "reason/wrong_value", "reason/no_answer")


def evaluate(run: Path, checkpoint: str, label: str, overrides: list[str]) -> dict:
    """``veriloop eval`` of one checkpoint of ``run`` with its own config; its report (cached)."""
    out = run / "reeval" / label
    report = out / f"{label}.json"
    if not report.exists():
        args = [
            sys.executable,
            "-m",
            "veriloop.cli",
            "eval",
            str(run / "config.yaml"),
            "--checkpoints",
            str(run / checkpoint),
            "--out",
            str(out),
            *overrides,
        ]
        out.mkdir(parents=True, exist_ok=True)
        with (out / "eval.log").open("a") as log:
            rc = subprocess.call(args, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        if rc != 0:
            raise SystemExit(f"{run}: veriloop eval {checkpoint} failed (exit {rc}); see {out / 'eval.log'}")
        (out / "final.json").rename(report)  # veriloop eval names a report after the folder it read
    return json.loads(report.read_text())


def compare(run: Path, overrides: list[str], split: str = "id") -> dict:
    """One run: start and end re-judged, the paired gain now and as logged."""
    start, end = (
        evaluate(run, c, label, overrides) for c, label in (("sft/final", "start"), ("final", "end"))
    )
    row: dict = {"run": str(run.relative_to(ROOT)) if run.is_relative_to(ROOT) else str(run)}
    for label, report in (("start", start), ("end", end)):
        metrics = report["splits"][split]
        row[label] = {k: metrics.get(k, 0.0) for k in ("avg@n", *REASONS)}
    row["gain now"] = paired_difference(
        start["per_problem"][split]["avg@n"], end["per_problem"][split]["avg@n"]
    )
    old = per_problem_reports(run)  # the run's own evaluations, judged by the verifier of its day
    if old and 0 in old:
        last = max(old)
        before, after = old[0][split]["avg@n"], old[last][split]["avg@n"]
        n = len(start["per_problem"][split]["avg@n"])
        row["gain as logged"] = paired_difference(before[:n], after[:n])  # on the same first n problems
        row["logged step"] = last
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "runs", type=Path, nargs="+", help="run folders (each with config.yaml, sft/final, final)"
    )
    ap.add_argument("--name", required=True, help="results file: benchmarks/results/reeval_NAME.json")
    ap.add_argument("--num-problems", type=int, help="held-out problems (default: the run's own)")
    args = ap.parse_args()
    missing = [str(r) for r in args.runs if not ((r / "sft" / "final").exists() and (r / "final").exists())]
    if missing:
        raise SystemExit(f"not finished runs with an SFT warm-up (RUN/sft/final and RUN/final): {missing}")
    overrides = ["eval.before_sft=false"]
    if args.num_problems:
        overrides.append(f"eval.num_problems={args.num_problems}")
    t0 = time.time()
    rows = []
    for run in args.runs:
        rows.append(compare(run.resolve(), overrides))
        print(json.dumps(rows[-1], indent=1), flush=True)
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"reeval_{args.name}.json"
    path.write_text(
        json.dumps(
            {
                "benchmark": "re-judged runs",
                "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                "command": " ".join(["python", "benchmarks/reeval_runs.py", *sys.argv[1:]]),
                "wall_s": time.time() - t0,
                "rows": rows,
            },
            indent=1,
        )
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
