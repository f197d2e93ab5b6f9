"""Process-local counters of verifier activity, for training metrics.

A timed-out, crashed or memory-capped verification is not a wrong answer (see :mod:`.verdict`); these
counters make such failures visible in logs instead of letting them vanish into a reward of zero.
"""

from __future__ import annotations

import threading
from collections import Counter
from typing import Literal

StatName = Literal[
    "checks", "math_checks", "points24_checks", "timeouts", "crashes", "memory_errors", "screened"
]
STAT_NAMES: tuple[StatName, ...] = (
    "checks",
    "math_checks",
    "points24_checks",
    "timeouts",
    "crashes",
    "memory_errors",
    "screened",
)

_LOCK = threading.Lock()
_COUNTS: Counter[str] = Counter()


def count(*names: StatName) -> None:
    """Add one to each named counter (thread-safe)."""
    with _LOCK:
        for name in names:
            _COUNTS[name] += 1


def verifier_stats() -> dict[str, int]:
    """Snapshot of the counters in this process.

    Keys: ``checks`` (all verifications), ``math_checks``, ``points24_checks``, ``timeouts``,
    ``crashes``, ``memory_errors`` (verifier failures, each also a verdict with ``error`` set) and
    ``screened`` (math answers rejected by the cheap pre-screen without reaching a worker).
    """
    with _LOCK:
        return {name: _COUNTS[name] for name in STAT_NAMES}


def reset_verifier_stats() -> None:
    """Set every counter back to zero."""
    with _LOCK:
        _COUNTS.clear()
