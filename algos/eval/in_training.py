"""Evaluation during a training run: the policy at one step, evaluated as ``cfg.eval`` says,
written to ``RUN/eval/`` and returned flat for the step's metrics row (``evaluate_step``); a report
already made with the same settings is read back instead of evaluated twice (``reusable_report``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from veriloop.agents.backends import Backend
from veriloop.agents.policy import Policy
from veriloop.algos.run.progress import say
from veriloop.configs.schema import ExperimentConfig


def evaluate_step(
    cfg: ExperimentConfig,
    policy: Policy,
    step: int,
    quiet: bool,
    *,
    tag: str | None = None,
    prefix: str = "eval",
    backend: Backend | None = None,
    reuse: bool = False,
) -> dict[str, float]:
    """Evaluate ``policy`` as ``cfg.eval`` says, write ``RUN/eval/<tag or step-N>.json`` and return its
    numbers flat (``prefix/split/metric``). With ``reuse``, a report already there with the same
    evaluation settings is read back instead (an interrupted run does not evaluate the same
    weights twice)."""
    from veriloop.algos.eval.loop import evaluate_config
    from veriloop.algos.eval.report import write_report

    splits, label = cfg.env.resolved_eval_splits, _checkpoint_label(cfg, step, tag)
    path = Path(cfg.run.out_dir) / cfg.run_name / "eval" / f"{tag or f'step-{step:06d}'}.json"
    report = reusable_report(cfg, path) if reuse else None
    if report is not None:
        say(quiet=quiet, text=f"{label}: evaluated before the interruption, reusing {path}")
    else:
        say(
            quiet=quiet,
            text=f"evaluating {label}: {len(splits)} split(s) ({', '.join(splits)}) x "
            f"{cfg.eval.num_problems} problems x {cfg.eval.n_samples} samples",
        )
        report = evaluate_config(cfg, policy, step=step, backend=backend)
        report["meta"]["checkpoint"] = label
        write_report(report, path.parent, path.stem)
    flat = {
        f"{prefix}/{split}/{k}": float(v)
        for split, m in report["splits"].items()
        for k, v in m.items()
        if isinstance(v, int | float) and not isinstance(v, bool)
    }
    shown = ", ".join(f"{k}={v:.3f}" for k, v in flat.items() if k.endswith("avg@n"))
    say(quiet=quiet, text=f"{prefix} @{step}: {shown}")
    return flat


def reusable_report(cfg: ExperimentConfig, path: Path) -> dict[str, Any] | None:
    """The report at ``path`` when it was made with ``cfg``'s evaluation settings (problems,
    samples, temperature, splits...); None when there is none or it differs."""
    from veriloop.algos.eval.report import read_report

    if not path.is_file():
        return None
    try:
        report = read_report(path)
        meta = report["meta"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    e, seeds = cfg.eval, list(cfg.eval_seed_range)
    want = {
        "num_problems": len(seeds),
        "first_seed": seeds[0],
        "n_samples": e.n_samples,
        "k_list": list(e.k_list),
        "temperature": e.temperature,
        "greedy": e.greedy,
        "max_new_tokens": cfg.rollout.max_new_tokens,
        "sampling_seed": e.seed_offset,
    }
    splits = {n: [str(sp.id), dict(sp.kwargs)] for n, sp in cfg.env.resolved_eval_splits.items()}
    saved = {n: [str(sp.get("id")), sp.get("kwargs") or {}] for n, sp in meta.get("splits", {}).items()}
    same = json.dumps(splits, sort_keys=True, default=str) == json.dumps(saved, sort_keys=True, default=str)
    if any(meta.get(k) != v for k, v in want.items()) or not same:
        return None
    return report


def _checkpoint_label(cfg: ExperimentConfig, step: int, tag: str | None) -> str:
    """What was evaluated, in words: the tables name it instead of the model's file name."""
    if tag == "base":
        return "base model (before SFT)"
    if step == 0:
        return "start (after SFT)" if cfg.sft.steps > 0 else "base model (step 0)"
    return f"RL step {step}"
