""" "Find all" answers: a gold of several values and an answer that lists them.

**The rule.** When the gold holds several values -- a set ``\\{1, 2\\}``, a bare list ``1, 2``, or
several boxes ``\\boxed{1}\\boxed{2}`` -- the answer may list values in any order, separated by
commas, semicolons, ``or`` or ``and`` (plain or in ``\\text{}``), each optionally written as
``x = 1``, with or without set braces: ``x=1 \\text{ or } x=2`` and ``2, 1`` both mean
``\\{1, 2\\}``. Both sides are then compared as sets by math-verify, so a missing or an extra value
is wrong (listing more values is no hedge that pays). When the gold is one value, such a list is
still a hedge (:mod:`.screen`). A tuple ``(1, 2)`` or an interval ``[1, 2)`` gold is not a set: it
keeps its own shape.

Linear-time scans only; the answer is already capped in size and nesting (:mod:`.extract`).
"""

from __future__ import annotations

import re

from veriloop.envs.verifiers.extract import BOX_COMMANDS, _group_close

MAX_MEMBERS = 32
_WORD_SEPARATORS = re.compile(
    r"\\(?:text|textrm|mathrm|mbox)\{\s*(?:or|and)\s*\}|\s(?:or|and)\s|\\(?:quad|qquad)", re.IGNORECASE
)
_SET_BRACES = (("\\left\\{", "\\right\\}"), ("\\{", "\\}"))
_NAME_EQUALS = re.compile(r"^\s*[A-Za-z](?:_\{?\w+\}?)?\s*=\s*")
_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}(?!\d))|\{,\}")


def boxed_contents(text: str) -> list[str]:
    """The contents of every complete ``\\boxed{...}``/``\\fbox{...}`` in ``text``, in order."""
    found: list[tuple[int, str]] = []
    for command in BOX_COMMANDS:
        start = text.find(command)
        while start >= 0:
            brace = start + len(command)
            if text.startswith("{", brace):
                close = _group_close(text, brace, len(text))
                if close >= 0:
                    found.append((start, text[brace + 1 : close].strip()))
            start = text.find(command, start + 1)
    return [content for _, content in sorted(found)]


def _top_level_split(text: str) -> list[str]:
    parts, depth, begin = [], 0, 0
    for i, ch in enumerate(text):
        if ch in "{([":
            depth += 1
        elif ch in "})]":
            depth -= 1
        elif ch in ",;" and depth == 0:
            parts.append(text[begin:i])
            begin = i + 1
    parts.append(text[begin:])
    return parts


def _strip_set_braces(text: str) -> str:
    text = text.strip()
    for open_, close in _SET_BRACES:
        if text.startswith(open_) and text.endswith(close):
            return text[len(open_) : -len(close)].strip()
    return text


def members(text: str) -> list[str] | None:
    """The values ``text`` lists under the rule of the module docstring, ``None`` when it lists none
    or more than :data:`MAX_MEMBERS`. One value gives a one-item list."""
    text = _THOUSANDS.sub("", _WORD_SEPARATORS.sub(",", _strip_set_braces(text)))
    values = [_NAME_EQUALS.sub("", part).strip() for part in _top_level_split(text)]
    values = [v for v in values if v]
    return values if 0 < len(values) <= MAX_MEMBERS else None


def gold_members(gold: str) -> list[str] | None:
    """The values of a gold that holds several (set, bare list or several boxes), else ``None``."""
    boxes = boxed_contents(gold)
    if len(boxes) > 1:
        return boxes
    text = gold.strip()
    if text[:1] in "([" and not text.startswith("\\{"):  # a tuple or an interval keeps its shape
        return None
    found = members(text)
    return found if found is not None and len(found) > 1 else None


def as_set(values: list[str]) -> str:
    """LaTeX for the set of ``values``: ``\\{1, 2\\}``."""
    return "\\{" + ", ".join(values) + "\\}"
