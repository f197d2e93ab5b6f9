"""Hostile model output: both verifiers must answer within a bound, never crash the caller, never run it.

Bounds: ``check_math`` with ``timeout=5`` must return within 7 s (most return in milliseconds, thanks
to the size guards and the bomb screen); ``check_points24`` within 0.5 s.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from veriloop.envs.verifiers import check_math, check_math_batch, check_points24
from veriloop.envs.verifiers.extract import extract_answer

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


def test_screened_bombs_never_reach_a_worker() -> None:
    for name in ("tower_flat", "factorial", "factorial_of_power", "tower_braced", "huge_exponent"):
        start = time.monotonic()
        verdict = check_math(BOMBS[name], "3")
        assert time.monotonic() - start < 0.05, name
        assert verdict.reason == "unparseable" and verdict.details["guard"], name


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
    slow = ("\\boxed{\\int_0^{10^9} x^{10^5} dx}", "3")  # legit but ~10 s in sympy
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
