"""``veriloop eval``: evaluate saved policies (``base``, ``RUN/final``, ``RUN/checkpoints/step-N``)
as a config says, writing one report per checkpoint, a combined summary and the pass@k plot."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from veriloop.algos.eval.loop import evaluate_config
from veriloop.algos.eval.report import comparison_markdown, report_markdown, write_report
from veriloop.algos.run.setup import check_backend_family, check_model, load_checkpoint_policy
from veriloop.configs.schema import ExperimentConfig


def _label(checkpoint: str) -> str:
    """A checkpoint's name by run and phase: ``base``, ``RUN`` (``RUN/final``: after RL), ``RUN/sft``
    (the warm-up's ``RUN/sft/final``), ``RUN/step-N`` / ``RUN/sft/step-N`` (training checkpoints);
    a folder outside any run folder by its own name."""
    if checkpoint in ("base", "default"):
        return "base"
    path = Path(checkpoint).resolve()
    run = run_folder_of(path)
    if run is None:
        return path.name if path.parent.name != "checkpoints" else f"{path.parent.parent.name}-{path.name}"
    parts = [p for p in path.relative_to(run).parts if p not in ("final", "checkpoints")]
    return "/".join([run.name, *(_step_name(p) for p in parts)])


def _step_name(part: str) -> str:
    """``step-000004`` -> ``step-4``; other names as they are."""
    head, _, number = part.partition("-")
    return f"step-{int(number)}" if head == "step" and number.isdigit() else part


def run_folder_of(checkpoint: str | Path) -> Path | None:
    """The run folder a saved policy belongs to (``RUN/final``, ``RUN/sft/final``,
    ``RUN/checkpoints/step-N``...): its nearest ancestor holding a ``config.yaml``; None if none."""
    for folder in Path(checkpoint).resolve().parents:
        if (folder / "config.yaml").is_file():
            return folder
    return None


def _default_eval_dir(cfg: ExperimentConfig, checkpoints: Sequence[str]) -> Path:
    """``RUN/eval-cli`` of the run the evaluated checkpoints come from (all from one run); the
    config's run folder when only the base model is evaluated or they come from several runs."""
    runs = {run_folder_of(c) for c in checkpoints if c not in ("base", "default")}
    if len(runs) == 1 and None not in runs:
        return next(iter(runs)) / "eval-cli"  # type: ignore[operator]
    return Path(cfg.run.out_dir) / cfg.run_name / "eval-cli"


def _cli_backend(cfg: ExperimentConfig, policy: Any) -> Any:
    """The engine ``veriloop eval`` samples with: the one training builds
    (``agents.backends.serving_backend``; vLLM, one per checkpoint) when its evaluations use the
    rollouts' backend (``eval.backend: rollout``); otherwise None, the HF engine (a ``vllm_server``
    is not attached to by ``eval``: it evaluates with the HF engine)."""
    from veriloop.agents.backends import serving_backend

    if cfg.eval.backend != "rollout":
        return None
    return serving_backend(cfg.rollout, policy, servers=False)


def run_eval_cli(
    config_path: str | None,
    checkpoints: Sequence[str],
    overrides: Sequence[str],
    out_dir: str | Path | None = None,
    imports: Sequence[str] = (),
) -> dict[str, dict]:
    """Evaluate each checkpoint as the config says; write per-checkpoint and combined reports and the
    pass@k-vs-k plot (``pass_at_k.png``) to ``out_dir`` (default: ``RUN_DIR/eval-cli``, where
    RUN_DIR is the run folder the checkpoints were saved in, or the config's run folder for the
    base model). Returns ``{label: report}``.

    The config, the environments (``imports`` are imported first) and every checkpoint path are
    checked before any model loads."""
    from veriloop.algos.run.plots import plot_pass_at_k
    from veriloop.configs.loader import load_config
    from veriloop.configs.schema import ConfigError

    cfg = load_config(config_path, overrides)
    cfg.env.imports = [*cfg.env.imports, *imports]
    cfg.env.resolve()
    missing = [c for c in checkpoints if c not in ("base", "default") and not Path(c).exists()]
    if missing:
        raise ConfigError(
            f"--checkpoints: {', '.join(missing)} not found; give saved policy folders (RUN/final, "
            "RUN/sft/final, RUN/checkpoints/step-N) or 'base'"
        )
    if any(c in ("base", "default") for c in checkpoints or ["base"]):
        check_model(cfg.policy.model)  # the base model exists (before any folder is made)
    if cfg.eval.backend == "rollout" and cfg.rollout.backend == "vllm":  # (vllm_server: the HF engine here)
        for model in [cfg.policy.model, *(c for c in checkpoints if c not in ("base", "default"))]:
            check_backend_family(model, "vllm")  # a VLM on vLLM, refused before any folder is made
    out = Path(out_dir) if out_dir is not None else _default_eval_dir(cfg, checkpoints)
    out.mkdir(parents=True, exist_ok=True)  # an unwritable folder fails now, before any model loads
    reports: dict[str, dict] = {}
    for checkpoint in checkpoints or ["base"]:
        label = _label(checkpoint)
        while label in reports:
            label += "+"
        policy = load_checkpoint_policy(cfg, checkpoint)
        backend = _cli_backend(cfg, policy)
        try:
            report = evaluate_config(cfg, policy, backend=backend)
        finally:
            if backend is not None:
                backend.close()
        report["meta"]["checkpoint"] = checkpoint
        paths = write_report(report, out, label.replace("/", "-"))  # quickstart/sft -> quickstart-sft.json
        print(f"{label}: {paths['markdown']}")
        reports[label] = report
    combined = "\n".join(report_markdown(r, title=label) for label, r in reports.items())
    if len(reports) > 1:  # side by side: SE and the paired change from one checkpoint to the next
        combined = f"## Compared\n\n{comparison_markdown(reports)}\n{combined}"
    (out / "summary.md").write_text(combined)
    plot_pass_at_k(reports, out / "pass_at_k.png")
    print(combined)
    print(f"\nevaluation written to {out} (summary.md, pass_at_k.png)")
    return reports


def cli_eval(args: argparse.Namespace) -> int:
    """``veriloop eval``: ``args.config`` (path or shipped name), ``args.checkpoints`` (list),
    ``args.out`` (folder or None), ``args.overrides`` (``dotted.key=value``), ``args.imports``."""
    run_eval_cli(
        args.config,
        list(args.checkpoints or []),
        list(args.overrides or []),
        args.out,
        imports=list(getattr(args, "imports", None) or []),
    )
    return 0
