"""The verdict every verifier returns.

A verdict separates three outcomes that RL code must never confuse:

* the answer is right (``correct=True``);
* the answer is wrong or malformed (``correct=False``, ``error=None``, ``reason`` says why);
* the verifier itself failed (``error`` is set: ``"timeout"``, ``"memory"`` or ``"crash"``). Such a verdict is *not* a wrong answer: trainers exclude it from
  baselines and count it in metrics.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Literal

VerifierError = Literal["timeout", "memory", "crash"]


@dataclass(frozen=True)
class Verdict:
    """Outcome of checking one model response.

    Attributes:
        correct: True only when the answer was checked and is right.
        error: Set only when the verifier failed (timeout, memory, crash);
            ``None`` whenever the response was actually judged.
        feedback: The message shown to the model as the next observation.
        parsed: The extracted final answer (or formula), ``None`` when nothing was found.
        reason: Short machine-readable category, e.g. ``"correct"``, ``"wrong_value"``,
            ``"no_answer"``, ``"hedged"``, ``"unevaluated"``, ``"unparseable"``, ``"illegal_numbers"``,
            ``"verifier_error"``.
        details: Extra task-specific facts (e.g. the value a formula evaluated to).
    """

    correct: bool
    error: VerifierError | None = None
    feedback: str = ""
    parsed: str | None = None
    reason: str = ""
    details: Mapping[str, Any] = field(default_factory=dict)

    @property
    def failed(self) -> bool:
        """True when the verifier could not judge the response (see ``error``)."""
        return self.error is not None

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form, used in episode logs."""
        out = asdict(self)
        out["details"] = dict(self.details)
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Verdict:
        """The inverse of :meth:`to_dict` (e.g. a verdict that came over the wire as JSON); missing
        fields take their defaults, unknown ones are an error."""
        unknown = set(data) - {f.name for f in fields(cls)}
        if unknown:
            raise ValueError(
                f"not Verdict fields: {sorted(unknown)}; expected a subset of {[f.name for f in fields(cls)]}"
            )
        return cls(**{"correct": False, **data, "details": dict(data.get("details") or {})})
