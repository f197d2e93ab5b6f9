"""``veriloop`` command line: one subcommand per job, each importing its heavy parts lazily.

``veriloop envs`` and ``veriloop demo`` need only the environments (no torch).
"""

from __future__ import annotations

import argparse
import errno
import os
import re
import shlex
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from veriloop.cli.compare import add_compare_command
from veriloop.cli.serve import add_serve_command

if TYPE_CHECKING:
    from veriloop.configs.schema import ExperimentConfig

Handler = Callable[[argparse.Namespace], int]
#: A ``section.key=value`` override (a checkpoint folder never looks like this).
_OVERRIDE = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)+=")


def _cmd_envs(args: argparse.Namespace) -> int:
    import gymnasium

    import veriloop.envs  # noqa: F401  (registers the environments)
    from veriloop.envs.plugins import import_modules, load_entry_points
    from veriloop.envs.splits import SPLITS

    before = set(gymnasium.registry)
    import gymnasium.envs  # noqa: F401  (gymnasium's own ids, to tell them apart from users')

    gym_own = {i for i in before if not i.startswith("veriloop/")}
    import_modules(args.imports or [])
    plugins = load_entry_points()
    ids = sorted(i for i in gymnasium.registry if i.startswith("veriloop/"))
    print("Registered environments:")
    for env_id in ids:
        spec = gymnasium.registry[env_id]
        print(f"  {env_id:40s} {spec.entry_point}")
    yours = sorted(i for i in gymnasium.registry if not i.startswith("veriloop/") and i not in gym_own)
    if yours:
        print(
            "\nYour environments (--import, entry points"
            + (f": {', '.join(plugins)}" if plugins else "")
            + "):"
        )
        for env_id in yours:
            print(f"  {env_id:40s} {gymnasium.registry[env_id].entry_point}")
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
    from veriloop.configs.describe import describe
    from veriloop.configs.loader import shipped_experiments
    from veriloop.configs.presets import list_presets
    from veriloop.configs.schema import ExperimentConfig

    lines = [
        f"shipped experiments (CONFIG): {', '.join(shipped_experiments())}",
        f"algorithm presets (algo.preset=NAME): {', '.join(list_presets())}",
        "models (policy.model=...): default, tiny, a local folder, or a Hub id such as Qwen/Qwen2.5-0.5B-Instruct",
        "",
        "settings (override any with KEY=VALUE):",
    ]
    for key, tp, default, doc in describe(ExperimentConfig):
        lines.append(f"  {key} ({tp}, default {default!r})")
        if doc:
            lines.append(f"      {doc}")
    return "\n".join(lines)


def _load(args: argparse.Namespace, name: str | None = None) -> ExperimentConfig:
    """The config with ``--import`` modules added and every environment id checked (no model yet)."""
    from veriloop.configs.loader import load_config

    cfg = load_config(name or args.config, args.overrides)
    cfg.env.imports = [*cfg.env.imports, *(args.imports or [])]
    cfg.env.resolve()
    return cfg


def _cmd_train(args: argparse.Namespace) -> int:
    from veriloop.agents.backends.http_client import ServerError
    from veriloop.algos.loop.train import train

    cfg = _load(args)
    _check_resumable(args, Path(cfg.run.out_dir) / cfg.run_name)
    try:
        run_dir = train(cfg, resume=args.resume, overwrite=args.overwrite)
    except ServerError as e:  # a generation server is gone: the message names it and how to resume
        print(f"veriloop train: {e}", file=sys.stderr)
        return 3
    if (run_dir / "summary.md").is_file():
        print(f"\n{(run_dir / 'summary.md').read_text()}")
    print(f"run folder: {folder_sizes(run_dir)}\nplot with: veriloop plot {run_dir}")
    return 0


#: What each part of a run folder is, for the line that says what takes its space.
_PARTS = {"checkpoints": "resume points: trained weights + optimizer state",
          "final": "the trained policy", "sft": "the warm-up: sft/final is its policy",
          "eval": "evaluation reports", "plots": "plots"}  # fmt: skip


def folder_sizes(run_dir: Path) -> str:
    """``RUN (155 MB: checkpoints/ 118 MB (resume points ...), final/ 23 MB (...), ...)``: what takes
    a run folder's space, biggest first."""

    def size(path: Path) -> int:
        files = [path] if path.is_file() else [f for f in path.rglob("*") if f.is_file()]
        return sum(f.stat().st_size for f in files if not f.is_symlink())

    parts = sorted(((size(p), p) for p in run_dir.iterdir()), key=lambda sp: sp[0], reverse=True)
    shown = [
        f"{p.name}{'/' if p.is_dir() else ''} {_mb(n)}" + (f" ({_PARTS[p.name]})" if p.name in _PARTS else "")
        for n, p in parts[:4]
        if n >= 1e6
    ]
    rest = sum(n for n, _ in parts) - sum(n for n, _ in parts[: len(shown)])
    tail = [f"the rest {_mb(rest)}"] if shown and rest >= 1e6 else []
    return f"{run_dir} ({_mb(sum(n for n, _ in parts))}" + (f": {', '.join(shown + tail)})" if shown else ")")


def _mb(n: float) -> str:
    return f"{n / 1e6:.0f} MB" if n >= 1e6 else f"{n / 1e3:.0f} kB"


def _cmd_sft(args: argparse.Namespace) -> int:
    from veriloop.algos.sft.train import sft_from_config

    cfg = _load(args)
    run_dir = Path(cfg.run.out_dir) / cfg.run_name
    if not (run_dir / "sft" / "final").is_dir():  # (a finished warm-up is said to be so)
        _check_resumable(args, run_dir / "sft", run_dir)
    sft_from_config(cfg, resume=args.resume, overwrite=args.overwrite)
    return 0


def _check_resumable(args: argparse.Namespace, folder: Path, lock_dir: Path | None = None) -> None:
    """``--resume`` of a run that is not there is refused, before anything is written (a folder
    another trainer holds is reported as that first). The Python API's ``resume=True`` starts it."""
    from veriloop.algos.run.setup import check_not_busy, holds_run
    from veriloop.configs.schema import ConfigError

    if not args.resume:
        return
    check_not_busy(lock_dir or folder)
    if not holds_run(folder):
        raise ConfigError(f"no run at {folder} to resume; drop --resume to start it")


def _cmd_eval(args: argparse.Namespace) -> int:
    from veriloop.cli.eval import cli_eval

    return int(cli_eval(args) or 0)


def _cmd_plot(args: argparse.Namespace) -> int:
    from veriloop.cli.plot import cli_plot

    return int(cli_plot(args) or 0)


def _cmd_quickstart(args: argparse.Namespace) -> int:
    """Train the default model briefly on generated math, evaluate before/after, draw the curves.
    The same command continues an interrupted quickstart (a run folder without ``final/``)."""
    from veriloop.algos.loop.train import train
    from veriloop.algos.run.plots import plot_run

    cfg = _load(args, "quickstart")
    run_dir = Path(cfg.run.out_dir) / cfg.run_name
    _check_resumable(args, run_dir)
    resume = args.resume or _continues(args, run_dir)
    run_dir = train(cfg, resume=resume, overwrite=args.overwrite)
    pngs = plot_run(run_dir)
    print(f"\nrun folder: {folder_sizes(run_dir)}")
    if (run_dir / "summary.md").is_file():
        print(f"\n{(run_dir / 'summary.md').read_text()}")
    print(
        f"evaluation tables: {run_dir / 'summary.md'} (all checkpoints), {run_dir / 'eval'} (one per evaluation)"
    )
    for png in pngs:
        print(f"plot: {png}")
    return 0


def _continues(args: argparse.Namespace, run_dir: Path) -> bool:
    """Whether a plain ``quickstart`` continues the run in ``run_dir``: yes when it was interrupted
    (it holds a run but no ``final/``); a finished one is refused, naming the commands that go on."""
    from veriloop.algos.run.setup import holds_run
    from veriloop.configs.schema import ConfigError

    if args.overwrite or not holds_run(run_dir):
        return False
    again = getattr(args, "again", "veriloop quickstart")  # set by run()
    if (run_dir / "final").is_dir():
        raise ConfigError(
            f"{run_dir} already holds a finished quickstart (tables: {run_dir / 'summary.md'}); nothing was "
            f"changed. Start it over with `{_with_args(again, ['--overwrite'])}`, or keep it and choose "
            f"another name: `{_with_args(again, ['run.name=quickstart2'])}`"
        )
    print(
        f"continuing the interrupted quickstart in {run_dir} (to start over: "
        f"`{_with_args(again, ['--overwrite'])}`)",
        flush=True,
    )
    return True


#: Set by the Makefile to the command the user typed (``make quickstart``): messages repeat it.
INVOKED_AS_ENV = "VERILOOP_INVOKED_AS"


def _with_args(command: str, extra: Sequence[str]) -> str:
    """``command`` with ``extra`` words: as ``ARGS='...'`` for a make target, appended otherwise."""
    if not extra:
        return command
    if command.startswith("make "):
        head, _, args = command.partition(" ARGS=")
        words = [*shlex.split(args), *extra] if args else list(extra)
        return f"{head} ARGS={shlex.quote(' '.join(words))}"
    return f"{command} {shlex.join(extra)}"


def _again_command(argv: Sequence[str]) -> str:
    """The command line that was run, minus ``--resume`` / ``--overwrite`` (the Makefile's name for
    it when it started this process)."""
    words = [w for w in argv if w not in ("--resume", "--overwrite")]
    made = os.environ.get(INVOKED_AS_ENV, "").strip()
    if made.startswith("make "):  # the Makefile passes the user's ARGS after the target's name
        return _with_args(made, words[1:])
    return shlex.join(["veriloop", *words])


def _resume_command(command: str, again: str) -> str:
    """What continues an interrupted ``command``: ``quickstart`` continues by itself, the trainers
    with ``--resume``."""
    return again if command == "quickstart" else _with_args(again, ["--resume"])


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "config", nargs="?", help="experiment YAML file, or the name of a shipped one (e.g. points24_grpo)"
    )
    p.add_argument(
        "overrides",
        nargs="*",
        metavar="KEY=VALUE",
        help="dotted overrides, e.g. algo.clip_high=0.3 (optional)",
    )
    _add_import_arg(p)


def _add_import_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--import",
        dest="imports",
        action="append",
        default=[],
        metavar="MODULE",
        help="import MODULE first, so its gymnasium.register(...) calls run (repeatable; the working "
        "directory is importable; same as env.imports in the config)",
    )


def _add_overwrite_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="delete an existing run of the same name first (never implied)",
    )


def _add_eval_command(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``veriloop eval CONFIG --checkpoints ...``."""
    p = sub.add_parser("eval", help="pass@k / avg@k / maj@k per split for checkpoints (or the base model)")
    p.add_argument(
        "config", nargs="?", help="experiment config naming the splits (env.eval_splits) and eval.* settings"
    )
    p.add_argument(
        "--checkpoints",
        nargs="+",
        default=["base"],
        help="saved policy folders (e.g. RUN/final) or 'base' for policy.model (default: base)",
    )
    p.add_argument(
        "--out", default=None, help="output folder (default: RUN_DIR/eval-cli of the checkpoints' run folder)"
    )
    p.add_argument(
        "overrides", nargs="*", metavar="KEY=VALUE", help="dotted overrides, e.g. eval.n_samples=16"
    )
    _add_import_arg(p)
    p.set_defaults(handler=_cmd_eval)


def _add_quickstart_command(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``veriloop quickstart [KEY=VALUE ...]``."""
    p = sub.add_parser(
        "quickstart", help="train the default model (~6 min on 2 idle CPU cores, bf16), evaluate, plot"
    )
    p.add_argument(
        "overrides",
        nargs="*",
        metavar="KEY=VALUE",
        help="dotted overrides of configs/experiments/quickstart.yaml",
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue an interrupted quickstart (plain `veriloop quickstart` does too)",
    )
    _add_overwrite_arg(p)
    _add_import_arg(p)
    p.set_defaults(handler=_cmd_quickstart)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="veriloop",
        description="RL with verifiable rewards in multi-turn Gymnasium verifier environments.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("envs", help="list registered environments and their evaluation splits")
    _add_import_arg(p)
    p.set_defaults(handler=_cmd_envs)

    p = sub.add_parser("demo", help="a scripted agent plays every environment; prints episodes and rewards")
    p.add_argument("--episodes", type=int, default=2, help="episodes per environment (default 2)")
    p.add_argument("--seed", type=int, default=0, help="first env seed (default 0)")
    p.set_defaults(handler=_cmd_demo)

    fmt = argparse.RawDescriptionHelpFormatter
    p = sub.add_parser(
        "train", help="RL training from an experiment config", epilog=_settings_help(), formatter_class=fmt
    )
    _add_config_args(p)
    p.add_argument("--resume", action="store_true", help="continue from the run's last complete checkpoint")
    _add_overwrite_arg(p)
    p.set_defaults(handler=_cmd_train)

    p = sub.add_parser(
        "sft", help="supervised warm-up only (sft.* settings)", epilog=_settings_help(), formatter_class=fmt
    )
    _add_config_args(p)
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue a cut warm-up from its last complete checkpoint (every run.checkpoint_every steps)",
    )
    _add_overwrite_arg(p)
    p.set_defaults(handler=_cmd_sft)

    _add_eval_command(sub)
    p = sub.add_parser("plot", help="draw a run's training curves to PNG files")
    p.add_argument("run", help="run folder (holds metrics.jsonl)")
    p.add_argument("--out", default=None, help="output folder (default: RUN/plots)")
    p.set_defaults(handler=_cmd_plot)

    _add_quickstart_command(sub)
    add_serve_command(sub)
    add_compare_command(sub)
    return parser


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse the command line; ``KEY=VALUE`` overrides may come before or after flags
    (``train cfg --import mod a=1`` as well as ``train cfg a=1 --import mod``)."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    stray = [e for e in extra if e.startswith("-") or "=" not in e or not hasattr(args, "overrides")]
    if stray:
        parser.error(f"unrecognized arguments: {' '.join(stray)}")
    if hasattr(args, "config") and args.config is None:  # only CONFIG is required, never an override
        from veriloop.configs.loader import shipped_experiments

        parser.error(
            f"{args.command} needs CONFIG: an experiment YAML file or a shipped one "
            f"({', '.join(shipped_experiments())}); e.g. `veriloop {args.command} quickstart`"
        )
    if extra:
        args.overrides = [*args.overrides, *extra]
    if getattr(args, "checkpoints", None):  # `--checkpoints a b key.x=1`: the override is not a folder
        is_override = [bool(_OVERRIDE.match(c)) for c in args.checkpoints]
        args.overrides = [*args.overrides, *(c for c, o in zip(args.checkpoints, is_override) if o)]
        args.checkpoints = [c for c, o in zip(args.checkpoints, is_override) if not o] or ["base"]
    return args


def run(argv: Sequence[str] | None = None) -> int:
    from veriloop.envs.plugins import working_dir_importable

    working_dir_importable()  # as with `python -m`: a user's module beside their config imports
    words = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(words)
    args.again = _again_command(words)
    handler: Handler = args.handler
    again = _resume_command(args.command, args.again)
    try:
        return handler(args)
    except KeyboardInterrupt:
        print(f"veriloop {args.command}: interrupted. {_kept(args.command, again)}", file=sys.stderr)
        return 130
    except Exception as e:
        message, code = _explain(e, args.command, again)
        if message is None:
            raise
        print(f"veriloop {args.command}: {message}", file=sys.stderr)
        return code


def _explain(e: Exception, command: str, again: str = "") -> tuple[str | None, int]:
    """The one-line message and exit code for a failure an operator can fix, or ``(None, 0)``:
    bad input (config, env id, a checkpoint that cannot be resumed) exits 2, a write the file
    system refused (full disk, read-only folder) exits 1, a run a guard stopped (nothing to learn,
    non-finite steps; ``algos.run.guards``) exits 4."""
    from veriloop.configs.schema import ConfigError
    from veriloop.envs.plugins import UnknownEnvError

    checkpoint = sys.modules.get("veriloop.algos.run.checkpoint")  # loaded if it raised (no torch here)
    if isinstance(e, ConfigError | UnknownEnvError) or (
        checkpoint and isinstance(e, checkpoint.CheckpointError)
    ):
        return str(e), 2
    if _refused_write(e):
        return f"{_disk_message(e)} {_kept(command, again)}", 1
    guards = sys.modules.get("veriloop.algos.run.guards")  # the run stopped itself: it could not learn
    if guards and isinstance(e, guards.RunStoppedError):
        return str(e), 4
    return None, 0


#: What survives an interrupted or failed write (checkpoints are committed atomically).
_KEPT = "Complete checkpoints are kept (a save cut half-way is ignored and removed later); continue with: "
_DISK_ERRORS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM}


#: How writers that are not Python's own file objects (torch.save, safetensors) say the disk is full.
_FULL_DISK_TEXTS = ("No space left on device", "os error 28", "file write failed", "iostream error")


def _refused_write(e: BaseException) -> bool:
    if isinstance(e, OSError):
        return e.errno in _DISK_ERRORS
    return any(text in str(e) for text in _FULL_DISK_TEXTS)


def _disk_message(e: BaseException) -> str:
    """One line for a write the file system refused: what, where, and what to do."""
    if not isinstance(e, OSError):
        e = OSError(errno.ENOSPC, f"a write failed ({str(e)[:200]}), most likely a full disk")
    where = f" ({e.filename})" if e.filename else ""
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        fix = "Free some space (or lower run.keep_last) or choose another run.out_dir"
    else:
        fix = "Choose a writable run.out_dir (or --out) or fix the permissions"
    return f"the file system refused{where}: {e.strerror or os.strerror(e.errno or 0)}. {fix}."


def _kept(command: str, again: str = "") -> str:
    """What an interrupted command leaves: trainers can resume (``again`` is the command that does
    it); other commands just run again."""
    if command not in ("train", "sft", "quickstart"):
        return "Run the command again."
    return _KEPT + (again or f"veriloop {command} ... --resume")


if __name__ == "__main__":
    sys.exit(run())
