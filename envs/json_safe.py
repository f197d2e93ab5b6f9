"""Values made ready for JSON, in one place for every floor (``veriloop.envs`` imports nothing of
the packages above it, so all of them may import this).

``jsonable`` keeps what an environment put in ``info`` as close to itself as JSON allows: objects
with ``to_dict`` (a ``Verdict``) become dicts, mappings dicts with string keys, tuples lists,
numpy / torch values Python numbers or lists; anything else is left as it is.
"""

from __future__ import annotations

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
