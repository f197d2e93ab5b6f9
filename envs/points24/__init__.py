"""Points24 (GeneralPoints): cards, an exact solver, the text/vision environment and card rendering.

Pillow is imported only by :mod:`.render`, when a vision observation is first drawn.
"""

from veriloop.envs.points24.cards import Card, card_value, deal, parse_code, recognition
from veriloop.envs.points24.env import DEFAULT_REWARDS, Points24Env, Points24Task
from veriloop.envs.points24.solver import is_solvable, solve

__all__ = [
    "DEFAULT_REWARDS",
    "Card",
    "Points24Env",
    "Points24Task",
    "card_value",
    "deal",
    "is_solvable",
    "parse_code",
    "recognition",
    "solve",
]
