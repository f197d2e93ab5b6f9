"""One writer per run folder: an advisory lock that a killed process cannot leave behind.

``RUN_DIR/.lock`` is locked with ``fcntl.flock`` for as long as a trainer (``veriloop train``,
``veriloop sft``, ``quickstart``) works in the folder. The kernel drops the lock when its process
ends in any way, ``kill -9`` included, so a stale lock never blocks a later ``--resume``; the file
itself stays (it is empty of meaning once unlocked). While held, it names the holder's pid, host
and start time, which the refusal a second trainer gets quotes.

``flock`` works between processes of one machine (and on most network file systems for
processes of one client); two machines writing the same folder on a file system without lock
support are not caught.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from veriloop.configs.schema import ConfigError

LOCK_FILE = ".lock"


class RunBusyError(ConfigError):
    """Another live process holds the run folder's lock (the CLI exits 2 with this message)."""


def acquire(run_dir: Path) -> int:
    """Lock ``run_dir`` (created if missing) for this process; returns the lock's file descriptor.

    Raises:
        RunBusyError: another process holds it; the message names that process and the fix.
    """
    run_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(run_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _describe(fd)
        os.close(fd)
        raise RunBusyError(
            f"run folder {run_dir} is in use by another trainer ({holder}); nothing was changed. Wait for it "
            "to finish or stop it (a killed trainer releases the folder at once), or choose another "
            "run.name"
        ) from None
    except BaseException:
        os.close(fd)
        raise
    info = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.strftime("%Y-%m-%d %H:%M:%S")}
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(info).encode(), 0)
    return fd


def release(fd: int) -> None:
    """Give the lock back (closing the descriptor releases it; the file stays)."""
    try:
        os.ftruncate(fd, 0)
    except OSError:
        pass
    os.close(fd)


@contextmanager
def run_lock(run_dir: Path) -> Iterator[None]:
    """Hold ``run_dir``'s lock for the block (see :func:`acquire`)."""
    fd = acquire(run_dir)
    try:
        yield
    finally:
        release(fd)


def _describe(fd: int) -> str:
    """The holder as its lock file says (pid, host, since when), or a plain 'another process'."""
    try:
        info = json.loads(os.pread(fd, 4096, 0).decode() or "{}")
        return f"pid {int(info['pid'])} on {str(info['host'])[:100]}, since {str(info['since'])[:40]}"
    except (OSError, ValueError, KeyError, TypeError):
        return "another process"


__all__ = ["LOCK_FILE", "RunBusyError", "acquire", "release", "run_lock"]
