"""Finding the final answer in a model response, in linear time and without regular expressions.

Model output is hostile, so every scan here is a single pass (or a backwards ``rfind`` walk whose total
work is bounded by the text length) over a text whose size the caller has already capped. Nothing is
parsed as mathematics here: that happens in the sandboxed workers (:mod:`.pool`).

Rules (shared by the math and Points24 verifiers):

* Thinking: if the response contains ``</think>``, only the text after the LAST ``</think>`` counts; a
  ``<think>`` that is opened and never closed (after the last ``</think>``) means there is no answer.
* Anchors: the final answer is the content of the LAST complete anchor, i.e. ``\\boxed{...}`` or
  ``\\fbox{...}`` (balanced braces, escaped ``\\{``/``\\}`` skipped) or ``<answer>...</answer>``.
  "Last" means the anchor that starts latest, so ``<answer>\\boxed{3}</answer>`` yields ``3``.
  An anchor that never closes (e.g. a truncated ``\\boxed{``) is ignored.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

MAX_RESPONSE_CHARS = 20_000
"""Responses longer than this are judged wrong (reason ``"too_long"``) without being scanned."""
MAX_ANSWER_CHARS = 1_000
"""Extracted answers longer than this are judged wrong (reason ``"too_long"``)."""
MAX_NESTING = 40
"""Deepest allowed bracket nesting (``{``, ``(``, ``[`` together) inside an extracted answer."""

BOX_COMMANDS = ("\\boxed", "\\fbox")
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
ANSWER_OPEN, ANSWER_CLOSE = "<answer>", "</answer>"

ExtractStatus = Literal["ok", "no_answer", "too_long", "too_deep"]


@dataclass(frozen=True)
class Extraction:
    """Result of looking for the final answer.

    Attributes:
        status: ``"ok"`` when an answer was found and passed the size guards.
        answer: The stripped anchor content (``None`` when nothing usable was found).
        start: Offset of the anchor in the post-thinking text (``-1`` when none).
    """

    status: ExtractStatus
    answer: str | None = None
    start: int = -1


def strip_thinking(text: str) -> str | None:
    """Return the part of ``text`` that may hold the answer, or ``None`` if thinking never closed."""
    last_close = text.rfind(THINK_CLOSE)
    last_open = text.rfind(THINK_OPEN)
    if last_open > last_close:
        return None
    if last_close >= 0:
        return text[last_close + len(THINK_CLOSE) :]
    return text


def match_braces(text: str) -> dict[int, int]:
    """Map the offset of every unescaped ``{`` that gets closed to the offset of its ``}``.

    A brace preceded by an odd number of backslashes (``\\{``) is literal LaTeX, not a group. One pass,
    O(len(text)) time and memory.
    """
    matches: dict[int, int] = {}
    stack: list[int] = []
    backslashes = 0
    for i, ch in enumerate(text):
        if ch == "\\":
            backslashes += 1
            continue
        escaped = backslashes % 2 == 1
        backslashes = 0
        if escaped:
            continue
        if ch == "{":
            stack.append(i)
        elif ch == "}" and stack:
            matches[stack.pop()] = i
    return matches


def last_boxed(text: str, braces: dict[int, int]) -> tuple[int, str] | None:
    """Start offset and content of the last complete ``\\boxed{...}`` / ``\\fbox{...}``, if any."""
    best: tuple[int, str] | None = None
    for command in BOX_COMMANDS:
        end = len(text)
        while True:
            i = text.rfind(command, 0, end)
            if i < 0:
                break
            j = i + len(command)
            while j < len(text) and text[j] == " ":
                j += 1
            if j < len(text) and text[j] == "{" and j in braces:
                if best is None or i > best[0]:
                    best = (i, text[j + 1 : braces[j]])
                break
            end = i + len(command) - 1
    return best


def last_answer_tag(text: str) -> tuple[int, str] | None:
    """Start offset and content of the last complete ``<answer>...</answer>`` pair, if any."""
    close = text.rfind(ANSWER_CLOSE)
    if close < 0:
        return None
    open_ = text.rfind(ANSWER_OPEN, 0, close)
    if open_ < 0:
        return None
    return open_, text[open_ + len(ANSWER_OPEN) : close]


def nesting_depth(text: str) -> int:
    """Deepest nesting of ``{([`` brackets in ``text`` (unbalanced closers are ignored)."""
    depth = deepest = 0
    for ch in text:
        if ch in "{([":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in "})]" and depth > 0:
            depth -= 1
    return deepest


def extract(response: str) -> Extraction:
    """Find the final math answer in ``response`` and apply the size guards.

    Returns an :class:`Extraction` whose ``status`` is ``"too_long"`` (response or answer over the
    caps), ``"no_answer"`` (no anchor, unclosed thinking, or an empty anchor), ``"too_deep"`` (bracket
    nesting over :data:`MAX_NESTING`) or ``"ok"``.
    """
    if len(response) > MAX_RESPONSE_CHARS:
        return Extraction("too_long")
    text = strip_thinking(response)
    if text is None:
        return Extraction("no_answer")
    candidates = [c for c in (last_boxed(text, match_braces(text)), last_answer_tag(text)) if c]
    if not candidates:
        return Extraction("no_answer")
    start, content = max(candidates)
    answer = content.strip()
    if len(answer) >= 2 and answer[0] == "$" and answer[-1] == "$":
        answer = answer.strip("$").strip()
    if not answer:
        return Extraction("no_answer", start=start)
    if len(answer) > MAX_ANSWER_CHARS:
        return Extraction("too_long", start=start)
    if nesting_depth(answer) > MAX_NESTING:
        return Extraction("too_deep", answer, start)
    return Extraction("ok", answer, start)


def extract_answer(response: str) -> str | None:
    """The final answer of a math response (see module docstring), or ``None`` if there is none.

    >>> extract_answer("<think>maybe \\\\boxed{2}</think> so \\\\boxed{\\\\frac{1}{2}}")
    '\\\\frac{1}{2}'
    """
    found = extract(response)
    return found.answer if found.status == "ok" else None
