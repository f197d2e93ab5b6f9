"""check_points24: formula extraction, the whitelisted grammar, exact values, card accounting."""

from __future__ import annotations

import json
from fractions import Fraction

import pytest

from veriloop.envs.verifiers import check_points24, reset_verifier_stats, verifier_stats
from veriloop.envs.verifiers.formula import FormulaError, evaluate
from veriloop.envs.verifiers.points24 import cards_match

CARDS = [3, 3, 8, 8]


def gp(formula: str, cards: list[object] | None = None) -> str:
    """A GeneralPoints-style JSON answer."""
    obj: dict[str, object] = {"formula": formula}
    if cards is not None:
        obj = {"cards": cards, **obj}
    return json.dumps(obj)


# ---------------------------------------------------------------- exact evaluation
@pytest.mark.parametrize(
    ("formula", "value", "numbers"),
    [
        ("8/(3-8/3)", Fraction(24), (8, 3, 8, 3)),
        ("1+2*3", Fraction(7), (1, 2, 3)),
        ("(1+2)*3", Fraction(9), (1, 2, 3)),
        ("10/4", Fraction(5, 2), (10, 4)),
        ("13-1-10", Fraction(2), (13, 1, 10)),
        ("0", Fraction(0), (0,)),
    ],
)
def test_evaluate_exact(formula: str, value: Fraction, numbers: tuple[int, ...]) -> None:
    done = evaluate(formula)
    assert (done.value, done.numbers) == (value, numbers)


@pytest.mark.parametrize(
    "formula",
    [
        "-3+27",
        "2**3",
        "2^3",
        "8//3",
        "08+16",
        "00+24",
        "2.5*8",
        "1e1",
        "1_0",
        "abs(3)",
        "x",
        "(3",
        "3 4",
        "",
        "٣+21",
        "３+21",
    ],
)
def test_evaluate_rejects(formula: str) -> None:
    with pytest.raises(FormulaError):
        evaluate(formula)


def test_evaluate_division_by_zero() -> None:
    with pytest.raises(ZeroDivisionError):
        evaluate("8/(3-3)")


# ---------------------------------------------------------------- accepted answers
@pytest.mark.parametrize(
    ("response", "source"),
    [
        (gp("8/(3-8/3)", [3, 3, 8, 8]), "json"),
        (gp("8 / (3 - 8 / 3) = 24"), "json"),
        ("<answer>8/(3-8/3)</answer>", "answer"),
        ("\\boxed{8 \\div (3 - 8 \\div 3)}", "boxed"),
        ("Let me think.\n8 ÷ (3 − 8 ÷ 3) = 24\n\n", "line"),
        ("24 = 8/(3-8/3)", "line"),
        ("<think>3*8 maybe</think>" + gp("8/(3-8/3)"), "json"),
        ('{\'cards\': [3, 3, 8, 8], "formula": "8/(3-8/3)"}', "json"),  # not JSON: read by hand
    ],
)
def test_accepts(response: str, source: str) -> None:
    verdict = check_points24(response, CARDS)
    assert verdict.correct, verdict
    assert (verdict.reason, verdict.feedback, verdict.error) == ("correct", "Correct!", None)
    assert verdict.details["source"] == source
    assert verdict.details["value"] == "24"
    assert sorted(verdict.details["numbers_used"]) == CARDS


def test_times_alias_and_face_cards() -> None:
    verdict = check_points24(gp("12 \\times (13 - 11) × 1", ["A", "J", "Q", "K"]), [1, 11, 12, 13])
    assert verdict.correct and verdict.details["cards_seen"] == ["A", "J", "Q", "K"]
    # K may stand for 10 (training rule) as well as 13
    assert cards_match(["K", "10", "10", "A"], [10, 10, 10, 1])
    assert cards_match(["J", "Q", "K", "A"], [11, 12, 13, 1])
    assert not cards_match(["J", "J", "3", "4"], [11, 12, 3, 4])


# ---------------------------------------------------------------- rejected answers
@pytest.mark.parametrize(
    ("response", "reason"),
    [
        ("I give up.", "no_answer"),
        ("<think>8/(3-8/3)</think>", "no_answer"),
        ("<think>8/(3-8/3)", "no_answer"),
        ("\\boxed{}", "no_answer"),
        (gp("3*8 or 8*3"), "hedged"),
        ("<answer>3*8*(8/8) or (8-3-3)*8</answer>", "hedged"),
        ("3*8*8/8, 3*8*3/3", "hedged"),
        ("8*3*8/8 = 24 = 3*8*3/3", "hedged"),
        (gp("-3+3+8+8+8"), "unparseable"),
        (gp("3**2+8+8-3"), "unparseable"),
        (gp("8//3*3*3*8"), "unparseable"),
        (gp("08*3*(8/8)"), "unparseable"),
        (gp("2.5*8+3-3"), "unparseable"),
        (gp("٣*8*(8/8)"), "unparseable"),
        (gp("3*8*abs(8/8)"), "unparseable"),
        (gp("8/(3-3)*8"), "division_by_zero"),
        (gp("3*8*3/3"), "illegal_numbers"),  # 3 used three times, one 8 missing
        (gp("3*8"), "illegal_numbers"),  # numbers missing
        (gp("(3*8+8-8)*(3/3)*1"), "illegal_numbers"),  # an extra number
        (gp("3+3+8+8"), "wrong_value"),
        (gp("8/(3-8/3)", [3, 3, 8, 9]), "wrong_cards"),  # correct formula, misread cards
        (gp("3*9*8/9", [3, 9, 8, 9]), "wrong_cards"),  # cards field made up to fit the formula
        ("\\boxed{8/(3-8/3)} wait, no \\boxed{3+3+8+8}", "wrong_value"),  # the last answer wins
        ("x" * 1_000_001, "too_long"),
    ],
)
def test_rejects(response: str, reason: str) -> None:
    verdict = check_points24(response, CARDS)
    assert (verdict.correct, verdict.reason, verdict.error) == (False, reason, None), verdict


def test_feedback_messages() -> None:
    assert check_points24(gp("3+3+8+8"), CARDS).feedback == "Your formula evaluates to 22, not 24."
    assert (
        check_points24(gp("3+3+8"), CARDS).feedback
        == "You must use exactly the numbers [3, 3, 8, 8]: you used [3, 3, 8]."
    )
    assert check_points24(gp("3^8"), CARDS).feedback.startswith("Could not parse your formula '3^8'")
    assert check_points24("", CARDS).feedback.startswith("No formula found")


def test_other_target_and_fraction_value() -> None:
    verdict = check_points24(gp("3/8+3+8"), CARDS, target=24)
    assert verdict.details["value"] == "91/8"
    assert check_points24(gp("3+3+8+8"), CARDS, target=22).correct


def test_counted_in_stats() -> None:
    reset_verifier_stats()
    check_points24(gp("3+3+8+8"), CARDS)
    assert verifier_stats()["points24_checks"] == 1 and verifier_stats()["checks"] == 1
