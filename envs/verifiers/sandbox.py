"""Run third-party scoring code on model text in a confined, short-lived process.

Some scorers we do not own (reasoning-gym's, for one) hand the model's answer to ``eval`` or to
sympy's ``parse_expr``: model text may then run as Python. Such code runs only here, in the
**scorer worker** (a :mod:`.pool` worker of role ``"scorer"``, a process apart from the math
workers, started with an almost empty environment). For every request the scorer worker forks a
**jail**: a grandchild of the caller that runs the scorer and nothing else. Before the scorer's
first line, the jail

* closes every file descriptor it inherited except the write end of its own result pipe (so the
  worker's reply channel to the caller is out of its reach) and points 0, 1, 2 at ``/dev/null``;
* clears its environment (``os.environ``) and moves into a fresh private temporary folder;
* caps address space (inherited), file size (:data:`MAX_FILE_BYTES`), open files, CPU seconds and
  forbids new processes (``RLIMIT_NPROC`` 0); is non-dumpable (no other process of its user may
  ``ptrace`` it) and dies with its worker;
* when it can: leaves the network (a new, empty network namespace), enters a ``chroot`` of the private
  folder (nothing outside it can be read or written; no ``/proc``), and, as root, drops to the
  ``nobody`` user and group.

What the jail could apply is :func:`isolation` (run as root on Linux: all of it; as another user, the
kernel must allow unprivileged user namespaces for the network and ``chroot`` steps). The worker
forwards only a validated JSON reply (``["ok", number]``, capped at :data:`MAX_REPLY_BYTES`), under
the request id of the caller, so a jail can at worst decide its own request's score (which the
scorer it runs decides anyway), never another request's, and never desynchronise the pool.

The scorer worker warms each scorer once on trusted text (the dataset's own gold answer) before
jailing anything, so lazy imports happen outside the ``chroot``.
"""

from __future__ import annotations

import ctypes
import json
import math
import os
import resource
import select
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

MAX_REPLY_BYTES = 4096
MAX_FILE_BYTES = 1 << 20  # a scorer may write scratch files of at most 1 MiB, in its folder only
MAX_OPEN_FILES = 16
NOBODY = 65534  # uid and gid of ``nobody`` on Linux
_CLONE_NEWUSER = 0x10000000
_CLONE_NEWNET = 0x40000000
_PR_SET_PDEATHSIG = 1
_PR_SET_DUMPABLE = 4
_RESULT_FD = 3  # the jail's result pipe, moved here before everything else is closed


def _libc() -> Any:
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:  # pragma: no cover - not Linux
        return None


_LIBC = _libc()


def _unshare(flags: int) -> bool:
    return hasattr(_LIBC, "unshare") and _LIBC.unshare(flags) == 0


def _prctl(option: int, value: int) -> None:
    if hasattr(_LIBC, "prctl"):  # Linux only
        _LIBC.prctl(option, value, 0, 0, 0)


def _write_id_map(path: str, inside: int, outside: int) -> None:
    with open(path, "w", encoding="ascii") as f:
        f.write(f"{inside} {outside} 1\n")


def _leave_network_and_files(folder: str) -> list[str]:
    """New network namespace + ``chroot`` (+ drop to ``nobody`` as root); the steps that worked."""
    done: list[str] = []
    uid, gid = os.getuid(), os.getgid()
    if uid == 0:
        if _unshare(_CLONE_NEWNET):
            done.append("network")
    elif _unshare(_CLONE_NEWUSER | _CLONE_NEWNET):  # an unprivileged user namespace, if allowed
        done.append("network")
        try:  # map ourselves, so that files keep an owner; "deny" is required before gid_map
            with open("/proc/self/setgroups", "w", encoding="ascii") as f:
                f.write("deny")
            _write_id_map("/proc/self/uid_map", uid, uid)
            _write_id_map("/proc/self/gid_map", gid, gid)
        except OSError:
            pass
    try:
        os.chroot(folder)
        os.chdir("/")
        done.append("files")
    except OSError:
        os.chdir(folder)
    if uid == 0:
        os.setgroups([])
        os.setgid(NOBODY)
        os.setuid(NOBODY)
        done.append("user")
    return done


def _set_limits(cpu_seconds: float) -> None:
    cpu = max(1, math.ceil(cpu_seconds))
    for limit, value in (
        (resource.RLIMIT_FSIZE, MAX_FILE_BYTES),
        (resource.RLIMIT_NOFILE, MAX_OPEN_FILES),
        (resource.RLIMIT_NPROC, 0),
        (resource.RLIMIT_CORE, 0),
        (resource.RLIMIT_CPU, cpu),
    ):
        resource.setrlimit(limit, (value, value))


def _confine(result_fd: int, folder: str, cpu_seconds: float) -> list[str]:
    """Everything of the module docstring, in the jail, before any scorer code runs."""
    os.dup2(result_fd, _RESULT_FD)
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    os.closerange(_RESULT_FD + 1, resource.getrlimit(resource.RLIMIT_NOFILE)[0])
    os.environ.clear()
    done = _leave_network_and_files(folder)
    _set_limits(cpu_seconds)
    # after the uid change, which resets both: die with the worker, and let no other jail of the
    # same user attach to this one (ptrace) and rewrite its score
    _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    _prctl(_PR_SET_DUMPABLE, 0)
    return done


def protect_worker() -> None:
    """Make the calling scorer worker non-dumpable: a jail running as the same user (no root) can
    then not ``ptrace`` its parent worker, whatever the machine's Yama setting."""
    _prctl(_PR_SET_DUMPABLE, 0)


def _jail_main(
    fn: Callable[..., Any], args: tuple[Any, ...], result_fd: int, folder: str, cpu: float
) -> None:
    """The jail's whole life: confine, run ``fn(*args)``, write one JSON reply, exit. Never returns."""
    try:
        try:
            done = _confine(result_fd, folder, cpu)
        except BaseException as exc:  # noqa: BLE001 - never run the scorer unconfined
            reply: list[Any] = ["crash", f"sandbox setup failed: {type(exc).__name__}: {exc}"]
        else:
            try:
                reply = ["ok", fn(*args), done]
            except MemoryError:
                reply = ["memory", "MemoryError"]
            except BaseException as exc:  # noqa: BLE001 - reported to the caller, never hidden
                reply = ["crash", f"{type(exc).__name__}: {exc}"[:300]]
        os.write(_RESULT_FD, json.dumps(reply).encode()[:MAX_REPLY_BYTES])
    finally:
        os._exit(0)


def _read_reply(fd: int, deadline: float) -> bytes | None:
    """Up to :data:`MAX_REPLY_BYTES` from ``fd`` until EOF; ``None`` when ``deadline`` passes first."""
    data = b""
    while len(data) <= MAX_REPLY_BYTES:
        remaining = deadline - time.monotonic()
        if remaining <= 0 or not select.select([fd], [], [], remaining)[0]:
            return None
        chunk = os.read(fd, MAX_REPLY_BYTES + 1)
        if not chunk:
            break
        data += chunk
    return data


def _validate(raw: bytes) -> tuple[str, Any]:
    """The jail's reply as ``(status, value)``; anything but the three documented shapes is a crash."""
    try:
        reply = json.loads(raw)
    except ValueError:
        return "crash", "the scorer's process sent no valid reply"
    if isinstance(reply, list) and len(reply) == 3 and reply[0] == "ok":
        _warn_if_partial(reply[2])
        value = reply[1]
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            return "ok", float(value)
        return "crash", f"the scorer returned {str(value)[:80]!r}, not a finite number"
    if isinstance(reply, list) and len(reply) == 2 and reply[0] in ("crash", "memory"):
        return reply[0], str(reply[1])[:300]
    return "crash", "the scorer's process sent a malformed reply"


ALL_STEPS = ("network", "files", "user")
_WARNED: list[bool] = []


def _warn_if_partial(done: Any) -> None:
    """Say once per process, on stderr, which optional jail steps this machine could not apply."""
    expected = ALL_STEPS if os.getuid() == 0 else ALL_STEPS[:2]
    missing = [step for step in expected if not (isinstance(done, list) and step in done)]
    if missing and not _WARNED:
        _WARNED.append(True)
        sys.stderr.write(
            f"veriloop: third-party scorers run with partial isolation here (missing: {', '.join(missing)}); "
            "run as root, or allow unprivileged user namespaces (sysctl kernel.unprivileged_userns_clone=1), "
            "for the full jail\n"
        )


def run_jailed(fn: Callable[..., Any], args: tuple[Any, ...], timeout: float) -> tuple[str, Any]:
    """``fn(*args)`` in a fresh jail (module docstring): ``("ok", float)``, ``("timeout", msg)``,
    ``("memory", msg)`` or ``("crash", msg)``. ``fn`` must return a number."""
    folder = tempfile.mkdtemp(prefix="veriloop-jail-")
    if os.getuid() == 0:
        os.chown(folder, NOBODY, NOBODY)
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the jail
        os.close(read_fd)
        _jail_main(fn, args, write_fd, folder, timeout + 1)
    os.close(write_fd)
    try:
        raw = _read_reply(read_fd, time.monotonic() + timeout)
    finally:
        os.close(read_fd)
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        os.waitpid(pid, 0)
        shutil.rmtree(folder, ignore_errors=True)
    if raw is None:
        return "timeout", f"no reply within {timeout:g} s"
    return _validate(raw)


def _probe() -> int:
    return 1


def isolation(timeout: float = 10.0) -> list[str]:
    """Which optional steps a jail on this machine gets: a subset of ``["network", "files", "user"]``
    (see the module docstring). Forks one jail to find out."""
    folder = tempfile.mkdtemp(prefix="veriloop-jail-")
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read_fd)
        _jail_main(_probe, (), write_fd, folder, timeout)
    os.close(write_fd)
    try:
        raw = _read_reply(read_fd, time.monotonic() + timeout)
    finally:
        os.close(read_fd)
        os.waitpid(pid, 0)
        shutil.rmtree(folder, ignore_errors=True)
    reply = json.loads(raw or b"null")
    return list(reply[2]) if isinstance(reply, list) and len(reply) == 3 else []
