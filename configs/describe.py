"""The configuration described for people: each field's documentation, parsed once from its class's
``Attributes:`` docstring section, and every setting as ``(dotted key, type, default, doc)`` for
``--help`` and the docs."""

from __future__ import annotations

import dataclasses
import re
import typing
from typing import Any, Literal


def field_docs(cls: type) -> dict[str, str]:
    """Parse the ``Attributes:`` section of a dataclass docstring into ``{field: doc}``.

    An entry is ``name: text`` (or ``a, b: text`` for fields sharing one text) indented one level
    under ``Attributes:``; more deeply indented lines continue it.
    """
    lines = (cls.__doc__ or "").expandtabs().splitlines()
    docs: dict[str, str] = {}
    inside, indent, names = False, None, []
    for line in lines:
        stripped = line.strip()
        if stripped == "Attributes:":
            inside = True
            continue
        if not inside or not stripped:
            continue
        depth = len(line) - len(line.lstrip())
        indent = depth if indent is None else indent
        if depth < indent:
            break
        entry = re.match(r"([A-Za-z_][\w, ]*):\s*(.*)", stripped) if depth == indent else None
        if entry:
            names = [n.strip() for n in entry.group(1).split(",")]
            for name in names:
                docs[name] = entry.group(2)
        else:
            for name in names:
                docs[name] += " " + stripped
    return docs


def type_name(tp: Any) -> str:
    """Readable type for help text: ``Literal`` choices joined by ``|``, ``X | None`` kept."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        return "|".join(str(a) for a in args)
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        return " | ".join(type_name(a) for a in args)
    if origin is not None:
        return f"{getattr(origin, '__name__', str(origin))}[{', '.join(type_name(a) for a in args)}]"
    if tp is type(None):
        return "None"
    return getattr(tp, "__name__", str(tp))


def describe(cls: type, prefix: str = "") -> list[tuple[str, str, Any, str]]:
    """``(dotted_key, type, default, doc)`` for every setting, nested sections flattened.

    Example: ``("rollout.group_size", "int", 8, "Samples (episodes) per problem; ...")``.
    """
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    rows: list[tuple[str, str, Any, str]] = []
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if isinstance(tp, type) and dataclasses.is_dataclass(tp):
            rows += describe(tp, prefix=f"{prefix}{f.name}.")
            continue
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if dataclasses.is_dataclass(default) or isinstance(default, dict):
            default = _plain(default)
        rows.append((prefix + f.name, type_name(tp), default, docs.get(f.name, "")))
    return rows


def _plain(value: Any) -> Any:
    """Dataclasses (also nested in dicts/lists) as plain dicts, for YAML and JSON."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value
