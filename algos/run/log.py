"""Where a run's numbers go: one JSONL line per step, TensorBoard scalars, optional wandb.

Every algorithm logs under the same metric names, so curves from different presets overlay.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from veriloop.agents.atomic import write_text_atomic


class RunLog:
    """Append-only metrics log for one run folder.

    Files: ``metrics.jsonl`` (one object per step, ``{"step": s, "time": t, **metrics}``) and,
    when enabled, TensorBoard event files under ``tb/``. On resume, lines for steps at or after
    the resumed step are dropped so the file never holds two copies of a step.
    """

    def __init__(
        self,
        run_dir: str | Path,
        *,
        tensorboard: bool = True,
        wandb_project: str | None = None,
        resume_from_step: int | None = None,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / "metrics.jsonl"
        if resume_from_step is not None:
            keep_steps_before(self.path, resume_from_step)
        self._file = self.path.open("a", encoding="utf-8")
        self._tb: Any = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(self.run_dir / "tb"))
        self._wandb: Any = None
        if wandb_project:
            try:
                import wandb
            except ImportError as err:
                raise ImportError("run.wandb is set but wandb is not installed: pip install wandb") from err
            self._wandb = wandb.init(project=wandb_project, dir=str(self.run_dir))

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        row = {"step": step, "time": time.time(), **{k: _plain(v) for k, v in metrics.items()}}
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()
        for key, value in row.items():
            if key in ("step", "time") or not isinstance(value, (int, float)) or isinstance(value, bool):
                continue
            if self._tb is not None and math.isfinite(value):
                self._tb.add_scalar(key, value, step)
        if self._wandb is not None:
            self._wandb.log(dict(row), step=step)

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """All rows of a run's ``metrics.jsonl`` (skipping a torn last line from a killed run)."""
    path = Path(run_dir) / "metrics.jsonl"
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def keep_steps_before(path: Path, step: int) -> None:
    """Drop the lines of the JSONL file ``path`` whose ``"step"`` is ``step`` or later (and torn or
    foreign lines), so a resumed run never logs a step twice; no file, nothing to do. The file is
    replaced atomically: a kill keeps the old one."""
    if path.exists():
        kept = [line for line in path.read_text().splitlines() if _step_of(line) < step]
        write_text_atomic(path, "".join(line + "\n" for line in kept))


def _step_of(line: str) -> int:
    try:
        return int(json.loads(line)["step"])
    except (json.JSONDecodeError, KeyError, TypeError, ValueError):
        return 1 << 62  # torn or foreign line: drop it


def _plain(value: Any) -> Any:
    if hasattr(value, "item") and callable(value.item):
        return value.item()
    return value
