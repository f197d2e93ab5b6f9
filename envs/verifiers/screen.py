"""Cheap checks on an extracted math answer before it reaches a sandboxed worker.

They only ever see answers already capped at :data:`.extract.MAX_ANSWER_CHARS` characters and
:data:`.extract.MAX_NESTING` levels, so even the walks that look back from every ``^`` stay far
below a millisecond.

Three kinds of screen, all decided relative to the gold answer (a screen never fires on a feature the
gold itself has, so a legitimate answer shaped like the gold always reaches math-verify):

* **Hedging** -- an answer that offers several candidates hoping one is right:
  ``3 or 4``, ``3 \\text{ and } 4``, ``3 \\pm 1`` / ``±`` / ``\\mp`` / ``∓``, or a comma/semicolon
  separated list (``3, 4`` or ``\\{3, 4\\}``) when the gold is a single value, or a chain of
  equalities (``x = 3 = 4``, ``3 = 4``: math-verify would read the last side). Thousands separators
  (``1,000``, ``1{,}000``, ``11,\\! 111,\\! 100``) are not lists: a number so written is one answer. When the gold has commas (a tuple, interval or set), a
  list-shaped answer is legitimate and math-verify compares the shapes.
* **Unevaluated** -- the question handed back as the answer: arithmetic on numbers that is not
  itself a number in a standard form (``14 - 26``, ``\\frac{1}{6} + \\frac{3}{2}``,
  ``3 \\times 11 + 10``, ``2^{3}``, ``\\sqrt{16}``, ``\\sqrt[3]{8}``, ``|-4|``, ``|{-3}|+1``,
  ``\\lfloor 4.5 \\rfloor``, ``\\lceil 3.2 \\rceil``) when the gold is a number
  (``-12``, ``\\frac{5}{3}``, ``0.5``). math-verify judges such an answer equal to the gold, so a
  policy can score on "Compute 14 - 26" by copying it into ``\\boxed{}``; one did, in 20 GRPO steps.
  The value is what was asked for. The last side of an equality is the answer (``x = 14 - 26`` is
  unevaluated); an answer with any name, word, unit or symbol outside plain arithmetic is left to
  math-verify. Style and spacing (``\\displaystyle``, ``\\,``) and Unicode operators (``−``, ``×``,
  ``÷``, ``·``) are read as their plain forms first.

  **The rule: a value in a standard form is not arithmetic left undone.** The standard forms are a
  literal (``-12``, ``0.5``, ``\\frac{5}{3}``, ``1\\frac{2}{3}``), scientific notation (a decimal
  times a power of ten, or the power alone: ``1.5 \\times 10^{6}``, ``3 \\cdot 10^{5}``,
  ``10^{-3}``) and one power of two integer literals worth at least :data:`MIN_POWER_VALUE`
  (``2^{10}`` for 1024: large values are commonly left as powers; ``2^{3}`` for 8 is the
  computation asked for). Anything else made of numbers and operators -- a sum, difference,
  product or quotient of several terms, a root, a power of a power, a small power -- is left
  undone.
* **Bombs** -- expressions whose exact evaluation can take minutes or gigabytes in sympy: power towers
  of height >= 3 (``2^{2^{2^{2}}}``, ``9^9^9``), literal exponents above :data:`MAX_EXPONENT`
  (``10^{100000000}``) or exponents that are literal powers above it (``9^{9^{9}}``, ``2^{2^{100}}``)
  and factorials of literals above :data:`MAX_FACTORIAL` or of powers
  (``10000000!``, ``(10^{6})!``). These are rejected as wrong at once. The worker deadline remains the
  real guarantee; this screen only saves a worker from burning its full deadline on the obvious cases.
"""

from __future__ import annotations

import math
import re
from typing import Literal

MAX_EXPONENT = 100_000
MAX_FACTORIAL = 1_000
HEDGE_WORDS = ("or", "and")
HEDGE_SIGNS = ("\\pm", "±", "\\mp", "∓")
#: Commands whose ``^`` is an upper limit, not an exponent.
BIG_OPERATORS = ("\\sum", "\\prod", "\\int", "\\iint", "\\iiint", "\\oint", "\\coprod")
_WORD_BREAKERS = (
    "\\text{",
    "\\textbf{",
    "\\mathrm{",
    "\\mbox{",
    "\\quad",
    "\\qquad",
    "\\,",
    "\\;",
    "~",
    "{",
    "}",
)

Bomb = Literal["power_tower", "huge_exponent", "huge_factorial"]


def _ascii_digits(text: str) -> bool:
    """True when ``text`` is one or more ASCII digits. ``str.isdigit`` also accepts ``²``, ``⁶`` and
    ``①``, which ``int()`` rejects: a screen must never raise on what a model writes."""
    return text.isascii() and text.isdigit()


def _without_thousands_separators(text: str) -> str:
    """Drop the separators of digit groups: ``12,345``, ``12{,}345``, ``12,\\!345``, ``11,\\! 111``.

    A separator is a ``,`` (or ``{,}``) between a digit and exactly three digits. After ``,\\!`` (the
    negative thin space of MATH's ``11,\\! 111,\\! 100``) spaces may come before the group; after a
    bare ``,`` they may not: ``32, 349`` is a list of two numbers (as Math-Verify reads it too).
    """
    text = text.replace("{,}", ",")
    out: list[str] = []
    n, i = len(text), 0
    while i < n:
        ch = text[i]
        if ch == "," and i > 0 and _ascii_digits(text[i - 1]):
            j = i + 1
            if text.startswith("\\!", j):
                j += 2
                while j < n and text[j] == " ":
                    j += 1
            group = text[j : j + 3]
            if len(group) == 3 and _ascii_digits(group) and not (j + 3 < n and _ascii_digits(text[j + 3])):
                i = j  # drop the separator, keep the digits
                continue
        out.append(ch)
        i += 1
    return "".join(out)


#: A thin or other space between digit groups: ``1\\,000``, ``1\\ 000``, ``1~000``, ``1 000`` (U+2009).
_GROUP_SPACE = r"(?:\\,|\\;|\\:|\\ |\\thinspace|\{\\,\}|~|[ \u2009\u202f\u00a0])"
_SPACE_GROUPED = re.compile(rf"([+-]?\d{{1,3}}(?:{_GROUP_SPACE}\d{{3}})+)(\.\d+)?")


def without_group_spaces(text: str) -> str | None:
    """A number written with spaces between its digit groups (``1\\,000``, SI style), without them
    (``1000``); ``None`` for any other text. math-verify reads ``1\\,000`` as something else."""
    match = _SPACE_GROUPED.fullmatch(text.strip())
    if match is None:
        return None
    return re.sub(_GROUP_SPACE, "", match.group(1)) + (match.group(2) or "")


def is_list_shaped(text: str) -> bool:
    """True when ``text`` holds a comma/semicolon separated list of several values.

    The LaTeX spaces ``\\,`` and ``\\;`` (``\\int_0^1 2x \\, dx``, ``1\\,000``) are not separators.
    """
    cleaned = _without_thousands_separators(text.replace("\\,", " ").replace("\\;", " "))
    return "," in cleaned or ";" in cleaned


def is_contradictory(answer: str, gold: str) -> bool:
    """True when ``answer`` is a chain of equalities the gold does not call for.

    math-verify reads ``x = 3 = 4`` and ``3 = 4`` as their last side, so both would score for gold 4.
    An answer may have as many ``=`` as the gold; when the gold has none, it may have one, and only
    after a name (``x = 4``, ``f(2) = 4``), never after a bare number (``3 = 4``).
    """
    count, gold_count = answer.count("="), gold.count("=")
    if count <= gold_count:
        return False
    if count - gold_count > 1 or gold_count > 0:
        return True
    left = answer[: answer.index("=")]
    return not any(ch.isalpha() for ch in left.replace("\\left", "").replace("\\right", ""))


#: LaTeX that means nothing in plain arithmetic (spacing, sizing, style, math delimiters), dropped first.
_ARITHMETIC_NOISE = ("\\displaystyle", "\\textstyle", "\\scriptstyle", "\\left", "\\right",
                     "\\!", "\\,", "\\;", "\\:", "\\ ", " ", "$")  # fmt: skip
#: LaTeX and Unicode operators and their one-character stand-ins (``f``: a fraction, ``s``: a root;
#: the optional argument of ``\\sqrt[3]{8}`` becomes a parenthesised group).
_ARITHMETIC_OPS = (("\\dfrac", "f"), ("\\tfrac", "f"), ("\\frac", "f"), ("\\sqrt", "s"),
                   ("\\times", "*"), ("\\cdot", "*"), ("\\ast", "*"), ("\\div", "/"),
                   ("\u2212", "-"), ("\u2013", "-"), ("\u00d7", "*"), ("\u00b7", "*"), ("\u22c5", "*"),
                   ("\u00f7", "/"), ("\u2215", "/"), ("{", "("), ("}", ")"), ("[", "("), ("]", ")"),
                   ("\\lvert", "|"), ("\\rvert", "|"), ("\\vert", "|"), ("\\mid", "|"),
                   ("\\lfloor", "\u230a"), ("\\rfloor", "\u230b"), ("\\lceil", "\u2308"), ("\\rceil", "\u2309"))  # fmt: skip
#: Plain arithmetic, with ``|`` (absolute value) and ``⌊ ⌋ ⌈ ⌉`` (floor, ceiling): never a standard form.
_ARITHMETIC_CHARS = frozenset("0123456789.+-*/^()fs|\u230a\u230b\u2308\u2309")
_NUMBER = r"\(*[+-]?\(*(?:\d+(?:\.\d*)?|\.\d+)\)*"
#: A number as a plain arithmetic form: signed decimal, ``a/b``, ``\\frac{a}{b}`` or ``\\frac ab``,
#: and a mixed number ``1\\frac{2}{3}`` (which math-verify reads as 5/3).
_LITERAL = re.compile(rf"{_NUMBER}|{_NUMBER}/{_NUMBER}|\(*[+-]?\d*f(?:\([+-]?\d+\)\([+-]?\d+\)|\d\d)\)*")
_EXPONENT = r"(?:\([+-]?\d+\)|[+-]?\d+)"
#: Scientific notation: ``1.5 \\times 10^{6}``, ``3 \\cdot 10^{5}``, ``-10^{-3}`` (any decimal mantissa).
_SCIENTIFIC = re.compile(rf"\(*[+-]?(?:(?:\d+(?:\.\d*)?|\.\d+)\*)?10\^{_EXPONENT}\)*")
#: One power of two integer literals: ``2^{10}``, ``-3^{7}`` (standard form from :data:`MIN_POWER_VALUE`).
_POWER = re.compile(r"\(*[+-]?(\d+)\^(?:\((\d+)\)|(\d+))\)*")
#: The smallest value a power of literals may stand for (``2^{10}`` for 1024, not ``2^{3}`` for 8).
MIN_POWER_VALUE = 1000


def _arithmetic_form(text: str) -> str | None:
    """``text`` as plain arithmetic (digits, ``. + - * / ^ ( )``, ``f`` for a fraction and ``s`` for
    a square root), or ``None`` when it holds anything else, or no digit."""
    form = _without_thousands_separators(text)
    for noise in _ARITHMETIC_NOISE:
        form = form.replace(noise, "")
    for latex, char in _ARITHMETIC_OPS:
        form = form.replace(latex, char)
    if not any(_ascii_digits(ch) for ch in form) or not set(form) <= _ARITHMETIC_CHARS:
        return None
    return form


def is_number(text: str) -> bool:
    """True when ``text`` is one number (``-12``, ``0.5``, ``5/3``, ``\\frac{-5}{3}``, ``1{,}000``)."""
    form = _arithmetic_form(text)
    return form is not None and _LITERAL.fullmatch(form) is not None


def is_standard_form(form: str) -> bool:
    """True when the arithmetic form ``form`` writes ONE value in a standard way (module docstring):
    a literal, scientific notation, or a power of two integer literals worth at least
    :data:`MIN_POWER_VALUE`."""
    if _LITERAL.fullmatch(form) or _SCIENTIFIC.fullmatch(form):
        return True
    power = _POWER.fullmatch(form)
    if power is None:
        return False
    base, exponent = int(power.group(1)), int(power.group(2) or power.group(3))
    return base >= 2 and exponent >= 2 and exponent * math.log10(base) >= math.log10(MIN_POWER_VALUE)


def is_unevaluated(answer: str, gold: str) -> bool:
    """True when ``gold`` is a number and ``answer`` (its last side, after any ``=``) is arithmetic
    on numbers not in a standard form: an expression left to evaluate (module docstring)."""
    if not is_number(gold):
        return False
    last = answer.rsplit("=", 1)[-1]
    form = _arithmetic_form(last)
    return form is not None and not is_standard_form(form)


#: How a missing or overflowed float prints (Python, pandas, JSON): never a gold answer.
_NON_FINITE = re.compile(r"[+-]?(?:nan|inf|infinity)", re.IGNORECASE)


def is_non_finite(value: object) -> bool:
    """True for a float NaN or infinity, or text that spells one (``nan``, ``-inf``, ``Infinity``):
    what pandas leaves for a missing float. ``\\infty`` (a LaTeX answer) is not such a spelling."""
    if isinstance(value, float):
        return not math.isfinite(value)
    return isinstance(value, str) and _NON_FINITE.fullmatch(value.strip()) is not None


def _words(text: str) -> set[str]:
    for breaker in _WORD_BREAKERS:
        text = text.replace(breaker, " ")
    return {w.lower() for w in text.split()}


def is_hedged(answer: str, gold: str) -> bool:
    """True when ``answer`` hedges between several candidates given the gold's shape (module doc)."""
    if is_contradictory(answer, gold):
        return True
    if any(sign in answer and sign not in gold for sign in HEDGE_SIGNS):
        return True
    answer_words, gold_words = _words(answer), _words(gold)
    if any(w in answer_words and w not in gold_words for w in HEDGE_WORDS):
        return True
    return is_list_shaped(answer) and not is_list_shaped(gold)


def _group_end(text: str, start: int) -> int:
    """Offset just past the ``{...}`` group opening at ``start`` (or the end of text if unclosed)."""
    depth = 0
    for i in range(start, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return i + 1
    return len(text)


def _exponent(text: str, i: int) -> tuple[str, int]:
    """The exponent that follows a ``^`` at ``i - 1``, and the offset just past it."""
    n = len(text)
    while i < n and text[i] == " ":
        i += 1
    if i >= n:
        return "", i
    if text[i] == "{":
        end = _group_end(text, i)
        return text[i + 1 : end - 1], end
    j = i + 1
    if _ascii_digits(text[i]):
        while j < n and _ascii_digits(text[j]):
            j += 1
    elif text[i] == "\\":
        while j < n and text[j].isalpha():
            j += 1
    return text[i:j], j


def tower_height(text: str) -> int:
    """Height of the tallest power tower in ``text``: ``2^3`` -> 1, ``2^{3^4}`` and ``2^3^4`` -> 2.

    Recursion depth is bounded by the caller's nesting cap (:data:`.extract.MAX_NESTING`).
    """
    best, i, n = 0, 0, len(text)
    while i < n:
        if text[i] != "^":
            i += 1
            continue
        height = 0
        while i < n and text[i] == "^":  # a chain a^b^c counts as a tower too
            exponent, i = _exponent(text, i + 1)
            height += 1 + tower_height(exponent)
        best = max(best, height)
    return best


def _unwrap(text: str) -> str:
    """``text`` without whitespace and without ONE pair of ``{}``/``()`` enclosing all of it."""
    text = text.strip()
    if len(text) >= 2 and (text[0], text[-1]) in (("{", "}"), ("(", ")")):
        depth = 0
        for i, ch in enumerate(text):
            depth += (ch == text[0]) - (ch == text[-1])
            if depth == 0:
                return text[1:-1].strip() if i == len(text) - 1 else text
    return text


def literal_log10(text: str, depth: int = 0) -> float | None:
    """log10 of ``text`` when it is an integer literal or a literal power (``9^{9}``, ``{10^{10}}``).

    ``None`` for anything else (a variable, a sum, a fraction ...): only plain literals are judged.
    Values below 1 count as 1 (log 0). Towers are read right to left, so the result may be ``inf``.
    """
    text = _unwrap(text)
    if depth > 4 or not text:
        return None
    digits = len(text) - len(text.lstrip("0123456789"))
    if digits == 0 or digits > 400:
        return None
    base = max(1, int(text[:digits]))
    if digits == len(text):
        return math.log10(base)
    if text[digits:].lstrip()[:1] != "^":
        return None
    exponent = literal_log10(text[digits:].lstrip()[1:], depth + 1)
    if exponent is None or base == 1:
        return None if exponent is None else 0.0
    return math.log10(base) * (math.inf if exponent > 300 else 10.0**exponent)


def _is_bound(text: str, i: int) -> bool:
    """True when the ``^`` at ``i`` is the upper limit of ``\\sum``/``\\int``/... (not a power).

    Handles ``\\sum_{k=1}^{n}``, ``\\int_0^{n}``, ``\\int\\limits_0^{n}`` and ``\\sum^{n}``.
    """
    j = len(text[:i].rstrip())
    if j >= 1 and text[j - 1] == "}":  # a braced subscript _{...}
        depth, k = 0, j - 1
        while k >= 0:
            depth += (text[k] == "}") - (text[k] == "{")
            if depth == 0:
                break
            k -= 1
        if k >= 1 and text[k - 1] == "_":
            j = k - 1
    elif j >= 2 and text[j - 2] == "_":  # a one-character subscript _0
        j -= 2
    head = text[:j].rstrip()
    for modifier in ("\\limits", "\\nolimits"):
        if head.endswith(modifier):
            head = head[: -len(modifier)].rstrip()
    return head.endswith(BIG_OPERATORS)


def _has_huge_exponent(text: str) -> bool:
    """A literal exponent above :data:`MAX_EXPONENT`: ``10^{100000000}`` or ``9^{9^{9}}``.

    The upper limit of a sum, product or integral (``\\sum_{k=1}^{10^{12}}``) is not an exponent.
    """
    for i, ch in enumerate(text):
        if ch == "^" and not _is_bound(text, i):
            exponent = _exponent(text, i + 1)[0].strip()
            if _ascii_digits(exponent):
                if len(exponent) > 6 or int(exponent) > MAX_EXPONENT:
                    return True
            elif "^" in exponent:  # the exponent is itself a power: 2^{2^{100}}, 10^{10^{10}}
                size = literal_log10(exponent)
                if size is not None and size > math.log10(MAX_EXPONENT) + 1e-9:
                    return True
    return False


def _has_huge_factorial(text: str) -> bool:
    for i, ch in enumerate(text):
        if ch != "!" or i == 0:
            continue
        j = i
        while j > 0 and text[j - 1] in " })]":
            j -= 1
        k = j
        while k > 0 and _ascii_digits(text[k - 1]):
            k -= 1
        digits = text[k:j]
        if digits and (len(digits) > 4 or int(digits) > MAX_FACTORIAL):
            return True
        if j < i and "^" in text[max(0, j - 40) : i]:  # (10^{6})! and friends
            return True
    return False


def find_bomb(answer: str, gold: str) -> Bomb | None:
    """The first bomb pattern in ``answer`` that ``gold`` does not share, else ``None``."""
    if tower_height(answer) >= 3 and tower_height(gold) < 3:
        return "power_tower"
    if _has_huge_exponent(answer) and not _has_huge_exponent(gold):
        return "huge_exponent"
    if _has_huge_factorial(answer) and not _has_huge_factorial(gold):
        return "huge_factorial"
    return None
