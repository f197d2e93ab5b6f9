"""What a model's architecture allows veriloop's fast paths to do.

The HF engine's reuse of an episode's keys/values between turns, its shared prefill of a group's
prompt, and the trainer's packing of a micro-batch behind its shared prompt
(:mod:`veriloop.agents.forward`) all assume that every layer is attention: a token's state is its
keys and values, which a mask can hide or show. A recurrent layer (the Gated DeltaNet linear
attention of Qwen3.5 and Qwen3-Next, a Mamba or convolution block) instead carries one running
state through the sequence: a packed sequence would run one row's state into the next, and the
state after a turn is not a slice of per-token keys/values. For such models those paths are
switched off: each turn is prefilled afresh from the whole context (with the model's own cache,
which holds the recurrent states) and the trainer runs each row as its own sequence.
"""

from __future__ import annotations

import warnings
from typing import Any

#: Layer types (transformers' ``config.layer_types``) that attend through a mask over per-token keys.
ATTENTION_LAYER_TYPES = frozenset({"full_attention", "sliding_attention", "chunked_attention", "attention"})
#: Layer types without any cache of their own (a shared-KV layer, an MLP-only block).
STATELESS_LAYER_TYPES = frozenset({"dummy", "moe", "mlp"})


def _text_config(model: Any) -> Any:
    config = getattr(model, "config", None)
    get_text = getattr(config, "get_text_config", None)
    return get_text() if callable(get_text) else config


def recurrent_layer_types(model: Any) -> list[str]:
    """The distinct layer types of ``model`` (a transformers model, or a peft wrapper of one) that
    carry a recurrent state instead of per-token keys/values, e.g. ``["linear_attention"]`` for
    Qwen3.5; empty for a pure-attention model."""
    config = _text_config(model)
    types: list[str] = []
    for field in ("layer_types", "layers_block_type"):
        value = getattr(config, field, None)
        if isinstance(value, (list, tuple)):
            types += [str(t) for t in value]
    known = ATTENTION_LAYER_TYPES | STATELESS_LAYER_TYPES
    return sorted({t for t in types if t not in known})


def is_recurrent(model: Any) -> bool:
    """Whether any layer of ``model`` carries a recurrent state (see :func:`recurrent_layer_types`)."""
    return bool(recurrent_layer_types(model))


def family(model: Any) -> str:
    """The model's family as transformers names it (``config.model_type``, e.g. ``"qwen3_5_text"``)."""
    return str(getattr(_text_config(model), "model_type", None) or type(model).__name__)


_told: set[tuple[str, str]] = set()


def say_once(model: Any, where: str, what: str) -> None:
    """Warn once per process and (family, ``where``) that a slower path is taken, and why."""
    key = (family(model), where)
    if key in _told:
        return
    _told.add(key)
    layers = ", ".join(recurrent_layer_types(model))
    warnings.warn(f"{key[0]} has recurrent layers ({layers}): {where} {what}", stacklevel=3)
