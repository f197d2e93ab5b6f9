"""Edges of the math check: absolute values, floors and ceilings are arithmetic left undone; digit
groups split by thin spaces are one number; the decimal tolerance is a setting."""

from __future__ import annotations

import time

import gymnasium
import pytest

import veriloop.envs  # noqa: F401  (registers the ids)
from veriloop.envs.verifiers import check_math
from veriloop.envs.verifiers.screen import is_unevaluated


@pytest.mark.parametrize(
    "answer",
    [
        "|{-4}|",
        "|-3|+1",
        "|-4|",
        "\\left| -4 \\right|",
        "\\lvert -4 \\rvert",
        "\\lfloor 4.5 \\rfloor",
        "\\lceil 3.2 \\rceil",
        "⌊4.5⌋",
    ],
)
def test_absolute_values_floors_and_ceilings_of_numbers_are_not_paid(answer: str) -> None:
    assert is_unevaluated(answer, "4")
    verdict = check_math(f"\\boxed{{{answer}}}", "4")
    assert not verdict.correct and verdict.reason == "unevaluated"


@pytest.mark.parametrize("gold", ["|x|", "\\lfloor x \\rfloor"])
def test_a_gold_with_bars_is_compared_not_screened(gold: str) -> None:
    assert not is_unevaluated(gold, gold)  # the screen fires only when the gold is a number


@pytest.mark.parametrize("answer", ["1\\,000", "1\\ 000", "1~000", "1{\\,}000", "1\u2009000"])
def test_digit_groups_split_by_thin_spaces_are_one_number(answer: str) -> None:
    assert check_math(f"\\boxed{{{answer}}}", "1000").correct
    assert not check_math(f"\\boxed{{{answer}}}", "100").correct


def test_thin_spaces_in_decimals_and_golds() -> None:
    assert check_math("\\boxed{12\\,345.5}", "\\frac{24691}{2}").correct
    assert check_math("\\boxed{1000000}", "1\\,000\\,000").correct
    assert not check_math("\\boxed{1\\,0000}", "10000").correct  # not a digit grouping


def test_the_decimal_tolerance_is_math_verify_s_six_places_and_a_setting() -> None:
    assert check_math("\\boxed{0.333333}", "\\frac{1}{3}").correct  # the documented default
    assert check_math("\\boxed{3.141593}", "\\pi").correct
    assert not check_math("\\boxed{0.3333}", "\\frac{1}{3}").correct
    assert not check_math("\\boxed{0.333333}", "\\frac{1}{3}", float_rounding=12).correct
    assert not check_math("\\boxed{3.141593}", "\\pi", float_rounding=10).correct
    assert check_math("\\boxed{0.333333333333}", "\\frac{1}{3}", float_rounding=12).correct
    assert check_math("\\boxed{0.5}", "\\frac{1}{2}", float_rounding=15).correct  # exact stays exact
    with pytest.raises(ValueError, match="float_rounding must be between 1 and 15"):
        check_math("\\boxed{1}", "1", float_rounding=0)


def test_the_math_env_takes_the_tolerance_as_a_kwarg() -> None:
    env = gymnasium.make("veriloop/MathVerify-v0", float_rounding=12)
    env.reset(seed=0, options={"task": {"question": "1/3?", "answer": "\\frac{1}{3}"}})
    assert env.step("\\boxed{0.333333}")[1] < 0  # dapo: -1 for wrong
    env.reset(seed=0, options={"task": {"question": "1/3?", "answer": "\\frac{1}{3}"}})
    assert env.step("\\boxed{0.333333333333}")[1] == 1.0
    with pytest.raises(ValueError, match="float_rounding must be an integer"):
        gymnasium.make("veriloop/MathVerify-v0", float_rounding=1.5)


def test_a_fresh_worker_pays_no_first_use_cost_inside_a_deadline() -> None:
    """sympy loads modules and fills caches on the first simplification of a process (0.2-1 s, more
    on a loaded machine): the worker does that before it says it is ready, not in a request."""
    from veriloop.envs.verifiers import _worker
    from veriloop.envs.verifiers.pool import WorkerPool

    assert [_worker.math_task(a, g)[0] in ("correct", "wrong") for a, g in _worker.WARM_UP_PAIRS] == [
        True
    ] * len(_worker.WARM_UP_PAIRS)  # each warm-up pair reaches math-verify's comparison
    workers = WorkerPool(1)
    try:
        workers.start()
        assert workers._idle[0].wait_ready()
        times = []
        for pair in (("$(y-2)^2$", "$y^2 - 4y + 4$"), ("$(z+3)^2$", "$z^2 + 6z + 9$")):  # alike, both new
            start = time.perf_counter()
            assert workers.run("math", (*pair, 6), 60)[1][0] == "correct"
            times.append(time.perf_counter() - start)
    finally:
        workers.shutdown()
    assert times[0] < 3 * times[1] + 0.1, times  # cold, the first took 10x the second
