"""Which Points24 variant is in a 135M model's reach? Deal statistics, solver demonstrations, base model.

For each variant (Points24 env options ``num_cards``, ``target``, ``ranks``; the 4-card / 24 default
as the reference) this measures, on ``--deals`` seeded deals of the training split (J/Q/K = 10) and
of the rule-OOD split (J/Q/K = 11/12/13):

* ``solvable_share``: the share of random deals (``solvable_only=False``) that have a solution;
* ``distinct_hands``: how many different value multisets the solvable deals hold (few = a policy
  can memorise them; the 4-card game has hundreds) and ``top10_share``, the share of deals the ten
  most frequent of them cover;
* the solver's demonstrations (what ``sft.source: solver`` trains on): mean formula characters and
  operators, the share with parentheses and with a division, mean tokens of the whole JSON answer
  (the default model's tokenizer);
* shortcut baselines: the share of solvable deals that the sum or the product of all cards solves
  (a policy that learnt one of them scores this much without searching);
* ``face_share``: the share of solvable hands that hold a J, Q or K, whose value the rule sets; on
  the rule-OOD split these are the hands where the rule matters (0: the split is the same game).

With ``--eval`` it also runs ``veriloop eval`` on the base model (``policy.model=default``), 16
problems by default, one sample each, and reports its success (avg@n) and verdict reasons per
split. The numbers go to ``benchmarks/results/points24_variants.json``.

    python benchmarks/report_points24_variants.py --deals 2000
    python benchmarks/report_points24_variants.py --eval --eval-problems 16 --variants 3c-t12
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import gymnasium

import veriloop.envs  # noqa: F401  (registers the environments)

RESULTS = Path(__file__).resolve().parent / "results"
ENV_ID = "veriloop/Points24-text-v0"
#: name -> Points24 options. "4c-t24" is the original game.
VARIANTS: dict[str, dict[str, Any]] = {
    "4c-t24": {},
    "3c-t24": {"num_cards": 3, "target": 24},
    "3c-t12": {"num_cards": 3, "target": 12},
    "3c-t10": {"num_cards": 3, "target": 10},
    "2c-t10-le6": {"num_cards": 2, "target": 10, "ranks": ["A", 2, 3, 4, 5, 6]},
    "2c-t12": {"num_cards": 2, "target": 12},
}
SPLITS = {"id": "10", "rule_ood": "11-12-13"}


def deal_stats(options: dict[str, Any], face_cards: str, deals: int) -> dict[str, float]:
    """Statistics of ``deals`` seeded deals (seeds 0..deals-1) of one variant and face-card rule."""
    env = gymnasium.make(ENV_ID, face_cards=face_cards, solvable_only=False, **options)
    solvable: list[dict[str, Any]] = []
    for seed in range(deals):
        task = env.reset(seed=seed)[1]["task"]
        if task["solution"] is not None:
            solvable.append(task)
    hands = Counter(tuple(sorted(t["values"])) for t in solvable)
    n = max(len(solvable), 1)
    out = {
        "deals": deals,
        "solvable_share": len(solvable) / deals,
        "distinct_hands": len(hands),
        "top10_share": sum(c for _, c in hands.most_common(10)) / n,
        "face_share": sum(any(r > 10 for r in t["ranks"]) for t in solvable) / n,
        "sum_solves": sum(sum(t["values"]) == t["target"] for t in solvable) / n,
        "product_solves": sum(_product(t["values"]) == t["target"] for t in solvable) / n,
    }
    out.update(demo_stats(solvable))
    return out


def _product(values: list[int]) -> int:
    out = 1
    for v in values:
        out *= v
    return out


def demo_stats(tasks: list[dict[str, Any]]) -> dict[str, float]:
    """What the solver's demonstrations look like (the JSON answer ``sft.source: solver`` trains on)."""
    if not tasks:
        return {}
    formulas = [t["solution"] for t in tasks]
    n = len(formulas)
    answers = [json.dumps({"cards": [c[:-1] for c in t["cards"]], "formula": t["solution"]}) for t in tasks]
    out = {
        "demo_formula_chars": sum(map(len, formulas)) / n,
        "demo_operators": sum(sum(f.count(op) for op in "+-*/") for f in formulas) / n,
        "demo_parentheses_share": sum("(" in f for f in formulas) / n,
        "demo_division_share": sum("/" in f for f in formulas) / n,
    }
    tokens = _token_counts(answers)
    if tokens:
        out["demo_answer_tokens"] = sum(tokens) / n
    return out


def _token_counts(texts: list[str]) -> list[int]:
    """Token counts under the default model's tokenizer ([] when it cannot be loaded)."""
    try:
        from transformers import AutoTokenizer

        from veriloop.agents.models.text import default_model_path

        tok = AutoTokenizer.from_pretrained(str(default_model_path()))
    except Exception as exc:  # noqa: BLE001 - optional: the report still has every other number
        print(f"(no token counts: {type(exc).__name__}: {exc})", file=sys.stderr)
        return []
    return [len(tok(t)["input_ids"]) for t in texts]


def _kwarg_overrides(prefix: str, options: dict[str, Any]) -> list[str]:
    return [f"{prefix}.{k}={json.dumps(v)}" for k, v in options.items()]


def base_model_eval(name: str, options: dict[str, Any], problems: int, max_new_tokens: int) -> dict[str, Any]:
    """``veriloop eval`` of the base model on both splits of one variant: one sample per problem,
    one attempt (the 135M base model's first answer), ``max_new_tokens`` per answer."""
    out_dir = Path(tempfile.mkdtemp(prefix=f"p24-{name}-"))
    cmd = [
        "veriloop",
        "eval",
        "points24_grpo",
        "--checkpoints",
        "base",
        "--out",
        str(out_dir),
        "policy.model=default",
        f"eval.num_problems={problems}",
        "eval.n_samples=1",
        "eval.k_list=[1]",
        "eval.greedy=false",
        f"rollout.max_new_tokens={max_new_tokens}",
        "rollout.max_turns=1",
        "env.kwargs.max_attempts=1",
        "env.eval_splits.rule_ood.kwargs.max_attempts=1",
        *_kwarg_overrides("env.kwargs", options),
        *_kwarg_overrides("env.eval_splits.rule_ood.kwargs", options),
    ]
    t0 = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "2"})
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    report = json.loads(next(out_dir.rglob("*.json")).read_text())
    keep = (
        "avg@n",
        "reason/correct",
        "reason/illegal_numbers",
        "reason/wrong_value",
        "reason/unparseable",
        "reason/wrong_cards",
        "reason/no_answer",
        "response_length/mean",
    )
    splits = {s: {k: m[k] for k in keep if m.get(k) is not None} for s, m in report["splits"].items()}
    return {"command": " ".join(cmd), "wall_s": time.perf_counter() - t0, "splits": splits}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--variants",
        nargs="+",
        default=list(VARIANTS),
        choices=list(VARIANTS),
        help="variants to measure (default: all)",
    )
    parser.add_argument("--deals", type=int, default=2000, help="seeded deals per variant and split")
    parser.add_argument("--eval", action="store_true", help="also run `veriloop eval` on the base model")
    parser.add_argument("--eval-problems", type=int, default=16, help="problems per split for --eval")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="tokens per answer for --eval")
    parser.add_argument("--out", type=Path, default=RESULTS / "points24_variants.json", help="JSON to write")
    args = parser.parse_args()
    old = json.loads(args.out.read_text()) if args.out.is_file() else {}
    table: dict[str, Any] = dict(old.get("variants", {}))
    for name in args.variants:
        options = VARIANTS[name]
        row: dict[str, Any] = dict(table.get(name, {}))
        row["options"] = options
        row.update({split: deal_stats(options, rule, args.deals) for split, rule in SPLITS.items()})
        if args.eval:
            row["base_model"] = base_model_eval(name, options, args.eval_problems, args.max_new_tokens)
        table[name] = row
        _print_row(name, row)
    record = {
        "benchmark": "points24 variants: deal statistics, solver demonstrations, base model",
        "command": " ".join(["python", "benchmarks/report_points24_variants.py", *sys.argv[1:]]),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "variants": table,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {args.out}")


def _print_row(name: str, row: dict[str, Any]) -> None:
    keys = (
        "solvable_share",
        "distinct_hands",
        "top10_share",
        "face_share",
        "sum_solves",
        "product_solves",
        "demo_formula_chars",
        "demo_parentheses_share",
        "demo_answer_tokens",
    )
    for split in SPLITS:
        cells = {k: round(row[split][k], 3) for k in keys if k in row[split]}
        print(f"{name:12s} {split:8s} {cells}")
    for split, m in row.get("base_model", {}).get("splits", {}).items():
        print(f"{name:12s} {split:8s} base model { ({k: round(v, 3) for k, v in m.items()}) }")


if __name__ == "__main__":
    main()
