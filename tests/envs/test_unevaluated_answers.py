"""An answer that hands the question back unevaluated is not the value it asks for.

math-verify judges ``\\boxed{14 - 26}`` equal to ``-12``. A GRPO run on level-1 math (dapo_parts,
grpo seed 1) learned to copy "Compute $14 - 26$" into the box and went from 0.32 to 0.65 held-out
accuracy in 20 steps; every answer below is one that run gave. Each test here failed before the
``unevaluated`` screen.
"""

from __future__ import annotations

import re

import gymnasium
import pytest

import veriloop.envs  # noqa: F401
from veriloop.envs.verifiers import check_math
from veriloop.envs.verifiers.screen import is_number, is_unevaluated

COPIED = [  # (the policy's boxed answer, the gold)
    ("14 - 26", "-12"),
    ("4 - 25", "-21"),
    ("46 + 26", "72"),
    ("\\frac{1}{6} + \\frac{3}{2}", "\\frac{5}{3}"),
    ("\\frac{3}{5} + \\frac{9}{5}", "\\frac{12}{5}"),
    ("3 \\times 11 + 10", "43"),
    ("2^{3}", "8"),
    ("\\sqrt{16}", "4"),
    ("x = 14 - 26", "-12"),
    ("\\left(\\frac{1}{2} + \\frac{9}{2}\\right) \\div (-\\frac{7}{8})", "-\\frac{40}{7}"),
]

VALUES = [  # numbers written as numbers stay correct
    ("-12", "-12"),
    ("(-12)", "-12"),
    ("\\frac{5}{3}", "\\frac{5}{3}"),
    ("\\dfrac{10}{6}", "\\frac{5}{3}"),
    ("\\frac53", "\\frac{5}{3}"),
    ("5/3", "\\frac{5}{3}"),
    ("1\\frac{2}{3}", "\\frac{5}{3}"),  # a mixed number: math-verify reads 5/3
    ("0.5", "\\frac{1}{2}"),
    ("1{,}000", "1000"),
    ("x = 4", "4"),
]


@pytest.mark.parametrize(("answer", "gold"), COPIED)
def test_a_copied_expression_is_unevaluated_not_correct(answer: str, gold: str) -> None:
    verdict = check_math(f"The answer is $\\boxed{{{answer}}}$.", gold)
    assert (verdict.correct, verdict.reason, verdict.error) == (False, "unevaluated", None)
    assert (
        verdict.feedback == f"Your answer {answer} is incorrect."
    )  # as a wrong value: the gold's shape stays hidden


@pytest.mark.parametrize(("answer", "gold"), VALUES)
def test_a_value_is_still_judged_by_its_value(answer: str, gold: str) -> None:
    assert not is_unevaluated(answer, gold)
    assert check_math(f"\\boxed{{{answer}}}", gold).correct


@pytest.mark.parametrize(
    ("answer", "gold"),
    [("2\\sqrt{3}", "\\sqrt{12}"), ("3+4", "3+4"), ("12 \\text{ dollars}", "12"), ("50\\%", "50")],
)
def test_the_screen_stays_out_when_the_gold_is_no_number_or_the_answer_is_no_arithmetic(
    answer: str, gold: str
) -> None:
    assert not is_unevaluated(answer, gold)


def test_is_number() -> None:
    assert all(is_number(g) for g in ["-12", "0.5", ".5", "\\frac{-5}{3}", "-\\frac{5}{3}", "1,000"])
    assert not any(is_number(g) for g in ["14-26", "2\\sqrt{3}", "x", "\\pi", "", "2^{3}"])


@pytest.mark.parametrize("level", [1, 2, 3])
def test_no_generated_compute_problem_scores_its_own_question(level: int) -> None:
    env = gymnasium.make("veriloop/MathVerify-v0", level=level)
    copied = 0
    for seed in range(120):
        _, info = env.reset(seed=seed)
        task = info["task"]
        m = re.match(r"Compute \$(.*)\$", task["question"])
        if m is None:
            continue
        copied += 1
        assert check_math(f"\\boxed{{{m.group(1)}}}", task["answer"]).reason == "unevaluated"
        assert check_math(f"\\boxed{{{task['answer']}}}", task["answer"]).correct
    assert copied > 30


def test_the_screen_is_fast_on_a_hostile_answer_at_the_size_cap() -> None:
    import time

    answers = ["(" * 500 + "1" + ")" * 499 + "+", "(-" * 499 + "1", "1" * 999 + "+"]
    start = time.perf_counter()
    assert all(is_unevaluated(a, "12") for a in answers)
    assert time.perf_counter() - start < 0.5  # ~10 ms here: the patterns backtrack at most quadratically
