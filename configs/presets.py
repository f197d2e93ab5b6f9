"""Algorithm presets: ``configs/algos/<name>.yaml`` files read into ``AlgoConfig``.

Presets ship as package data of ``veriloop.configs``; a preset is a flat mapping of AlgoConfig
fields. Unknown preset names and unknown keys fail with the closest valid name.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.resources
from typing import Any

import yaml

from veriloop.configs.algo import AlgoConfig


def _presets_dir() -> Any:
    return importlib.resources.files("veriloop.configs") / "algos"


def list_presets() -> list[str]:
    """Names of the shipped algorithm presets, sorted."""
    return sorted(p.name[: -len(".yaml")] for p in _presets_dir().iterdir() if p.name.endswith(".yaml"))


def _did_you_mean(name: str, choices: list[str]) -> str:
    close = difflib.get_close_matches(name, choices, n=1)
    return f" Did you mean {close[0]!r}?" if close else ""


def config_from_mapping(data: dict[str, Any], *, source: str = "mapping") -> AlgoConfig:
    """Build and validate an AlgoConfig from a flat mapping; unknown keys raise with a suggestion."""
    fields = [f.name for f in dataclasses.fields(AlgoConfig)]
    for key in data:
        if key not in fields:
            raise ValueError(f"{source}: unknown AlgoConfig key {key!r}.{_did_you_mean(str(key), fields)}")
    cfg = AlgoConfig(**data)
    cfg.validate()
    return cfg


def load_preset(name: str, **overrides: Any) -> AlgoConfig:
    """Load ``configs/algos/<name>.yaml`` as an AlgoConfig, with optional field overrides.

    Example: ``load_preset("dapo", overlong_max_len=512, overlong_cache_len=128)``.
    """
    names = list_presets()
    if name not in names:
        raise ValueError(
            f"unknown algorithm preset {name!r}.{_did_you_mean(name, names)} Available: {', '.join(names)}"
        )
    text = (_presets_dir() / f"{name}.yaml").read_text(encoding="utf-8")
    data = yaml.safe_load(text) or {}
    if not isinstance(data, dict):
        raise ValueError(
            f"preset {name!r} must be a flat mapping of AlgoConfig fields, got {type(data).__name__}"
        )
    return config_from_mapping({**data, **overrides}, source=f"preset {name!r}")
