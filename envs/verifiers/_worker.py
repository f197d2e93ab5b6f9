"""A sandboxed verifier worker process: ``python -m veriloop.envs.verifiers._worker MEMORY_BYTES [ROLE]``.

The worker caps its own address space with ``RLIMIT_AS``, warms up for its role, prints a
``["ready", null]`` line, then serves requests, one JSON line each way:

* request: ``[request_id, task, [args...]]`` on stdin (EOF or ``null`` ends the worker);
* reply: ``[request_id, status, value]`` on stdout, status ``"ok"``, ``"memory"`` (a ``MemoryError``
  was raised) or ``"crash"`` (any other exception, ``value`` says which). The caller checks that the
  id is the one it sent, so a stray line can never answer another request.

Roles (:data:`ROLES`): ``"math"`` (default) imports and warms math-verify and serves ``math``;
``"scorer"`` serves third-party scorers named as ``"package.module:function"`` entry points
(:func:`entry_point`; e.g. reasoning-gym's), each call in a jail of its own
(:mod:`.sandbox`): third-party code never shares a process with math-verify or with the reply pipe.

JSON (never pickle) keeps the parent safe even from a compromised worker. Deadlines are NOT enforced
here: the parent kills a worker that overruns (:mod:`.pool`), so no ``signal.alarm`` is ever used.
The worker is started as a fresh interpreter (not forked, not via multiprocessing), so it never
re-imports the caller's ``__main__`` script.
"""

from __future__ import annotations

import importlib
import json
import os
import resource
import signal
import sys
from collections.abc import Callable
from typing import Any, TextIO


def _parse(latex: str) -> list[Any] | None:
    """math-verify parse; ``None`` when it raises an ordinary error (bad LaTeX is the model's fault).

    Only math-verify's LaTeX extraction is used. Its default also tries ``ExprExtractionConfig``,
    which (a) hands plain-text matches to sympy's ``parse_expr`` -- an ``eval`` underneath -- and
    (b) when the LaTeX does not parse, falls back to the LAST NUMBER in the text, so ``2 ** 3``
    would count as ``3``. Our answers always arrive wrapped in ``$...$``, which the LaTeX
    extractor reads (``1/2``, ``0.5``, ``x = 3``, ``1,000`` included).

    ``MemoryError`` and ``RecursionError`` propagate: they are verifier failures, not wrong answers.
    (math-verify also swallows exceptions internally; those cannot be told apart from "no match".)
    """
    from math_verify import LatexExtractionConfig, parse

    try:
        return parse(  # type: ignore[no-any-return]
            latex,
            extraction_config=[LatexExtractionConfig()],
            parsing_timeout=None,  # type: ignore[arg-type]
            raise_on_error=True,
        )
    except (MemoryError, RecursionError):
        raise
    except Exception:  # noqa: BLE001 - an unparseable answer is judged, not crashed on
        return None


def math_task(answer: str, gold: str, float_rounding: int = 6) -> tuple[str, str]:
    """Compare one extracted answer to its gold with math-verify.

    Args:
        answer: Extracted answer, already wrapped for math-verify (``$...$``).
        gold: Gold answer, wrapped the same way.
        float_rounding: When either side is a decimal, both are rounded to this many decimal places
            before they are compared (math-verify's ``float_rounding``).

    Returns:
        ``(outcome, detail)`` with outcome ``"correct"``, ``"wrong"``, ``"unparseable"`` (the answer
        parses to nothing) or ``"bad_gold"`` (the gold parses to nothing: a dataset problem);
        ``detail`` is the parsed answer's text form (capped at 200 chars). Exceptions raised by
        ``verify`` propagate (the parent reports them as ``crash``/``memory``).
    """
    from math_verify import verify

    gold_parsed = _parse(gold)
    if not gold_parsed:
        return "bad_gold", ""
    answer_parsed = _parse(answer)
    if not answer_parsed:
        return "unparseable", ""
    ok = verify(
        gold_parsed,
        answer_parsed,
        float_rounding=int(float_rounding),
        timeout_seconds=None,
        raise_on_error=True,
    )
    return ("correct" if ok else "wrong"), str(answer_parsed[-1])[:200]


def entry_point(name: str) -> Callable[..., Any]:
    """The function a ``"package.module:function"`` string names (as Gymnasium's entry points),
    imported on first use. A scorer task is named this way, so this module names no package of
    its callers (reasoning-gym's scorer is ``veriloop.interop.reasoning_gym_env:score_in_worker``)."""
    module, sep, attr = name.partition(":")
    if not (sep and module and attr):
        raise ValueError(f"task {name!r} is not a 'package.module:function' entry point")
    function = getattr(importlib.import_module(module), attr)
    if not callable(function):
        raise TypeError(f"task {name!r} names {type(function).__name__}, not a function")
    return function  # type: ignore[no-any-return]


class _EntryPoints(dict[str, Callable[..., Any]]):
    """The scorer role's tasks: any ``"module:function"`` entry point, imported on its first request."""

    def __missing__(self, name: str) -> Callable[..., Any]:
        self[name] = entry_point(name)
        return self[name]


ROLES: dict[str, dict[str, Callable[..., Any]]] = {
    "math": {"math": math_task},
    "scorer": _EntryPoints(),
}
TASKS: dict[str, Callable[..., Any]] = ROLES["math"]


def _limit_memory(max_bytes: int) -> None:
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    if hard != resource.RLIM_INFINITY:
        max_bytes = min(max_bytes, hard)
    resource.setrlimit(resource.RLIMIT_AS, (max_bytes, hard))


#: Comparisons a worker makes once before it says it is ready: the first symbolic simplification,
#: radical, decimal, interval and set comparison in a process load sympy's lazy modules and caches
#: (~0.2-1 s, several times that on a loaded machine), which would otherwise land inside the deadline
#: of the first request of each kind, on every fresh or replaced worker.
WARM_UP_PAIRS = (
    ("$\\frac{1}{2}$", "$0.5$"),
    ("$(x+1)^2$", "$x^2 + 2x + 1$"),
    ("$4$", "$2\\sqrt{3}$"),
    ("$(1,2]$", "$(1, 2]$"),
    ("$\\{3, 2, 1\\}$", "$\\{1, 2, 3\\}$"),
    ("$60^\\circ$", "$\\frac{\\pi}{3}$"),
    ("$x = 3$", "$3$"),
)


def _warm_up() -> None:
    import logging

    # math-verify warns that its own signal-based timeout is off: the parent enforces deadlines.
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    for answer, gold in WARM_UP_PAIRS:
        math_task(answer, gold)


def _handle(request: Any, tasks: dict[str, Callable[..., Any]] | None = None) -> list[Any]:
    tasks = TASKS if tasks is None else tasks
    request_id = request[0] if isinstance(request, list) and request else None
    try:
        _, task, args = request
        return [request_id, "ok", tasks[task](*args)]
    except MemoryError:
        return [request_id, "memory", "MemoryError"]
    except Exception as exc:  # noqa: BLE001 - every failure is reported to the parent, never hidden
        return [request_id, "crash", f"{type(exc).__name__}: {exc}"[:300]]


def serve(requests: TextIO, replies: TextIO, tasks: dict[str, Callable[..., Any]] | None = None) -> None:
    """Answer JSON-line requests until EOF or a ``null`` request."""
    replies.write('["ready", null]\n')
    replies.flush()
    for line in requests:
        request = json.loads(line)
        if request is None:
            return
        replies.write(json.dumps(_handle(request, tasks)) + "\n")
        replies.flush()


def main(argv: list[str]) -> None:
    """Process entry point: protocol on the original stdout, stray prints go to stderr.

    When the parent goes away (its end of a pipe closes, or Ctrl-C reaches the whole process group)
    the worker exits at once and silently: no ``BrokenPipeError`` or ``KeyboardInterrupt``
    traceback lands on the user's terminal. The parent kills its workers itself, so SIGINT is ignored.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        _run(argv)
    except (BrokenPipeError, ConnectionResetError, EOFError):
        pass
    try:
        sys.stderr.flush()
    except OSError:
        pass
    # skip the interpreter's own flush of stdout: into a closed pipe it prints "Exception ignored ..."
    os._exit(0)


def _run(argv: list[str]) -> None:
    # A parent running torch with OMP_PROC_BIND=true has its main thread pinned to one core, and a
    # child inherits that mask: the worker would then share that core with the training thread.
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, range(os.cpu_count() or 1))
    _limit_memory(int(argv[0]))
    role = argv[1] if len(argv) > 1 else "math"
    replies = os.fdopen(os.dup(sys.stdout.fileno()), "w", encoding="utf-8")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    if role == "math":
        _warm_up()
    else:
        from veriloop.envs.verifiers.sandbox import protect_worker

        protect_worker()
    serve(sys.stdin, replies, ROLES[role])


if __name__ == "__main__":
    main(sys.argv[1:])
