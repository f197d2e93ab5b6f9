"""Values made ready for JSON, in one place for every floor (``veriloop.envs`` imports nothing of
the packages above it, so all of them may import this).

``jsonable`` keeps what an environment put in ``info`` as close to itself as JSON allows: objects
with ``to_dict`` (a ``Verdict``) become dicts, mappings dicts with string keys, tuples lists,
numpy / torch values Python numbers or lists; anything else is left as it is.

``json_safe`` is strict: its result always passes ``json.dumps(..., allow_nan=False)`` (reports,
dataset rows, third-party task data): non-finite floats become ``None`` and any other object its
``str``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any


def jsonable(value: Any) -> Any:
    """A JSON-ready copy: numpy scalars/arrays become Python numbers/lists, dataclasses dicts."""
    if hasattr(value, "to_dict"):
        return jsonable(value.to_dict())
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if hasattr(value, "tolist"):  # numpy / torch
        return value.tolist()
    return value


def json_safe(value: Any) -> Any:
    """Strict JSON: ``nan`` / ``inf`` -> ``None``, mappings -> dicts with string keys, lists and
    tuples -> lists, numpy / torch values -> Python numbers or lists, any other object -> its ``str``."""
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    if hasattr(value, "tolist"):  # numpy / torch
        return json_safe(value.tolist())
    return str(value)
