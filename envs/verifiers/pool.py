"""A pool of sandboxed worker processes with hard, caller-enforced deadlines.

Why not ``multiprocessing.Pool`` or ``concurrent.futures``: neither can kill one stuck task without
tearing down the whole pool, and their spawn/forkserver start methods re-run the caller's unguarded
``__main__`` code in every worker. Here each worker is a fresh interpreter running
:mod:`._worker` (``subprocess``, JSON lines over pipes); the calling thread owns one worker for the
duration of a request, and if the reply does not arrive within the deadline the worker is killed
(SIGKILL) and a replacement is started at once. No ``signal.alarm`` (it only works in the main thread
and cannot interrupt C code).

* Each worker caps its address space (``RLIMIT_AS``, default :data:`DEFAULT_MEMORY_BYTES`).
* Every request carries a fresh random id that its reply must echo: a reply to anything else means
  the worker's pipe was written by someone else, so the worker is replaced and the request is a
  ``"crash"`` (a stray line can never answer the next request).
* Two roles, two pools: :func:`get_pool` (math-verify) and :func:`get_scorer_pool` (third-party
  scorers, each call jailed by :mod:`.sandbox`; its workers start with an almost empty environment,
  :data:`SCORER_ENV_KEYS`). A scorer pool removes the jail folders of dead workers
  (:func:`.sandbox.sweep_leftovers`, in a background thread) when it starts and after it kills a worker.
* The deadline counts from the moment the request is written to a ready worker: waiting for a free
  slot, or for a (re)started worker to import math-verify (~1 s), does not eat into it.
* Thread-safe: at most ``size`` requests run at once; further callers wait for a free slot, served
  first-in, first-out (:class:`FifoSlots`: a released slot is handed to the longest waiter, so a
  caller that just finished cannot jump the queue).
* :func:`get_pool` creates the module-level pool lazily (size ``max(2, os.cpu_count())``), re-creates
  it in a forked child, and shuts it down at exit. :meth:`WorkerPool.start` launches the workers
  without waiting for them (the math environments call it when they are made), so the ~2-4 s import
  and warm-up of math-verify overlaps with model loading instead of delaying the first check.

**How long a check can take.** A request holds its slot for at most ``W + timeout`` seconds, where
``W`` is the wait for its worker to become ready: 0 for a warm worker, the worker's start-up (about
2-4 s, capped at :data:`STARTUP_TIMEOUT_S`) right after a cold start or after the worker it replaces
was killed. With FIFO slots, a caller that finds ``q`` requests queued ahead of it starts within
``ceil((q + 1) / size) - 1`` slot turns, so its total time is at most
``ceil((q + 1) / size) * (W + timeout)``: with nothing queued, one ``timeout`` (5 s by default) plus
``W``; a batch through :func:`~.math_check.check_math_batch` never queues more than ``size`` items
of its own.
"""

from __future__ import annotations

import atexit
import collections
import json
import os
import secrets
import select
import subprocess
import sys
import threading
import time
from typing import Any, Literal

DEFAULT_MEMORY_BYTES = 1 << 30  # 1 GiB of address space per worker
STARTUP_TIMEOUT_S = 120.0  # generous: a cold start imports sympy and the LaTeX parser
Status = Literal["ok", "timeout", "crash", "memory"]
Role = Literal["math", "scorer"]
#: The only variables a scorer worker inherits (so no secret of the caller's reaches third-party code).
SCORER_ENV_KEYS = ("PATH", "PYTHONPATH", "LANG", "LC_ALL", "TMPDIR")
#: Fixed for scorer workers: one BLAS thread (they fork a jail per call, which wants a single thread).
SCORER_ENV_FIXED = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def _scorer_env() -> dict[str, str]:
    env = {key: os.environ[key] for key in SCORER_ENV_KEYS if key in os.environ}
    return {**env, **SCORER_ENV_FIXED}


class FifoSlots:
    """A counting semaphore that serves waiters in arrival order (``threading.Semaphore`` does not).

    ``release`` hands the slot straight to the longest-waiting thread, so a thread that releases and
    re-acquires at once queues behind it. Usable as a context manager.
    """

    def __init__(self, size: int) -> None:
        self._free = size
        self._lock = threading.Lock()
        self._waiters: collections.deque[threading.Event] = collections.deque()

    def acquire(self) -> None:
        with self._lock:
            if self._free > 0 and not self._waiters:
                self._free -= 1
                return
            turn = threading.Event()
            self._waiters.append(turn)
        turn.wait()  # set by release(), which passed its slot to us

    def release(self) -> None:
        with self._lock:
            if self._waiters:
                self._waiters.popleft().set()
            else:
                self._free += 1

    @property
    def waiting(self) -> int:
        """Threads queued for a slot (for diagnostics)."""
        with self._lock:
            return len(self._waiters)

    def __enter__(self) -> FifoSlots:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class _Worker:
    """One worker process and the read buffer of its reply pipe."""

    def __init__(self, memory_bytes: int, role: Role = "math") -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "veriloop.envs.verifiers._worker", str(memory_bytes), role],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            bufsize=0,
            env=_scorer_env() if role == "scorer" else None,
        )
        self.ready = False
        self._buffer = b""

    def send(self, message: Any) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write((json.dumps(message) + "\n").encode())

    def receive(self, timeout: float) -> Any | None:
        """The next JSON reply, ``None`` if none arrives within ``timeout``; EOFError if it died."""
        assert self.process.stdout is not None
        fd = self.process.stdout.fileno()
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buffer:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([fd], [], [], remaining)[0]:
                return None
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                raise EOFError("worker closed its pipe")
            self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        return json.loads(line)

    def poll_ready(self) -> bool:
        """Non-blocking: mark the worker ready if its ready line has arrived."""
        if not self.ready and self.process.stdout is not None:
            if select.select([self.process.stdout.fileno()], [], [], 0)[0]:
                self.wait_ready()
        return self.ready

    def wait_ready(self) -> bool:
        if not self.ready:
            try:
                self.ready = self.receive(STARTUP_TIMEOUT_S) == ["ready", None]
            except (EOFError, OSError, ValueError):
                self.ready = False
        return self.ready

    def kill(self) -> None:
        """SIGKILL the process and close its pipes (safe to call twice)."""
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(timeout=10)
        for pipe in (self.process.stdin, self.process.stdout):
            if pipe is not None:
                pipe.close()


class WorkerPool:
    """Run ``(task, args)`` requests on worker processes, killing any that overruns its deadline.

    Args:
        size: Maximum number of workers (and of concurrent requests).
        memory_bytes: Address-space cap (``RLIMIT_AS``) of each worker.
        role: ``"math"`` or ``"scorer"`` (see :mod:`._worker`).
    """

    def __init__(self, size: int, memory_bytes: int = DEFAULT_MEMORY_BYTES, role: Role = "math") -> None:
        if size < 1:
            raise ValueError(f"WorkerPool size must be >= 1, got {size}")
        self.size = size
        self.memory_bytes = memory_bytes
        self.role: Role = role
        self._slots = FifoSlots(size)
        self._lock = threading.Lock()
        self._idle: list[_Worker] = []
        self._live: set[_Worker] = set()
        self._started = False
        self._closed = False

    def run(self, task: str, args: tuple[Any, ...], timeout: float) -> tuple[Status, Any]:
        """Run ``task(*args)`` in a worker; return ``(status, value)``.

        ``status`` is ``"ok"`` (``value`` is the task's return value, JSON round-tripped),
        ``"timeout"`` (the worker was killed after ``timeout`` seconds), ``"memory"`` (the worker hit
        its memory cap) or ``"crash"`` (the task raised, or the worker died; ``value`` says how).
        """
        with self._slots:
            worker = self._take()
            if not worker.wait_ready():
                self._replace(worker)
                return "crash", f"worker failed to start (exit code {worker.process.poll()})"
            request_id = secrets.token_hex(16)
            try:
                worker.send([request_id, task, list(args)])
                reply = worker.receive(timeout)
            except (EOFError, OSError, ValueError) as exc:
                self._replace(worker)
                return "crash", f"worker died ({type(exc).__name__}, exit code {worker.process.poll()})"
            if reply is None:
                self._replace(worker)
                return "timeout", f"no reply within {timeout:g} s"
            if not (isinstance(reply, list) and len(reply) == 3 and reply[0] == request_id):
                self._replace(worker)  # someone else wrote to its pipe: nothing it says can be trusted
                return "crash", "the worker's reply did not answer this request; worker replaced"
            _, status, value = reply
            if status not in ("ok", "memory", "crash"):
                self._replace(worker)
                return "crash", f"the worker replied with an unknown status {str(status)[:40]!r}"
            if status == "memory":
                self._replace(worker)  # state after a MemoryError is not trustworthy
            else:
                self._give_back(worker)
            return status, value

    @property
    def started(self) -> bool:
        """True once the workers have been launched (by :meth:`start` or the first request)."""
        return self._started

    def start(self) -> None:
        """Launch every worker now, without waiting for them to be ready (idempotent)."""
        with self._lock:
            self._start_locked()

    def _start_locked(self) -> None:
        if self._closed:
            raise RuntimeError("WorkerPool is shut down; create a new one (or call get_pool()).")
        if not self._started:  # start every worker at once so their imports overlap
            self._started = True
            self._idle = [_Worker(self.memory_bytes, self.role) for _ in range(self.size)]
            self._live.update(self._idle)
            self._sweep()

    def _sweep(self) -> None:
        """Scorer pools: remove the jail folders of dead workers, off the calling thread."""
        if self.role == "scorer":
            from veriloop.envs.verifiers.sandbox import sweep_leftovers

            threading.Thread(target=sweep_leftovers, name="veriloop-jail-sweep", daemon=True).start()

    def _take(self) -> _Worker:
        with self._lock:
            self._start_locked()
            ready = [w for w in self._idle if w.poll_ready()]
            worker = ready[-1] if ready else self._idle[-1]
            self._idle.remove(worker)
            return worker

    def _give_back(self, worker: _Worker) -> None:
        with self._lock:
            if not self._closed:
                self._idle.append(worker)
                return
        worker.kill()

    def _replace(self, worker: _Worker) -> None:
        """Kill ``worker`` and start its replacement now, so it warms up while others work."""
        worker.kill()
        with self._lock:
            self._live.discard(worker)
            if not self._closed:
                fresh = _Worker(self.memory_bytes, self.role)
                self._live.add(fresh)
                self._idle.append(fresh)
        self._sweep()  # the killed worker's jail folder, if it was killed mid-call

    @property
    def worker_pids(self) -> list[int]:
        """Process ids of the live workers (for tests and diagnostics)."""
        with self._lock:
            return [w.process.pid for w in self._live]

    def shutdown(self) -> None:
        """Stop every worker (idle ones politely, busy ones with SIGKILL)."""
        with self._lock:
            self._closed = True
            workers, self._idle = list(self._live), []
            self._live.clear()
        for worker in workers:
            try:
                worker.send(None)
                worker.process.wait(timeout=0.5)
            except (OSError, ValueError, subprocess.TimeoutExpired):
                pass
            worker.kill()


_POOLS: dict[Role, WorkerPool] = {}
_POOL_PIDS: dict[Role, int] = {}
_POOL_LOCK = threading.Lock()


def _shared(role: Role) -> WorkerPool:
    with _POOL_LOCK:
        if role not in _POOLS or _POOL_PIDS[role] != os.getpid():
            _POOLS[role] = WorkerPool(max(2, os.cpu_count() or 1), role=role)
            _POOL_PIDS[role] = os.getpid()
        return _POOLS[role]


def get_pool() -> WorkerPool:
    """The shared math-verify pool, created on first use (size ``max(2, os.cpu_count())``)."""
    return _shared("math")


def get_scorer_pool() -> WorkerPool:
    """The shared pool of third-party scorers (role ``"scorer"``, every call jailed), created on first use."""
    return _shared("scorer")


def shutdown_pool() -> None:
    """Shut the shared pools down (each is re-created on its next use)."""
    with _POOL_LOCK:
        pools = [(p, _POOL_PIDS[r]) for r, p in _POOLS.items()]
        _POOLS.clear()
    for pool, pid in pools:
        if pid == os.getpid():
            pool.shutdown()


atexit.register(shutdown_pool)
