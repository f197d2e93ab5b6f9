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


def _settings_help() -> str:
    """Every config key with its type, default and doc: the schema is the one source of truth."""
    from veriloop.configs.schema import ExperimentConfig, describe

    lines = ["settings (override any with KEY=VALUE):"]
    for key, tp, default, doc in describe(ExperimentConfig):
        lines.append(f"  {key} ({tp}, default {default!r})")
        if doc:
            lines.append(f"      {doc}")
    return "\n".join(lines)


def _load(args: argparse.Namespace) -> object:
    from veriloop.configs.loader import load_config

    return load_config(args.config, args.overrides)


def _cmd_train(args: argparse.Namespace) -> int:
    from veriloop.algos.train import train

    cfg = _load(args)
    run_dir = train(cfg, resume=args.resume)  # type: ignore[arg-type]
    print(
        f"run folder: {run_dir}  (metrics.jsonl, eval/, checkpoints/, final/); plot with: veriloop plot {run_dir}"
    )
    return 0


def _cmd_sft(args: argparse.Namespace) -> int:
    from pathlib import Path

    from veriloop.agents.loading import save_policy
    from veriloop.algos.sft_train import warmup_from_config
    from veriloop.algos.train import build_policy

    cfg = _load(args)
    if cfg.sft.steps <= 0:  # type: ignore[attr-defined]
        print("sft.steps is 0: nothing to do (set sft.steps=N)", file=sys.stderr)
        return 2
    policy = build_policy(cfg)  # type: ignore[arg-type]
    run_dir = Path(cfg.run.out_dir) / cfg.run_name  # type: ignore[attr-defined]
    metrics = warmup_from_config(cfg, policy, run_dir=run_dir / "sft")
    out = save_policy(policy, run_dir / "sft" / "final")
    print(f"SFT done: {metrics}\nsaved policy: {out}")
    return 0


def _cmd_eval(args: argparse.Namespace) -> int:
    from veriloop.algos.evaluate import cli_eval

    return int(cli_eval(args) or 0)


def _cmd_plot(args: argparse.Namespace) -> int:
    from veriloop.algos.plots import cli_plot

    return int(cli_plot(args) or 0)


def _cmd_quickstart(args: argparse.Namespace) -> int:
    """Train the default model briefly on generated math, evaluate before/after, draw the curves."""
    from veriloop.algos.plots import plot_run
    from veriloop.algos.train import train
    from veriloop.configs.loader import load_config

    cfg = load_config("quickstart", args.overrides)
    run_dir = train(cfg, resume=args.resume)
    pngs = plot_run(run_dir)
    print(f"\nrun folder: {run_dir}")
    print(f"evaluation tables: {run_dir / 'eval'}")
    for png in pngs:
        print(f"plot: {png}")
    return 0


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", help="experiment YAML file, or the name of a shipped one (e.g. points24_grpo)")
    p.add_argument(
        "overrides", nargs="*", metavar="KEY=VALUE", help="dotted overrides, e.g. algo.clip_high=0.3"
    )


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

    fmt = argparse.RawDescriptionHelpFormatter
    p = sub.add_parser("train", help="RL training from an experiment config", epilog=_settings_help(),
                       formatter_class=fmt)  # fmt: skip
    _add_config_args(p)
    p.add_argument("--resume", action="store_true", help="continue from the run's last complete checkpoint")
    p.set_defaults(handler=_cmd_train)

    p = sub.add_parser("sft", help="supervised warm-up only (sft.* settings)", epilog=_settings_help(),
                       formatter_class=fmt)  # fmt: skip
    _add_config_args(p)
    p.set_defaults(handler=_cmd_sft)

    p = sub.add_parser("eval", help="pass@k / avg@k / maj@k per split for checkpoints (or the base model)")
    p.add_argument("config", help="experiment config naming the splits (env.eval_splits) and eval.* settings")
    p.add_argument(
        "--checkpoints",
        nargs="+",
        default=["base"],
        help="saved policy folders (e.g. RUN/final) or 'base' for policy.model (default: base)",
    )
    p.add_argument("--out", default=None, help="output folder (default: RUN_DIR/eval-cli)")
    p.add_argument(
        "overrides", nargs="*", metavar="KEY=VALUE", help="dotted overrides, e.g. eval.n_samples=16"
    )
    p.set_defaults(handler=_cmd_eval)

    p = sub.add_parser("plot", help="draw a run's training curves to PNG files")
    p.add_argument("run", help="run folder (holds metrics.jsonl)")
    p.add_argument("--out", default=None, help="output folder (default: RUN/plots)")
    p.set_defaults(handler=_cmd_plot)

    p = sub.add_parser(
        "quickstart", help="train the default model (~10 CPU minutes on 2 cores), evaluate, plot"
    )
    p.add_argument(
        "overrides",
        nargs="*",
        metavar="KEY=VALUE",
        help="dotted overrides of configs/experiments/quickstart.yaml",
    )
    p.add_argument("--resume", action="store_true", help="continue an interrupted quickstart")
    p.set_defaults(handler=_cmd_quickstart)
    return parser


def run(argv: Sequence[str] | None = None) -> int:
    from veriloop.configs.schema import ConfigError

    args = build_parser().parse_args(argv)
    handler: Handler = args.handler
    try:
        return handler(args)
    except ConfigError as e:  # a bad config or override: the message says what and how to fix it
        print(f"veriloop {args.command}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(run())
