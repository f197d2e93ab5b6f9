"""S2R's written checks for Points24: worked arithmetic, solver-style wrong answers, and the traces."""

from __future__ import annotations

import json
from fractions import Fraction

import gymnasium
import numpy as np
import pytest

from veriloop.envs.points24.env import Points24Env
from veriloop.envs.points24.solver import random_formula
from veriloop.envs.solve_verify import parse_action
from veriloop.envs.verifiers.formula import FormulaError, evaluate, show_number, worked_steps


@pytest.mark.parametrize(
    ("formula", "steps"),
    [
        ("(2+10)*1", ["2+10 = 12", "12*1 = 12"]),
        ("10-2*3", ["2*3 = 6", "10-6 = 4"]),  # precedence: the product first
        ("2-5-1", ["2-5 = -3", "(-3)-1 = -4"]),  # left to right; a negative operand in parentheses
        ("8/(3-8/3)", ["3-(8/3) = 1/3", "8/(1/3) = 24"]),  # 8/3 reads as itself: no step
        ("12", []),
    ],
)
def test_worked_steps_by_hand(formula, steps):
    assert worked_steps(formula) == steps


@pytest.mark.parametrize("hostile", ["__import__('os')", "2**99999", "1/0", "(" * 40 + "1" + ")" * 40])
def test_worked_steps_only_walks_the_grammar(hostile):
    with pytest.raises((FormulaError, ZeroDivisionError)):
        worked_steps(hostile)


def test_random_formulas_use_each_number_once_and_carry_their_value():
    rng = np.random.default_rng(0)
    for values in ([3, 4, 5], [1, 1, 13, 10], [7, 2]):
        for _ in range(200):
            value, formula = random_formula(values, rng)
            done = evaluate(formula)
            assert done.value == value and sorted(done.numbers) == sorted(values)
            steps = worked_steps(formula)  # a whole value is the last step's result
            if value.denominator == 1:
                assert steps[-1].endswith(f" = {show_number(value)}")
    with pytest.raises(ValueError, match="at least one number"):
        random_formula([], rng)


def _task(cards):
    env = Points24Env(num_cards=3, target=12)
    env.reset(options={"task": cards})
    return env, env.task


def test_wrong_demonstrations_look_like_the_solvers_answers():
    env, task = _task(["3S", "7C", "9D"])
    rng, used = np.random.default_rng(1), set()
    for _ in range(10):
        wrong = env.wrong_demonstration(task, rng, used)
        assert wrong is not None
        verdict = env.check(wrong, task)
        assert verdict.reason == "wrong_value"  # the right cards, a whole number that is not 12
        assert Fraction(verdict.details["value"]).denominator == 1
    assert len(used) == 10


def test_verification_demonstration_by_hand():
    env, task = _task(["3S", "7C", "9D"])
    right = json.dumps({"cards": ["3", "7", "9"], "formula": "3*7-9"})
    assert env.verification_demonstration(task, right) == (
        "Check: 3*7 = 21, 21-9 = 12. Numbers 3, 7, 9; cards 3, 7, 9. 12 is 12."
    )
    wrong = json.dumps({"cards": ["3", "7", "9"], "formula": "9-7+3"})
    assert env.verification_demonstration(task, wrong) == (
        "Check: 9-7 = 2, 2+3 = 5. Numbers 3, 7, 9; cards 3, 7, 9. 5 is not 12."
    )
    illegal = json.dumps({"formula": "3*4"})  # its value is 12, but not from these cards
    assert env.verification_demonstration(task, illegal) == (
        "Check: 3*4 = 12. Numbers 3, 4; cards 3, 7, 9. 12 is 12."
    )
    assert env.verification_demonstration(task, "no formula here") is None


def test_s2r_points24_traces_write_the_check_before_the_verdict():
    sv = gymnasium.make(
        "veriloop/SolveVerify-v0", task="points24", num_cards=3, target=12, max_attempts=2
    ).unwrapped
    sv.reset(seed=4)
    trace = sv.demonstration_episode(sv.task, np.random.default_rng(0), p_wrong_first=1.0)
    (wrong, w_trained), (judge_wrong, _), (right, r_trained), (judge_right, _) = trace
    assert (w_trained, r_trained) == (False, True)
    assert judge_wrong.startswith("Check: ") and "is not 12.\n<verify>incorrect</verify>" in judge_wrong
    assert judge_right.startswith("Check: ") and judge_right.endswith(" is 12.\n<verify>correct</verify>")
    assert parse_action(judge_wrong) == ("verify", False) and parse_action(judge_right) == ("verify", True)
    # replayed through the env, both verdicts match the truth
    sv.reset(options={"task": sv.task})
    infos = [sv.step(action)[4] for action, _ in trace]
    assert [i["verify_matches_truth"] for i in infos[1::2]] == [True, True]
