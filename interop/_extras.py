"""Loud, lazy optional imports: a missing integration names the extra that installs it."""

from __future__ import annotations

import importlib
from types import ModuleType


class MissingExtraError(ImportError):
    """An optional integration was used without its extra installed."""


def require(module: str, extra: str, what: str) -> ModuleType:
    """Import ``module`` or raise :class:`MissingExtraError` naming ``pip install veriloop[extra]``.

    Args:
        module: The third-party module to import (``"openenv.core"``, ``"trl"`` ...).
        extra: veriloop's extra that installs it (``"openenv"``, ``"trl"`` ...).
        what: What needs it, for the message (``"veriloop/ReasoningGym-v0"``).
    """
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise MissingExtraError(
            f"{what} needs the optional package behind `{module}`, which is not installed "
            f"({exc}). Install it with: pip install 'veriloop[{extra}]'"
        ) from exc
