"""Named layouts of the benchmark files people have on disk: ``env.kwargs.preset=NAME`` sets the
field mapping (:class:`~veriloop.envs.datasets.FieldMap`) and checks the answers.

=========  ===========================================  ==========================================
preset     fields                                       answers
=========  ===========================================  ==========================================
math500    ``problem`` / ``answer`` (MATH-500's JSONL)  as written (LaTeX such as ``\\frac{1}{2}``)
gsm8k      ``question`` / ``answer``                    the text after the last ``####``
aime       ``problem`` / ``answer``                     an integer 0-999 (``"033"`` is 33)
boxed      ``problem`` / ``solution``                   the last ``\\boxed{...}`` of the solution
=========  ===========================================  ==========================================

So ``env.kwargs.data=math500.jsonl env.kwargs.preset=math500`` trains on (or, as an
``eval_splits`` entry with ``part: all``, evaluates on) MATH-500 as its file is laid out. An explicit
``question_key`` / ``answer_key`` / ``answer_extract`` that contradicts the preset is an error.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from veriloop.envs.datasets import Extract, FieldMap


@dataclass(frozen=True)
class Preset:
    """One file layout: its fields, how the answer is read, whether answers must be integers."""

    question_key: str
    answer_key: str
    answer_extract: Extract | None = None
    integer_answers: bool = False


PRESETS: dict[str, Preset] = {
    "math500": Preset("problem", "answer"),
    "gsm8k": Preset("question", "answer", "after_hashes"),
    "aime": Preset("problem", "answer", integer_answers=True),
    "boxed": Preset("problem", "solution", "last_boxed"),
}
#: FieldMap's own defaults: a key left at its default does not contradict a preset.
_DEFAULTS = FieldMap()


def preset_fields(
    preset: str | None, question_key: str, answer_key: str, answer_extract: Extract | None
) -> FieldMap:
    """The field mapping of ``preset`` (None: the keys as given); ``ValueError`` for an unknown
    preset or a key set to something else than the preset's."""
    if preset is None:
        return FieldMap(question_key, answer_key, answer_extract)
    if preset not in PRESETS:
        raise ValueError(f"preset must be one of {sorted(PRESETS)} (or unset), got {preset!r}")
    p = PRESETS[preset]
    given = {"question_key": question_key, "answer_key": answer_key, "answer_extract": answer_extract}
    for key, value in given.items():
        if value != getattr(_DEFAULTS, key) and value != getattr(p, key):
            raise ValueError(
                f"preset {preset!r} reads {key}={getattr(p, key)!r}, but {key}={value!r} was given: "
                f"drop {key} or the preset"
            )
    return FieldMap(p.question_key, p.answer_key, p.answer_extract)


def checked_answers(preset: str | None, problems: Sequence[Any], source: str) -> list[Any]:
    """``problems`` as the preset wants them: AIME answers as integers 0-999 (``"033"`` -> ``"33"``),
    ``ValueError`` naming the file and the question otherwise."""
    if preset is None or not PRESETS[preset].integer_answers:
        return list(problems)
    out = []
    for i, p in enumerate(problems):
        text = str(p.answer).strip()
        if not (text.isdigit() and 0 <= int(text) <= 999):
            raise ValueError(
                f"{source} problem {i + 1} ({p.question[:40]!r}...): preset {preset!r} wants an "
                f"integer answer 0-999, got {text[:40]!r}: use preset math500 or boxed for other answers"
            )
        out.append(dataclasses.replace(p, answer=str(int(text))))
    return out
