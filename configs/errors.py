"""The error every configuration check raises."""

from __future__ import annotations


class ConfigError(ValueError):
    """An invalid configuration; the message names the key, the problem and the fix."""
