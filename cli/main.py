"""``veriloop`` command line: one subcommand per job, each importing its heavy parts lazily.

``veriloop envs`` and ``veriloop demo`` need only the environments (no torch).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

Handler = Callable[[argparse.Namespace], int]


def _cmd_envs(args: argparse.Namespace) -> int:
    import gymnasium

    import veriloop.envs  # noqa: F401  (registers the environments)
    from veriloop.envs.splits import SPLITS

    ids = sorted(i for i in gymnasium.registry if i.startswith("veriloop/"))
    print("Registered environments:")
    for env_id in ids:
        spec = gymnasium.registry[env_id]
        print(f"  {env_id:40s} {spec.entry_point}")
    print("\nSplits (family / split -> id and kwargs):")
    for family, splits in SPLITS.items():
        for split, (env_id, kwargs) in splits.items():
            print(f"  {family:18s} {split:12s} {env_id} {kwargs or ''}")
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from veriloop.envs.demo import main as demo_main

    return int(demo_main(episodes=args.episodes, seed=args.seed) or 0)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="veriloop",
        description="RL with verifiable rewards in multi-turn Gymnasium verifier environments.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("envs", help="list registered environments and their evaluation splits")
    p.set_defaults(handler=_cmd_envs)

    p = sub.add_parser("demo", help="a scripted agent plays every environment; prints episodes and rewards")
    p.add_argument("--episodes", type=int, default=2, help="episodes per environment (default 2)")
    p.add_argument("--seed", type=int, default=0, help="first env seed (default 0)")
    p.set_defaults(handler=_cmd_demo)
    return parser


def run(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    handler: Handler = args.handler
    return handler(args)


if __name__ == "__main__":
    sys.exit(run())
