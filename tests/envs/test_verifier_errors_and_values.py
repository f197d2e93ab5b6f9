"""Second hardening round of the verifiers: each test failed before its fix.

Verifier exceptions and user checks (a raising or stuck ``check`` is a verifier error), Unicode
digits, values in a standard form vs arithmetic left undone, the bare-brace cap, the Points24 JSON
cards check, feedback that hides the gold's shape, "find all" answers, and the vision env's feedback.
"""

from __future__ import annotations

import math
import time
from typing import Any

import gymnasium
import pytest

import veriloop.envs  # noqa: F401  (registers the ids)
from veriloop.envs.base import VerifierEnv
from veriloop.envs.math_env import MathVerifyEnv
from veriloop.envs.verifiers import Verdict, check_math, check_math_batch, check_points24, math_check
from veriloop.envs.verifiers.extract import MAX_BARE_BRACES, bare_brace_depth
from veriloop.envs.verifiers.guarded import DEFAULT_CHECK_TIMEOUT_S, check_deadline
from veriloop.envs.verifiers.screen import MIN_POWER_VALUE, is_unevaluated
from veriloop.envs.verifiers.sets import gold_members, members


# ------------------------------------------------------------------ a check that raises or stalls
class UserEnv(VerifierEnv[dict]):
    """A user environment whose check misbehaves on demand."""

    def __init__(self, behaviour: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.behaviour = behaviour

    def sample_task(self) -> dict:
        return {"answer": "7"}

    def prompt(self, task: dict) -> str:
        return "Say 7."

    def check(self, response: str, task: dict) -> Verdict:
        if self.behaviour == "raise":
            raise ValueError("my checker has a bug")
        if self.behaviour == "stall":
            time.sleep(30)
        ok = response.strip() == task["answer"]
        return Verdict(correct=ok, reason="correct" if ok else "wrong_value")

    def reward(self, verdict: Verdict, task: dict) -> tuple[float, dict[str, float]]:
        return float(verdict.correct), {}


def test_a_user_check_that_raises_is_a_verifier_error() -> None:
    env = UserEnv("raise")
    env.reset(seed=0)
    _, reward, terminated, truncated, info = env.step("7")
    assert (reward, terminated, truncated, info["verifier_error"]) == (0.0, False, True, "crash")
    assert "my checker has a bug" in info["verdict"].details["message"]


def test_a_user_check_gets_the_math_deadline_and_it_is_configurable() -> None:
    env = UserEnv("stall")
    assert check_deadline(env) == DEFAULT_CHECK_TIMEOUT_S == math_check.DEFAULT_TIMEOUT_S
    env.check_timeout_s = 0.3
    env.reset(seed=0)
    start = time.monotonic()
    _, reward, _, truncated, info = env.step("7")
    assert time.monotonic() - start < 3
    assert (reward, truncated, info["verifier_error"]) == (0.0, True, "timeout")
    good = UserEnv("ok")
    good.check_timeout_s = 0.3
    good.reset(seed=0)
    assert good.step("7")[1] == 1.0  # a quick check under a deadline is judged as before


def test_built_in_checks_bound_their_own_time_and_user_code_gets_the_deadline() -> None:
    import importlib

    from veriloop.envs import ENVS, INTEROP_ENVS

    for env_id, (entry_point, _) in {**ENVS, **INTEROP_ENVS}.items():
        module, _, name = entry_point.partition(":")
        cls = getattr(importlib.import_module(module), name)
        expected = DEFAULT_CHECK_TIMEOUT_S if env_id == "veriloop/Dataset-v0" else None  # the user's function
        assert check_deadline(cls.__new__(cls)) == expected, env_id
    env = UserEnv("ok", check_timeout_s=math.inf)
    assert check_deadline(env) is None
    assert check_deadline(UserEnv("ok", check_timeout_s=12)) == 12.0
    with pytest.raises(ValueError, match="check_timeout_s"):
        UserEnv("ok", check_timeout_s=0)


def test_a_built_in_check_that_raises_is_a_verifier_error(monkeypatch: pytest.MonkeyPatch) -> None:
    env = gymnasium.make("veriloop/MathVerify-v0")
    env.reset(seed=0)

    def broken(*args: Any) -> Verdict:
        raise ValueError("invalid literal for int() with base 10: '²'")

    monkeypatch.setattr(MathVerifyEnv, "check", broken)
    _, reward, _, truncated, info = env.step("\\boxed{1}")
    assert (reward, truncated, info["verifier_error"]) == (0.0, True, "crash")


def test_solve_verify_catches_a_raising_check_too(monkeypatch: pytest.MonkeyPatch) -> None:
    env = gymnasium.make("veriloop/SolveVerify-v0")
    env.reset(seed=0)

    def broken(*args: Any) -> Verdict:
        raise ValueError("a verifier bug")

    monkeypatch.setattr(MathVerifyEnv, "check", broken)
    _, reward, _, truncated, info = env.step("\\boxed{1}")
    assert (reward, truncated, info["verifier_error"]) == (0.0, True, "crash")


# ------------------------------------------------------------------ Unicode digits
@pytest.mark.parametrize(
    "answer", ["2^{²}", "²!", "10^⁶", "①", "①!", "2^{①}", "3^{٣}", "⑳!", "10^{²²²²²²²²}", "1,²³⁴"]
)
def test_unicode_digits_never_raise(answer: str) -> None:
    verdict = check_math(f"\\boxed{{{answer}}}", "4")
    assert verdict.error is None and not verdict.correct


def test_a_screen_that_raises_anyway_is_a_verifier_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(math_check, "is_hedged", lambda *a: int("²"))
    verdict = check_math("\\boxed{3}", "3")
    assert (verdict.error, verdict.reason) == ("crash", "verifier_error")


# ------------------------------------------------------------------ standard forms, both ways
STANDARD = [
    ("2^{10}", "1024"),
    ("1.5 \\times 10^{6}", "1500000"),
    ("3 \\cdot 10^{5}", "300000"),
    ("10^{6}", "1000000"),
    ("-2^{10}", "-1024"),
    ("1.5 × 10^{6}", "1500000"),
    ("2.5 \\times 10^{-3}", "0.0025"),
]
UNDONE = [
    ("2^{3}", "8"),  # a small power: the computation asked for
    ("\\displaystyle 14-26", "-12"),
    ("\\textstyle 14-26", "-12"),
    ("14 − 26", "-12"),  # U+2212
    ("3 × 11 + 10", "43"),
    ("\\sqrt[3]{8}", "2"),
    ("2 \\times 10^{3} + 5", "2005"),
    ("2^{2^{2}}", "16"),
    ("10^{3} \\div 8", "125"),
]


@pytest.mark.parametrize(("answer", "gold"), STANDARD)
def test_a_value_in_a_standard_form_is_judged_by_its_value(answer: str, gold: str) -> None:
    assert not is_unevaluated(answer, gold)
    assert check_math(f"\\boxed{{{answer}}}", gold).correct


@pytest.mark.parametrize(("answer", "gold"), UNDONE)
def test_arithmetic_left_undone_is_unevaluated(answer: str, gold: str) -> None:
    verdict = check_math(f"\\boxed{{{answer}}}", gold)
    assert (verdict.correct, verdict.reason) == (False, "unevaluated")


def test_the_power_threshold() -> None:
    assert MIN_POWER_VALUE == 1000
    assert is_unevaluated("3^{6}", "729") and not is_unevaluated("3^{7}", "2187")


# ------------------------------------------------------------------ brace nesting
def test_deep_bare_braces_are_refused_at_once() -> None:
    hostile = "\\boxed{" + "{" * 15 + "1" + "}" * 15 + "}"  # 40 characters of answer
    assert bare_brace_depth(hostile[7:-1]) == 15 > MAX_BARE_BRACES
    start = time.monotonic()
    verdicts = check_math_batch([(hostile, "1")] * 16)
    assert time.monotonic() - start < 2.0
    assert {(v.reason, v.details.get("guard")) for v in verdicts} == {("unparseable", "nesting_depth")}


def test_allowed_nesting_is_still_judged() -> None:
    at_cap = "{" * MAX_BARE_BRACES + "1" + "}" * MAX_BARE_BRACES
    assert check_math(f"\\boxed{{{at_cap}}}", "1", timeout=30).correct
    fractions = "\\frac{1}{" * 10 + "x" + "}" * 10  # command arguments nest cheaply
    assert bare_brace_depth(fractions) == 0
    assert check_math("\\boxed{(((((((((((1)))))))))))}", "1").correct  # 11 parentheses
    assert check_math("\\boxed{" + "(" * 13 + "1" + ")" * 13 + "}", "1").reason == "unparseable"


# ------------------------------------------------------------------ Points24 JSON
@pytest.mark.parametrize(
    "response",
    [
        '{"cards": ["A", "2", "3", "4"], "formula": "8/(3-8/3)",}',
        '{"cards": ["A", "2", "3", "4",], "formula": "8/(3-8/3)"}',
        "{'cards': ['A', '2', '3', '4'], \"formula\": \"8/(3-8/3)\"}",
        '{"cards": "3 3 8 8", "formula": "8/(3-8/3)",}',
    ],
)
def test_malformed_json_never_skips_the_cards_check(response: str) -> None:
    assert check_points24(response, [3, 3, 8, 8]).reason in {"wrong_cards"}


def test_malformed_json_with_the_right_cards_still_scores() -> None:
    response = '{"cards": ["3", "3", "8", "8",], "formula": "8/(3-8/3)",}'
    assert check_points24(response, [3, 3, 8, 8]).correct


# ------------------------------------------------------------------ feedback hides the gold's shape
@pytest.mark.parametrize(
    "answer", ["1, 2", "3 \\pm 1", "3 \\text{ or } 4", "14 - 26", "x = 3 = 4", "2^{2^{2^{2}}}"]
)
def test_screen_feedback_is_the_wrong_value_line(answer: str) -> None:
    for gold in ("-12", "x", "\\{5, 6\\}"):
        verdict = check_math(f"\\boxed{{{answer}}}", gold)
        if not verdict.correct and verdict.error is None:
            assert verdict.feedback == f"Your answer {answer} is incorrect.", (gold, verdict)


# ------------------------------------------------------------------ "find all"
@pytest.mark.parametrize(
    ("answer", "gold", "correct"),
    [
        ("x=1 \\text{ or } x=2", "\\{1,2\\}", True),
        ("x = 2, x = 1", "\\{1, 2\\}", True),
        ("2 \\text{ and } 1", "1, 2", True),
        ("\\{1, 2\\}", "\\boxed{1}\\boxed{2}", True),
        ("1, 2", "\\boxed{1}\\boxed{2}", True),
        ("1", "\\boxed{1}\\boxed{2}", False),
        ("1, 2, 3", "\\{1, 2\\}", False),  # an extra value is wrong, not a hedge that pays
        ("x = 1", "\\{1, 2\\}", False),
        ("1 \\text{ or } 2", "1", False),  # one value asked: still a hedge
    ],
)
def test_find_all_answers(answer: str, gold: str, correct: bool) -> None:
    verdict = check_math(f"\\boxed{{{answer}}}", gold)
    assert verdict.correct is correct and verdict.error is None, verdict


def test_set_members() -> None:
    assert members("x_1 = 3 \\text{ or } x_2 = -1") == ["3", "-1"]
    assert members("1{,}000") == ["1000"]
    assert gold_members("(1, 2)") is None and gold_members("[1, 2)") is None  # tuple, interval
    assert gold_members("1,000") is None and gold_members("\\boxed{3}") is None


# ------------------------------------------------------------------ Points24-vision feedback
def test_vision_feedback_never_lists_the_dealt_values() -> None:
    env = gymnasium.make("veriloop/Points24-vision-v0", max_attempts=50)
    leaks = 0
    for seed in range(20):
        _, info = env.reset(seed=seed)
        dealt = str(sorted(info["task"]["values"]))
        for formula in ("1+2", "1+1+1+1", "13*13-13-13"):
            obs = env.step(f'{{"formula": "{formula}"}}')[0]
            leaks += dealt in obs["text"] or dealt[1:-1] in obs["text"]
    assert leaks == 0
    text_env = gymnasium.make("veriloop/Points24-text-v0", max_attempts=2)
    _, info = text_env.reset(seed=0)
    assert str(sorted(info["task"]["values"])) in text_env.step('{"formula": "1+2"}')[0]  # text: as before
