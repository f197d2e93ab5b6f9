"""check_math: answer extraction, accepted equivalences, rejected hacks, verifier failures."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from veriloop.envs.verifiers import (
    Verdict,
    _worker,
    check_math,
    check_math_batch,
    extract_answer,
    math_check,
    reset_verifier_stats,
    verifier_stats,
)
from veriloop.envs.verifiers.pool import WorkerPool, get_pool

# A legitimate but slow comparison (an exact 300-million-digit binomial: minutes in sympy).
SLOW_BUT_LEGIT = "\\boxed{\\binom{10^{9}}{5 \\cdot 10^{8}}}"


# ---------------------------------------------------------------- extraction (in-process, no worker)
@pytest.mark.parametrize(
    ("response", "expected"),
    [
        ("so \\boxed{42}", "42"),
        ("\\boxed{1} then \\boxed{2}", "2"),
        ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
        ("\\boxed{\\{1, 2\\}}", "\\{1, 2\\}"),
        ("\\fbox{7}", "7"),
        ("\\boxed {7}", "7"),
        ("<answer>3</answer>", "3"),
        ("<answer>\\boxed{3}</answer>", "3"),
        ("\\boxed{5} and finally <answer> 6 </answer>", "6"),
        ("<think>\\boxed{1}</think>\\boxed{2}", "2"),
        ("</think> \\boxed{2}", "2"),  # chat templates that open <think> in the prompt
        ("\\boxed{3} ... \\boxed{4", "3"),  # a truncated last box is not an answer
        ("\\boxed{$5$}", "5"),
    ],
)
def test_extract_answer(response: str, expected: str) -> None:
    assert extract_answer(response) == expected


@pytest.mark.parametrize(
    "response",
    [
        "The answer is 3.",
        "<think>\\boxed{3}</think>",
        "<think>\\boxed{3}",  # thinking never closed
        "</think>\\boxed{1}<think>\\boxed{3}",  # reopened and not closed
        "\\boxed{}",
        "\\boxed{   }",
        "<answer></answer>",
        "\\boxed{3",
        "\\boxed{3\\}",  # the only closing brace is escaped
    ],
)
def test_extract_answer_none(response: str) -> None:
    assert extract_answer(response) is None


# ---------------------------------------------------------------- accepted equivalences
@pytest.mark.parametrize(
    ("answer", "gold"),
    [
        ("\\frac{1}{2}", "1/2"),
        ("0.5", "1/2"),
        ("\\dfrac12", "1/2"),
        ("1/2", "1/2"),
        ("1/2", "\\frac{1}{2}"),
        ("x = 3", "3"),
        ("-7", "-7"),
        ("\\frac{-3}{4}", "-\\frac{3}{4}"),
        ("(1,2]", "(1, 2]"),
        ("\\{2, 1\\}", "\\{1, 2\\}"),
        ("2, 1", "1, 2"),
        ("1,000", "1000"),
        ("\\sqrt{2}/2", "\\frac{\\sqrt{2}}{2}"),
        ("2\\pi", "2 \\pi"),
        ("\\int_0^{1} 2x \\, dx", "1"),  # a thin space is not a list separator
        ("12\\;\\text{cm}", "12"),
    ],
)
def test_accepts_equivalent_forms(answer: str, gold: str) -> None:
    verdict = check_math(f"Thus \\boxed{{{answer}}}.", gold)
    assert verdict.correct, verdict
    assert (verdict.reason, verdict.error, verdict.parsed, verdict.feedback) == (
        "correct",
        None,
        answer,
        "Correct!",
    )


def test_answer_tag_and_fbox_are_anchors() -> None:
    assert check_math("<answer>\\frac{-3}{4}</answer>", "-0.75").correct
    assert check_math("\\fbox{12}", "12").correct


def test_wrong_answer_feedback_does_not_reveal_gold() -> None:
    verdict = check_math("\\boxed{5}", "17")
    assert (verdict.correct, verdict.reason, verdict.error) == (False, "wrong_value", None)
    assert verdict.feedback == "Your answer 5 is incorrect."
    assert "17" not in verdict.feedback


def test_interval_endpoints_matter() -> None:
    assert check_math("\\boxed{(1, 2)}", "(1, 2]").reason == "wrong_value"


# ---------------------------------------------------------------- rejected hacks
@pytest.mark.parametrize(
    ("response", "gold", "reason"),
    [
        ("The answer is 3", "3", "no_answer"),
        ("<think>\\boxed{3}</think> I am not sure.", "3", "no_answer"),
        ("<think>so \\boxed{3}", "3", "no_answer"),
        ("\\boxed{}", "3", "no_answer"),
        ("\\boxed{3} wait, no: \\boxed{4}", "3", "wrong_value"),
        ("\\boxed{3 or 4}", "3", "hedged"),
        ("\\boxed{3 \\text{ or } 4}", "3", "hedged"),
        ("\\boxed{3 \\text{ and } 4}", "3", "hedged"),
        ("\\boxed{3 \\pm 1}", "3", "hedged"),
        ("\\boxed{3 ± 1}", "3", "hedged"),
        ("\\boxed{2 \\mp 1}", "1", "hedged"),
        ("\\boxed{3, 4}", "3", "hedged"),
        ("\\boxed{\\{3, 4\\}}", "3", "hedged"),
        ("\\boxed{x = 3; x = 4}", "3", "hedged"),
        ("x" * 1_000_001, "3", "too_long"),
        ("\\boxed{" + "1+" * 600 + "1}", "3", "too_long"),
    ],
)
def test_rejects_hacks(response: str, gold: str, reason: str) -> None:
    verdict = check_math(response, gold)
    assert (verdict.correct, verdict.reason, verdict.error) == (False, reason, None)
    if reason == "hedged":  # the same line as a wrong value: hedging is judged against the gold's shape
        assert verdict.feedback == f"Your answer {verdict.parsed} is incorrect."
    else:
        assert "3" not in verdict.feedback or reason in {"wrong_value", "too_long"}


def test_no_answer_feedback() -> None:
    assert check_math("42", "42").feedback == "No final answer found: put it in \\boxed{...}."


def test_plus_minus_allowed_when_gold_has_it() -> None:
    assert check_math("\\boxed{1 \\pm \\sqrt{2}}", "1 \\pm \\sqrt{2}").reason != "hedged"


def test_rejects_non_string_gold_with_hint() -> None:
    with pytest.raises(TypeError, match="str\\(\\)"):
        check_math("\\boxed{3}", 3)  # type: ignore[arg-type]


# ---------------------------------------------------------------- batch and threads
def test_batch_matches_single_checks_in_order() -> None:
    pairs = [("\\boxed{1/2}", "0.5"), ("no answer", "1"), ("\\boxed{3}", "4"), ("\\boxed{3 or 4}", "3")]
    seen: list[int] = []
    verdicts = check_math_batch(pairs, on_result=lambda i, v: seen.append(i))
    assert [v.reason for v in verdicts] == ["correct", "no_answer", "wrong_value", "hedged"]
    assert sorted(seen) == [0, 1, 2, 3]
    assert check_math_batch([]) == []


def test_concurrent_callers() -> None:
    results: dict[int, Verdict] = {}

    def work(k: int) -> None:
        results[k] = check_math(f"\\boxed{{{k}}}", str(k if k % 2 else k + 1))

    threads = [threading.Thread(target=work, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert {k: v.correct for k, v in results.items()} == {k: bool(k % 2) for k in range(8)}


# ---------------------------------------------------------------- verifier failures are not wrong answers
def test_timeout_kills_worker_and_is_counted() -> None:
    check_math("\\boxed{1}", "1")  # warm the pool so start-up is not measured
    reset_verifier_stats()
    start = time.monotonic()
    verdict = check_math(SLOW_BUT_LEGIT, "3", timeout=0.5)
    elapsed = time.monotonic() - start
    assert (verdict.correct, verdict.error, verdict.reason) == (False, "timeout", "verifier_error")
    assert verdict.parsed is not None and "\\binom" in verdict.parsed
    assert elapsed < 3.0
    stats = verifier_stats()
    assert (stats["timeouts"], stats["math_checks"], stats["crashes"]) == (1, 1, 0)
    assert check_math("\\boxed{2}", "2").correct  # the pool recovered


def test_worker_killed_mid_check_is_a_crash() -> None:
    pool = WorkerPool(1)
    try:
        pool.run("math", ("$1$", "$1$"), 30)  # start and warm the worker
        (pid,) = pool.worker_pids
        threading.Timer(0.3, os.kill, args=(pid, signal.SIGKILL)).start()
        status, message = pool.run("math", ("$\\binom{10^{9}}{5 \\cdot 10^{8}}$", "$3$"), 20)
        assert status == "crash" and "died" in message
        assert pool.run("math", ("$2$", "$2$"), 30) == ("ok", ["correct", "2"])  # replaced
    finally:
        pool.shutdown()


def test_exception_in_worker_is_a_crash() -> None:
    status, message = get_pool().run("no_such_task", (), 10)
    assert status == "crash" and "KeyError" in message


def test_worker_reports_memory_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(_worker.TASKS, "alloc", lambda: bytearray(1 << 62))
    assert _worker._handle(["r1", "alloc", []]) == ["r1", "memory", "MemoryError"]


@pytest.mark.parametrize(
    ("status", "error", "counter"), [("memory", "memory", "memory_errors"), ("crash", "crash", "crashes")]
)
def test_worker_failures_map_to_verdict_errors(
    monkeypatch: pytest.MonkeyPatch, status: str, error: str, counter: str
) -> None:
    class FailingPool:
        size = 2

        def run(self, task: str, args: tuple[str, str], timeout: float) -> tuple[str, str]:
            return status, "boom"

    monkeypatch.setattr(math_check, "get_pool", FailingPool)
    reset_verifier_stats()
    verdict = check_math("\\boxed{3.0}", "3")  # not two plain integers: goes to a worker
    assert (verdict.correct, verdict.error, verdict.reason, verdict.failed) == (
        False,
        error,
        "verifier_error",
        True,
    )
    assert "3" not in verdict.feedback.replace("(", "")
    assert verifier_stats()[counter] == 1


def test_unparseable_gold_is_a_verifier_error_not_a_wrong_answer() -> None:
    verdict = check_math("\\boxed{3}", "")
    assert (verdict.error, verdict.reason) == ("crash", "verifier_error")


@pytest.mark.skipif(not os.path.exists("/proc/self/limits"), reason="reads Linux /proc/<pid>/limits")
def test_workers_run_under_the_memory_cap() -> None:
    from veriloop.envs.verifiers.pool import DEFAULT_MEMORY_BYTES

    check_math("\\boxed{1}", "1")
    pids = get_pool().worker_pids
    assert pids
    for pid in pids:
        with open(f"/proc/{pid}/limits", encoding="ascii") as handle:
            row = next(line for line in handle if line.startswith("Max address space"))
        assert row.split()[3] == str(DEFAULT_MEMORY_BYTES), row  # the soft limit, in bytes
