"""``veriloop plot``: draw a run's curves (``metrics.jsonl``) into ``<run>/plots``."""

from __future__ import annotations

import argparse
import sys

from veriloop.algos.run.plots import plot_run


def cli_plot(args: argparse.Namespace) -> int:
    """``veriloop plot``: ``args.run`` (run folder), ``args.out`` (folder or None = ``<run>/plots``).
    Exit 2 (one line, no traceback) for a folder that is not a run, 1 when it has nothing to draw."""
    try:
        paths = plot_run(args.run, args.out)
    except FileNotFoundError as e:
        print(f"veriloop plot: {e}", file=sys.stderr)
        return 2
    if not paths:
        print(
            f"veriloop plot: nothing to draw: {args.run}/metrics.jsonl logs none of the plotted metrics "
            "(a run that stopped before its first step?)",
            file=sys.stderr,
        )
        return 1
    for path in paths:
        print(path)
    return 0
