"""Finding the final answer in a model response, in linear time and constant extra memory.

Model output is hostile, so every scan here is a single pass: ``str.rfind`` walks from the end, and
brace matching uses one character-class regular expression (``\\.|[{}]``: fixed-length alternatives,
nothing to backtrack) that visits only backslashes and braces. No scan builds a table proportional to
the text, and nothing is sliced out of it before its size is known. Nothing is parsed as mathematics
here: that happens in the sandboxed workers (:mod:`.pool`).

Rules (shared by the math and Points24 verifiers):

* Thinking: if the response contains ``</think>``, only the text after the LAST ``</think>`` counts; a
  ``<think>`` that is opened and never closed (after the last ``</think>``) means there is no answer.
* Anchors: the final answer is the content of the LAST complete anchor, i.e. ``\\boxed{...}`` or
  ``\\fbox{...}`` (balanced braces, escaped ``\\{``/``\\}`` skipped) or ``<answer>...</answer>``.
  "Last" means the anchor that starts latest, so ``<answer>\\boxed{3}</answer>`` yields ``3``.
  An anchor that never closes (e.g. a truncated ``\\boxed{``) is ignored.
* Size: the cap that judges an answer is on the ANSWER (:data:`MAX_ANSWER_CHARS`), so reasoning of any
  length before it is fine. The whole response only meets :data:`MAX_RESPONSE_CHARS`, a resource bound
  far above any generation length that keeps the worst in-process scan under ~0.1 s.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

MAX_RESPONSE_CHARS = 1_000_000
"""Resource bound: responses longer than this (~250k tokens) are judged ``"too_long"`` unscanned."""
MAX_ANSWER_CHARS = 1_000
"""Extracted answers longer than this are judged wrong (reason ``"too_long"``)."""
MAX_NESTING = 12
"""Deepest allowed bracket nesting (``{``, ``(``, ``[`` together) inside an extracted answer."""
MAX_BARE_BRACES = 8
"""Deepest allowed nesting of bare ``{...}`` groups (not the argument of a command, a script or
another group: ``{{{1}}}``). math-verify's time doubles with each such level (about 1 s at 10,
5 s at 12, 17 s at 14 on one core), while ``\\frac``/``\\sqrt`` arguments and parentheses
nest cheaply."""

BOX_COMMANDS = ("\\boxed", "\\fbox")
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
ANSWER_OPEN, ANSWER_CLOSE = "<answer>", "</answer>"
_BRACE_TOKENS = re.compile(r"\\.|[{}]", re.DOTALL)  # an escape pair (skipped) or a brace

ExtractStatus = Literal["ok", "no_answer", "too_long", "too_deep"]
Span = tuple[int, int, int]
"""``(anchor start, content start, content end)``: offsets into the response."""


@dataclass(frozen=True)
class Extraction:
    """Result of looking for the final answer.

    Attributes:
        status: ``"ok"`` when an answer was found and passed the size guards.
        answer: The stripped anchor content (``None`` when nothing usable was found).
        start: Offset of the anchor in the response (``-1`` when none).
    """

    status: ExtractStatus
    answer: str | None = None
    start: int = -1


def answer_region(text: str) -> int | None:
    """Offset where the answer may start (after the last ``</think>``), ``None`` if thinking never closed."""
    last_close = text.rfind(THINK_CLOSE)
    last_open = text.rfind(THINK_OPEN)
    if last_open > last_close:
        return None
    return last_close + len(THINK_CLOSE) if last_close >= 0 else 0


def _group_close(text: str, open_: int, end: int) -> int:
    """Offset of the ``}`` closing the ``{`` at ``open_``, searching before ``end``; ``-1`` if none."""
    depth = 1
    for token in _BRACE_TOKENS.finditer(text, open_ + 1, end):
        ch = token.group()
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return token.start()
    return -1


def _box_starts(text: str, lo: int) -> list[int]:
    """Offsets of ``\\boxed``/``\\fbox`` at or after ``lo``, latest first (one ``rfind`` walk each)."""
    starts: list[int] = []
    for command in BOX_COMMANDS:
        end = len(text)
        while (i := text.rfind(command, lo, end)) >= 0:
            starts.append(i)
            end = i + len(command) - 1
    return sorted(starts, reverse=True)


def last_boxed(text: str, lo: int = 0) -> Span | None:
    """Span of the last complete ``\\boxed{...}`` / ``\\fbox{...}`` starting at or after ``lo``.

    Candidates are tried latest first. When one never closes, an earlier one can only close before it
    starts (its group would otherwise have to close inside the unclosed one), so each candidate's
    brace scan stops where the previous candidate begins: all scans together cover the text once.
    """
    bound = len(text)
    for i in _box_starts(text, lo):
        j = i + (len(BOX_COMMANDS[0]) if text.startswith(BOX_COMMANDS[0], i) else len(BOX_COMMANDS[1]))
        while j < bound and text[j] == " ":
            j += 1
        if j < bound and text[j] == "{":
            close = _group_close(text, j, bound)
            if close >= 0:
                return i, j + 1, close
        bound = i
    return None


def last_answer_tag(text: str, lo: int = 0) -> Span | None:
    """Span of the last complete ``<answer>...</answer>`` pair starting at or after ``lo``."""
    close = text.rfind(ANSWER_CLOSE, lo)
    if close < 0:
        return None
    open_ = text.rfind(ANSWER_OPEN, lo, close)
    if open_ < 0:
        return None
    return open_, open_ + len(ANSWER_OPEN), close


def final_anchor(text: str, lo: int = 0) -> Span | None:
    """The span of the anchor that starts latest (boxed or answer tag), ``None`` if neither exists."""
    found = [s for s in (last_boxed(text, lo), last_answer_tag(text, lo)) if s is not None]
    return max(found) if found else None


def read_span(text: str, span: Span, limit: int) -> str | None:
    """The stripped content of ``span``; ``None`` when it is longer than ``limit`` characters.

    Up to ``limit`` characters of surrounding whitespace are tolerated before anything is copied, so
    a hostile megabyte inside one anchor is never sliced out.
    """
    _, start, end = span
    if end - start > 2 * limit:
        return None
    content = text[start:end].strip()
    return content if len(content) <= limit else None


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


def bare_brace_depth(text: str) -> int:
    """Deepest nesting of bare ``{`` groups: a ``{`` is bare unless the character before it (spaces
    skipped) ends a command name or is ``}``, ``]``, ``^`` or ``_`` (an argument or a script)."""
    stack: list[bool] = []
    bare = deepest = 0
    last = ""
    for ch in text:
        if ch == "{":
            is_bare = not (last.isalpha() or last in ("}", "]", "^", "_"))
            stack.append(is_bare)
            bare += is_bare
            deepest = max(deepest, bare)
        elif ch == "}" and stack:
            bare -= stack.pop()
        if ch != " ":
            last = ch
    return deepest


def malformed_latex(text: str) -> str | None:
    """Why ``text`` (a gold answer) cannot be well-formed LaTeX, or ``None`` if nothing is wrong.

    Structural checks only, linear time: unbalanced unescaped braces (``\\frac{``, ``3}``), a dangling
    backslash and an odd number of unescaped ``$``. A gold that fails these parses to nothing in
    math-verify, so every answer to it would score as wrong.
    """
    depth = 0
    for token in _BRACE_TOKENS.finditer(text):
        ch = token.group()
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth < 0:
                return f"a '}}' at offset {token.start()} closes no '{{'"
    if depth > 0:
        return f"{depth} '{{' never closed"
    trailing = len(text) - len(text.rstrip("\\"))
    if trailing % 2 == 1:
        return "it ends in a lone backslash"
    dollars = text.count("$") - text.count("\\$")
    if dollars % 2 == 1:
        return "an unmatched '$'"
    return None


def extract(response: str) -> Extraction:
    """Find the final math answer in ``response`` and apply the size guards to it.

    Returns an :class:`Extraction` whose ``status`` is ``"too_long"`` (the answer is over
    :data:`MAX_ANSWER_CHARS`, or the response over the resource bound :data:`MAX_RESPONSE_CHARS`),
    ``"no_answer"`` (no anchor, unclosed thinking, or an empty anchor), ``"too_deep"`` (bracket
    nesting over :data:`MAX_NESTING`, or bare braces over :data:`MAX_BARE_BRACES`) or ``"ok"``.
    """
    if len(response) > MAX_RESPONSE_CHARS:
        return Extraction("too_long")
    lo = answer_region(response)
    span = None if lo is None else final_anchor(response, lo)
    if span is None:
        return Extraction("no_answer")
    start = span[0]
    answer = read_span(response, span, MAX_ANSWER_CHARS)
    if answer is None:
        return Extraction("too_long", start=start)
    if len(answer) >= 2 and answer[0] == "$" and answer[-1] == "$":
        answer = answer.strip("$").strip()
    if not answer:
        return Extraction("no_answer", start=start)
    if nesting_depth(answer) > MAX_NESTING or bare_brace_depth(answer) > MAX_BARE_BRACES:
        return Extraction("too_deep", answer, start)
    return Extraction("ok", answer, start)


def extract_answer(response: str) -> str | None:
    """The final answer of a math response (see module docstring), or ``None`` if there is none.

    >>> extract_answer("<think>maybe \\\\boxed{2}</think> so \\\\boxed{\\\\frac{1}{2}}")
    '\\\\frac{1}{2}'
    """
    found = extract(response)
    return found.answer if found.status == "ok" else None
