"""Points24: cards, solver, rules, suits, rewards, multi-turn episodes, vision rendering."""

from __future__ import annotations

import itertools
import json

import gymnasium
import numpy as np
import pytest

from veriloop.envs.points24.cards import Card, card_value, deal, parse_code, rank_of_claim, recognition
from veriloop.envs.points24.env import DEFAULT_REWARDS, Points24Env, Points24Task
from veriloop.envs.points24.render import IMAGE_SHAPE, render_cards
from veriloop.envs.points24.solver import is_solvable, solve
from veriloop.envs.verifiers import check_points24


def _answer(cards, formula):
    return json.dumps({"cards": cards, "formula": formula})


@pytest.mark.parametrize(
    ("values", "expected"), [([3, 3, 8, 8], "8/(3-8/3)"), ([1, 1, 1, 1], None), ([5, 5, 5, 1], "5*(5-1/5)")]
)
def test_solver_known_hands(values, expected):
    assert solve(values) == expected


def test_solver_solutions_verify_and_count():
    hands = list(itertools.combinations_with_replacement(range(1, 14), 4))[::7]
    for hand in hands:
        formula = solve(hand)
        if formula is not None:
            verdict = check_points24(_answer([str(v) for v in hand], formula), hand)
            assert verdict.correct, (hand, formula, verdict)
    assert solve([2, 3], 6) == "2*3" and solve([1, 2, 3, 4], 10) is not None and not is_solvable([1, 1, 1, 2])


def test_card_values_and_codes():
    assert [card_value(r, "10") for r in (1, 10, 11, 12, 13)] == [1, 10, 10, 10, 10]
    assert [card_value(r, "11-12-13") for r in (1, 10, 11, 12, 13)] == [1, 10, 11, 12, 13]
    assert parse_code("10h") == Card(10, "H") and parse_code("Q♠") == Card(12, "S")
    assert Card(12, "S").code() == "QS" and Card(1, "H").label() == "A♥"
    with pytest.raises(ValueError, match="cannot read card"):
        parse_code("ZZ")
    rng = np.random.default_rng(0)
    assert all(not c.is_red for _ in range(20) for c in deal(rng, 4, "black"))
    assert all(c.is_red for _ in range(20) for c in deal(rng, 4, "red"))
    hand = deal(rng, 4, "any")
    assert len(set(hand)) == 4


def test_recognition_multiset_match():
    cards = (Card(11, "S"), Card(10, "C"), Card(3, "S"), Card(3, "C"))
    assert recognition(["J", "10", "3", "3"], cards, "10") == 1.0
    assert recognition(["10", "10", "3", "3"], cards, "10") == 1.0  # J read as its value under J = 10
    assert recognition(["10", "10", "3", "3"], cards, "11-12-13") == 0.75
    assert recognition(["3", "3", "3", "3"], cards, "10") == 0.5
    assert recognition(["Q♠", "x"], cards, "10") == 0.0  # a queen is not the jack, even if both are 10
    assert recognition(["j♠", "x"], cards, "10") == 0.25
    assert recognition(None, cards, "10") is None and recognition("J1033", cards, "10") is None
    assert rank_of_claim("king") == 13 and rank_of_claim(True) is None and rank_of_claim(14) is None


@pytest.mark.parametrize("env_id", ["veriloop/Points24-text-v0", "veriloop/Points24-vision-v0"])
def test_dealt_hands_solvable_and_rule_applied(env_id):
    env = gymnasium.make(env_id)
    for seed in range(40):
        _, info = env.reset(seed=seed)
        task = info["task"]
        assert task["solution"] is not None and task["face_cards"] == "10"
        assert all(c[-1] in "SC" for c in task["cards"])
        assert task["values"] == [min(r, 10) for r in task["ranks"]]


def test_rule_ood_changes_values_and_prompt():
    ood = gymnasium.make("veriloop/Points24-text-ruleood-v0")
    pinned = ["KS", "QC", "JS", "AC"]
    obs, info = ood.reset(options={"task": pinned})
    assert info["task"]["values"] == [13, 12, 11, 1] and "11, 12 and 13" in obs
    iid = gymnasium.make("veriloop/Points24-text-v0")
    obs, info = iid.reset(options={"task": pinned})
    assert info["task"]["values"] == [10, 10, 10, 1] and "each count as 10" in obs
    assert "K♠, Q♣, J♠, A♣" in obs


def test_visual_ood_red_suits_and_prompt_hides_cards():
    env = gymnasium.make("veriloop/Points24-vision-visualood-v0")
    obs, info = env.reset(seed=5)
    assert all(c[-1] in "HD" for c in info["task"]["cards"])
    assert set(obs) == {"text", "image"} and obs["image"].shape == IMAGE_SHAPE
    assert "not listed" in obs["text"]
    assert not any(label in obs["text"] for label in info["task"]["labels"])


def test_attempt_three_correct_rewards(script):
    env = gymnasium.make("veriloop/Points24-text-v0")
    _, info = env.reset(seed=11)
    task = info["task"]
    names = [c[:-1] for c in task["cards"]]
    wrong_value = "-".join(str(v) for v in sorted(task["values"], reverse=True))
    actions = [
        _answer(names, wrong_value),
        _answer(names, "+".join(["1"] * 4) + "*24"),
        _answer(names, task["solution"]),
    ]
    out = script(env, 11, actions)
    assert out["rewards"] == [-1.0, -5.0, 10.0]
    assert out["terminated"] == [False, False, True] and out["truncated"] == [False] * 3
    assert [i["verdict"].reason for i in out["infos"]] == ["wrong_value", "illegal_numbers", "correct"]
    assert [i["attempt"] for i in out["infos"]] == [1, 2, 3]
    assert out["infos"][-1]["recognition"] == 1.0
    assert "You have 4 attempts left" in out["obs"][1] and "Correct" in out["obs"][3]


def test_max_attempts_exhausted_truncates(script):
    env = gymnasium.make("veriloop/Points24-vision-v0")
    out = script(env, 2, ["no json at all"] * 5)
    assert out["rewards"] == [-5.0] * 5
    assert out["truncated"] == [False] * 4 + [True] and not any(out["terminated"])
    assert all(i["recognition"] is None for i in out["infos"])
    first = out["obs"][0]["image"]
    assert all(np.array_equal(o["image"], first) for o in out["obs"])  # the image on every turn
    assert all(o["image"] is not first for o in out["obs"][1:])


def test_vision_recognition_partial():
    env = gymnasium.make("veriloop/Points24-vision-v0")
    env.reset(options={"task": ["QS", "3C", "5S", "AC"]})
    _, reward, *_, info = env.step(_answer(["Q", "3", "5", "2"], "10*3-5-1"))
    assert info["recognition"] == 0.75 and info["verdict"].reason == "wrong_cards"
    assert reward == DEFAULT_REWARDS["wrong_cards"]


def test_custom_rewards():
    env = Points24Env(rewards={"correct": 1.0, "illegal_numbers": -2.0})
    _, info = env.reset(seed=0)
    _, reward, *_ = env.step(_answer([c[:-1] for c in info["task"]["cards"]], "1+1"))
    assert reward == -2.0


def test_render_deterministic_and_distinct():
    hand = (Card(12, "S"), Card(3, "C"), Card(5, "S"), Card(1, "C"))
    a, b = render_cards(hand), render_cards(hand)
    assert a.shape == IMAGE_SHAPE and a.dtype == np.uint8 and np.array_equal(a, b) and a is not b
    other = render_cards((Card(13, "S"), Card(3, "C"), Card(5, "S"), Card(1, "C")))
    red = render_cards(tuple(Card(c.rank, {"S": "H", "C": "D"}[c.suit]) for c in hand))
    assert not np.array_equal(a, other) and not np.array_equal(a, red)
    assert (red[..., 0].astype(int) - red[..., 1] > 100).sum() > 500  # red ink present
    assert (a[..., 0].astype(int) - a[..., 1] > 100).sum() == 0  # black hand: no red ink
    env = Points24Env(vision=True, render_mode="rgb_array")
    env.reset(options={"task": Points24Task(hand)})
    assert np.array_equal(env.render(), a)


def test_unsolvable_target_fails_loudly(monkeypatch):
    import veriloop.envs.points24.env as p24_env

    monkeypatch.setattr(p24_env, "MAX_DEALS", 20)  # keep the test fast: 20 hopeless deals are enough
    env = Points24Env(target=100000)
    with pytest.raises(RuntimeError, match="no solvable hand"):
        env.reset(seed=0)
    env = Points24Env(target=100000, solvable_only=False)
    _, info = env.reset(seed=0)
    assert info["task"]["solution"] is None


@pytest.mark.parametrize(
    ("response", "reason", "reward"),
    [
        (_answer(["3", "3", "8", "8"], "8/(3-8/3)"), "correct", 10.0),
        (_answer(["3", "3", "8", "8"], "3+3+8+8"), "wrong_value", -1.0),
        (_answer(["3", "3", "8", "8"], "3*8"), "illegal_numbers", -5.0),
        (_answer(["3", "3", "8", "9"], "8/(3-8/3)"), "wrong_cards", -5.0),
        (_answer(["3", "3", "8", "8"], "3**2+8+8-3"), "unparseable", -5.0),
        (_answer(["3", "3", "8", "8"], "8/(3-3)*8"), "division_by_zero", -1.0),
        (_answer(["3", "3", "8", "8"], "3*8*8/8 or 8*3*(8-8+1)"), "hedged", -5.0),
        ("I would need more time.", "no_answer", -5.0),
        ("x" * 1_000_001, "too_long", -5.0),
        ("I give up.", "gave_up", -5.0),
    ],
)
def test_reward_per_verdict(response, reason, reward):
    """GeneralPoints' rewards: +10 correct, -1 wrong value, -5 numbers not the cards or malformed."""
    env = gymnasium.make("veriloop/Points24-text-v0")
    env.reset(options={"task": ["3S", "3C", "8S", "8C"]})
    _, got, terminated, truncated, info = env.step(response)
    assert (info["verdict"].reason, got) == (reason, reward)
    assert info["reward_components"] == {"verdict": reward}
    assert terminated == (reason in ("correct", "gave_up")) and not truncated  # 4 attempts are left


def test_no_failure_is_cheaper_than_a_legal_formula():
    """Every failure without a legal formula costs at least as much as illegal numbers: else RL learns it."""
    legal = {"correct", "wrong_value", "division_by_zero"}
    worst_legal = min(DEFAULT_REWARDS[r] for r in legal)
    for reason, reward in DEFAULT_REWARDS.items():
        if reason not in legal:
            assert reward <= DEFAULT_REWARDS["illegal_numbers"] < worst_legal, reason


@pytest.mark.parametrize(
    ("env_id", "reason"),
    [("veriloop/Points24-text-ruleood-v0", "correct"), ("veriloop/Points24-text-v0", "illegal_numbers")],
)
def test_face_card_rule_decides_the_verdict(env_id, reason):
    """12*(13-11)*1 uses Q, K, J, A as 12, 13, 11, 1: right under rule OOD, wrong when J = Q = K = 10."""
    env = gymnasium.make(env_id)
    env.reset(options={"task": ["KS", "QC", "JS", "AC"]})
    _, _, _, _, info = env.step(_answer(["K", "Q", "J", "A"], "12*(13-11)*1"))
    assert info["verdict"].reason == reason and info["recognition"] == 1.0
