"""``veriloop compare RUN [RUN ...]``: runs (or arms x seeds) side by side, paired by problem.

Writes ``compare.md`` (the tables of :mod:`veriloop.algos.eval.compare`) and ``compare.png`` (the
held-out curves with ± 1 SE bands) to ``--out`` (default: ``compare/`` beside the first run) and
prints the tables.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def add_compare_command(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``veriloop compare RUN [RUN ...] [--group-by KEY] [--metric M] [--out DIR]``."""
    p = sub.add_parser("compare", help="compare runs (or arms x seeds) on their held-out evaluations")
    p.add_argument("runs", nargs="+", metavar="RUN", help="run folders; the first run's arm is the reference")
    p.add_argument(
        "--group-by",
        default=None,
        metavar="KEY",
        help="config key whose value names the arm (e.g. algo.name); an arm's runs are its "
        "seeds (rollout.seed). Default: every run is its own arm",
    )
    p.add_argument("--metric", default="avg@n", choices=["avg@n", "greedy_acc"], help="default avg@n")
    p.add_argument("--out", default=None, help="output folder (default: compare/ beside the first run)")
    p.set_defaults(handler=cli_compare)


def cli_compare(args: argparse.Namespace) -> int:
    """Exit 2 (one line, nothing written) when a folder is not a run, has no evaluation, or two runs
    of one arm share a seed."""
    from veriloop.algos.eval.compare import CompareError, compare_markdown, group_runs, load_run, plot_compare

    try:
        arms = group_runs([load_run(r, args.group_by) for r in args.runs])
    except CompareError as e:
        print(f"veriloop compare: {e}", file=sys.stderr)
        return 2
    if len(arms) < 2 and not args.group_by:
        print(
            "veriloop compare: one run has nothing to be compared with: pass two or more run folders",
            file=sys.stderr,
        )
        return 2
    out = Path(args.out) if args.out else Path(args.runs[0]).resolve().parent / "compare"
    out.mkdir(parents=True, exist_ok=True)
    text = compare_markdown(arms, args.metric)
    (out / "compare.md").write_text(text)
    png = plot_compare(arms, out / "compare.png", args.metric)
    print(text)
    print(f"tables: {out / 'compare.md'}\nplot: {png}")
    return 0
