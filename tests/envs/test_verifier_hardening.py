"""Verifier hardening: each test here failed on the code before the fix it names.

Items: 3 (size cap on the extracted answer), 5 (FIFO slots, cold start), 6 (Math-Verify's thousands
separators), 7 (Points24 ``==``), 8 (contradictory equations), 9 (malformed gold at load time),
13 (no BrokenPipeError from workers), 14 (give-up check on a 10 MB response). Item 2's evaluation
part is in ``tests/algos/eval/test_eval_metrics.py``; its reward part is here.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
import tracemalloc
from pathlib import Path

import gymnasium
import pytest

from veriloop.envs.base import gave_up
from veriloop.envs.math_data import load_jsonl
from veriloop.envs.verifiers import Verdict, _worker, check_math, check_points24, math_check, pool
from veriloop.envs.verifiers.extract import MAX_ANSWER_CHARS, MAX_RESPONSE_CHARS, extract

# ----------------------------------------------------------------------------- item 3: long reasoning


def test_correct_answer_after_long_reasoning_is_judged() -> None:
    thought = "Let me think about this carefully. " * 1400  # ~47,600 characters of reasoning
    assert len(thought) > 40_000
    assert check_math(thought + "So the answer is \\boxed{42}.", "42").correct
    assert check_math(f"<think>{thought}</think> \\boxed{{\\frac{{1}}{{2}}}}", "\\frac{1}{2}").correct
    cards = json.dumps({"cards": ["3", "3", "8", "8"], "formula": "8/(3-8/3)"})
    assert check_points24(thought + cards, [3, 3, 8, 8]).correct


def test_size_cap_applies_to_the_answer() -> None:
    long_answer = "\\boxed{" + "1+" * MAX_ANSWER_CHARS + "1}"
    verdict = check_math("short reasoning " + long_answer, "3")
    assert verdict.reason == "too_long" and "final answer" in verdict.feedback
    # an unclosed huge box at the end does not hide an earlier complete one
    assert extract("\\boxed{7} then \\boxed{" + "9" * 100_000).answer == "7"
    # the resource cap on the whole response is far above any generation length
    assert MAX_RESPONSE_CHARS >= 1_000_000
    assert check_math("x" * (MAX_RESPONSE_CHARS + 1), "3").reason == "too_long"


def test_extraction_memory_is_bounded() -> None:
    """A brace-dense megabyte must not build a brace table (the old scan kept one entry per pair)."""
    text = "{}" * 450_000 + "\\boxed{5}"
    tracemalloc.start()
    try:
        assert extract(text).answer == "5"
        assert extract("\\boxed{" + "{}" * 450_000).status == "no_answer"  # never closes
        assert extract("\\boxed{" + "{}" * 450_000 + "}").status == "too_long"
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4_000_000, f"extraction peaked at {peak / 1e6:.1f} MB"


# ----------------------------------------------------------------------------- item 5: FIFO and cold start


def test_slots_are_served_first_in_first_out() -> None:
    """A caller that releases and re-acquires must queue behind the threads already waiting."""
    slots = pool.WorkerPool(1)._slots
    order: list[str] = []
    slots.acquire()

    def waiter(name: str) -> None:
        slots.acquire()
        order.append(name)
        slots.release()

    threads = []
    for queued, name in enumerate(("w1", "w2", "w3"), start=1):
        t = threading.Thread(target=waiter, args=(name,))
        t.start()
        threads.append(t)
        deadline = time.monotonic() + 5  # let each one queue before the next
        while getattr(slots, "waiting", queued) < queued and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.05)
    slots.release()
    slots.acquire()  # barging in here would jump the queue
    order.append("main")
    slots.release()
    for t in threads:
        t.join(5)
    assert order == ["w1", "w2", "w3", "main"]


def test_making_a_math_env_starts_the_pool() -> None:
    pool.shutdown_pool()
    gymnasium.make("veriloop/MathVerify-v0")
    assert "math" in pool._POOLS and pool._POOLS["math"].started


def test_plain_integer_answers_need_no_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_pool() -> None:
        raise AssertionError("a plain integer comparison must not wait for a worker")

    monkeypatch.setattr(math_check, "get_pool", no_pool)
    assert check_math("so \\boxed{42}", "42").correct
    assert check_math("\\boxed{-7}", "-7").correct
    wrong = check_math("\\boxed{41}", "42")
    assert (wrong.correct, wrong.reason, wrong.error) == (False, "wrong_value", None)
    assert "42" not in wrong.feedback


# ----------------------------------------------------------------------------- item 6: separators


@pytest.mark.parametrize(
    ("answer", "gold"),
    [
        ("11,\\! 111,\\! 111,\\! 100", "11111111100"),
        ("32,\\! 349", "32349"),
        ("\\$16,\\!386.20", "16386.20"),
        ("\\$16386.17", "16386.17"),
        ("10,\\!080", "10080"),
        ("\\$32,\\!348", "32348"),
    ],
)
def test_math_verify_thousands_separator_cases(answer: str, gold: str) -> None:
    verdict = check_math(f"is $\\boxed{{{answer}}}$", gold)
    assert verdict.correct, verdict


@pytest.mark.parametrize(
    ("answer", "gold"),
    [
        ("32, 349", "32349"),  # a comma and a space is a list (Math-Verify expects 0 here too)
        ("3, 4", "4"),
        ("3 \\text{ or } 4", "4"),
        ("4 \\pm 1", "4"),
        ("1,\\! 23", "123"),  # not a group of three digits
    ],
)
def test_anti_hedging_is_kept(answer: str, gold: str) -> None:
    verdict = check_math(f"\\boxed{{{answer}}}", gold)
    assert not verdict.correct and verdict.reason == "hedged", verdict


# ----------------------------------------------------------------------------- item 7: Points24 ==


@pytest.mark.parametrize("formula", ["8*3*1*1 == 24", "8*3*1*1 === 24", "8*3*1*1 = 24 =", "= 8*3*1*1"])
def test_points24_rejects_double_equals(formula: str) -> None:
    response = json.dumps({"cards": ["8", "3", "1", "1"], "formula": formula})
    verdict = check_points24(response, [8, 3, 1, 1])
    assert not verdict.correct and verdict.reason == "unparseable", verdict


def test_points24_documented_equals_forms_still_pass() -> None:
    for formula in ("8*3*1*1", "8*3*1*1 = 24", "24 = 8*3*1*1"):
        assert check_points24(json.dumps({"formula": formula}), [8, 3, 1, 1]).correct


# ----------------------------------------------------------------------------- item 8: contradictions


@pytest.mark.parametrize("answer", ["x = 3 = 4", "3 = 4", "x = 4 = 4 = 3"])
def test_contradictory_equations_are_not_correct(answer: str) -> None:
    verdict = check_math(f"\\boxed{{{answer}}}", "4")
    assert not verdict.correct and verdict.reason == "hedged", verdict


def test_single_equation_answers_still_pass() -> None:
    assert check_math("\\boxed{x = 4}", "4").correct
    assert check_math("\\boxed{y = 2x + 1}", "y = 2x + 1").correct


# ----------------------------------------------------------------------------- item 9: malformed gold


@pytest.mark.parametrize("gold", ["\\frac{", "\\frac{1}{2", "3}", "\\sqrt{2}\\", "{{1}"])
def test_malformed_gold_is_rejected_at_load_time(tmp_path: Path, gold: str) -> None:
    path = tmp_path / "data.jsonl"
    rows = [{"question": "q1", "answer": "1"}, {"question": "q2", "answer": gold}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    with pytest.raises(ValueError, match=f"{path}:2: .*answer"):
        load_jsonl(path)


def test_escaped_braces_in_gold_are_fine(tmp_path: Path) -> None:
    path = tmp_path / "data.jsonl"
    path.write_text(json.dumps({"question": "q", "answer": "\\{1, 2\\}"}) + "\n")
    assert load_jsonl(path)[0].answer == "\\{1, 2\\}"


# ----------------------------------------------------------------------------- item 13: worker exit


def test_worker_is_silent_when_its_parent_goes_away() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", _worker.__name__, str(1 << 30)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert proc.stdout is not None and proc.stdin is not None and proc.stderr is not None
    assert proc.stdout.readline().strip() == b'["ready", null]'
    proc.stdout.close()  # the parent is gone: nobody reads the replies any more
    proc.stdin.write(b'["a", "math", ["$1$", "$1$"]]\n["b", "math", ["$2$", "$2$"]]\n')
    proc.stdin.close()
    err = proc.stderr.read().decode()
    proc.wait(30)
    assert "BrokenPipeError" not in err and "Traceback" not in err, err


# ----------------------------------------------------------------------------- item 14: give-up check


def test_give_up_check_costs_no_memory_on_a_huge_response() -> None:
    huge = "blah\n" * 2_000_000  # 10 MB
    giving_up = huge + "I give up."
    tracemalloc.start()
    try:
        assert not gave_up(huge)
        assert gave_up(giving_up)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1_000_000, f"gave_up peaked at {peak / 1e6:.1f} MB"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("I give up", True),
        ("work...\n  i GIVE up!!  \n\n", True),
        ("I give up\r\n", True),
        ("I give up. Just kidding: \\boxed{3}", False),
        ("I give up\nno wait", False),
        ("", False),
        ("x" * 5000 + " I give up", False),
        ("\n" * 5000 + "I give up" + " " * 5000, True),
    ],
)
def test_give_up_phrase(text: str, expected: bool) -> None:
    assert gave_up(text) is expected


# ----------------------------------------------------------------------------- item 2: no pay for a timeout


@pytest.mark.parametrize(
    ("env_id", "kwargs"),
    [
        ("veriloop/MathVerify-v0", {"reward": "r1"}),
        ("veriloop/MathVerify-v0", {"reward": "dapo"}),
        ("veriloop/MathVerifyRetry-v0", {"reward": "r1"}),
        ("veriloop/SolveVerify-v0", {"reward_mode": "process"}),
        ("veriloop/SolveVerify-v0", {"reward_mode": "outcome"}),
    ],
)
def test_no_reward_is_paid_for_a_verifier_timeout(
    monkeypatch: pytest.MonkeyPatch, env_id: str, kwargs: dict
) -> None:
    timeout = Verdict(correct=False, error="timeout", reason="verifier_error", parsed="4")
    import veriloop.envs.math_env as math_env

    monkeypatch.setattr(math_env, "check_math", lambda *a, **k: timeout)
    env = gymnasium.make(env_id, **kwargs).unwrapped
    env.reset(seed=0)
    _, reward, terminated, truncated, info = env.step("<think>ok</think> <answer>\\boxed{4}</answer>")
    assert reward == 0.0 and info["verifier_error"] == "timeout"
    assert all(v <= 0.0 for v in info["reward_components"].values())
    assert truncated and not terminated
