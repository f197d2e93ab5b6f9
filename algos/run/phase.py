"""The step machinery the RL loop (``train.py``) and the SFT warm-up (``sft_train.py``) share.

Both loops are written out top to bottom in their own module; what they have in common is here,
once: the steps to run (with a progress bar), the non-finite guard with its one limit
(``train.max_consecutive_nonfinite``), and when to log and to checkpoint::

    loop = StepLoop(total, "train", guard, log=run_log, log_every=..., checkpoint_every=...)
    for step in loop.steps(start):        # a bar at a terminal, a line every 10 s in a log file
        metrics = ...                     # one step: forward/backward, clip, optimizer step unless non-finite
        loop.observe(skipped)             # counted; NonFiniteTrainingError after `limit` in a row
        loop.log_metrics(step + 1, metrics)            # every `log_every` steps and after the last
        if loop.checkpoint_due(step + 1): save(...)    # every `checkpoint_every` steps and after the last

Steps are logged and checkpointed under the number of steps *done* (``step + 1``), so a checkpoint
``step-000004`` holds the weights after four steps and a resumed run starts at ``step = 4``.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from veriloop.algos.run.log import RunLog
from veriloop.algos.run.nonfinite import NonFiniteGuard, NonFiniteTrainingError
from veriloop.algos.run.progress import Progress, say


def _minutes(seconds: float) -> str:
    """``"12 min"``, ``"2.5 h"``, ``"40 s"``: an estimate's size, not its digits."""
    if seconds < 90:
        return f"{seconds:.0f} s"
    return f"{seconds / 60:.0f} min" if seconds < 5400 else f"{seconds / 3600:.1f} h"


@dataclass
class StepLoop:
    """Steps ``start .. total - 1`` of one training phase, and the schedules around them.

    Attributes:
        total: Steps of the whole phase (a resumed phase starts later, not with fewer).
        desc: The phase's name in progress lines and errors (``"train"``, ``"sft warm-up"``).
        guard: Counts skipped (non-finite) steps; ``guard.limit`` in a row stop the phase.
        log_every: Log every this many steps (the last step is always logged).
        checkpoint_every: Checkpoint every this many steps; 0 = only after the last step.
        log: Where ``log_metrics`` writes (None: nothing is written, e.g. on ranks other than 0).
        advice: The error's last words: how to avoid non-finite steps in this phase.
        quiet: No progress bar or lines.
    """

    total: int
    desc: str
    guard: NonFiniteGuard
    log_every: int = 1
    checkpoint_every: int = 0
    log: RunLog | None = None
    advice: str = "lower the learning rate or the gradient-norm clip, or check the data"
    quiet: bool = False
    _bar: Progress | None = field(default=None, init=False, repr=False)

    def steps(self, start: int) -> Iterator[int]:
        """Yield ``start .. total - 1``; the progress advances once the caller's step is done."""
        bar = self._bar = Progress(self.total, self.desc, "steps", initial=start, quiet=self.quiet)
        try:
            for step in range(start, self.total):
                t0 = time.monotonic()
                yield step
                bar.update()
                if (
                    step == start and self.total - step > 1
                ):  # what the rest will cost, from the step just done
                    self._estimate(step + 1, time.monotonic() - t0)
        finally:
            bar.close()
            self._bar = None

    def _estimate(self, done: int, seconds: float) -> None:
        left = self.total - done
        say(
            quiet=self.quiet,
            text=f"{self.desc}: ≈ {_minutes(seconds * left)} on this machine for the {left} step{'s' * (left != 1)} "
            f"left ({seconds:.1f} s a step, measured after step {done})",
        )

    def observe(self, skipped: bool) -> None:
        """Count one step (``skipped``: its loss or gradient norm was NaN/inf and no update was
        made). Raises :class:`NonFiniteTrainingError` when that makes ``guard.limit`` in a row: a
        run that diverged stops instead of spinning through skipped steps."""
        if self.guard.observe(skipped):
            raise NonFiniteTrainingError(
                f"{self.desc}: {self.guard.in_a_row} consecutive steps had a non-finite loss or gradient "
                f"and were skipped; {self.advice}"
            )

    def log_due(self, done: int) -> bool:
        """Log after ``done`` steps? Every ``log_every`` steps, and after the last."""
        return done % self.log_every == 0 or done == self.total

    def log_metrics(self, done: int, metrics: Mapping[str, Any]) -> None:
        """Write ``metrics`` under step ``done`` when a log is open and the schedule says so."""
        if self.log is not None and self.log_due(done):
            self.log.log(done, metrics)

    def checkpoint_due(self, done: int) -> bool:
        """Checkpoint after ``done`` steps? Every ``checkpoint_every`` steps, and after the last."""
        every = self.checkpoint_every
        return (every > 0 and done % every == 0) or done == self.total

    def show(self, text: str) -> None:
        """A short summary of the last step beside the progress bar (at a terminal only)."""
        if self._bar is not None:
            self._bar.set_postfix(text)
