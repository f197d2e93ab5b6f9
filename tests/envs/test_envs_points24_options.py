"""Points24's variant options: ``num_cards``, ``target`` and ``ranks`` (defaults: 4, 24, A..K).

Each option is checked like the rest of the game: hand-checked deals, the solver on small hands,
the verifier's card rule, prompts and feedback, rule OOD, the image, validation errors, and that
the defaults deal exactly what the original game deals.
"""

from __future__ import annotations

import json
import warnings

import gymnasium
import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env

from veriloop.envs.points24.cards import Card, check_ranks, deal
from veriloop.envs.points24.env import Points24Env, Points24Task
from veriloop.envs.points24.render import CARD_W, IMAGE_SHAPE, TABLE, render_cards
from veriloop.envs.points24.solver import solve
from veriloop.envs.solve_verify import SolveVerifyEnv
from veriloop.envs.verifiers import check_points24

P24 = "veriloop/Points24-text-v0"
SMALL = {"num_cards": 2, "target": 10, "ranks": ["A", 2, 3, 4, 5, 6]}


def _answer(cards, formula):
    return json.dumps({"cards": cards, "formula": formula})


def _solved(task):
    """The reference solution as the model should answer it: ranks without suits, then the formula."""
    return _answer([code[:-1] for code in task["cards"]], task["solution"])


def test_defaults_deal_the_original_game():
    """Spelling the defaults out changes nothing: same cards, prompt and info for every seed."""
    plain = gymnasium.make(P24)
    spelled = gymnasium.make(P24, num_cards=4, target=24, ranks=["A", *range(2, 11), "J", "Q", "K"])
    for seed in range(25):
        assert plain.reset(seed=seed) == spelled.reset(seed=seed)
    _, info = plain.reset(seed=0)
    assert info["task"]["cards"] == ["AS", "8C", "5S", "4C"]  # the README's seed-0 deal


def test_small_variant_deals_hand_checked():
    """2 cards, target 10, values <= 6: seeds 0..2 deal 5♠5♣ (5+5), 6♣4♣ (4+6), 2♠5♠ (2*5)."""
    env = gymnasium.make(P24, **SMALL)
    expected = {0: (["5S", "5C"], "5+5"), 1: (["6C", "4C"], "4+6"), 2: (["2S", "5S"], "2*5")}
    for seed, (cards, solution) in expected.items():
        obs, info = env.reset(seed=seed)
        assert (info["task"]["cards"], info["task"]["solution"]) == (cards, solution)
        assert info["task"]["target"] == 10 and "two cards" in obs and "10 points card game" in obs
    for seed in range(40):
        task = env.reset(seed=seed)[1]["task"]
        assert len(task["cards"]) == 2 and max(task["ranks"]) <= 6 and task["solution"] is not None
        assert check_points24(_solved(task), task["values"], 10).correct
    assert env.reset(seed=7) == env.reset(seed=7)  # the seed fixes the episode


def test_three_card_deals_and_solver():
    env = gymnasium.make(P24, num_cards=3, target=12)
    _, info = env.reset(seed=0)
    assert info["task"]["cards"] == ["3C", "AC", "8C"] and info["task"]["solution"] == "8+1+3"
    for seed in range(40):
        task = env.reset(seed=seed)[1]["task"]
        assert len(task["cards"]) == 3 and len(set(task["cards"])) == 3
        assert check_points24(_solved(task), task["values"], 12).correct


@pytest.mark.parametrize(
    ("values", "target", "expected"),
    [
        ([2, 5], 10, "2*5"),
        ([4, 6], 10, "4+6"),
        ([1, 1], 10, None),
        ([6, 6], 10, None),
        ([3, 4], 12, "3*4"),
        ([2, 2, 3], 12, "3*(2+2)"),
        ([1, 2, 3], 12, None),
        ([2, 3, 4], 24, "4*2*3"),
        ([3, 3, 8], 24, None),
    ],
)
def test_solver_on_two_and_three_cards(values, target, expected):
    """Hand-checked: 1 and 1 make at most 2; 6, 6 give 12, 0, 36 or 1; 1, 2, 3 reach at most 9."""
    assert solve(values, target) == expected


@pytest.mark.parametrize(
    ("formula", "cards", "reason"),
    [
        ("8+1+3", ["3", "A", "8"], "correct"),
        ("8+4", ["3", "A", "8"], "illegal_numbers"),  # 4 is not a card; A and 3 unused
        ("8+3+1+0", ["3", "A", "8"], "illegal_numbers"),  # a number that was not dealt
        ("8*3/2", ["3", "A", "8"], "illegal_numbers"),
        ("8+3+1", ["3", "A", "8", "K"], "wrong_cards"),  # four cards listed for a three-card hand
        ("8+3-1", ["3", "A", "8"], "wrong_value"),
    ],
)
def test_verifier_uses_exactly_the_dealt_cards(formula, cards, reason):
    env = gymnasium.make(P24, num_cards=3, target=12)
    env.reset(options={"task": ["3C", "AC", "8C"]})
    _, _, _, _, info = env.step(_answer(cards, formula))
    assert info["verdict"].reason == reason


def test_feedback_names_the_variant_target():
    env = gymnasium.make(P24, num_cards=3, target=12, max_attempts=2)
    env.reset(options={"task": ["3C", "AC", "8C"]})
    obs, *_ = env.step(_answer(["3", "A", "8"], "8+3-1"))
    assert "not 12" in obs and "Try again" in obs


def test_rule_ood_respects_the_options():
    """Under J/Q/K = 11/12/13 the K of a 2-card hand is 13: 1*13 reaches 13 there, not under J = Q = K = 10."""
    kwargs = {"num_cards": 2, "target": 13, "ranks": ["A", 2, 3, "J", "Q", "K"]}
    ood = gymnasium.make(P24, face_cards="11-12-13", **kwargs)
    iid = gymnasium.make(P24, face_cards="10", **kwargs)
    obs, info = ood.reset(options={"task": ["KS", "AC"]})
    assert info["task"]["values"] == [13, 1] and "11, 12 and 13" in obs
    assert ood.step(_answer(["K", "A"], "1*13"))[4]["verdict"].reason == "correct"
    obs, info = iid.reset(options={"task": ["KS", "AC"]})
    assert info["task"]["values"] == [10, 1] and "each count as 10" in obs
    assert iid.step(_answer(["K", "A"], "1*13"))[4]["verdict"].reason == "illegal_numbers"
    for seed in range(20):
        task = ood.reset(seed=seed)[1]["task"]
        assert task["solution"] is not None and set(task["ranks"]) <= {1, 2, 3, 11, 12, 13}


def test_a_deck_without_face_cards_drops_the_face_rule():
    env = gymnasium.make(P24, **SMALL)
    obs, _ = env.reset(seed=0)
    assert "J, Q" not in obs and "An ace counts as 1 and number cards count as printed." in obs
    ood_obs, _ = gymnasium.make(P24, face_cards="11-12-13", **SMALL).reset(seed=0)
    assert ood_obs == obs  # without J/Q/K the rule-OOD split is the same game


def test_vision_renders_short_hands_centred():
    two = render_cards((Card(5, "S"), Card(6, "C")))
    three = render_cards((Card(5, "S"), Card(6, "C"), Card(1, "S")))
    for image, n in ((two, 2), (three, 3)):
        assert image.shape == IMAGE_SHAPE
        cloth = np.all(image == np.array(TABLE, np.uint8), axis=2).all(axis=0)  # [W]: columns of bare table
        card_cols = np.flatnonzero(~cloth)
        left, right = card_cols[0], IMAGE_SHAPE[1] - 1 - card_cols[-1]
        assert abs(int(left) - int(right)) <= 2 and n * CARD_W <= card_cols[-1] - card_cols[0] + 1
    with pytest.raises(ValueError, match="1 to 4 cards"):
        render_cards(deal(np.random.default_rng(0), 5))
    env = gymnasium.make("veriloop/Points24-vision-v0", num_cards=3, target=12)
    obs, _ = env.reset(seed=0)
    assert obs["image"].shape == IMAGE_SHAPE and "The three cards are shown in the image" in obs["text"]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"num_cards": 5}, r"num_cards must be one of \(2, 3, 4\).*got 5"),
        ({"num_cards": 1}, "num_cards must be one of"),
        ({"num_cards": "3"}, r"got '3'"),
        ({"num_cards": True}, "num_cards must be one of"),
        ({"target": 0}, "target must be a positive whole number.*got 0"),
        ({"target": 24.5}, "got 24.5"),
        ({"target": "24"}, "got '24'"),
        ({"ranks": "A-6"}, r"ranks must be a list of card ranks such as \['A', '2'"),
        ({"ranks": ["A", "T"]}, "'T' is not a card rank"),
        ({"ranks": ["A", "KK"]}, "Did you mean 'K'"),
        ({"ranks": [14]}, "14 is not a card rank"),
        ({"ranks": ["A", 1]}, "ranks lists 'A' twice"),
        ({"ranks": []}, "ranks is empty"),
        ({"ranks": ["A"], "num_cards": 3}, r"cannot deal 3 distinct cards from a deck of 2 .*add ranks"),
    ],
)
def test_options_are_validated_with_the_fix(kwargs, match):
    with pytest.raises(ValueError, match=match):
        gymnasium.make(P24, **kwargs)


def test_ranks_accept_names_and_numbers():
    assert check_ranks(["k", "10", 2, "A", "3"]) == (1, 2, 3, 10, 13)
    assert check_ranks(None) == tuple(range(1, 14))
    assert gymnasium.make(P24, target=24.0).unwrapped.target == 24


def test_pinned_task_must_match_num_cards():
    env = gymnasium.make(P24, num_cards=2, target=10)
    with pytest.raises(ValueError, match=r'needs two cards \(num_cards=2\) such as \["QS", "3C"\]'):
        env.reset(options={"task": ["QS", "3C", "5S"]})
    _, info = env.reset(options={"task": Points24Task((Card(5, "S"), Card(2, "C")), 10)})
    assert info["task"]["solution"] == "2*5"


def test_unreachable_variant_fails_loudly(monkeypatch):
    import veriloop.envs.points24.env as p24_env

    monkeypatch.setattr(p24_env, "MAX_DEALS", 20)
    with pytest.raises(RuntimeError, match=r"no solvable hand in 20 deals of 2 cards .* target 100"):
        Points24Env(num_cards=2, target=100, ranks=["A", 2]).reset(seed=0)


def test_demonstrations_and_s2r_on_a_variant():
    env = Points24Env(**SMALL)
    env.reset(options={"task": ["5S", "5C"]})
    right = env.demonstration(env.task)
    assert right is not None and env.check(right, env.task).correct
    rng, used = np.random.default_rng(0), set()
    wrong = [env.wrong_demonstration(env.task, rng, used) for _ in range(4)]
    assert sorted(json.loads(w)["formula"] for w in wrong[:3]) == ["5*5", "5-5", "5/5"]  # 5+5 is the answer
    assert wrong[3] is None  # three wrong formulas exist over 5, 5: no fourth
    sv = gymnasium.make("veriloop/SolveVerify-v0", task="points24", max_attempts=2, **SMALL)
    obs, info = sv.reset(seed=1)
    assert len(info["task"]["cards"]) == 2 and "two cards" in obs
    assert sv.step(_solved(info["task"]))[4]["solve_correct"]
    assert isinstance(sv.unwrapped, SolveVerifyEnv)


@pytest.mark.parametrize(
    ("env_id", "kwargs"),
    [(P24, SMALL), ("veriloop/Points24-vision-v0", {"num_cards": 3, "target": 12})],
)
def test_check_env_on_variants(env_id, kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a checker warning is a failure too
        check_env(gymnasium.make(env_id, **kwargs).unwrapped)
