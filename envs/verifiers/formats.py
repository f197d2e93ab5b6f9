"""Response-format checks shared by environments and reward shaping (pure Python, linear time)."""

from __future__ import annotations


def r1_format_ok(response: str) -> bool:
    """True when the response is exactly ``<think>…</think>`` then ``<answer>…</answer>``.

    The same language as the regex ``\\s*<think>.*?</think>\\s*<answer>.*?</answer>\\s*`` (DOTALL,
    full match): whitespace may surround the blocks, and either block may contain anything. Decided
    in one linear pass: that regex backtracks over every ``</think>`` and ``</answer>`` pair, which
    takes minutes on a hostile megabyte.
    """
    text = response.strip()
    if not (text.startswith("<think>") and text.endswith("</answer>")):
        return False
    answer_end = len(text) - len("</answer>")  # the final </answer> closes the answer block
    close = text.find("</think>", len("<think>"))
    while close >= 0:
        after = rest = close + len("</think>")
        while rest < answer_end and text[rest].isspace():  # runs after different </think> are disjoint
            rest += 1
        if text.startswith("<answer>", rest) and rest + len("<answer>") <= answer_end:
            return True
        close = text.find("</think>", after)
    return False
