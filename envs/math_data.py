"""Math problems: a JSONL loader and a procedural generator with exact answers.

A :class:`MathProblem` carries the question, the gold answer as a LaTeX-friendly string
(``-7``, ``\\frac{3}{4}``, ``-\\frac{5}{2}``), an optional difficulty level and a short
step-by-step ``solution`` ending in ``\\boxed{answer}`` (SFT warm-up data).

Generated kinds (all arithmetic is exact, with :class:`fractions.Fraction`):

=========== ============================================================================
kind        level 1 / level 2 / level 3
=========== ============================================================================
integer     a ± b / a·b ± c / (a − b)·c + d ÷ e with negatives (d divisible by e)
fraction    a/b + c/d / a/b − c/d or a/b · c/d / (a/b + c/d) ÷ (e/f)
linear      ax + b = c with x a small natural / negative coefficients / ax + b = cx + d, x a fraction
word        shopping (sum) / speed·time / sharing a remainder (fractions)
=========== ============================================================================
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Any, Literal

import numpy as np

from veriloop.envs.datasets import FieldMap, jsonl_rows, load_rows, refuse_non_finite, refuse_oversized
from veriloop.envs.json_safe import json_safe
from veriloop.envs.verifiers.extract import malformed_latex

Kind = Literal["integer", "fraction", "linear", "word"]
KINDS: tuple[Kind, ...] = ("integer", "fraction", "linear", "word")
LEVELS: tuple[int, ...] = (1, 2, 3)


@dataclass(frozen=True)
class MathProblem:
    """One math task. ``answer`` is the gold string given to ``check_math``."""

    question: str
    answer: str
    level: int | None = None
    solution: str | None = None
    kind: str | None = None
    source: str = "generated"
    meta: Mapping[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (a fresh dict), the inverse of :meth:`from_dict`."""
        return {
            "question": self.question,
            "answer": self.answer,
            "level": self.level,
            "solution": self.solution,
            "kind": self.kind,
            "source": self.source,
            "meta": dict(self.meta),
        }

    @classmethod
    def from_dict(cls, row: Mapping[str, Any]) -> MathProblem:
        """Build from a dict with at least ``question`` and ``answer`` (see :func:`parse_row`)."""
        return parse_row(row, where="task dict")


def latex(value: Fraction) -> str:
    """Exact LaTeX form: ``-7``, ``\\frac{3}{4}``, ``-\\frac{5}{2}``."""
    if value.denominator == 1:
        return str(value.numerator)
    sign = "-" if value < 0 else ""
    return f"{sign}\\frac{{{abs(value.numerator)}}}{{{value.denominator}}}"


def _inline(value: Fraction) -> str:
    """LaTeX of a value as an operand (negative values parenthesised)."""
    text = latex(value)
    return f"({text})" if value < 0 else text


# ---------------------------------------------------------------------------- JSONL loading
def parse_row(row: Any, *, where: str) -> MathProblem:
    """Validate one JSON row; ``ValueError`` names ``where`` (file:line) and the reason."""
    if not isinstance(row, Mapping):
        raise ValueError(f"{where}: expected a JSON object, got {type(row).__name__}")
    question, answer, level = row.get("question"), row.get("answer"), row.get("level")
    if question is None:
        raise ValueError(f'{where}: missing "question" (keys present: {sorted(row)})')
    if not isinstance(question, str) or not question.strip():
        raise ValueError(f'{where}: "question" must be a non-empty string, got {question!r:.60}')
    refuse_oversized(question, "question", where)
    if answer is None:
        raise ValueError(f'{where}: missing "answer" (keys present: {sorted(row)})')
    if isinstance(answer, bool) or not isinstance(answer, (str, int)):
        raise ValueError(f'{where}: "answer" must be a string (or integer), got {type(answer).__name__}')
    if not str(answer).strip():
        raise ValueError(f'{where}: "answer" is empty; every problem needs a gold answer')
    refuse_non_finite(answer, "answer", where)
    refuse_oversized(str(answer), "answer", where)
    problem = malformed_latex(str(answer))
    if problem is not None:
        raise ValueError(
            f'{where}: "answer" {str(answer)!r:.80} is malformed LaTeX ({problem}); every response to it '
            "would score as wrong: fix the gold answer"
        )
    if level is not None and (isinstance(level, bool) or not isinstance(level, int)):
        raise ValueError(f'{where}: "level" must be an integer or absent, got {level!r}')
    for key in ("solution", "kind", "source"):
        value = row.get(key)
        if value is not None and not isinstance(value, str):
            raise ValueError(f'{where}: "{key}" must be a string or absent, got {type(value).__name__}')
    if row.get("meta") is not None and not isinstance(row["meta"], Mapping):
        raise ValueError(f'{where}: "meta" must be a JSON object or absent, got {type(row["meta"]).__name__}')
    solution = row.get("solution")
    known = {"question", "answer", "level", "solution", "kind", "source", "meta"}
    meta = dict(row.get("meta") or {})
    meta.update({k: v for k, v in row.items() if k not in known})
    return MathProblem(
        question=question,
        answer=str(answer).strip(),
        level=level,
        solution=solution,
        kind=row.get("kind"),
        source=str(row.get("source") or where.rsplit(":", 1)[0]),
        meta=meta,
    )


def load_problems(
    source: str | Path,
    *,
    fields: FieldMap | None = None,
    split: str = "train",
    revision: str | None = None,
    subset: str | None = None,
) -> list[MathProblem]:
    """Problems from any dataset :func:`~veriloop.envs.datasets.load_rows` reads, with ``fields``
    naming the question and answer fields (default ``question`` / ``answer``).

    A ``level`` may be an integer or a string such as ``"3"`` or ``"Level 3"`` (MATH's); other
    fields go to ``meta``. With ``answer_extract: last_boxed`` the answer field is a worked solution
    and becomes the problem's ``solution`` when the row has none (``sft.source: generator``). Raises ``ValueError("<file> row <n>: <reason>")`` on a bad row.
    """
    fields = fields or FieldMap()
    problems = []
    for where, row in load_rows(source, split=split, revision=revision, subset=subset):
        mapped = {k: json_safe(v) for k, v in row.items()}
        mapped["question"] = fields.question(row, where)
        mapped["answer"] = fields.answer(row, where)
        mapped["level"] = _level(row.get("level"), where)
        if fields.answer_extract == "last_boxed" and not mapped.get("solution"):
            mapped["solution"] = str(row[fields.answer_key])  # a worked solution: generator SFT uses it
        mapped.setdefault("source", str(source))
        problems.append(parse_row(mapped, where=where))
    return problems


def _level(value: Any, where: str) -> int | None:
    if value is None or (isinstance(value, int) and not isinstance(value, bool)):
        return value
    match = re.fullmatch(r"(?:level\s*)?(\d+)", str(value).strip(), re.IGNORECASE)
    if match is None:
        raise ValueError(f'{where}: "level" must be an integer (or "3", "Level 3"), got {value!r:.40}')
    return int(match.group(1))


def load_jsonl(path: str | Path) -> list[MathProblem]:
    """Read problems from a JSONL file: one object per line with ``question`` and ``answer``.

    Optional keys: ``level`` (int), ``solution`` (str), anything else goes to ``meta``.
    Blank lines are skipped. Raises ``ValueError("<file>:<line>: <reason>")`` on a bad row (invalid
    UTF-8 or JSON, a missing or empty question or answer, a malformed gold answer such as
    ``\\frac{`` -- see :func:`~veriloop.envs.verifiers.extract.malformed_latex` -- or a field of the
    wrong type).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"math data file not found: {path} (expected a .jsonl file)")
    problems = [parse_row(row, where=where) for where, row in jsonl_rows(path)]
    if not problems:
        raise ValueError(f"{path}: no problems found (file is empty)")
    return problems


# ---------------------------------------------------------------------------- generator
def _int(rng: np.random.Generator, low: int, high: int, *, nonzero: bool = False) -> int:
    """Uniform integer in [low, high], optionally never 0."""
    while True:
        value = int(rng.integers(low, high + 1))
        if value != 0 or not nonzero:
            return value


def _integer(rng: np.random.Generator, level: int) -> tuple[str, Fraction, list[str]]:
    if level == 1:
        a, b = _int(rng, 2, 50), _int(rng, 2, 50)
        op = "+" if rng.integers(2) else "-"
        value = Fraction(a + b if op == "+" else a - b)
        return f"Compute ${a} {op} {b}$.", value, [f"${a} {op} {b} = {value}$."]
    if level == 2:
        a, b, c = _int(rng, 2, 15), _int(rng, 2, 15), _int(rng, 1, 60)
        op = "+" if rng.integers(2) else "-"
        product = a * b
        value = Fraction(product + c if op == "+" else product - c)
        steps = [f"First ${a} \\times {b} = {product}$.", f"Then ${product} {op} {c} = {value}$."]
        return f"Compute ${a} \\times {b} {op} {c}$.", value, steps
    a, b, c = _int(rng, -20, 20), _int(rng, -20, 20), _int(rng, -9, 9, nonzero=True)
    e = _int(rng, 2, 9)
    d = e * _int(rng, -12, 12)
    value = Fraction((a - b) * c + d // e)
    q = f"Compute $({a} - {_inline(Fraction(b))}) \\times {_inline(Fraction(c))} + \\frac{{{d}}}{{{e}}}$."
    steps = [
        f"${a} - {_inline(Fraction(b))} = {a - b}$.",
        f"${_inline(Fraction(a - b))} \\times {_inline(Fraction(c))} = {(a - b) * c}$.",
        f"$\\frac{{{d}}}{{{e}}} = {d // e}$, so the total is ${(a - b) * c} + {_inline(Fraction(d // e))} = {value}$.",
    ]
    return q, value, steps


def _frac(rng: np.random.Generator, max_den: int, *, signed: bool = False) -> Fraction:
    low = -9 if signed else 1
    return Fraction(_int(rng, low, 9, nonzero=True), _int(rng, 2, max_den))


def _fraction(rng: np.random.Generator, level: int) -> tuple[str, Fraction, list[str]]:
    x, y = _frac(rng, 6 if level == 1 else 12), _frac(rng, 6 if level == 1 else 12)
    if level == 1:
        op, value = "+", x + y
    elif level == 2:
        op = "-" if rng.integers(2) else "\\times"
        value = x - y if op == "-" else x * y
    else:
        z = _frac(rng, 9, signed=True)
        s = x + y
        value = s / z
        q = f"Compute $\\left({latex(x)} + {latex(y)}\\right) \\div {_inline(z)}$."
        steps = [
            f"${latex(x)} + {latex(y)} = {latex(s)}$.",
            f"${latex(s)} \\div {_inline(z)} = {latex(value)}$.",
        ]
        return q, value, steps
    q = f"Compute ${latex(x)} {op} {latex(y)}$ and simplify."
    return q, value, [f"${latex(x)} {op} {latex(y)} = {latex(value)}$ in lowest terms."]


def _linear(rng: np.random.Generator, level: int) -> tuple[str, Fraction, list[str]]:
    if level < 3:
        lo = 1 if level == 1 else -12
        a, x = _int(rng, 2 if level == 1 else lo, 12, nonzero=True), _int(rng, lo, 12)
        b = _int(rng, 1 if level == 1 else -30, 30)
        c = a * x + b
        sign = "+" if b >= 0 else "-"
        q = f"Solve for $x$: ${a}x {sign} {abs(b)} = {c}$."
        steps = [f"Subtract {b}: ${a}x = {c - b}$.", f"Divide by {a}: $x = {x}$."]
        return q, Fraction(x), steps
    a, c = _int(rng, -9, 9, nonzero=True), _int(rng, -9, 9)
    while c == a:
        c = _int(rng, -9, 9)
    b, d = _int(rng, -20, 20), _int(rng, -20, 20)
    value = Fraction(d - b, a - c)
    q = f"Solve for $x$: ${a}x + {_inline(Fraction(b))} = {c}x + {_inline(Fraction(d))}$."
    steps = [
        f"Collect terms: $({a} - {_inline(Fraction(c))})x = {d} - {_inline(Fraction(b))}$, i.e. ${a - c}x = {d - b}$.",
        f"So $x = {latex(value)}$.",
    ]
    return q, value, steps


_NAMES = ("Ana", "Ben", "Chen", "Dara", "Eli", "Fatima", "Gus", "Hana")


def _word(rng: np.random.Generator, level: int) -> tuple[str, Fraction, list[str]]:
    name = _NAMES[int(rng.integers(len(_NAMES)))]
    if level == 1:
        n, price, extra = _int(rng, 2, 9), _int(rng, 2, 12), _int(rng, 1, 20)
        value = Fraction(n * price + extra)
        q = (
            f"{name} buys {n} notebooks at {price} dollars each and a pen for {extra} dollars. "
            f"How many dollars does {name} spend in total?"
        )
        return (
            q,
            value,
            [
                f"Notebooks: ${n} \\times {price} = {n * price}$.",
                f"Total: ${n * price} + {extra} = {value}$.",
            ],
        )
    if level == 2:
        speed, hours, back = _int(rng, 3, 80), _int(rng, 2, 6), _int(rng, 1, 9)
        value = Fraction(speed * hours - back * hours)
        q = (
            f"{name} walks at {speed} km per hour for {hours} hours, while a wind pushes back "
            f"{back} km every hour. How many km does {name} cover?"
        )
        steps = [
            f"Net speed ${speed} - {back} = {speed - back}$ km/h.",
            f"Distance ${speed - back} \\times {hours} = {value}$.",
        ]
        return q, value, steps
    total, people = _int(rng, 10, 60), _int(rng, 3, 8)
    kept = Fraction(_int(rng, 1, 4), 5)
    value = total * (1 - kept) / people
    q = (
        f"{name} has {total} litres of juice, keeps ${latex(kept)}$ of it and shares the rest equally "
        f"among {people} friends. How many litres does each friend get?"
    )
    steps = [
        f"Shared: ${total} \\times (1 - {latex(kept)}) = {latex(total * (1 - kept))}$.",
        f"Each: ${latex(total * (1 - kept))} \\div {people} = {latex(value)}$.",
    ]
    return q, value, steps


_MAKERS = {"integer": _integer, "fraction": _fraction, "linear": _linear, "word": _word}


def generate_problem(
    rng: np.random.Generator, *, level: int | None = None, kind: Kind | None = None
) -> MathProblem:
    """One problem drawn with ``rng``; ``level``/``kind`` default to a uniform choice."""
    level = int(LEVELS[int(rng.integers(len(LEVELS)))]) if level is None else level
    kind = KINDS[int(rng.integers(len(KINDS)))] if kind is None else kind
    if level not in LEVELS:
        raise ValueError(f"level must be one of {LEVELS}, got {level!r}")
    if kind not in _MAKERS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    question, value, steps = _MAKERS[kind](rng, level)
    answer = latex(value)
    solution = "\n".join([*steps, f"The answer is $\\boxed{{{answer}}}$."])
    return MathProblem(
        question=question,
        answer=answer,
        level=level,
        solution=solution,
        kind=kind,
        meta={"value": f"{value.numerator}/{value.denominator}"},
    )


def normalize_levels(level: int | Sequence[int] | None) -> tuple[int, ...] | None:
    """``None`` (mixed), one level or a list of levels -> tuple of valid levels."""
    if level is None:
        return None
    levels = (level,) if isinstance(level, int) else tuple(level)
    bad = [lv for lv in levels if lv not in LEVELS]
    if bad or not levels:
        raise ValueError(f"level must be None or in {LEVELS} (or a list of them), got {level!r}")
    return levels
