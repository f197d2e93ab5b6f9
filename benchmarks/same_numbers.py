"""Do two runs give the same numbers? Compares every metric two run folders logged, step by step.

Timings (``time/*``, ``*_s``, ``*per_s``) are left out; metrics only one run logs are listed, not
compared. Used to check that a refactor keeps a seed's numbers to the last digit:

  python benchmarks/same_numbers.py RUN_A RUN_B --out benchmarks/results/quickstart_same_numbers.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def _timing(key: str) -> bool:
    return key == "time" or key.startswith("time/") or key.endswith("_s") or "per_s" in key


def compare(a: Path, b: Path) -> dict:
    """Per step: how many metrics both runs logged, which of them differ (with both values)."""
    rows_a = [json.loads(line) for line in (a / "metrics.jsonl").read_text().splitlines() if line]
    rows_b = [json.loads(line) for line in (b / "metrics.jsonl").read_text().splitlines() if line]
    steps = []
    for ra, rb in zip(rows_a, rows_b, strict=False):
        common = sorted(k for k in ra.keys() & rb.keys() if not _timing(k))
        steps.append({
            "step": ra.get("step"),
            "compared": len(common),
            "differ": {k: [ra[k], rb[k]] for k in common if ra[k] != rb[k]},
            "only_a": sorted(k for k in ra.keys() - rb.keys() if not _timing(k)),
            "only_b": sorted(k for k in rb.keys() - ra.keys() if not _timing(k)),
            "sample": {k: ra[k] for k in ("reward/mean", "entropy", "grad_norm", "response_length/mean") if k in ra},
        })  # fmt: skip
    same = len(rows_a) == len(rows_b) and all(not s["differ"] for s in steps)
    return {"run_a": str(a), "run_b": str(b), "steps_a": len(rows_a), "steps_b": len(rows_b),
            "identical": same, "steps": steps}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_a", type=Path)
    ap.add_argument("run_b", type=Path)
    ap.add_argument("--out", type=Path, help="also write the comparison here (JSON)")
    ap.add_argument("--note", default="", help="what the two runs are (kept in the JSON)")
    args = ap.parse_args()
    result = {"note": args.note, **compare(args.run_a, args.run_b)}
    text = json.dumps(result, indent=1)
    if args.out:
        args.out.write_text(text + "\n")
    print(text)
    raise SystemExit(0 if result["identical"] else 1)


if __name__ == "__main__":
    main()
