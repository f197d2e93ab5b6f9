"""What stands between a model's answer and reasoning-gym's own scorers: no ``eval``, no hedges.

reasoning-gym scorers run jailed (:mod:`veriloop.envs.verifiers.sandbox`), but the jail cannot stop
code that runs *inside* it from writing the jail's own reply: an answer that a scorer ``eval``'s
could set its own score. So no model text reaches an ``eval``-based parser at all:

* **Math datasets** (:data:`MATH_DATASETS`, scorers that call sympy's ``parse_expr``): the answer must
  be one arithmetic expression in a strict grammar (:func:`is_math_expression`: ASCII numbers, the
  operators ``+ - * / ^ **``, parentheses, commas, single-letter symbols and a fixed list of function
  names); anything else is a wrong answer, scored 0 without calling the scorer. No ``.`` outside a
  number, no quote, bracket, underscore or non-ASCII character, no other name: no attribute,
  subscript, string, ``lambda`` or builtin can be written.
* **Literal datasets** (:data:`EVAL_DATASETS`, scorers that call Python's ``eval`` to read a list the
  model may write): in the scorer worker, the module's ``eval`` is replaced by
  :func:`ast.literal_eval` (:func:`disarm_eval`), which reads the same literals and runs nothing.

``tests/interop/test_reasoning_gym_guard.py`` lists every ``eval``-family call in reasoning-gym and
fails when a new one appears that is neither covered here nor audited as trusted.

**Hedges.** A hedge (several candidate answers in one) is paid by many scorers (``350 or 0`` scored
1.0 in gsm_symbolic, partial credit in others). :func:`is_hedge` flags an answer that

1. uses a separator the item's gold answer does not: the word ``or``, ``|``, ``;``, a second
   non-empty line, or a comma (a thousands separator such as ``1,000`` is not one); or
2. holds two numbers where the gold is one number (``350.0 -4``; ``1,000`` and ``2.5e-3`` are one);
3. puts two words or numbers side by side (``350.0 0``) where the gold has none; or
4. contains the gold as a separate piece next to other letters, digits or pictographs (``350 0``,
   ``x, 350``).

Rules 2 to 4 do not apply to the math datasets, where an expression such as ``G + 7`` may be a
right answer (and the grammar already refuses ``or``, ``;`` and ``|``).

Without a gold (datasets whose scorer checks any valid answer) only ``or``, ``|`` and ``;`` count.
A flagged answer is scored 0 (reason ``"hedged"``): never above a single wrong answer.
"""

from __future__ import annotations

import ast
import re
import sys
import unicodedata
from typing import Any

#: Datasets whose scorer hands the answer to sympy's ``parse_expr`` (``puzzle24`` and ``countdown``
#: also do, but are scored by veriloop's own formula checks instead).
MATH_DATASETS = frozenset({"simple_integration", "intermediate_integration", "polynomial_multiplication"})
#: Datasets whose scorer calls Python's ``eval`` on the answer (to read a list literal).
EVAL_DATASETS = frozenset({"binary_matrix", "n_queens", "spiral_matrix", "string_insertion"})
#: Names (beyond single ASCII letters) a math answer may use: sympy functions and constants.
MATH_NAMES = frozenset(
    "sin cos tan cot sec csc asin acos atan acot asec acsc sinh cosh tanh coth sech csch "
    "asinh acosh atanh acoth exp log ln sqrt Abs pi oo".split()
)
MAX_MATH_CHARS = 2000
_MATH_TOKEN = re.compile(r"[ \t\r\n]+|[0-9]+(?:\.[0-9]*)?|\.[0-9]+|[A-Za-z][A-Za-z0-9]*|\*\*|[-+*/^(),]")


def is_math_expression(text: str) -> bool:
    """True when ``text`` is made only of the tokens of the strict math grammar (module docstring).

    Tokens are matched end to end, so nothing outside the grammar can hide between two of them.
    Whether the tokens form a valid expression is left to the scorer (a syntax error scores 0).
    """
    if len(text) > MAX_MATH_CHARS or not text.strip():
        return False
    position = 0
    while position < len(text):
        token = _MATH_TOKEN.match(text, position)
        if token is None:
            return False
        word = token.group()
        if word[0].isalpha() and len(word) > 1 and word not in MATH_NAMES:
            return False
        position = token.end()
    return True


def _no_eval(source: Any, *_: Any) -> Any:
    """Stands in for ``eval`` in a literal dataset's module: a Python literal, or ``ValueError``."""
    return ast.literal_eval(source)


def disarm_eval(data: Any, dataset: str) -> None:
    """In the scorer worker: the scorer of a literal dataset reads literals with :func:`ast.literal_eval`
    (its module's ``eval`` name is rebound; module globals come before builtins). Idempotent."""
    if dataset in EVAL_DATASETS:
        sys.modules[type(data).__module__].eval = _no_eval  # type: ignore[attr-defined]


def math_screen(dataset: str, answer: str) -> bool:
    """True when ``answer`` may be handed to ``dataset``'s scorer (always, outside the math datasets)."""
    return dataset not in MATH_DATASETS or is_math_expression(answer)


_OR = re.compile(r"\bor\b", re.IGNORECASE)
_LIST_COMMA = re.compile(r",(?![0-9]{3}(?![0-9]))")  # a comma, unless it groups thousands
_ALWAYS = (_OR, re.compile(r"\|"), re.compile(";"))


def _lines(text: str) -> int:
    return sum(1 for line in text.splitlines() if line.strip())


def _new_separator(answer: str, gold: str | None) -> bool:
    if any(sep.search(answer) and (gold is None or not sep.search(gold)) for sep in _ALWAYS):
        return True
    if gold is None:
        return False
    if _LIST_COMMA.search(answer) and not _LIST_COMMA.search(gold):
        return True
    return _lines(answer) > 1 and _lines(gold) <= 1


def _bounded(text: str, start: int, end: int) -> bool:
    """The piece ``text[start:end]`` is not part of a longer word or number."""

    def joins(inner: str, outer: str, beyond: str) -> bool:
        return outer.isalnum() or outer == "_" or (outer == "." and inner.isdigit() and beyond.isdigit())

    before = text[start - 1] if start > 0 else ""
    after = text[end] if end < len(text) else ""
    if before and joins(text[start], before, text[start - 2] if start > 1 else ""):
        return False
    return not (after and joins(text[end - 1], after, text[end + 1] if end + 1 < len(text) else ""))


def _substantive(char: str) -> bool:
    """A letter, digit or pictograph (``❌``): a piece of another answer, not punctuation around one."""
    return char.isalnum() or unicodedata.category(char) == "So"


def _contains_gold_and_more(answer: str, gold: str) -> bool:
    text, piece = " ".join(answer.split()).casefold(), " ".join(gold.split()).casefold()
    if not piece or text == piece:
        return False
    start = text.find(piece)
    while start >= 0:
        end = start + len(piece)
        if _bounded(text, start, end) and any(map(_substantive, text[:start] + text[end:])):
            return True
        start = text.find(piece, start + 1)
    return False


_JUXTAPOSED = re.compile(r"[^\W_]\s+[^\W_]")  # two words or numbers side by side: "350.0 0"
_NUMBER = re.compile(r"[0-9]+(?:,[0-9]{3})*(?:\.[0-9]+)?(?:[eE][-+]?[0-9]+)?")
_ONE_NUMBER = re.compile(rf"\s*[-+]?{_NUMBER.pattern}\s*")


def is_hedge(dataset: str, answer: str, gold: Any) -> bool:
    """True when ``answer`` offers several candidates for an item whose gold is ``gold`` (module
    docstring); ``gold`` is the item's reasoning-gym answer (``None`` where the dataset has none)."""
    gold_text = None if gold is None else str(gold)
    if _new_separator(answer, gold_text):
        return True
    if gold_text is None or dataset in MATH_DATASETS:
        return False
    if _ONE_NUMBER.fullmatch(gold_text) and len(_NUMBER.findall(answer)) > 1:
        return True
    if _JUXTAPOSED.search(answer) and not _JUXTAPOSED.search(gold_text):
        return True
    return _contains_gold_and_more(answer, gold_text)
