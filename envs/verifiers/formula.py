"""Safe parsing and exact evaluation of Points24 arithmetic formulas.

A formula is untrusted model output, so it is never evaluated by Python. It is normalised, screened
character by character, parsed with ``ast.parse(mode="eval")`` and then walked over a whitelist of
nodes, computing with :class:`fractions.Fraction` (exact: ``8/(3-8/3) == 24``).

Grammar accepted (anything else is rejected as unparseable):

* integer literals written with ASCII digits, without leading zeros (``08`` is rejected, ``0`` is fine);
* binary ``+ - * /`` and parentheses; no unary minus (``-3``), no power (``**``, ``^``), no floor
  division (``//``), no decimals (``2.5``), no names, calls or attributes.

Normalisation before screening: ``×``, ``·``, ``∗``, ``\\times``, ``\\cdot`` -> ``*``; ``÷``,
``\\div`` -> ``/``; ``−`` (U+2212), ``–``, ``—`` -> ``-``; ``\\left(``/``\\right)`` and ``[ ]`` ->
``( )``; ``$`` and surrounding whitespace dropped. The letter ``x`` is deliberately NOT read as
multiplication: it is ambiguous (a variable? a card?), and the prompt asks for ``*``.
"""

from __future__ import annotations

import ast
import operator
from dataclasses import dataclass
from fractions import Fraction
from functools import lru_cache

MAX_FORMULA_CHARS = 200
MAX_PAREN_DEPTH = 16
ALLOWED_CHARS = frozenset("0123456789+-*/() ")
_REPLACEMENTS = (
    ("\\left(", "("),
    ("\\right)", ")"),
    ("\\times", "*"),
    ("\\cdot", "*"),
    ("\\div", "/"),
    ("×", "*"),
    ("·", "*"),
    ("∗", "*"),
    ("÷", "/"),
    ("−", "-"),
    ("–", "-"),
    ("—", "-"),
    ("[", "("),
    ("]", ")"),
    ("$", ""),
    ("\t", " "),
)
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


class FormulaError(ValueError):
    """The formula is not in the accepted grammar (message says why)."""


@dataclass(frozen=True)
class Evaluated:
    """An accepted formula: its exact value and the integer literals it uses, in order."""

    value: Fraction
    numbers: tuple[int, ...]


def normalise(text: str) -> str:
    """Apply the operator aliases of the module docstring and strip whitespace."""
    for old, new in _REPLACEMENTS:
        if old in text:
            text = text.replace(old, new)
    return text.strip()


_OPERATORS_TO_SPACES = str.maketrans("+-*/()", "      ")


def screen(text: str) -> None:
    """Raise :class:`FormulaError` unless ``text`` (normalised) is short, plain and shallow."""
    if len(text) > MAX_FORMULA_CHARS:
        raise FormulaError(f"formula longer than {MAX_FORMULA_CHARS} characters")
    bad = set(text) - ALLOWED_CHARS
    if bad:
        shown = ", ".join(repr(ch) for ch in sorted(bad)[:5])
        raise FormulaError(f"characters not allowed: {shown} (use digits, + - * / and parentheses)")
    if text.count("(") > MAX_PAREN_DEPTH:
        depth = 0
        for ch in text:
            depth += (ch == "(") - (ch == ")")
            if depth > MAX_PAREN_DEPTH:
                raise FormulaError(f"parentheses nested deeper than {MAX_PAREN_DEPTH}")
    if "0" in text:
        for token in text.translate(_OPERATORS_TO_SPACES).split():
            if len(token) > 1 and token[0] == "0":
                raise FormulaError(f"numbers must not have leading zeros (got {token})")


def _walk(node: ast.AST, numbers: list[int]) -> int | Fraction:
    """Exact value of a whitelisted node: ints stay ints until a division leaves a remainder."""
    kind = type(node)
    if kind is ast.BinOp:
        op = type(node.op)  # type: ignore[attr-defined]
        if op not in _OPS:
            raise FormulaError(f"{op.__name__} is not allowed (only + - * / on whole numbers)")
        left = _walk(node.left, numbers)  # type: ignore[attr-defined]
        right = _walk(node.right, numbers)  # type: ignore[attr-defined]
        if op is not ast.Div:
            return _OPS[op](left, right)
        if right == 0:
            raise ZeroDivisionError("division by zero")
        if type(left) is int and type(right) is int:
            return left // right if left % right == 0 else Fraction(left, right)
        return Fraction(left) / right  # at least one side is already a Fraction
    if kind is ast.Constant and type(node.value) is int:  # type: ignore[attr-defined]
        numbers.append(node.value)  # type: ignore[attr-defined]
        return node.value  # type: ignore[attr-defined]
    raise FormulaError(f"{kind.__name__} is not allowed (only + - * / on whole numbers)")


def evaluate(text: str) -> Evaluated:
    """Evaluate a normalised formula exactly.

    Results (and failures) are memoised per formula string: in RL the same formula recurs across the
    samples of a group, and evaluation is a pure function of the string.

    Raises:
        FormulaError: The text is outside the grammar.
        ZeroDivisionError: The formula divides by zero.
    """
    outcome = _evaluate_cached(text)
    if isinstance(outcome, Exception):
        raise type(outcome)(*outcome.args)
    return outcome


@lru_cache(maxsize=8192)
def _evaluate_cached(text: str) -> Evaluated | FormulaError | ZeroDivisionError:
    try:
        screen(text)
        if not text:
            raise FormulaError("empty formula")
        try:
            tree = ast.parse(text, mode="eval")
        except SyntaxError as exc:
            raise FormulaError(f"not a valid formula ({exc.msg})") from None
        numbers: list[int] = []
        value = _walk(tree.body, numbers)
    except (FormulaError, ZeroDivisionError) as exc:
        return exc
    return Evaluated(Fraction(value), tuple(numbers))


def show_number(value: int | Fraction) -> str:
    """``12``, ``-3`` or ``8/3``: a whole number bare, any other fraction as ``p/q``."""
    value = Fraction(value)
    return str(value.numerator) if value.denominator == 1 else f"{value.numerator}/{value.denominator}"


_SYMBOLS = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/"}


def worked_steps(text: str) -> list[str]:
    """An accepted formula evaluated one operation at a time, innermost first, left to right:
    ``"(2+10)*1"`` -> ``["2+10 = 12", "12*1 = 12"]``, ``"8/(3-8/3)"`` -> ``["3-(8/3) = 1/3",
    "8/(1/3) = 24"]``: an operand that is not a whole number >= 0 is parenthesised, and a division
    whose result reads as itself (``8/3``) is no step.

    For written checks (S2R verification traces); the value agrees with :func:`evaluate`.

    Raises:
        FormulaError: The text is outside the grammar.
        ZeroDivisionError: The formula divides by zero.
    """
    evaluate(text)  # the screen and the whitelist first: nothing else reaches the walk below
    steps: list[str] = []

    def operand(value: Fraction) -> str:
        shown = show_number(value)
        return shown if value.denominator == 1 and value >= 0 else f"({shown})"

    def walk(node: ast.AST) -> Fraction:
        if isinstance(node, ast.BinOp):
            left, right = walk(node.left), walk(node.right)
            value = Fraction(_OPS[type(node.op)](left, right))
            step = f"{operand(left)}{_SYMBOLS[type(node.op)]}{operand(right)}"
            if step != show_number(value):  # 7/9 = 7/9 says nothing
                steps.append(f"{step} = {show_number(value)}")
            return value
        return Fraction(node.value)  # type: ignore[attr-defined]  # an int literal: evaluate() vetted it

    walk(ast.parse(text, mode="eval").body)
    return steps
