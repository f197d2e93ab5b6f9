"""veriloop environments: Gymnasium verifier environments (no torch needed).

Importing this package registers every environment (entry points are strings, so an env's
module is imported only when it is made)::

    import gymnasium
    import veriloop.envs

    env = gymnasium.make("veriloop/Points24-text-v0")
    obs, info = env.reset(seed=0)

Ids: ``veriloop/MathVerify-v0``, ``veriloop/MathVerifyRetry-v0``, ``veriloop/Points24-{text,vision}-v0``,
``veriloop/Points24-{text,vision}-ruleood-v0``, ``veriloop/Points24-vision-visualood-v0``,
``veriloop/SolveVerify-v0``; :data:`SPLITS` maps evaluation splits to them. :data:`INTEROP_ENVS`:
``veriloop/ReasoningGym-v0`` (any reasoning-gym dataset; ``pip install 'veriloop[reasoning-gym]'``).
"""

from __future__ import annotations

from typing import Any

import gymnasium

from veriloop.envs.base import SIGNAL_KEY, LearnerSignal, VerifierEnv
from veriloop.envs.spaces import UnicodeText
from veriloop.envs.splits import SPLITS, split_env

from ._package_name import require_package_name

require_package_name(__name__, "envs")  # the folder envs/ is the package veriloop.envs

_MATH = "veriloop.envs.math_env:MathVerifyEnv"
_P24 = "veriloop.envs.points24.env:Points24Env"

#: id -> (entry point, default kwargs)
ENVS: dict[str, tuple[str, dict[str, Any]]] = {
    "veriloop/MathVerify-v0": (_MATH, {"max_attempts": 1}),
    "veriloop/MathVerifyRetry-v0": (_MATH, {"max_attempts": 3}),
    "veriloop/Points24-text-v0": (_P24, {"vision": False, "face_cards": "10", "suits": "black"}),
    "veriloop/Points24-text-ruleood-v0": (
        _P24,
        {"vision": False, "face_cards": "11-12-13", "suits": "black"},
    ),
    "veriloop/Points24-vision-v0": (_P24, {"vision": True, "face_cards": "10", "suits": "black"}),
    "veriloop/Points24-vision-ruleood-v0": (
        _P24,
        {"vision": True, "face_cards": "11-12-13", "suits": "black"},
    ),
    "veriloop/Points24-vision-visualood-v0": (_P24, {"vision": True, "face_cards": "10", "suits": "red"}),
    "veriloop/SolveVerify-v0": ("veriloop.envs.solve_verify:SolveVerifyEnv", {"task": "math"}),
}


#: Ids that bring other projects' environments in; each needs its extra (see :mod:`veriloop.interop`),
#: and making one without it raises an error that names the extra.
INTEROP_ENVS: dict[str, tuple[str, dict[str, Any]]] = {
    "veriloop/ReasoningGym-v0": (
        "veriloop.interop.reasoning_gym_env:ReasoningGymEnv",  # pip install 'veriloop[reasoning-gym]'
        {"dataset": "basic_arithmetic", "config": {}},
    ),
}


def _register_all() -> None:
    for env_id, (entry_point, kwargs) in {**ENVS, **INTEROP_ENVS}.items():
        if env_id not in gymnasium.registry:
            gymnasium.register(
                id=env_id, entry_point=entry_point, kwargs=dict(kwargs), disable_env_checker=False
            )


def registered_ids() -> list[str]:
    """Every registered ``veriloop/...`` id (including users' own), sorted."""
    return sorted(i for i in gymnasium.registry if i.startswith("veriloop/"))


_register_all()

__all__ = [
    "ENVS",
    "INTEROP_ENVS",
    "SIGNAL_KEY",
    "SPLITS",
    "LearnerSignal",
    "UnicodeText",
    "VerifierEnv",
    "registered_ids",
    "split_env",
]
