"""S2R solve -> verify -> correct: action parsing, process/outcome rewards, budgets, statistics."""

from __future__ import annotations

import json
import random
import re
import time

import gymnasium
import pytest

from veriloop.envs.solve_verify import NO_SOLVES_LEFT, VERIFY_PROMPT, correction_stats, parse_action

OK, BAD = "<verify>correct</verify>", "<verify>incorrect</verify>"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("\\boxed{3}", ("solve", None)),
        (OK, ("verify", True)),
        (" <VERIFY> Incorrect </verify>", ("verify", False)),
        (f"{OK} hmm, no: {BAD}", ("verify", False)),
        ("<verify>maybe</verify>", ("invalid", None)),
        ("<verify>correct", ("invalid", None)),
    ],
)
def test_parse_action(text, expected):
    assert parse_action(text) == expected


_TAG = re.compile(r"<verify>(.*?)</verify>", re.IGNORECASE | re.DOTALL)


def _reference_parse(text):
    """The documented rule as a regex (fine for short strings; quadratic on hostile ones)."""
    tags = _TAG.findall(text)
    if not tags:
        return ("invalid", None) if "<verify>" in text.lower() else ("solve", None)
    word = tags[-1].strip().lower()
    return ("verify", word == "correct") if word in ("correct", "incorrect") else ("invalid", None)


def test_parse_action_matches_the_regex_rule_on_random_texts():
    pieces = ["<verify>", "</verify>", "<VERIFY>", "</Verify>", "correct", "incorrect", " ", "\n", "x", "</"]
    rng = random.Random(0)
    for _ in range(20_000):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 8)))
        assert parse_action(text) == _reference_parse(text), text


def test_parse_action_is_linear_on_hostile_text():
    bait = "<verify>" * 8_000 + "<verify>correct</verify>"  # the lazy regex took ~3 s on this
    start = time.monotonic()
    assert parse_action(bait) == ("invalid", None)  # the first <verify> pairs with the only </verify>
    assert parse_action("<verify>" * 125_000) == ("invalid", None)  # one megabyte
    assert time.monotonic() - start < 0.5


def _math_env(**kwargs):
    env = gymnasium.make("veriloop/SolveVerify-v0", **kwargs)
    _, info = env.reset(seed=2)
    return env, info["task"]["answer"]


def test_wrong_then_right_process_rewards(script):
    env, gold = _math_env()
    out = script(env, 2, ["\\boxed{987654321}", BAD, f"\\boxed{{{gold}}}", OK])
    assert out["rewards"] == [-1.0, 1.0, 1.0, 1.0]
    assert out["terminated"] == [False, False, False, True] and not any(out["truncated"])
    infos = out["infos"]
    assert [i["action_kind"] for i in infos] == ["solve", "verify", "solve", "verify"]
    assert [i["action_index"] for i in infos] == [0, 1, 2, 3]
    assert [i["solve_correct"] for i in infos] == [False, False, True, True]
    assert [i["verify_matches_truth"] for i in infos] == [None, True, None, True]
    assert [i["outcome_reward"] for i in infos] == [None, None, None, 1.0]
    # a verify's reward class is the truth of the solve it judged (balanced verify rewards read it)
    assert [i["signal"].reward_class for i in infos] == [None, "wrong", None, "right"]
    assert out["obs"][1] == VERIFY_PROMPT and out["obs"][2] == "Solve again."
    assert gold not in out["obs"][1]  # correctness stays hidden after a solve
    assert infos[-1]["stats"] == {
        "solves": 2,
        "verifies": 2,
        "final_correct": True,
        "wrong_to_right": 1,
        "right_to_wrong": 0,
        "verify_accuracy": 1.0,
    }


def test_outcome_mode_rewards_only_at_the_end(script):
    env, gold = _math_env(reward_mode="outcome")
    out = script(env, 2, ["\\boxed{987654321}", BAD, f"\\boxed{{{gold}}}", OK])
    assert out["rewards"] == [0.0, 0.0, 0.0, 1.0]
    assert [i["process_reward"] for i in out["infos"]] == [-1.0, 1.0, 1.0, 1.0]


def test_wrong_verify_and_right_to_wrong(script):
    env, gold = _math_env(reward_mode="outcome")
    out = script(env, 2, [f"\\boxed{{{gold}}}", BAD, "\\boxed{987654321}", OK])
    assert [i["process_reward"] for i in out["infos"]] == [1.0, -1.0, -1.0, -1.0]
    assert [i["signal"].reward_class for i in out["infos"]] == [
        None,
        "right",
        None,
        "wrong",
    ]  # not the verdict
    assert out["rewards"][-1] == -1.0 and out["terminated"][-1]
    stats = out["infos"][-1]["stats"]
    assert stats["right_to_wrong"] == 1 and stats["verify_accuracy"] == 0.0 and not stats["final_correct"]


def test_attempts_exhausted_truncates(script):
    env, _ = _math_env()
    out = script(env, 2, ["\\boxed{987654321}", BAD] * 3)
    assert out["truncated"] == [False] * 5 + [True] and not any(out["terminated"])
    assert out["infos"][-1]["attempt"] == 3 and out["infos"][-1]["outcome_reward"] == -1.0


def test_no_solve_after_the_last_attempt(script):
    env, gold = _math_env(max_attempts=2)
    out = script(env, 2, ["\\boxed{987654321}", "\\boxed{987654320}", f"\\boxed{{{gold}}}"])
    infos = out["infos"]
    assert [i["action_kind"] for i in infos] == ["solve", "solve", "invalid"]
    assert [i["attempt"] for i in infos] == [1, 2, 2]  # the third solve is neither checked nor counted
    assert infos[-1]["verdict"] is None and infos[-1]["process_reward"] == -1.0
    assert out["truncated"] == [False, False, True] and not any(out["terminated"])
    assert out["obs"][-1] == NO_SOLVES_LEFT
    assert infos[-1]["outcome_reward"] == -1.0 and infos[-1]["stats"]["solves"] == 2
    out = script(env, 2, ["\\boxed{987654321}", BAD, f"\\boxed{{{gold}}}", OK])  # verifying is still fine
    assert out["terminated"][-1] and out["rewards"] == [-1.0, 1.0, 1.0, 1.0]


def test_invalid_actions_and_step_budget(script):
    env, gold = _math_env(max_steps=3)
    out = script(env, 2, [OK, "\\boxed{1}", "<verify>perhaps</verify>"])
    assert [i["action_kind"] for i in out["infos"]] == ["invalid", "solve", "invalid"]
    assert out["rewards"][0] == -1.0 and out["rewards"][2] == -1.0
    assert out["truncated"] == [False, False, True] and "solve first" in out["obs"][1]
    out = script(env, 2, ["\\boxed{1}", BAD, BAD])
    assert out["infos"][2]["action_kind"] == "invalid"  # a verify right after a verify


def test_points24_task(script):
    env = gymnasium.make("veriloop/SolveVerify-v0", task="points24")
    _, info = env.reset(seed=0)
    task = info["task"]
    right = json.dumps({"cards": [c[:-1] for c in task["cards"]], "formula": task["solution"]})
    out = script(env, 0, [right, OK])
    assert out["rewards"] == [1.0, 1.0] and out["terminated"] == [False, True]
    with pytest.raises(ValueError, match="text Points24"):
        gymnasium.make("veriloop/SolveVerify-v0", task="points24", vision=True)
    with pytest.raises(ValueError, match="'math' or 'points24'"):
        gymnasium.make("veriloop/SolveVerify-v0", task="chess")


def test_correction_stats_hand_computed():
    history = [
        {"kind": "solve", "correct": False},
        {"kind": "verify", "matches": True},
        {"kind": "solve", "correct": True},
        {"kind": "verify", "matches": False},
        {"kind": "solve", "correct": False},
        {"kind": "invalid"},
    ]
    assert correction_stats(history) == {
        "solves": 3,
        "verifies": 2,
        "final_correct": False,
        "wrong_to_right": 1,
        "right_to_wrong": 1,
        "verify_accuracy": 0.5,
    }
    assert correction_stats([])["verify_accuracy"] is None
