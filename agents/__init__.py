"""Policies, chat formatting, the rollout loop and trajectory records.

Heavy dependencies (torch, transformers, peft) load only when a name that needs them is first
used, so ``import veriloop.agents`` stays cheap.
"""

from __future__ import annotations

import importlib
from typing import Any

from veriloop.envs._package_name import require_package_name

require_package_name(__name__, "agents")  # the folder agents/ is the package veriloop.agents

# public name -> module (relative to veriloop.agents) that defines it
_EXPORTS = {
    "Policy": "policy",
    "LoraSettings": "loading",
    "load_policy": "loading",
    "save_policy": "loading",
    "build_policy": "loading",
    "default_model_path": "models.text",
    "encode_vision_messages": "vision",
    "TurnRecord": "trajectory",
    "Trajectory": "trajectory",
    "token_logprobs": "forward",
    "rollout": "engine",
    "EpisodeSpec": "engine",
    "RolloutLimits": "engine",
    "SamplingParams": "sampling_params",
    "ScriptedPolicy": "scripted",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'veriloop.agents' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"veriloop.agents.{_EXPORTS[name]}"), name)
    globals()[name] = value
    return value
