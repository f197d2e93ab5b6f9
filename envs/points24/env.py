"""Points24 (GeneralPoints): make 24 from four cards, as text or as an image.

Options (keyword arguments of ``gymnasium.make``) make easier or harder variants of the same game:
``num_cards`` (2, 3 or 4 cards, default 4), ``target`` (default 24) and ``ranks`` (the ranks in the
deck, default all of A..K). With the defaults the deals, prompts and checks are exactly the original
game's. Rule OOD still means J, Q, K = 11, 12, 13, so a deck meant for it must hold J, Q or K.

Registered ids (see :mod:`veriloop.envs.splits` for the evaluation splits):

================================== ======== ============ ======= =========================
id                                 vision   face_cards   suits   role
================================== ======== ============ ======= =========================
veriloop/Points24-text-v0          no       10           black   training (GP-L)
veriloop/Points24-text-ruleood-v0  no       11-12-13     black   rule OOD
veriloop/Points24-vision-v0        yes      10           black   training (GP-VL)
veriloop/Points24-vision-ruleood-v0 yes     11-12-13     black   rule OOD
veriloop/Points24-vision-visualood-v0 yes   10           red     visual OOD
================================== ======== ============ ======= =========================

The model answers with a JSON object ``{"cards": [...], "formula": "..."}``; ``check_points24``
verifies that the formula uses each card's number exactly once and equals the target.
"""

from __future__ import annotations

import difflib
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from fractions import Fraction
from typing import Any

import numpy as np
from gymnasium import spaces

from veriloop.envs.base import VerifierEnv
from veriloop.envs.points24.cards import (
    ALL_RANKS,
    FACE_RANKS,
    RANK_NAMES,
    Card,
    FaceRule,
    SuitSet,
    card_value,
    check_ranks,
    check_rule,
    deal,
    parse_code,
    recognition,
)
from veriloop.envs.points24.solver import random_formula, solve
from veriloop.envs.verifiers import Verdict, check_points24
from veriloop.envs.verifiers.formula import worked_steps

#: Reward per verdict reason. GeneralPoints: correct +10, wrong value -1, illegal numbers -5.
#: Our choices: a JSON ``cards`` list that does not match the deal counts as illegal numbers (-5);
#: division by zero is a wrong calculation (-1); any other malformed output (unparseable, no
#: answer, hedged, too long) and giving up cost as much as illegal numbers (-5), so that the only
#: way to lose less than -5 is a legal formula. Measured reason (benchmarks/bench_learning.py
#: points24, README "Results"): with malformed output at -1, GRPO on a weak policy learned to
#: answer unparseably instead of legally -- a cheaper failure than an illegal formula.
DEFAULT_REWARDS: dict[str, float] = {
    "correct": 10.0,
    "wrong_value": -1.0,
    "division_by_zero": -1.0,
    "illegal_numbers": -5.0,
    "wrong_cards": -5.0,
    "unparseable": -5.0,
    "no_answer": -5.0,
    "hedged": -5.0,
    "too_long": -5.0,
    "gave_up": -5.0,
}
MAX_DEALS = 1000
#: The hand sizes Points24 offers: the exact solver and the card image are sized for at most four.
NUM_CARDS = (2, 3, 4)
_COUNT_WORDS = {2: "two", 3: "three", 4: "four"}


@dataclass(frozen=True)
class Points24Task:
    """A dealt hand: the cards, the target and the face-card rule; ``solution`` is a reference formula."""

    cards: tuple[Card, ...]
    target: int = 24
    face_cards: FaceRule = "10"

    @property
    def values(self) -> tuple[int, ...]:
        """The numbers the cards stand for under ``face_cards``."""
        return tuple(card_value(c.rank, self.face_cards) for c in self.cards)

    @property
    def solution(self) -> str | None:
        """A formula reaching ``target`` (``None`` if the hand has none); cached by the solver."""
        return solve(self.values, self.target)

    def to_dict(self) -> dict[str, Any]:
        return {
            "cards": [c.code() for c in self.cards],
            "labels": [c.label() for c in self.cards],
            "ranks": [c.rank for c in self.cards],
            "values": list(self.values),
            "target": self.target,
            "face_cards": self.face_cards,
            "solution": self.solution,
        }


def check_num_cards(num_cards: Any) -> int:
    """``num_cards`` as an int in :data:`NUM_CARDS`, else a ``ValueError`` that says what to pass."""
    if isinstance(num_cards, bool) or not isinstance(num_cards, int) or num_cards not in NUM_CARDS:
        raise ValueError(
            f"num_cards must be one of {NUM_CARDS} (the exact solver and the card image are sized for at "
            f"most four cards; fewer make the game easier), got {num_cards!r}"
        )
    return num_cards


def check_target(target: Any) -> int:
    """``target`` as a positive int, else a ``ValueError`` that says what to pass."""
    if isinstance(target, float) and target.is_integer():
        target = int(target)
    if isinstance(target, bool) or not isinstance(target, int) or target < 1:
        raise ValueError(f"target must be a positive whole number such as 24 (default) or 12, got {target!r}")
    return target


def merge_rewards(rewards: Mapping[str, float] | None) -> dict[str, float]:
    """``DEFAULT_REWARDS`` updated by ``rewards``; unknown reasons raise with a suggestion."""
    table = dict(DEFAULT_REWARDS)
    for key, value in (rewards or {}).items():
        if key not in table:
            hint = difflib.get_close_matches(key, list(table), n=1)
            extra = f" Did you mean {hint[0]!r}?" if hint else ""
            raise ValueError(f"unknown reward key {key!r}; valid keys: {sorted(table)}.{extra}")
        table[key] = float(value)
    return table


class Points24Env(VerifierEnv[Points24Task]):
    """Use each dealt card's number once with ``+ - * /`` and parentheses to reach ``target``.

    Args:
        vision: Show the cards as an image (observation ``{"text", "image"}``) instead of in the text.
        face_cards: ``"10"`` (J, Q, K = 10; training) or ``"11-12-13"`` (rule OOD).
        suits: ``"black"`` (♠♣, training), ``"red"`` (♥♦, visual OOD) or ``"any"``.
        target: The number to reach, a positive whole number (24).
        num_cards: Cards per hand: 2, 3 or 4 (4). Fewer cards make the search shallower; the
            verifier still requires each dealt card's number exactly once.
        ranks: The ranks in the deck, as names or numbers (``["A", 2, "3", "J"]``); ``None`` = all
            of A..K. ``["A", "2", "3", "4", "5", "6"]`` keeps every value at most 6; keep J, Q or K
            in the deck when the rule-OOD split (``face_cards="11-12-13"``) should differ from it.
        solvable_only: Re-deal (with ``np_random``) until the hand has a solution.
        rewards: Overrides of :data:`DEFAULT_REWARDS`, keyed by verdict reason.
        max_attempts: Responses per episode (5 = the paper's VIter); after a failed attempt the
            verifier's feedback is the next observation.

    Observation: text (``UnicodeText``), or with ``vision=True`` a ``Dict`` with ``"text"`` and
    ``"image"`` (``Box(0, 255, (128, 336, 3), uint8)``, the same cards on every turn).

    ``info``: at reset ``{"task": Points24Task.to_dict()}`` -- cards (codes like ``"QS"``),
    labels, ranks, values, target, face_cards and a reference ``solution`` (not for the policy).
    At step: ``verdict``, ``reward_components`` (``{"verdict": r}``), ``attempt``, ``task``,
    ``verifier_error`` when the verifier failed, and ``recognition``: the fraction of dealt cards
    matched by the JSON ``cards`` list (ranks as a multiset; a number equal to a card's value under
    the rule also counts), ``None`` when the response gave no list.
    """

    metadata: dict[str, Any] = {"render_modes": ["ansi", "rgb_array"], "render_fps": 1}

    def __init__(
        self,
        *,
        vision: bool = False,
        face_cards: FaceRule = "10",
        suits: SuitSet = "black",
        target: int = 24,
        num_cards: int = 4,
        ranks: Sequence[str | int] | None = None,
        solvable_only: bool = True,
        rewards: Mapping[str, float] | None = None,
        max_attempts: int = 5,
        **base_kwargs: Any,
    ) -> None:
        super().__init__(max_attempts=max_attempts, **base_kwargs)
        self.vision = bool(vision)
        self.face_cards = check_rule(face_cards)
        self.suits = suits
        self.num_cards = check_num_cards(num_cards)
        self.ranks = check_ranks(ranks)
        # a throwaway deal validates `suits` and that the deck holds num_cards distinct cards, early
        deal(np.random.default_rng(0), self.num_cards, suits, self.ranks)
        self.target = check_target(target)
        self.solvable_only = bool(solvable_only)
        self.rewards = merge_rewards(rewards)
        self._image: np.ndarray | None = None
        self._image_task: Points24Task | None = None
        if self.vision:
            from veriloop.envs.points24.render import IMAGE_SHAPE

            # text part: the same UnicodeText bound as the base observation/action space
            self.observation_space = spaces.Dict(
                {"text": self.action_space, "image": spaces.Box(0, 255, IMAGE_SHAPE, np.uint8)}
            )

    # ------------------------------------------------------------------ task
    def sample_task(self) -> Points24Task:
        for _ in range(MAX_DEALS):
            cards = deal(self.np_random, self.num_cards, self.suits, self._deal_ranks)
            task = Points24Task(cards, self.target, self.face_cards)
            if not self.solvable_only or task.solution is not None:
                return task
        raise RuntimeError(
            f"no solvable hand in {MAX_DEALS} deals of {self.num_cards} cards (ranks "
            f"{[RANK_NAMES[r - 1] for r in self.ranks]}) for target {self.target}; choose a reachable "
            "target, more cards or ranks, or pass solvable_only=False"
        )

    @property
    def _deal_ranks(self) -> tuple[int, ...] | None:
        """The ``ranks`` argument of :func:`deal`: ``None`` for the full deck (the original deal)."""
        return None if self.ranks == ALL_RANKS else self.ranks

    def task_from_options(self, spec: Any) -> Points24Task:
        """Accept a :class:`Points24Task`, its ``to_dict()`` form, or a list of card codes (``["QS", ...]``)."""
        if isinstance(spec, Points24Task):
            return spec
        if isinstance(spec, Mapping):
            codes = spec.get("cards")
            target = int(spec.get("target", self.target))
            rule = check_rule(spec.get("face_cards", self.face_cards))
        else:
            codes, target, rule = spec, self.target, self.face_cards
        if isinstance(codes, str) or not isinstance(codes, Sequence) or len(codes) != self.num_cards:
            example = json.dumps(["QS", "3C", "5S", "AC"][: self.num_cards])
            raise ValueError(
                f'options["task"] needs {_COUNT_WORDS[self.num_cards]} cards (num_cards={self.num_cards}) '
                f"such as {example}, got {codes!r}"
            )
        cards = tuple(c if isinstance(c, Card) else parse_code(str(c)) for c in codes)
        return Points24Task(cards, target, rule)

    # ------------------------------------------------------------------ text
    def rule_text(self, task: Points24Task) -> str:
        """How cards count; the J/Q/K clause only when the deck (or the pinned hand) has face cards."""
        if not FACE_RANKS & {*self.ranks, *(c.rank for c in task.cards)}:
            return "An ace counts as 1 and number cards count as printed."
        faces = (
            "J, Q and K each count as 10" if task.face_cards == "10" else "J, Q and K count as 11, 12 and 13"
        )
        return f"An ace counts as 1, number cards count as printed, and {faces}."

    def prompt(self, task: Points24Task) -> str:
        goal = (
            f"Use the number of every card exactly once, combined with +, -, *, / and parentheses, "
            f"to write a formula whose value is {task.target}. {self.rule_text(task)}"
        )
        game, count = f"You are playing the {task.target} points card game.", _COUNT_WORDS[len(task.cards)]
        if self.vision:
            intro = f"{game} The {count} cards are shown in the image; they are not listed in this text."
            fmt = (
                'Answer with a JSON object {"cards": [...], "formula": "..."}, where "cards" lists the '
                f'ranks of the {count} cards you read from the image, without suits (e.g. "A", "7", "10", "K"), '
                'and "formula" uses their numbers.'
            )
        else:
            listed = ", ".join(c.label() for c in task.cards)
            intro = f"{game} Your cards: {listed}."
            fmt = (
                'Answer with a JSON object {"cards": [...], "formula": "..."}, where "cards" lists the '
                f'ranks of the {count} cards, without suits (e.g. "A", "7", "10", "K"), and "formula" uses '
                "their numbers."
            )
        return f"{intro}\n{goal}\n{fmt}"

    # ------------------------------------------------------------------ verify and score
    def check(self, response: str, task: Points24Task) -> Verdict:
        return check_points24(response, list(task.values), task.target)

    def feedback(self, verdict: Verdict, task: Points24Task, attempts_left: int, done: bool) -> str:
        """As :class:`VerifierEnv`'s, except that the vision env never writes the dealt values in text
        (the verifier's "use exactly the numbers [...]" would let a policy skip reading the image)."""
        if self.vision and verdict.reason == "illegal_numbers":
            used = sorted(verdict.details.get("numbers_used", ()))
            text = (
                f"Your formula must use the number of every card in the image exactly once: you used {used}."
            )
            verdict = replace(verdict, feedback=text)
        return super().feedback(verdict, task, attempts_left, done)

    def reward(self, verdict: Verdict, task: Points24Task) -> tuple[float, dict[str, float]]:
        reason = "correct" if verdict.correct else verdict.reason
        if reason not in self.rewards:
            raise ValueError(
                f"verdict reason {reason!r} has no reward; known reasons: {sorted(self.rewards)}"
            )
        value = self.rewards[reason]
        return value, {"verdict": value}

    def step_info(self, verdict: Verdict, task: Points24Task) -> dict[str, Any]:
        claims = verdict.details.get("cards_seen") if verdict.details else None
        return {"recognition": recognition(claims, task.cards, task.face_cards)}

    def step_metrics(self, verdict: Verdict, task: Points24Task) -> dict[str, float]:
        """``recognition_acc`` (Chu et al. 2025): ``info["recognition"]``, ``nan`` when no card list."""
        value = self.step_info(verdict, task)["recognition"]
        return {"recognition_acc": math.nan if value is None else float(value)}

    # ------------------------------------------------------------------ demonstrations (SFT)
    def demonstration(self, task: Points24Task) -> str | None:
        """The requested JSON answer: the card ranks and the exact solver's formula (None if unsolvable)."""
        formula = solve(list(task.values), task.target)
        if formula is None:
            return None
        return json.dumps({"cards": [RANK_NAMES[c.rank - 1] for c in task.cards], "formula": formula})

    def privileged_context(self, task: Points24Task) -> str | None:
        """For a self-distillation teacher only: the exact solver's formula, or that the hand has no
        solution. Never shown to the policy being trained or evaluated."""
        formula = solve(list(task.values), task.target)
        if formula is None:
            return f"These cards cannot make {task.target}."
        return f"A formula that makes {task.target} with these cards: {formula}"

    def wrong_demonstration(self, task: Points24Task, rng: Any, used: set[str]) -> str | None:
        """The right cards in a formula of the wrong value, written as the solver writes its answers
        (:func:`~veriloop.envs.points24.solver.random_formula`) and of a whole-number value, so that
        only its value tells it from a right one: a verifier trained on these must check the arithmetic,
        not the form (nor whether a fraction shows)."""
        for _ in range(200):
            value, formula = random_formula(task.values, rng)
            if value != task.target and value.denominator == 1 and formula not in used:
                used.add(formula)
                cards = [RANK_NAMES[c.rank - 1] for c in task.cards]
                return json.dumps({"cards": cards, "formula": formula})
        return None  # a small hand has few formulas: all of them used (or right) after 200 draws

    def verification_demonstration(self, task: Points24Task, response: str) -> str | None:
        """A written check of ``response``: its formula worked one operation at a time, the numbers it
        uses against the cards' and its value against the target, e.g. ``Check: 2+10 = 12, 12*1 = 12.
        Numbers 1, 2, 10; cards 1, 2, 10. 12 is 12.`` None when no formula can be evaluated."""
        verdict = self.check(response, task)
        if verdict.parsed is None or "value" not in verdict.details:
            return None
        steps = worked_steps(verdict.parsed)
        used = ", ".join(str(n) for n in sorted(verdict.details["numbers_used"]))
        cards = ", ".join(str(v) for v in sorted(task.values))
        value = verdict.details["value"]
        same = "is" if Fraction(value) == task.target else "is not"
        return f"Check: {', '.join(steps) or value}. Numbers {used}; cards {cards}. {value} {same} {task.target}."

    # ------------------------------------------------------------------ observations
    def image(self) -> np.ndarray:
        """The current hand as an RGB array ``[H, W, 3]`` (rendered once per task, copied per call)."""
        if self._image is None or self._image_task != self.task:
            from veriloop.envs.points24.render import render_cards

            self._image, self._image_task = render_cards(self.task.cards), self.task
        return self._image.copy()

    def observation(self, text: str) -> Any:
        if not self.vision:
            return self._clip(text)
        return {"text": self._clip(text), "image": self.image()}

    def render(self) -> Any:
        if self.render_mode == "rgb_array":
            return self.image()
        return super().render()
