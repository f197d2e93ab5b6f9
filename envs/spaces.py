"""Spaces for language-model environments.

Gymnasium's :class:`~gymnasium.spaces.Text` only contains strings made of a fixed character set
(alphanumerics by default). Model responses and verifier feedback contain arbitrary unicode
(LaTeX, ``×``, ``♠``, CJK, emoji), so veriloop's environments use :class:`UnicodeText`.
"""

from __future__ import annotations

import string
from typing import Any

import numpy as np
from gymnasium.spaces import Text

#: Characters used by :meth:`UnicodeText.sample`: printable ASCII without the control whitespace.
SAMPLE_CHARSET = string.ascii_letters + string.digits + string.punctuation + " "


class UnicodeText(Text):
    """Any Python ``str`` whose length lies in ``[min_length, max_length]``.

    ``contains`` accepts every unicode character; ``sample`` draws printable ASCII
    (:data:`SAMPLE_CHARSET`), which is enough for ``check_env`` and for fuzzing an env.

    Example:
        >>> space = UnicodeText(max_length=10)
        >>> "x = ½ ♠" in space, "a" * 11 in space, 3 in space
        (True, False, False)
    """

    def __init__(self, max_length: int, *, min_length: int = 0, seed: Any = None) -> None:
        super().__init__(max_length, min_length=min_length, charset=SAMPLE_CHARSET, seed=seed)

    def contains(self, x: Any) -> bool:
        """True for a ``str`` with ``min_length <= len(x) <= max_length``; any characters allowed."""
        return isinstance(x, str) and self.min_length <= len(x) <= self.max_length

    def sample(self, mask: Any = None, probability: Any = None) -> str:
        """Printable text; lengths up to ``min(max_length, 256)`` keep samples cheap."""
        if mask is not None or probability is not None:
            return super().sample(mask=mask, probability=probability)
        upper = max(self.min_length, min(self.max_length, 256))
        length = int(self.np_random.integers(self.min_length, upper + 1))
        chars = self.np_random.choice(np.array(list(SAMPLE_CHARSET)), size=length)
        return "".join(chars.tolist())

    def __repr__(self) -> str:
        return f"UnicodeText({self.min_length}, {self.max_length})"

    def __eq__(self, other: Any) -> bool:
        return (
            isinstance(other, UnicodeText)
            and self.min_length == other.min_length
            and self.max_length == other.max_length
        )

    def __hash__(self) -> int:
        return hash(("UnicodeText", self.min_length, self.max_length))
