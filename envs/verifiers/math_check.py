"""The math verifier: is the final answer of a response equivalent to the gold answer?

Pipeline for one response (everything before step 4 runs in-process, in linear time):

1. Resource bound: a response over :data:`.extract.MAX_RESPONSE_CHARS` (1,000,000 characters) is
   wrong (``"too_long"``) unscanned.
2. Extraction (:mod:`.extract`): only text after the last ``</think>`` counts; the LAST
   ``\\boxed{}``/``\\fbox{}``/``<answer></answer>`` anchor is the answer; none -> ``"no_answer"``.
   The size cap is on this answer (:data:`.extract.MAX_ANSWER_CHARS`), not on the reasoning before
   it: over the cap -> ``"too_long"``.
3. Screens (:mod:`.screen`): hedged answers (``3 or 4``, ``\\pm``, a list when the gold is one value,
   an equality chain such as ``x = 3 = 4``) -> ``"hedged"``; nesting deeper than
   :data:`.extract.MAX_NESTING` or an obvious evaluation bomb (power tower, huge factorial) ->
   ``"unparseable"`` with ``details["guard"]`` naming the screen; arithmetic on numbers handed back
   as the answer when the gold is a number (``\\boxed{14 - 26}`` for ``-12``) -> ``"unevaluated"``. When answer and gold are both
   plain integers (``42``, ``-7``) the comparison is exact and in-process: no worker is involved.
4. Equivalence: math-verify ``parse`` (LaTeX extraction only: its plain-expression mode would hand the
   text to sympy's ``parse_expr`` and fall back to the last number in it) + ``verify`` in a sandboxed
   worker process (:mod:`.pool`) with a hard deadline ``timeout``. A worker that overruns is SIGKILLed: the verdict then has
   ``error="timeout"`` and ``reason="verifier_error"``; a worker that raised or died gives
   ``error="crash"``, one that hit its memory cap ``error="memory"``. These are verifier failures,
   never scored as wrong answers, and are counted in :func:`.stats.verifier_stats`.

Feedback strings never reveal the gold answer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from veriloop.envs.verifiers import stats
from veriloop.envs.verifiers.extract import MAX_NESTING, MAX_RESPONSE_CHARS, extract
from veriloop.envs.verifiers.pool import get_pool
from veriloop.envs.verifiers.screen import (
    find_bomb,
    is_hedged,
    is_non_finite,
    is_unevaluated,
    without_group_spaces,
)
from veriloop.envs.verifiers.sets import as_set, gold_members, members
from veriloop.envs.verifiers.verdict import Verdict

DEFAULT_TIMEOUT_S = 5.0
#: Decimal places a decimal answer must share with the gold (math-verify's own default): ``0.333333``
#: is paid for ``\\frac{1}{3}`` and ``3.141593`` for ``\\pi``; exact forms are compared exactly.
DEFAULT_FLOAT_ROUNDING = 6
MAX_FLOAT_ROUNDING = 15  # math-verify evaluates to 15 significant digits
MAX_PLAIN_DIGITS = 100  # integers compared in-process; longer digit strings go to a worker
NO_ANSWER_FEEDBACK = "No final answer found: put it in \\boxed{...}."
#: Feedback of a wrong value and of every gold-relative screen alike (the gold's shape stays hidden).
INCORRECT_FEEDBACK = "Your answer {} is incorrect."


@dataclass(frozen=True)
class _Job:
    """An answer that passed every in-process screen and must go to a worker."""

    answer: str
    payload: tuple[str, str]  # (wrapped answer, wrapped gold) for math-verify


def _show(answer: str, limit: int = 200) -> str:
    return answer if len(answer) <= limit else answer[:limit] + "..."


def _wrap(latex: str) -> str:
    """Put math delimiters around ``latex`` unless it already has some (math-verify looks for them).

    An escaped dollar (``\\$16386.17``, a currency sign) is not a delimiter.
    """
    bare = latex.replace("\\$", "")
    return latex if "$" in bare or "\\(" in bare or "\\[" in bare else f"${latex}$"


def _plain_integer(text: str) -> int | None:
    """The value of ``text`` when it is a plain integer literal (``42``, ``-7``, ``+3``), else ``None``."""
    digits = text[1:] if text[:1] in "+-" else text
    if not digits or len(digits) > MAX_PLAIN_DIGITS or not (digits.isascii() and digits.isdigit()):
        return None
    return int(text)


def _compare_integers(answer: str, gold: str) -> Verdict | None:
    """Decide in-process when answer and gold are both plain integers (no worker, no cold start).

    Integer literals are equal exactly when their values are, which is also math-verify's judgement.
    """
    value, gold_value = _plain_integer(answer), _plain_integer(gold)
    if value is None or gold_value is None:
        return None
    if value == gold_value:
        return Verdict(True, feedback="Correct!", parsed=answer, reason="correct")
    return _wrong("wrong_value", INCORRECT_FEEDBACK.format(_show(answer)), answer, as_parsed=str(value))


def _wrong(reason: str, feedback: str, parsed: str | None = None, **details: Any) -> Verdict:
    return Verdict(correct=False, feedback=feedback, parsed=parsed, reason=reason, details=details)


def _check_types(response: object, gold: object) -> None:
    if not isinstance(response, str) or not isinstance(gold, str):
        raise TypeError(
            f"check_math expects (response: str, gold: str), got ({type(response).__name__}, "
            f"{type(gold).__name__}); convert numeric golds with str()."
        )


def _prepare(response: str, gold: str) -> Verdict | _Job:
    """Steps 1-3 of the module docstring: a final verdict, or a job for a worker."""
    found = extract(response)
    if found.status == "too_long":
        if len(response) > MAX_RESPONSE_CHARS:
            msg = (
                f"Your response is too long ({len(response)} characters; the limit is {MAX_RESPONSE_CHARS})."
            )
        else:
            msg = "Your final answer is too long: give a single short expression in \\boxed{...}."
        return _wrong("too_long", msg)
    if found.status == "no_answer" or found.answer is None:
        return _wrong("no_answer", NO_ANSWER_FEEDBACK)
    answer = found.answer
    if found.status == "too_deep":
        msg = (
            f"Could not read your final answer: brackets are nested too deep (at most {MAX_NESTING} levels)."
        )
        return _wrong("unparseable", msg, answer, guard="nesting_depth")
    return _screen(answer, gold)


def _screen(answer: str, gold: str) -> Verdict | _Job:
    """Step 3 of the module docstring on an extracted answer: a final verdict, or a job for a worker.

    Every screen here depends on the gold's shape, so each answers with the wrong-value feedback:
    its own reason is for metrics, never shown to the policy.
    """
    if is_non_finite(gold):  # a missing value in the dataset (pandas' NaN): nothing may be paid for it
        return _bad_gold(answer, f"the gold answer is {gold.strip()[:20]!r}, not a value: fix the dataset")
    gold = without_group_spaces(gold) or gold  # 1\,000 is 1000, not a list
    value = without_group_spaces(answer)
    if value is not None:  # one number in digit groups (math-verify would misread 1\,000): no screen fires
        return _compare_integers(value, gold.strip()) or _Job(answer, (_wrap(value), _wrap(gold)))
    incorrect = INCORRECT_FEEDBACK.format(_show(answer))
    gold_set = gold_members(gold)
    if gold_set is not None:  # "find all": compare as sets (see .sets)
        listed = members(answer)
        bomb = find_bomb(answer, gold)
        if bomb is not None:
            return _wrong("unparseable", incorrect, answer, guard=bomb)
        if listed is not None:
            return _Job(answer, (_wrap(as_set(listed)), _wrap(as_set(gold_set))))
    if is_hedged(answer, gold):
        return _wrong("hedged", incorrect, answer)
    bomb = find_bomb(answer, gold)
    if bomb is not None:
        return _wrong("unparseable", incorrect, answer, guard=bomb)
    if is_unevaluated(answer, gold):
        return _wrong("unevaluated", incorrect, answer)
    decided = _compare_integers(answer, gold.strip())
    if decided is not None:
        return decided
    return _Job(answer, (_wrap(answer), _wrap(gold)))


#: The verifier-stats counter of each failure kind.
_FAILURE_STAT: dict[str, stats.StatName] = {
    "timeout": "timeouts",
    "memory": "memory_errors",
    "crash": "crashes",
}


def _finish(job: _Job, status: str, value: Any) -> Verdict:
    """Turn a worker reply into a verdict (and count failures)."""
    if status != "ok":
        error = {"timeout": "timeout", "memory": "memory"}.get(status, "crash")
        stats.count(_FAILURE_STAT[error])
        return Verdict(
            correct=False,
            error=error,  # type: ignore[arg-type]
            feedback=f"The verifier could not check your answer ({error}); it was not scored.",
            parsed=job.answer,
            reason="verifier_error",
            details={"message": str(value)},
        )
    outcome, parsed_form = value
    if outcome == "correct":
        return Verdict(True, feedback="Correct!", parsed=job.answer, reason="correct")
    if outcome == "unparseable":
        msg = f"Could not read your final answer {_show(job.answer)} as a mathematical expression."
        return _wrong("unparseable", msg, job.answer)
    if outcome == "bad_gold":
        return _bad_gold(job.answer, "the gold answer could not be parsed by math-verify: fix the dataset")
    return _wrong(
        "wrong_value", INCORRECT_FEEDBACK.format(_show(job.answer)), job.answer, as_parsed=parsed_form
    )


def _bad_gold(answer: str, message: str) -> Verdict:
    """A dataset problem: a verifier failure (counted as a crash), never a score."""
    stats.count("crashes")
    return Verdict(
        correct=False,
        error="crash",
        feedback="The verifier could not check your answer (crash); it was not scored.",
        parsed=answer,
        reason="verifier_error",
        details={"message": message},
    )


def check_float_rounding(float_rounding: object) -> int:
    """``float_rounding`` as an int in ``[1, MAX_FLOAT_ROUNDING]``, else a ``ValueError`` saying so."""
    if isinstance(float_rounding, bool) or not isinstance(float_rounding, int):
        raise ValueError(
            f"float_rounding must be an integer number of decimal places, got {float_rounding!r}"
        )
    if not 1 <= float_rounding <= MAX_FLOAT_ROUNDING:
        raise ValueError(
            f"float_rounding must be between 1 and {MAX_FLOAT_ROUNDING} decimal places, got {float_rounding}"
        )
    return float_rounding


def check_math(
    response: str,
    gold: str,
    *,
    timeout: float = DEFAULT_TIMEOUT_S,
    float_rounding: int = DEFAULT_FLOAT_ROUNDING,
) -> Verdict:
    """Check the final answer of ``response`` against ``gold`` (pipeline in the module docstring).

    Args:
        response: The model's full response text (thinking included).
        gold: The reference answer in LaTeX or plain form (``"\\frac{1}{2}"``, ``"(1, 2]"``, ``"7"``).
        timeout: Wall-clock seconds the sandboxed comparison may take before its worker is killed.
        float_rounding: When the answer or the gold is a decimal, the decimal places both must agree
            to (:data:`DEFAULT_FLOAT_ROUNDING`, 6: ``0.333333`` is paid for ``\\frac{1}{3}``; 12
            demands ``0.333333333333``). Exact forms (integers, fractions, ``\\pi``) are compared
            exactly whatever this is.

    Returns:
        A :class:`Verdict`: ``reason`` is one of ``correct``, ``wrong_value``, ``no_answer``,
        ``hedged``, ``unevaluated``, ``too_long``, ``unparseable``, ``verifier_error``; ``parsed`` is the extracted
        answer string.
    """
    stats.count("checks", "math_checks")
    _check_types(response, gold)
    check_float_rounding(float_rounding)
    try:
        prepared = _prepare(response, gold)
    except Exception as exc:  # noqa: BLE001 - a screen bug is a verifier failure, never a crash
        stats.count("crashes")
        return Verdict(
            correct=False,
            error="crash",
            feedback="The verifier could not check your answer (crash); it was not scored.",
            reason="verifier_error",
            details={"message": f"{type(exc).__name__}: {exc}"[:300]},
        )
    if isinstance(prepared, Verdict):
        if prepared.details.get("guard"):
            stats.count("screened")
        return prepared
    status, value = get_pool().run("math", (*prepared.payload, float_rounding), timeout)
    return _finish(prepared, status, value)


def check_math_batch(
    pairs: Sequence[tuple[str, str]],
    *,
    timeout: float = DEFAULT_TIMEOUT_S,
    float_rounding: int = DEFAULT_FLOAT_ROUNDING,
    on_result: Callable[[int, Verdict], None] | None = None,
) -> list[Verdict]:
    """Check many ``(response, gold)`` pairs in parallel over the worker pool.

    Each item gets its own deadline on its own worker, so a pathological item holds one worker for at
    most ``timeout`` seconds while the other items flow through the remaining workers.

    Args:
        pairs: ``(response, gold)`` pairs.
        timeout: Per-item deadline in seconds (see :func:`check_math`).
        float_rounding: See :func:`check_math`.
        on_result: Optional callback ``on_result(index, verdict)``, called (from a pool thread) as
            soon as each item is decided -- useful for streaming or for measuring per-item latency.

    Returns:
        One verdict per pair, in input order.
    """
    results: list[Verdict | None] = [None] * len(pairs)

    def one(index: int) -> None:
        response, gold = pairs[index]
        verdict = check_math(response, gold, timeout=timeout, float_rounding=float_rounding)
        results[index] = verdict
        if on_result is not None:
            on_result(index, verdict)

    if pairs:
        workers = min(len(pairs), get_pool().size)
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="veriloop-math") as executor:
            for future in [executor.submit(one, i) for i in range(len(pairs))]:
                future.result()
    return [r for r in results if r is not None]
