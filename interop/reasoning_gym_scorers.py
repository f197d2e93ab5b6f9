"""Our own scorers for the reasoning-gym datasets whose scorers evaluate the model's text.

reasoning-gym scores ``puzzle24`` and ``countdown`` answers with sympy's ``parse_expr`` (an ``eval``
underneath), and its ``puzzle24`` scorer never checks that the formula uses the dealt numbers
(``4*6*1*1`` scores on any deal). For these two datasets veriloop scores in-process with its own
safe formula verifier instead (:mod:`veriloop.envs.verifiers.formula`: a whitelisted grammar,
exact fractions, nothing executed), keeping reasoning-gym's reward levels:

* ``puzzle24``: :func:`~veriloop.envs.verifiers.check_points24` on the dealt numbers
  (``metadata["numbers"]``), target 24 -> 1.0 when correct, else reasoning-gym's floor 0.01;
* ``countdown``: the formula must use exactly ``metadata["numbers"]`` and reach
  ``metadata["target"]`` -> 1.0; a well-formed formula with other numbers or another value -> 0.05;
  anything unparseable -> 0.01 (reasoning-gym's three levels).

Either way, an operator outside the dataset's ``operators`` option is unparseable. Every other
dataset is scored by reasoning-gym's own scorer, jailed (:mod:`veriloop.envs.verifiers.sandbox`).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any

from veriloop.envs.verifiers import check_points24
from veriloop.envs.verifiers.formula import FormulaError, evaluate, normalise

FLOOR = 0.01  # reasoning-gym's score for an unusable answer
NEAR_MISS = 0.05  # countdown: a formula that parses but is wrong
_OPERATORS = frozenset("+-*/")


def _operators_ok(formula: str, config: Mapping[str, Any]) -> bool:
    allowed = set(config.get("operators") or _OPERATORS)
    return not (set(normalise(formula)) & _OPERATORS) - allowed


def score_puzzle24(answer: str, metadata: Mapping[str, Any], config: Mapping[str, Any]) -> float:
    """1.0 when ``answer`` makes 24 from exactly the dealt numbers, else 0.01."""
    if not _operators_ok(answer, config):
        return FLOOR
    numbers = [int(n) for n in metadata["numbers"]]
    return 1.0 if check_points24(answer, numbers, 24).correct else FLOOR


def score_countdown(answer: str, metadata: Mapping[str, Any], config: Mapping[str, Any]) -> float:
    """1.0 / 0.05 / 0.01 as in the module docstring."""
    formula = normalise(answer)
    if not _operators_ok(formula, config):
        return FLOOR
    try:
        done = evaluate(formula)
    except (FormulaError, ZeroDivisionError):
        return FLOOR
    if sorted(done.numbers) != sorted(int(n) for n in metadata["numbers"]):
        return NEAR_MISS
    return 1.0 if done.value == int(metadata["target"]) else NEAR_MISS


#: Dataset name -> our scorer ``(answer, entry metadata, dataset config) -> score``.
SAFE_SCORERS: dict[str, Callable[[str, Mapping[str, Any], Mapping[str, Any]], float]] = {
    "puzzle24": score_puzzle24,
    "countdown": score_countdown,
}


def safe_score(dataset: str, answer: str, metadata: Mapping[str, Any], config_json: str) -> float | None:
    """Our score of ``answer`` when ``dataset`` has a safe scorer here, else ``None``."""
    scorer = SAFE_SCORERS.get(dataset)
    return None if scorer is None else scorer(answer, metadata, json.loads(config_json))
