"""One writer per run folder: an advisory lock that a killed process cannot leave behind.

``RUN_DIR/.lock`` is locked with ``fcntl.flock`` for as long as a trainer (``veriloop train``,
``veriloop sft``, ``quickstart``) works in the folder. The kernel drops the lock when its process
ends in any way, ``kill -9`` included, so a stale lock never blocks a later ``--resume``; the file
itself stays (it is empty of meaning once unlocked). While held, it names the holder's pid, host
and start time, which the refusal a second trainer gets quotes. The file is opened without
following symlinks and must be a regular file of one link: a ``.lock`` that is a symlink, hard
link, folder or device is refused (exit 2, one line) and nothing it points at is touched.

``flock`` works between processes of one machine (and on most network file systems for
processes of one client); two machines writing the same folder on a file system without lock
support are not caught.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import stat
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import NoReturn

from veriloop.configs.schema import ConfigError

LOCK_FILE = ".lock"


class RunBusyError(ConfigError):
    """Another live process holds the run folder's lock (the CLI exits 2 with this message)."""


class RunLockFileError(ConfigError):
    """``RUN/.lock`` is a symlink, folder or other non-regular file (the CLI exits 2 with this)."""


def acquire(run_dir: Path) -> int:
    """Lock ``run_dir`` (created if missing) for this process; returns the lock's file descriptor.

    Raises:
        RunBusyError: another process holds it; the message names that process and the fix.
        RunLockFileError: ``.lock`` is not a regular file of its own (a symlink, hard link,
            folder...); nothing is followed or truncated.
    """
    run_dir.mkdir(parents=True, exist_ok=True)
    fd = _open_lock_file(run_dir / LOCK_FILE)
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


def _open_lock_file(path: Path) -> int:
    """Open (or create) the lock file, never following a symlink and refusing anything but a
    regular file of one link: the lock is truncated and written, so a ``.lock`` pointing at
    another file must not be. Raises :class:`RunLockFileError` naming the problem and the fix."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        info = None
    if info is not None and not stat.S_ISREG(info.st_mode):
        _refuse(path, _kind(info.st_mode))
    flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY
    try:
        fd = os.open(path, flags, 0o644)
    except OSError as e:  # swapped for a symlink or folder since lstat (ELOOP, EISDIR...)
        _refuse(path, f"not a regular file ({e.strerror})")
    opened = os.fstat(fd)
    if not stat.S_ISREG(opened.st_mode) or opened.st_nlink != 1:
        os.close(fd)
        _refuse(
            path, _kind(opened.st_mode) if not stat.S_ISREG(opened.st_mode) else "a hard link to another file"
        )
    return fd


def _kind(mode: int) -> str:
    if stat.S_ISLNK(mode):
        return "a symbolic link"
    return "a folder" if stat.S_ISDIR(mode) else "not a regular file"


def _refuse(path: Path, what: str) -> NoReturn:
    raise RunLockFileError(
        f"{path} is {what}, not the run's lock file; nothing was changed. Remove it (a trainer "
        "creates its own), or choose another run.name"
    )


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


__all__ = ["LOCK_FILE", "RunBusyError", "RunLockFileError", "acquire", "release", "run_lock"]
