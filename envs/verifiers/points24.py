"""The Points24 (GeneralPoints) verifier: does the formula reach the target using each card once?

Where the formula is looked for (after the ``<think>`` rule of :mod:`.extract`; the candidate that
starts LAST in the text wins):

* a JSON object with a ``"formula"`` key (GeneralPoints' output format), optionally with ``"cards"``;
* ``<answer>...</answer>`` or ``\\boxed{...}``;
* failing all of these, the last non-empty line, if it is made of formula characters only.

A candidate may end in ``= 24`` (or start with ``24 =``), with one ``=``: ``==``, ``===``, a dangling
``=`` or a chain is ``"unparseable"``. Several candidate expressions in the final answer (``3*8 or
4*6``, ``3*8, 4*6``, ``3*8 = 4*6``) -> ``"hedged"``. Reasoning of any length may come before the
answer; the size cap is on the formula (:data:`.formula.MAX_FORMULA_CHARS`), and the whole response
only meets the resource bound :data:`.extract.MAX_RESPONSE_CHARS`. The formula grammar and its safe,
exact evaluation live in :mod:`.formula`.

Reasons, checked in this order: ``too_long`` (response over the cap), ``no_answer``, ``hedged``,
``unparseable`` (outside the grammar), ``division_by_zero`` (a wrong answer, not a verifier failure),
``wrong_cards`` (the JSON ``"cards"`` field does not match the cards dealt; ``J``/``Q``/``K`` may stand
for 10 or for 11/12/13, ``A`` for 1), ``illegal_numbers`` (the formula's numbers are not exactly the
dealt multiset), ``wrong_value``, ``correct``. Rewards per reason are the environment's business.

``details``: ``value`` (exact, as a string fraction), ``numbers_used``, ``cards_seen`` (the JSON
``"cards"`` field as upper-case strings, ``None`` if absent; for recognition accuracy) and ``source``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from veriloop.envs.verifiers import stats
from veriloop.envs.verifiers.extract import (
    MAX_RESPONSE_CHARS,
    answer_region,
    last_answer_tag,
    last_boxed,
    read_span,
)
from veriloop.envs.verifiers.formula import (
    ALLOWED_CHARS,
    MAX_FORMULA_CHARS,
    Evaluated,
    FormulaError,
    evaluate,
    normalise,
    show_number,
)
from veriloop.envs.verifiers.verdict import Verdict

MAX_JSON_CHARS = 4_000
MAX_CARDS = 16
_FACE_VALUES = {"A": {1}, "ACE": {1}, "J": {11, 10}, "Q": {12, 10}, "K": {13, 10}}
_HEDGE_SEPARATORS = (" or ", " OR ", " and ", ",", ";", "\n")
_LINE_CHARS = ALLOWED_CHARS | set("=|.^")  # a bare last line "looks like a formula attempt"
NO_FORMULA_FEEDBACK = 'No formula found: answer with {"cards": [...], "formula": "..."}.'


_DECODER = json.JSONDecoder()


def _json_candidate(text: str, lo: int) -> tuple[int, str, list[str] | None] | None:
    """(start, formula, cards_seen) from the flat JSON object holding the last ``"formula"`` key.

    The object is decoded from the nearest ``{`` before the key (``raw_decode``: one linear pass over
    at most :data:`MAX_JSON_CHARS`); if that fails (single quotes, trailing commas...), the string
    value after the key is read by hand, and so is a ``"cards"`` list (:func:`_cards_by_hand`): a
    malformed object never skips the cards check.
    """
    key = text.rfind('"formula"', lo)
    if key < 0:
        return None
    opener = text.rfind("{", max(lo, key - MAX_JSON_CHARS), key)
    if opener >= 0:
        try:
            obj, _ = _DECODER.raw_decode(text[opener : opener + MAX_JSON_CHARS])
        except (ValueError, RecursionError):
            obj = None
        if isinstance(obj, dict) and isinstance(obj.get("formula"), str):
            return opener, obj["formula"], _cards_seen(obj.get("cards"))
    rest = text[key + len('"formula"') : key + MAX_JSON_CHARS].lstrip(" \t\n:").lstrip()
    close = rest.find('"', 1)
    if not rest.startswith('"') or close < 0:
        return None
    start = opener if opener >= 0 else key
    return start, rest[1:close], _cards_by_hand(text[start : key + MAX_JSON_CHARS])


def _cards_by_hand(region: str) -> list[str] | None:
    """The ``"cards"`` list of an object that is not valid JSON, read leniently (quotes optional, a
    trailing comma ignored); ``None`` without a ``"cards"`` key; ``["?"]`` (matching no deal) when
    the key is there but no list can be read."""
    key = max(region.find('"cards"'), region.find("'cards'"))
    if key < 0:
        return None
    rest = region[key + len('"cards"') :].lstrip(" \t\n:").lstrip()
    close = rest.find("]")
    if not rest.startswith("[") or close < 0:
        return ["?"]
    labels = [item.strip().strip("\"'").strip() for item in rest[1:close].split(",")]
    return _cards_seen([label for label in labels if label]) or ["?"]


def _cards_seen(field: Any) -> list[str] | None:
    if not isinstance(field, list) or len(field) > MAX_CARDS:
        return None
    return [str(c).strip().upper()[:8] for c in field]


def _last_line(text: str, lo: int) -> str | None:
    end = len(text)
    while end > lo:
        start = max(lo, text.rfind("\n", lo, end) + 1)
        if end - start > 2 * MAX_JSON_CHARS:  # a huge last line is no formula: never copy it
            return None
        line = text[start:end].strip()
        if line:
            marked = normalise(line)
            for sep in _HEDGE_SEPARATORS:
                marked = marked.replace(sep, "|")
            return line if marked and not set(marked) - _LINE_CHARS else None
        end = start - 1
    return None


def find_formula(response: str) -> tuple[str, str, list[str] | None] | None:
    """(source, formula text, cards_seen) of the final answer, ``None`` if there is none."""
    lo = answer_region(response)
    if lo is None:
        return None
    found: list[tuple[int, str, str, list[str] | None]] = []
    js = _json_candidate(response, lo)
    if js is not None:
        found.append((js[0], "json", js[1], js[2]))
    for source, span in (("answer", last_answer_tag(response, lo)), ("boxed", last_boxed(response, lo))):
        if span is not None:
            content = read_span(response, span, MAX_FORMULA_CHARS)
            if content is None:  # over-long: keep a cut copy, which the formula screen rejects
                content = response[span[1] : span[1] + MAX_FORMULA_CHARS + 1]
            found.append((span[0], source, content, None))
    if found:
        _, source, formula, cards = max(found, key=lambda c: c[0])
        return source, formula, cards
    line = _last_line(response, lo)
    return None if line is None else ("line", line, None)


def _single_expression(formula: str, target: int) -> tuple[str | None, str]:
    """``(expression, "")`` for the one expression in ``formula``, else ``(None, reason)``.

    Accepted: ``EXPR``, ``EXPR = target`` and ``target = EXPR``. Several candidates (``3*8 or 4*6``,
    ``3*8 = 4*6``) are ``"hedged"``; any other use of ``=`` (``==``, ``===``, a dangling ``=``, a
    chain ``EXPR = 24 = 24``) is ``"unparseable"``: only the documented format passes.
    """
    if "=" not in formula and not any(sep in formula for sep in _HEDGE_SEPARATORS):
        return formula, ""  # fast path: the common case
    marked = formula
    for sep in _HEDGE_SEPARATORS:
        marked = marked.replace(sep, "|")
    if len([p for p in marked.split("|") if p.strip()]) > 1:
        return None, "hedged"
    sides = [s.strip() for s in formula.split("=")]
    if len(sides) == 1:
        return sides[0], ""
    exprs = [s for s in sides if s != str(target)]
    if len(exprs) > 1 and all(exprs):
        return None, "hedged"
    if len(sides) != 2 or not all(sides):
        return None, "unparseable"
    return (exprs[0] if exprs else str(target)), ""


def cards_match(seen: Sequence[str], cards: Sequence[int]) -> bool:
    """True when the labels ``seen`` can be read as exactly the multiset ``cards``.

    Digit labels must equal the value; ``A`` is 1; ``J``/``Q``/``K`` are 11/12/13 or 10 (both rules).
    """
    if len(seen) != len(cards):
        return False
    if all(label.isdigit() and label.isascii() for label in seen):  # fast path: no face cards
        return sorted(int(label) for label in seen) == sorted(cards)
    remaining = list(cards)
    faces: list[set[int]] = []
    for label in seen:
        if label.isdigit() and label.isascii():
            if int(label) not in remaining:
                return False
            remaining.remove(int(label))
        elif label in _FACE_VALUES:
            faces.append(_FACE_VALUES[label])
        else:
            return False
    for options in sorted(faces, key=len):
        own = [v for v in sorted(options, reverse=True) if v in remaining]  # prefer 11/12/13 over 10
        if not own:
            return False
        remaining.remove(own[0])
    return not remaining


def _verdict(ok: bool, reason: str, feedback: str, parsed: str | None, **details: Any) -> Verdict:
    return Verdict(correct=ok, feedback=feedback, parsed=parsed, reason=reason, details=details)


def _judge(done: Evaluated, cards: list[int], target: int, expr: str, details: dict[str, Any]) -> Verdict:
    value = done.value
    shown = show_number(value)
    details["value"] = shown
    details["numbers_used"] = list(done.numbers)
    seen = details.get("cards_seen")
    if seen is not None and not cards_match(seen, cards):
        return _verdict(
            False, "wrong_cards", "The cards you listed do not match the cards dealt.", expr, **details
        )
    if sorted(done.numbers) != sorted(cards):
        msg = f"You must use exactly the numbers {sorted(cards)}: you used {sorted(done.numbers)}."
        return _verdict(False, "illegal_numbers", msg, expr, **details)
    if done.value != target:
        msg = f"Your formula evaluates to {shown}, not {target}."
        return _verdict(False, "wrong_value", msg, expr, **details)
    return _verdict(True, "correct", "Correct!", expr, **details)


def check_points24(response: str, cards: Sequence[int], target: int = 24) -> Verdict:
    """Check a Points24 response (rules and reasons in the module docstring).

    Args:
        response: The model's full response text.
        cards: The numeric values of the dealt cards, e.g. ``[1, 10, 10, 13]``.
        target: The value the formula must reach.

    Returns:
        A :class:`Verdict` whose ``parsed`` is the formula (``None`` if none was found).
    """
    stats.count("checks", "points24_checks")
    card_list = [int(c) for c in cards]
    if len(response) > MAX_RESPONSE_CHARS:
        msg = f"Your response is too long ({len(response)} characters; the limit is {MAX_RESPONSE_CHARS})."
        return _verdict(False, "too_long", msg, None)
    found = find_formula(response)
    if found is None or not found[1].strip():
        return _verdict(False, "no_answer", NO_FORMULA_FEEDBACK, None)
    source, raw, seen = found
    details: dict[str, Any] = {"source": source, "cards_seen": seen}
    raw = raw.strip()
    expr, problem = _single_expression(normalise(raw), target)
    if problem == "hedged":
        return _verdict(
            False, "hedged", "Give exactly one formula: yours offers several candidates.", raw, **details
        )
    if expr is None:
        msg = f"Could not parse your formula: write it alone, or as FORMULA = {target}, with a single '='."
        return _verdict(False, "unparseable", msg, raw, **details)
    try:
        done = evaluate(expr)
    except FormulaError as exc:
        shown = raw if len(raw) <= 80 else raw[:80] + "..."
        return _verdict(
            False, "unparseable", f"Could not parse your formula {shown!r}: {exc}.", raw, **details
        )
    except ZeroDivisionError:
        return _verdict(False, "division_by_zero", "Your formula divides by zero.", expr, **details)
    return _judge(done, card_list, target, expr, details)
