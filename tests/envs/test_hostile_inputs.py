"""Hostile model output: both verifiers must answer within a bound, never crash the caller, never run it.

Bounds: ``check_math`` with ``timeout=5`` must return within 7 s (most return in milliseconds, thanks
to the size guards and the bomb screen); ``check_points24`` within 0.5 s.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from veriloop.envs.verifiers import _worker, check_math, check_math_batch, check_points24
from veriloop.envs.verifiers.extract import extract_answer
from veriloop.envs.verifiers.screen import find_bomb

BOMBS = {
    "tower_flat": "\\boxed{9^9^9^9^9}",
    "factorial": "\\boxed{10000000!}",
    "factorial_of_power": "\\boxed{(10^{6})!}",
    "tower_braced": "\\boxed{2^{2^{2^{2^{2^{2^{2}}}}}}}",
    "huge_exponent": "\\boxed{10^{100000000}}",
    "one_megabyte": "7" * 1_000_000,
    "one_megabyte_boxed": "\\boxed{" + "9" * 1_000_000 + "}",
    "deep_braces": "\\boxed{" + "{" * 5000 + "1" + "}" * 5000 + "}",
    "deep_parens_in_box": "\\boxed{" + "(" * 450 + "1" + ")" * 450 + "}",
    "unclosed_braces": "{" * 5000,
    "unclosed_parens": "(" * 19_000,
    "boxed_bait_long": "\\boxed{" * 10_000,
    "boxed_bait_short": "\\boxed{" * 2_800,
    "think_bait": "<think>" * 2_500,
    "close_think_bait": "</think>" * 2_400 + "\\boxed{1}",
    "answer_bait": "<answer>" * 2_000 + "1</answer>",
    "spaces": " " * 19_999,
    "digits": "1" * 19_999,
    "boxed_digits": "\\boxed{" + "1" * 999 + "}",
    "escaped_braces": "\\boxed{" + "\\{" * 4000 + "}",
    "backslashes": "\\" * 19_999,
    "frac_chain": "\\boxed{" + "\\frac{1}{" * 100 + "2" + "}" * 100 + "}",
    "nul_and_unicode": "\\boxed{\x00\ud800\u202e3}",
}


@pytest.fixture(scope="module", autouse=True)
def warm_pool() -> None:
    """Start the worker pool once, so start-up time is not charged to the first case."""
    check_math("\\boxed{1}", "1")


@pytest.mark.parametrize("name", sorted(BOMBS))
def test_math_bombs_return_in_bound(name: str) -> None:
    start = time.monotonic()
    verdict = check_math(BOMBS[name], "3", timeout=5.0)
    assert time.monotonic() - start < 7.0
    assert verdict.correct is False


@pytest.mark.parametrize("name", sorted(BOMBS))
def test_points24_bombs_return_in_bound(name: str) -> None:
    start = time.monotonic()
    verdict = check_points24(BOMBS[name], [3, 3, 8, 8])
    assert time.monotonic() - start < 0.5
    assert verdict.correct is False and verdict.error is None


@pytest.mark.parametrize("name", sorted(BOMBS))
def test_extraction_is_fast(name: str) -> None:
    start = time.monotonic()
    extract_answer(BOMBS[name])
    assert time.monotonic() - start < 0.2


def _no_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any use of the verifier's worker pool fails the test: screened input must never reach it."""

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("a screened answer reached the worker pool")

    monkeypatch.setattr("veriloop.envs.verifiers.math_check.get_pool", refuse)


def test_screened_bombs_never_reach_a_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    _no_worker(monkeypatch)
    for name in ("tower_flat", "factorial", "factorial_of_power", "tower_braced", "huge_exponent"):
        start = time.monotonic()
        verdict = check_math(BOMBS[name], "3")
        # a bound far under the 5 s deadline that a worker would hold (a loaded CI machine took 0.1 s)
        assert time.monotonic() - start < 1.0, name
        assert verdict.reason == "unparseable" and verdict.details["guard"], name


@pytest.mark.parametrize(
    "answer", ["9^{9^{9}}", "10^{10^{10}}", "2^{2^{100}}", "(10^{10})^{10^{10}}", "x^{10^{6}}"]
)
def test_two_storey_towers_are_screened(answer: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each of these held a worker for the whole 5 s deadline before the screen knew them."""
    _no_worker(monkeypatch)
    start = time.monotonic()
    verdict = check_math(f"\\boxed{{{answer}}}", "3")
    assert time.monotonic() - start < 1.0
    assert (verdict.correct, verdict.error) == (False, None)
    assert (verdict.reason, verdict.details["guard"]) == ("unparseable", "huge_exponent")


def test_tower_screen_judges_plain_literals_only() -> None:
    assert find_bomb("2^{2^{4}}", "3") is None  # 65536: small enough to compute
    assert find_bomb("10^{10^{5}}", "3") is None  # exactly at the cap
    assert find_bomb("7^{10^{5} + 1}", "3") is None  # not a literal: math-verify and the deadline decide
    assert find_bomb("2^{x^{9}}", "3") is None
    assert find_bomb("10^{10^{10}}", "10^{10^{10}}") is None  # the gold has it too


@pytest.mark.parametrize(
    ("answer", "gold"),
    [
        ("\\sum_{k=1}^{1000000} k", "500000500000"),  # an upper limit is not an exponent
        ("\\sum_{k=1}^{10^{12}} k", "500000000000500000000000"),
        ("\\int_0^{10^{9}} 0 \\, dx", "0"),
    ],
)
def test_big_limits_are_not_mistaken_for_bombs(answer: str, gold: str) -> None:
    verdict = check_math(f"\\boxed{{{answer}}}", gold)
    assert verdict.details.get("guard") is None
    assert verdict.correct, verdict


@pytest.mark.parametrize(
    ("answer", "gold"), [("2 ** 3", "3"), ("9**9", "9"), ("1)(", "1"), ("x = 2**3", "3"), ("7 ** 4", "4")]
)
def test_no_last_number_fallback(answer: str, gold: str) -> None:
    """math-verify's plain-expression mode read "2 ** 3" as its last number, 3: a free reward."""
    verdict = check_math(f"\\boxed{{{answer}}}", gold)
    assert (verdict.correct, verdict.error) == (False, None)


def test_model_text_never_reaches_sympy_parse_expr(monkeypatch: pytest.MonkeyPatch) -> None:
    """The worker's own code path, run in-process with sympy's ``parse_expr`` (an ``eval``) watched."""
    import math_verify.parser

    calls: list[object] = []

    def trap(*args: object, **kwargs: object) -> None:
        calls.append(args)  # recorded, not raised: math-verify swallows exceptions from its parsers
        raise ValueError("parse_expr is off limits")

    monkeypatch.setattr(math_verify.parser, "parse_expr", trap)
    math_verify.parser.parse_expr_cached.cache_clear()
    cases = [
        ("$x = 2**3$", "$8$"),  # the plain-expression extractor handed "2**3" to parse_expr
        ("$= (1+2)*3 $", "$9$"),
        ("$\\frac{1}{2}$", "$0.5$"),
        ("$x = 3$", "$3$"),
        ("$__import__('os').system('true')$", "$3$"),
    ]
    outcomes = [_worker.math_task(answer, gold)[0] for answer, gold in cases]
    assert calls == []
    assert outcomes[2:4] == ["correct", "correct"]
    assert "correct" not in outcomes[:2] + outcomes[4:]


def _injections(target: Path) -> list[str]:
    cmd = f"__import__('os').system('touch {target}')"
    return [
        cmd,
        f'exec("{cmd}")',
        f"eval('{cmd}')",
        f"(lambda: {cmd})()",
        "[c for c in ().__class__.__base__.__subclasses__()]",
    ]


def test_code_injection_is_never_executed(tmp_path: Path) -> None:
    target = tmp_path / "pwned"
    for payload in _injections(target):
        assert not check_math(f"\\boxed{{{payload}}}", "3").correct
        assert not check_math(f"<answer>{payload}</answer>", "3").correct
        for response in (
            payload,
            f'{{"cards": [3, 3, 8, 8], "formula": "{payload}"}}',
            f"<answer>{payload}</answer>",
        ):
            assert check_points24(response, [3, 3, 8, 8]).correct is False
    time.sleep(0.2)
    assert not target.exists()


def test_one_pathological_item_does_not_delay_the_others() -> None:
    """A slow item holds one worker until its deadline; the rest finish on the other worker(s)."""
    normal = [(f"\\boxed{{{k}/2}}", f"{k / 2}") for k in range(1, 11)]
    slow = (
        "\\boxed{\\binom{10^{9}}{5 \\cdot 10^{8}}}",
        "3",
    )  # legit (a 300-million-digit integer) but minutes in sympy
    pairs = normal[:3] + [slow] + normal[3:]
    done_at: dict[int, float] = {}
    start = time.monotonic()
    verdicts = check_math_batch(
        pairs, timeout=4.0, on_result=lambda i, v: done_at.setdefault(i, time.monotonic() - start)
    )
    total = time.monotonic() - start
    assert verdicts[3].error == "timeout"
    assert all(v.correct for i, v in enumerate(verdicts) if i != 3)
    others = [t for i, t in done_at.items() if i != 3]
    assert max(others) < 2.0, f"normal items finished at {sorted(others)} s"
    assert 4.0 <= done_at[3] < 6.0 and total < 6.5


#: Megabyte texts built to make naive regexes or scans backtrack, for the environments' own parsing.
ENV_BAIT = {
    "verify_tags": "<verify>" * 125_000,
    "r1_shape": "<think>" + "</think><answer></answer>x" * 40_000 + "</answer>x",
    "think_tags": "<think>" * 80_000 + "</think>" * 80_000,
    "answer_tags": "<answer>" * 60_000 + "</answer>" * 60_000,
    "boxed_open": "\\boxed{" * 150_000,
    "json_keys": '{"formula": "' * 80_000,
    "give_up_lines": "I give up\n" * 100_000 + "no",
    "deep_braces": "{" * 500_000 + "}" * 500_000,
}
_ENV_PROBE = """
import json, sys, time, gymnasium, veriloop.envs
baits = json.loads(sys.stdin.read())
worst = {}
for env_id in veriloop.envs.registered_ids():
    for name, text in baits.items():
        env = gymnasium.make(env_id)
        env.reset(seed=0)
        start = time.monotonic()
        env.step(text)
        worst[f"{env_id} {name}"] = time.monotonic() - start
print(json.dumps(worst))
"""


def test_every_env_steps_fast_on_megabyte_bait() -> None:
    """In a subprocess, so a quadratic regex fails the test instead of hanging the suite."""
    out = subprocess.run(
        [sys.executable, "-c", _ENV_PROBE],
        input=json.dumps(ENV_BAIT),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    seconds = json.loads(out.stdout)
    from veriloop.envs import ENVS, INTEROP_ENVS

    assert len(seconds) == len(ENVS | INTEROP_ENVS) * len(ENV_BAIT)
    slow = {k: round(v, 2) for k, v in seconds.items() if v > 1.0}
    assert not slow, slow
