"""Calling an environment's ``check`` so that it can neither crash the caller nor stall it.

:func:`guarded_check` is what :meth:`veriloop.envs.VerifierEnv.step` calls:

* an exception raised by ``check`` becomes a verdict with ``error="crash"`` (``reason``
  ``"verifier_error"``, the exception in ``details["message"]``), counted in the verifier stats
  and logged once per environment class with its traceback -- one hostile answer that trips a
  verifier bug must not end training or evaluation;
* a ``check`` that is not one of veriloop's built-in checks (:data:`BOUNDED_CHECKS`: a user's
  environment, a subclass that overrides ``check``, the dataset environment, which calls the
  user's function) runs in a helper thread under the environment's ``check_timeout_s``
  (:data:`DEFAULT_CHECK_TIMEOUT_S` unless set, the math verifier's deadline); a late one gives
  ``error="timeout"``. Python cannot kill a thread: the late check is abandoned and runs on
  (daemon thread), its result discarded. The built-in checks bound their own time (worker
  processes with deadlines, or linear-time pure Python), so they run inline;
* ``KeyboardInterrupt`` and ``SystemExit`` are never swallowed.
"""

from __future__ import annotations

import logging
import math
import threading
from typing import Any

from veriloop.envs.verifiers import stats
from veriloop.envs.verifiers.verdict import Verdict

#: Deadline of a user environment's ``check`` (seconds): the math verifier's default.
DEFAULT_CHECK_TIMEOUT_S = 5.0
#: The checks that bound their own time (``module.qualname`` of the ``check`` function): they run
#: inline, with no thread deadline on top (the math check's own deadline excludes worker start-up).
BOUNDED_CHECKS = frozenset(
    {
        "veriloop.envs.math_env.MathVerifyEnv.check",
        "veriloop.envs.points24.env.Points24Env.check",
        "veriloop.envs.solve_verify.SolveVerifyEnv.check",
        "veriloop.interop.reasoning_gym_env.ReasoningGymEnv.check",
    }
)
_LOG = logging.getLogger(__name__)
_LOGGED: set[type] = set()


def check_deadline(env: Any) -> float | None:
    """Seconds ``env.check`` may take here; ``None`` = no deadline (a built-in check, or ``inf``)."""
    timeout = getattr(env, "check_timeout_s", None)
    if timeout is None:
        check = type(env).check
        return (
            None if f"{check.__module__}.{check.__qualname__}" in BOUNDED_CHECKS else DEFAULT_CHECK_TIMEOUT_S
        )
    if not timeout > 0:
        raise ValueError(f"check_timeout_s must be > 0 seconds (math.inf: no deadline), got {timeout!r}")
    return None if math.isinf(timeout) else float(timeout)


def _failed(error: str, message: str) -> Verdict:
    stats.count("crashes" if error == "crash" else "timeouts")
    return Verdict(
        correct=False,
        error=error,  # type: ignore[arg-type]
        feedback=f"The verifier failed ({error}); this episode is stopped.",
        reason="verifier_error",
        details={"message": message[:300]},
    )


def _crashed(env: Any, exc: Exception) -> Verdict:
    if type(env) not in _LOGGED:
        _LOGGED.add(type(env))
        _LOG.warning("%s.check raised; the step is a verifier error", type(env).__name__, exc_info=exc)
    return _failed("crash", f"{type(exc).__name__}: {exc}")


def _checked(verdict: Any) -> Verdict:
    if not isinstance(verdict, Verdict):
        raise TypeError(f"check() must return a Verdict, got {type(verdict).__name__}")
    return verdict


def guarded_check(env: Any, response: str, task: Any) -> Verdict:
    """``env.check(response, task)`` under the rules of the module docstring."""
    timeout = check_deadline(env)
    if timeout is None:
        try:
            return _checked(env.check(response, task))
        except Exception as exc:  # noqa: BLE001 - a verifier failure is data, never a crash
            return _crashed(env, exc)
    box: list[Any] = []

    def run() -> None:
        try:
            box.append(_checked(env.check(response, task)))
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread below
            box.append(exc)

    thread = threading.Thread(target=run, name=f"veriloop-check-{type(env).__name__}", daemon=True)
    thread.start()
    thread.join(timeout)
    if not box:
        return _failed("timeout", f"{type(env).__name__}.check gave no verdict within {timeout:g} s")
    outcome = box[0]
    if isinstance(outcome, Exception):
        return _crashed(env, outcome)
    if isinstance(outcome, BaseException):
        raise outcome
    return outcome  # type: ignore[no-any-return]
