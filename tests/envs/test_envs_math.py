"""Math: generator exactness, levels, JSONL loading errors, reward schemes, retry episodes."""

from __future__ import annotations

import json
import random
import re
import time
from fractions import Fraction

import gymnasium
import numpy as np
import pytest

from veriloop.envs.math_data import KINDS, generate_problem, latex, load_jsonl
from veriloop.envs.math_env import MathVerifyEnv, r1_format_ok
from veriloop.envs.verifiers import check_math


def test_latex_forms():
    assert [latex(Fraction(-7)), latex(Fraction(3, 4)), latex(Fraction(-10, 4))] == [
        "-7",
        "\\frac{3}{4}",
        "-\\frac{5}{2}",
    ]


def test_generated_answers_verify_exactly():
    rng = np.random.default_rng(0)
    for i in range(48):
        level, kind = 1 + i % 3, KINDS[(i // 3) % 4]
        p = generate_problem(rng, level=level, kind=kind)
        assert (p.level, p.kind) == (level, kind)
        assert Fraction(p.meta["value"]) == _value_of(p.answer)
        assert p.solution.endswith(f"$\\boxed{{{p.answer}}}$.")
        right = check_math(p.solution, p.answer)
        wrong = check_math(f"\\boxed{{{p.answer}+1}}", p.answer)
        assert right.correct and not wrong.correct and wrong.error is None, (p, right, wrong)


def _value_of(answer: str) -> Fraction:
    """Parse our own LaTeX forms back (test helper, never used on model output)."""
    sign = -1 if answer.startswith("-") else 1
    body = answer.lstrip("-")
    if body.startswith("\\frac{"):
        num, den = body[len("\\frac{") : -1].split("}{")
        return sign * Fraction(int(num), int(den))
    return sign * Fraction(int(body))


def test_levels_differ_in_difficulty():
    rng = np.random.default_rng(1)
    l3 = [generate_problem(rng, level=3, kind="linear") for _ in range(30)]
    l1 = [generate_problem(rng, level=1, kind="linear") for _ in range(30)]
    assert all("\\frac" not in p.answer and int(p.answer) > 0 for p in l1)
    assert any("\\frac" in p.answer for p in l3)
    with pytest.raises(ValueError, match="level must be one of"):
        generate_problem(rng, level=4)


def test_level_kwarg_and_mix():
    env = gymnasium.make("veriloop/MathVerify-v0", level=2)
    assert {env.reset(seed=s)[1]["task"]["level"] for s in range(20)} == {2}
    mixed = gymnasium.make("veriloop/MathVerify-v0")
    assert {mixed.reset(seed=s)[1]["task"]["level"] for s in range(40)} == {1, 2, 3}
    with pytest.raises(ValueError, match="level must be None or in"):
        gymnasium.make("veriloop/MathVerify-v0", level=7)


def _write(tmp_path, lines):
    path = tmp_path / "probs.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_jsonl_loading_and_env(tmp_path):
    rows = [
        {"question": "What is 2+2?", "answer": "4", "level": 1, "id": "a"},
        {"question": "Half of 1?", "answer": "\\frac{1}{2}", "level": 2},
    ]
    path = _write(tmp_path, [json.dumps(r) for r in rows] + [""])
    problems = load_jsonl(path)
    assert [p.answer for p in problems] == ["4", "\\frac{1}{2}"] and problems[0].meta == {"id": "a"}
    env = gymnasium.make("veriloop/MathVerify-v0", data=str(path), level=2)
    obs, info = env.reset(seed=0)
    assert "Half of 1?" in obs and info["task"]["answer"] == "\\frac{1}{2}"
    _, reward, terminated, _, _ = env.step("so it is \\boxed{0.5}")
    assert reward == 1.0 and terminated


@pytest.mark.parametrize(
    ("line", "reason"),
    [
        ("{not json", "invalid JSON"),
        ('{"question": "q"}', 'missing "answer"'),
        ('{"question": 3, "answer": "1"}', '"question" must be a non-empty string'),
        ('{"answer": "1"}', 'missing "question"'),
        ("[1, 2]", "expected a JSON object"),
        ('{"question": "q", "answer": [1]}', '"answer" must be a string'),
        ('{"question": "q", "answer": "1", "level": "hard"}', '"level" must be an integer'),
        ('{"question": "q", "answer": ""}', '"answer" is empty'),
        ('{"question": "q", "answer": "  "}', '"answer" is empty'),
        ('{"question": "q", "answer": "1", "meta": "x"}', '"meta" must be a JSON object'),
        ('{"question": "q", "answer": "1", "meta": 5}', '"meta" must be a JSON object'),
        ('{"question": "q", "answer": "1", "kind": 5}', '"kind" must be a string'),
        ('{"question": "q", "answer": "1", "solution": ["a"]}', '"solution" must be a string'),
        ("[" * 100_000, "nested too deeply"),
    ],
)
def test_jsonl_errors_name_file_and_line(tmp_path, line, reason):
    path = _write(tmp_path, ['{"question": "ok", "answer": "1"}', "", line])
    with pytest.raises(ValueError) as err:
        load_jsonl(path)
    assert f"{path}:3:" in str(err.value) and reason in str(err.value)


def test_jsonl_bad_encoding_names_file_and_line(tmp_path):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(b'{"question": "ok", "answer": "1"}\n{"question": "caf\xe9", "answer": "1"}\n')
    with pytest.raises(ValueError, match=f"{re.escape(str(path))}:2: not UTF-8 text"):
        load_jsonl(path)


def test_dapo_and_r1_rewards():
    task = {"question": "What is 6*7?", "answer": "42"}
    dapo = MathVerifyEnv()
    dapo.reset(options={"task": task})
    assert dapo.step("\\boxed{42}")[1] == 1.0
    dapo.reset(options={"task": task})
    assert dapo.step("\\boxed{41}")[1] == -1.0
    r1 = MathVerifyEnv(reward="r1")
    obs, _ = r1.reset(options={"task": task})
    assert "<think>" in obs and "<answer>" in obs
    shaped = "<think>6*7 = 42</think>\n<answer>\\boxed{42}</answer>"
    _, reward, _, _, info = r1.step(shaped)
    assert reward == pytest.approx(1.1) and info["reward_components"] == {"accuracy": 1.0, "format": 0.1}
    r1.reset(options={"task": task})
    _, reward, _, _, info = r1.step("<think>hmm</think><answer>\\boxed{41}</answer>")
    assert reward == pytest.approx(0.1)
    r1.reset(options={"task": task})
    assert r1.step("\\boxed{42}")[1] == 1.0  # right but unshaped: no format bonus
    assert not r1_format_ok("<answer>1</answer><think>x</think>") and r1_format_ok(
        " <think></think><answer>1</answer> "
    )
    with pytest.raises(ValueError, match="'dapo' or 'r1'"):
        MathVerifyEnv(reward="grpo")


def test_retry_episode(script):
    env = gymnasium.make("veriloop/MathVerifyRetry-v0")
    _, info = env.reset(seed=4)
    gold = info["task"]["answer"]
    out = script(env, 4, ["\\boxed{987654321}", "no idea", f"\\boxed{{{gold}}}"])
    assert out["rewards"] == [-1.0, -1.0, 1.0] and out["terminated"] == [False, False, True]
    assert "Try again. You have 2 attempts left." in out["obs"][1] and gold not in out["obs"][1]
    assert [i["verdict"].reason for i in out["infos"]] == ["wrong_value", "no_answer", "correct"]
    out = script(env, 4, ["\\boxed{987654321}"] * 3)
    assert out["truncated"] == [False, False, True] and not any(out["terminated"])


_R1 = re.compile(r"\s*<think>.*?</think>\s*<answer>.*?</answer>\s*", re.DOTALL)


def test_r1_format_matches_the_regex_rule_on_random_texts():
    pieces = ["<think>", "</think>", "<answer>", "</answer>", " ", "\n", "x", "<", "</"]
    rng = random.Random(0)
    for _ in range(20_000):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 9)))
        assert r1_format_ok(text) == (_R1.fullmatch(text) is not None), text


def test_r1_format_is_linear_on_hostile_text():
    baits = [
        "<think>" + "</think><answer></answer>x" * 10_000 + "</answer>x",  # the regex took ~7 s on this
        "<think>" + "</think> x" * 100_000 + "</think> <answer>1</answer>",  # walks every </think>
        "<think></think>" + " " * 1_000_000 + "x</answer>",
    ]
    start = time.monotonic()
    assert [r1_format_ok(b) for b in baits] == [False, True, False]
    assert time.monotonic() - start < 0.5
    env = MathVerifyEnv(reward="r1")
    env.reset(seed=0)
    start = time.monotonic()
    _, reward, terminated, _, info = env.step(baits[0] * 4)  # a megabyte through the whole env
    assert time.monotonic() - start < 1.0
    assert (reward, terminated, info["verdict"].reason) == (0.0, True, "too_long")
