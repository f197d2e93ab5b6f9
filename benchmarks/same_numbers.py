"""Do two runs give the same numbers? Compares every metric two run folders logged, step by step.

Timings (``time/*``, ``*_s``, ``*per_s``) are left out, and keys starting with an ``--ignore``
prefix; metrics only one run logs are listed, not compared. With ``--weights`` the sha256 of every
``*.safetensors`` / ``*.pt`` file under each run's ``final/`` is compared too. Used to check that a
refactor keeps a seed's numbers to the last digit:

  python benchmarks/same_numbers.py RUN_A RUN_B --out benchmarks/results/quickstart_same_numbers.json

``benchmarks/same_numbers_runs.sh`` makes three such runs (quickstart, asynchronous, DPPO).
"""

from __future__ import annotations

import argparse
import hashlib
import json
from collections.abc import Sequence
from pathlib import Path


def _timing(key: str, ignore: Sequence[str] = ()) -> bool:
    timing = key == "time" or key.startswith("time/") or key.endswith("_s") or "per_s" in key
    return timing or any(key.startswith(p) for p in ignore)


def weight_hashes(run: Path) -> dict[str, str]:
    """sha256 of every weights file under ``run/final`` (``*.safetensors``, ``*.pt``), by relative path."""
    files = sorted(p for p in (run / "final").rglob("*") if p.suffix in (".safetensors", ".pt"))
    return {str(p.relative_to(run)): hashlib.sha256(p.read_bytes()).hexdigest() for p in files}


def compare(a: Path, b: Path, ignore: Sequence[str] = ()) -> dict:
    """Per step: how many metrics both runs logged, which of them differ (with both values)."""
    rows_a = [json.loads(line) for line in (a / "metrics.jsonl").read_text().splitlines() if line]
    rows_b = [json.loads(line) for line in (b / "metrics.jsonl").read_text().splitlines() if line]
    steps = []
    for ra, rb in zip(rows_a, rows_b, strict=False):
        common = sorted(k for k in ra.keys() & rb.keys() if not _timing(k, ignore))
        steps.append(
            {
                "step": ra.get("step"),
                "compared": len(common),
                "differ": {k: [ra[k], rb[k]] for k in common if ra[k] != rb[k]},
                "only_a": sorted(k for k in ra.keys() - rb.keys() if not _timing(k, ignore)),
                "only_b": sorted(k for k in rb.keys() - ra.keys() if not _timing(k, ignore)),
                "sample": {
                    k: ra[k]
                    for k in ("reward/mean", "entropy", "grad_norm", "response_length/mean")
                    if k in ra
                },
            }
        )
    same = len(rows_a) == len(rows_b) and all(not s["differ"] for s in steps)
    return {
        "run_a": str(a),
        "run_b": str(b),
        "steps_a": len(rows_a),
        "steps_b": len(rows_b),
        "identical": same,
        "steps": steps,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_a", type=Path)
    ap.add_argument("run_b", type=Path)
    ap.add_argument("--out", type=Path, help="also write the comparison here (JSON)")
    ap.add_argument("--note", default="", help="what the two runs are (kept in the JSON)")
    ap.add_argument(
        "--ignore", action="append", default=[], help="leave out keys with this prefix (repeatable)"
    )
    ap.add_argument("--weights", action="store_true", help="also compare the sha256 of final/'s weight files")
    args = ap.parse_args()
    result = {"note": args.note, "ignored": args.ignore, **compare(args.run_a, args.run_b, args.ignore)}
    if args.weights:
        ha, hb = weight_hashes(args.run_a), weight_hashes(args.run_b)
        result["final_sha256"] = {"run_a": ha, "run_b": hb, "same": ha == hb}
        result["identical"] = result["identical"] and ha == hb
    text = json.dumps(result, indent=1)
    if args.out:
        args.out.write_text(text + "\n")
    print(text)
    raise SystemExit(0 if result["identical"] else 1)


if __name__ == "__main__":
    main()
