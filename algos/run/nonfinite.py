"""The non-finite guard both training loops share (through ``steps.StepLoop``: RL in ``train.py``,
SFT in ``sft_train.py``), with one limit, ``train.max_consecutive_nonfinite``.

A step whose loss or gradient norm is NaN/inf is skipped by the loop (no optimizer step, the
weights stay as they were); the guard counts those steps and tells the loop when too many came in a
row, so a run that has diverged stops instead of spinning through skipped steps.
"""

from __future__ import annotations

from dataclasses import dataclass

from veriloop.algos.run.guards import RunStoppedError


class NonFiniteTrainingError(RunStoppedError):
    """Too many consecutive steps had a NaN/inf loss or gradient (RL or SFT)."""


@dataclass
class NonFiniteGuard:
    """Counts skipped (non-finite) steps.

    Attributes:
        limit: this many skipped steps in a row stop the run (``observe`` returns True).
        in_a_row: skipped steps since the last finite one (restored on resume).
        total: skipped steps of the whole run (restored on resume).
    """

    limit: int
    in_a_row: int = 0
    total: int = 0

    def observe(self, skipped: bool) -> bool:
        """Count one step; True when it makes ``limit`` skipped steps in a row (stop the run)."""
        if skipped:
            self.total += 1
            self.in_a_row += 1
        else:
            self.in_a_row = 0
        return self.in_a_row >= self.limit
