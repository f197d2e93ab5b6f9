"""Evaluation splits: family -> split name -> (env id, extra kwargs).

Split names: ``"id"`` is the training distribution; ``"rule_ood"`` changes the rules (Points24:
J, Q, K = 11, 12, 13 instead of 10); ``"visual_ood"`` changes the look (red suits instead of
black); math splits by difficulty level. One line builds any split::

    env_id, kwargs = split_env("points24-vision", "visual_ood")
    env = gymnasium.make(env_id, **kwargs)
"""

from __future__ import annotations

import difflib
from typing import Any

SPLITS: dict[str, dict[str, tuple[str, dict[str, Any]]]] = {
    "points24-text": {
        "id": ("veriloop/Points24-text-v0", {}),
        "rule_ood": ("veriloop/Points24-text-ruleood-v0", {}),
    },
    "points24-vision": {
        "id": ("veriloop/Points24-vision-v0", {}),
        "rule_ood": ("veriloop/Points24-vision-ruleood-v0", {}),
        "visual_ood": ("veriloop/Points24-vision-visualood-v0", {}),
    },
    "math": {
        "id": ("veriloop/MathVerify-v0", {}),
        "level_1": ("veriloop/MathVerify-v0", {"level": 1}),
        "level_2": ("veriloop/MathVerify-v0", {"level": 2}),
        "level_3": ("veriloop/MathVerify-v0", {"level": 3}),
    },
    "math-retry": {
        "id": ("veriloop/MathVerifyRetry-v0", {}),
    },
    "s2r-math": {
        "id": ("veriloop/SolveVerify-v0", {}),
    },
    "s2r-points24": {
        "id": ("veriloop/SolveVerify-v0", {"task": "points24"}),
        "rule_ood": ("veriloop/SolveVerify-v0", {"task": "points24", "face_cards": "11-12-13"}),
    },
}


def _pick(name: str, choices: list[str], what: str) -> None:
    if name not in choices:
        hint = difflib.get_close_matches(name, choices, n=1)
        extra = f" Did you mean {hint[0]!r}?" if hint else ""
        raise KeyError(f"unknown {what} {name!r}; choose one of {choices}.{extra}")


def split_env(family: str, split: str = "id") -> tuple[str, dict[str, Any]]:
    """``(env_id, kwargs)`` of ``SPLITS[family][split]`` (kwargs is a fresh copy)."""
    _pick(family, list(SPLITS), "split family")
    _pick(split, list(SPLITS[family]), f"split of {family!r}")
    env_id, kwargs = SPLITS[family][split]
    return env_id, dict(kwargs)
