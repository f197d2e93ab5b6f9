"""Public verifiers: rule-based reward functions for math answers and Points24 formulas.

>>> from veriloop.envs.verifiers import check_points24
>>> check_points24('{"cards": [3, 3, 8, 8], "formula": "8/(3-8/3)"}', [3, 3, 8, 8]).correct
True

``check_math`` runs math-verify in sandboxed worker processes with hard deadlines (see
:mod:`.math_check` and :mod:`.pool`); ``check_points24`` is pure Python and fast (:mod:`.points24`).
Every verifier returns a :class:`Verdict`, whose ``error`` field separates "the verifier failed" from
"the answer is wrong".
"""

from veriloop.envs.verifiers.extract import extract_answer
from veriloop.envs.verifiers.formats import r1_format_ok
from veriloop.envs.verifiers.math_check import check_math, check_math_batch
from veriloop.envs.verifiers.points24 import check_points24
from veriloop.envs.verifiers.pool import shutdown_pool
from veriloop.envs.verifiers.stats import reset_verifier_stats, verifier_stats
from veriloop.envs.verifiers.verdict import Verdict, VerifierError

__all__ = [
    "Verdict",
    "VerifierError",
    "check_math",
    "check_math_batch",
    "check_points24",
    "extract_answer",
    "r1_format_ok",
    "reset_verifier_stats",
    "shutdown_pool",
    "verifier_stats",
]
