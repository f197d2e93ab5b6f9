"""The records and helpers every generation backend shares: :class:`GenRequest`, :class:`GenResult`,
the :class:`Backend` and :class:`ServingBackend` protocols (the contract every backend keeps),
end-of-turn ids and stop strings. The backends themselves
(``hf``, ``vllm``, ``vllm_server``) import this module, never the package that picks one."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

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


@runtime_checkable
class Backend(Protocol):
    """What the rollout engine needs from a generation backend: the HF engine
    (:class:`~veriloop.agents.backends.hf.HFBackend`, which samples with the policy's own weights)
    and :class:`~veriloop.agents.scripted.ScriptedPolicy` are this and no more."""

    def generate(
        self, requests: Sequence[GenRequest], sampling: SamplingParams, generator: torch.Generator
    ) -> list[GenResult]:
        """One :class:`GenResult` per request, in order, sampled in one batched call."""
        ...

    def release(self, key: Hashable) -> None:
        """Forget any state kept for an episode (called when it ends)."""
        ...


@runtime_checkable
class ServingBackend(Backend, Protocol):
    """A backend with its own copy of the weights (vLLM in-process, or vLLM servers): the whole
    contract the trainer, the asynchronous worker and ``veriloop eval`` use, built by
    :func:`~veriloop.agents.backends.serving_backend`.

    ``sync`` loads the trained weights into it: merged into the full weights, or, when
    ``serves_adapter``, as a new adapter version named ``model_name``; the engine keeps the newest
    ``keep_adapters`` of them (asynchronous training sets K + 2), ``pin`` holds an episode's
    requests to the version it started with and one batch mixes at most ``adapter_slots()`` (None:
    the servers do not say). ``close`` frees the engine at the end of a run (it is unusable after).
    """

    serves_adapter: bool
    keep_adapters: int

    @property
    def model_name(self) -> str:
        """The weight version :meth:`sync` served last (an adapter's name, or the base model's)."""
        ...

    def sync(self) -> None:
        """Load the policy's current weights (call after every optimizer step)."""
        ...

    def close(self) -> None: ...

    def pin(self, key: Hashable, adapter: str) -> None:
        """Requests with ``key`` sample with the adapter version named ``adapter`` (still kept)."""
        ...

    def adapter_slots(self) -> int | None: ...


def protocol_members(protocol: type) -> set[str]:
    """The names a protocol class declares (its methods, properties and annotated attributes),
    with those of the protocols it extends."""
    names: set[str] = set()
    for cls in protocol.__mro__:
        if cls is object or cls is Protocol or not getattr(cls, "_is_protocol", False):
            continue
        names |= {n for n in vars(cls) if not n.startswith("_")} | set(getattr(cls, "__annotations__", {}))
    return names


def missing_members(cls: type, protocol: type) -> list[str]:
    """The members of ``protocol`` that ``cls`` neither defines nor annotates at class level
    (an attribute set in ``__init__`` is declared by its class-level annotation)."""
    declared: set[str] = set()
    for klass in cls.__mro__:
        declared |= set(vars(klass)) | set(getattr(klass, "__annotations__", {}))
    return sorted(protocol_members(protocol) - declared)


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
