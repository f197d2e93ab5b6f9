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
* when it can: leaves the network (a new, empty network namespace), mounts over its private folder a
  size-limited ``tmpfs`` seen only in its own mount namespace (the **quota**: :data:`MAX_JAIL_BYTES`
  in all, :data:`MAX_JAIL_ENTRIES` files and folders; it vanishes with the jail, so nothing it wrote
  ever reaches the disk), enters a ``chroot`` of that folder (nothing outside it can be read or
  written; no ``/proc``), and, as root, drops to the ``nobody`` user and group. Without the quota
  step, the jail may write no byte to any file (``RLIMIT_FSIZE`` 0).

What the jail could apply is :func:`isolation` (run as root on Linux: all of it; as another user, the
kernel must allow unprivileged user namespaces for the network, quota and ``chroot`` steps).

Cleanup never counts against a deadline: the folder is removed with one ``rmdir`` when the quota held
(it is empty on disk), else by a detached cleaner process that outlives a killed worker. Each folder
is named after its scorer worker's pid (``veriloop-jail-PID-*``), and :func:`sweep_leftovers`
(called when a scorer pool starts and after it kills a worker) removes the folders of dead workers.

The worker forwards only a validated JSON reply (``["ok", number]``, capped at :data:`MAX_REPLY_BYTES`), under
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
MAX_JAIL_BYTES = 8 << 20  # the jail's tmpfs: at most 8 MiB in all ...
MAX_JAIL_ENTRIES = 64  # ... and at most 64 files and folders
MAX_OPEN_FILES = 16
JAIL_PREFIX = "veriloop-jail-"
NOBODY = 65534  # uid and gid of ``nobody`` on Linux
_CLONE_NEWNS = 0x00020000
_CLONE_NEWUSER = 0x10000000
_CLONE_NEWNET = 0x40000000
_PR_SET_PDEATHSIG = 1
_PR_SET_DUMPABLE = 4
_MS_NOSUID, _MS_NODEV, _MS_NOEXEC, _MS_REC, _MS_PRIVATE = 0x2, 0x4, 0x8, 0x4000, 0x40000
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


def _mount_quota(folder: str) -> bool:
    """Mount the quota ``tmpfs`` over ``folder``, private to this (new) mount namespace."""
    if not hasattr(_LIBC, "mount"):  # pragma: no cover - not Linux
        return False
    if _LIBC.mount(b"none", b"/", None, _MS_REC | _MS_PRIVATE, None) != 0:
        return False  # never let the mount propagate to the host's namespace
    options = f"size={MAX_JAIL_BYTES},nr_inodes={MAX_JAIL_ENTRIES + 1},mode=0700"  # + its own root
    if os.getuid() == 0:
        options += f",uid={NOBODY},gid={NOBODY}"
    flags = _MS_NOSUID | _MS_NODEV | _MS_NOEXEC
    return _LIBC.mount(b"tmpfs", folder.encode(), b"tmpfs", flags, options.encode()) == 0  # type: ignore[no-any-return]


def _leave_network_and_files(folder: str) -> list[str]:
    """New network and mount namespaces, quota ``tmpfs``, ``chroot`` (+ ``nobody`` as root); the steps that worked."""
    done: list[str] = []
    uid, gid = os.getuid(), os.getgid()
    mounts = False
    if uid == 0:
        mounts = _unshare(_CLONE_NEWNET | _CLONE_NEWNS)
        if mounts or _unshare(_CLONE_NEWNET):
            done.append("network")
    elif (mounts := _unshare(_CLONE_NEWUSER | _CLONE_NEWNET | _CLONE_NEWNS)) or _unshare(
        _CLONE_NEWUSER | _CLONE_NEWNET
    ):  # an unprivileged user namespace, if allowed
        done.append("network")
        try:  # map ourselves, so that files keep an owner; "deny" is required before gid_map
            with open("/proc/self/setgroups", "w", encoding="ascii") as f:
                f.write("deny")
            _write_id_map("/proc/self/uid_map", uid, uid)
            _write_id_map("/proc/self/gid_map", gid, gid)
        except OSError:
            pass
    quota = mounts and _mount_quota(folder)
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
    if quota:
        done.append("quota")
    return done


def _set_limits(cpu_seconds: float, quota: bool) -> None:
    cpu = max(1, math.ceil(cpu_seconds))
    for limit, value in (
        (resource.RLIMIT_FSIZE, MAX_FILE_BYTES if quota else 0),
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
    _set_limits(cpu_seconds, "quota" in done)
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


ALL_STEPS = ("network", "files", "user", "quota")
_WARNED: list[bool] = []


def _warn_if_partial(done: Any) -> None:
    """Say once per process, on stderr, which optional jail steps this machine could not apply."""
    expected = ALL_STEPS if os.getuid() == 0 else ("network", "files", "quota")
    missing = [step for step in expected if not (isinstance(done, list) and step in done)]
    if missing and not _WARNED:
        _WARNED.append(True)
        sys.stderr.write(
            f"veriloop: third-party scorers run with partial isolation here (missing: {', '.join(missing)}); "
            "run as root, or allow unprivileged user namespaces (sysctl kernel.unprivileged_userns_clone=1), "
            "for the full jail\n"
        )


def _new_folder() -> str:
    """A fresh private folder named after this process (see :func:`sweep_leftovers`)."""
    folder = tempfile.mkdtemp(prefix=f"{JAIL_PREFIX}{os.getpid()}-")
    if os.getuid() == 0:
        os.chown(folder, NOBODY, NOBODY)
    return folder


_CLEANERS: list[int] = []


def _discard(folder: str) -> None:
    """Remove a jail's folder without waiting for it: one ``rmdir`` when the quota kept it empty on
    disk, else a detached cleaner process (it outlives this one if a deadline kills it)."""
    for pid in list(_CLEANERS):  # reap the cleaners that finished
        if os.waitpid(pid, os.WNOHANG)[0]:
            _CLEANERS.remove(pid)
    try:
        os.rmdir(folder)
        return
    except FileNotFoundError:
        return
    except OSError:
        pass
    pid = os.fork()
    if pid == 0:  # the cleaner: holds none of the worker's pipes open (its death must read as EOF)
        try:
            null = os.open(os.devnull, os.O_RDWR)
            for fd in (0, 1, 2):
                os.dup2(null, fd)
            os.closerange(3, resource.getrlimit(resource.RLIMIT_NOFILE)[0])
            shutil.rmtree(folder, ignore_errors=True)
        finally:
            os._exit(0)
    _CLEANERS.append(pid)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_leftovers(folder: str | None = None) -> list[str]:
    """Remove the jail folders (``veriloop-jail-PID-*`` in ``folder``, default the temporary folder)
    whose worker ``PID`` is no longer running: what a killed worker left. Returns the removed paths."""
    folder = folder or tempfile.gettempdir()
    removed: list[str] = []
    try:
        names = os.listdir(folder)
    except OSError:
        return removed
    for name in names:
        pid_text = name[len(JAIL_PREFIX) :].partition("-")[0]
        if not (name.startswith(JAIL_PREFIX) and pid_text.isdigit()) or _pid_alive(int(pid_text)):
            continue
        path = os.path.join(folder, name)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def run_jailed(fn: Callable[..., Any], args: tuple[Any, ...], timeout: float) -> tuple[str, Any]:
    """``fn(*args)`` in a fresh jail (module docstring): ``("ok", float)``, ``("timeout", msg)``,
    ``("memory", msg)`` or ``("crash", msg)``. ``fn`` must return a number."""
    folder = _new_folder()
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
        _discard(folder)
    if raw is None:
        return "timeout", f"no reply within {timeout:g} s"
    return _validate(raw)


def _probe() -> int:
    return 1


def isolation(timeout: float = 10.0) -> list[str]:
    """Which optional steps a jail on this machine gets: a subset of ``["network", "files", "user",
    "quota"]`` (see the module docstring). Forks one jail to find out."""
    folder = _new_folder()
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
        _discard(folder)
    reply = json.loads(raw or b"null")
    return list(reply[2]) if isinstance(reply, list) and len(reply) == 3 else []
