"""Progress that reads well at a terminal and in a log file.

At a terminal: a tqdm bar, and messages written above it (never glued onto it). Not at a terminal
(output going to a file, CI, ``nohup``): no bar, but a line when each phase starts and a progress
line every :data:`LOG_INTERVAL_S` seconds (done/total, rate, time left), also while one long unit
of work (a batch of episodes, a training step) is still running: nothing is silent for longer.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import Any

#: Seconds between progress lines when the output is not a terminal (and between redraws of a
#: terminal's bar while nothing finishes).
LOG_INTERVAL_S = 10.0


def at_terminal() -> bool:
    return sys.stderr.isatty()


def say(text: str, quiet: bool = False) -> None:
    """Print a line; at a terminal it goes above any live progress bar."""
    if quiet:
        return
    if at_terminal():
        from tqdm import tqdm

        tqdm.write(text)
    else:
        print(text, flush=True)


class Progress:
    """Counts work done in one phase (``desc``) and shows it as a bar or as periodic log lines.

    Args:
        total: Units of work in the phase.
        desc: Phase name, e.g. ``"eval base"`` or ``"sft warm-up"``.
        unit: Unit name for the log lines (``"episodes"``, ``"steps"``).
        initial: Units already done (a resumed phase).
        quiet: Show nothing.
    """

    def __init__(self, total: int, desc: str, unit: str, *, initial: int = 0, quiet: bool = False) -> None:
        self.total, self.desc, self.unit, self.done = total, desc, unit, initial
        self.quiet = quiet
        self._start = self._last = time.monotonic()
        self._first = initial
        self._bar: Any = None
        self._stop = threading.Event()
        if quiet:
            return
        if at_terminal():
            from tqdm import tqdm

            self._bar = tqdm(
                total=total,
                initial=initial,
                desc=desc,
                unit=unit.rstrip("s"),
                leave=False,
                dynamic_ncols=True,
            )
        else:
            print(f"{desc}: {total - initial} {unit} to go", flush=True)
        threading.Thread(target=self._heartbeat, name=f"progress {desc}", daemon=True).start()

    def update(self, n: int = 1) -> None:
        self.done += n
        if self._bar is not None:
            self._bar.update(n)
        elif not self.quiet and (time.monotonic() - self._last >= LOG_INTERVAL_S or self.done >= self.total):
            self._print()

    def _print(self) -> None:
        self._last = time.monotonic()
        print(self.line(), flush=True)

    def _heartbeat(self) -> None:
        """While the phase runs: a line (or a redrawn bar) when nothing was shown for
        :data:`LOG_INTERVAL_S` seconds, so a long batch or step never leaves the screen still."""
        while not self._stop.wait(LOG_INTERVAL_S / 2):
            if time.monotonic() - self._last < LOG_INTERVAL_S:
                continue
            if self._bar is not None:
                self._last = time.monotonic()
                self._bar.refresh()
            else:
                self._print()

    def line(self) -> str:
        """``desc: done/total unit (rate/s, ~T left)``."""
        elapsed = max(time.monotonic() - self._start, 1e-9)
        rate = (self.done - self._first) / elapsed
        if rate == 0 and self.done < self.total:  # the first unit of this call is still running: no rate yet
            return (
                f"{self.desc}: {self.done}/{self.total} {self.unit} ({_duration(elapsed)}, none finished yet)"
            )
        left = (self.total - self.done) / rate if rate > 0 else float("nan")
        eta = f", ~{_duration(left)} left" if self.done < self.total and rate > 0 else ""
        return f"{self.desc}: {self.done}/{self.total} {self.unit} ({rate:.3g}/s, {_duration(elapsed)}{eta})"

    def set_postfix(self, text: str) -> None:
        if self._bar is not None:
            self._bar.set_postfix_str(text)

    def close(self) -> None:
        self._stop.set()
        if self._bar is not None:
            self._bar.close()


def _duration(seconds: float) -> str:
    if seconds != seconds:  # nan
        return "?"
    m, s = divmod(int(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h}h{m:02d}m" if h else (f"{m}m{s:02d}s" if m else f"{s}s")
