"""Generation through vLLM (GPU), with the same interface as the HF backend.

Install with ``pip install veriloop[vllm]`` (needs CUDA). vLLM is imported only when this backend
is built, so the rest of veriloop never needs it.

What this relies on (vLLM >= 0.10.2 public API; not runnable on the CPU machines where veriloop is
developed, so the tests in ``tests/agents/test_vllm_backend.py`` skip without CUDA + vLLM):

* ``LLM.generate(prompts=[TokensPrompt(prompt_token_ids=ids)], sampling_params=..., lora_request=...)``:
  token ids in, ``RequestOutput.outputs[0].token_ids`` / ``.logprobs`` / ``.finish_reason`` out.
  ``SamplingParams(logprobs=0)`` returns the log-prob of each sampled token only.
* Recorded log-probs: vLLM reports *raw* model log-probs by default. To record the log-probs of the
  distribution actually sampled from (veriloop's convention, see ``sampling_params``), build the
  ``LLM`` with ``logprobs_mode="processed_logprobs"`` (vLLM >= 0.10.2); this backend passes it
  when ``processed_logprobs=True`` (the default).
* Weight sync (:meth:`VLLMBackend.sync`; also once at start, since the policy may already differ
  from the checkpoint on disk, e.g. after an SFT warm-up):
  - LoRA: the adapter is saved to a fresh folder and a new ``LoRARequest(name, int_id, path)`` with
    a new name and id is used from then on (vLLM caches adapters, and keys its prefix cache, by
    them, so they are never reused); the previous folder is deleted. ``max_lora_rank`` is set to
    the smallest rank vLLM accepts that holds the adapter's (vLLM's default, 16, would refuse r=32).
  - Full fine-tuning: ``LLM.collective_rpc(fn, args=(weights,))`` runs ``fn(worker, weights)`` on
    every worker, which calls ``worker.model_runner.model.load_weights(weights=[(name, tensor),
    ...])``; then ``LLM.reset_prefix_cache()``, because cached KV blocks were computed with the
    old weights. The engine runs in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, set unless
    already set) so the tensors are handed over, not pickled to another process.
* No KV state is kept here: vLLM's prefix caching (``enable_prefix_caching=True``) reuses the
  shared prefix of each episode's growing context across turns.
* ``"default"`` (the name :func:`~veriloop.agents.loading.load_policy` gives SmolLM2) is resolved
  to the cached checkpoint folder: vLLM would look it up on the Hub.
"""

from __future__ import annotations

import itertools
import os
import shutil
import tempfile
from collections.abc import Hashable, Sequence
from pathlib import Path
from typing import Any

import torch

from veriloop.agents.backends import GenRequest, GenResult
from veriloop.agents.policy import Policy
from veriloop.agents.sampling_params import SamplingParams

INSTALL_HINT = "pip install veriloop[vllm]"


def import_vllm() -> Any:
    """The ``vllm`` module, or an ImportError that says how to install it."""
    try:
        import vllm
    except ImportError as err:
        raise ImportError(
            f"the vLLM backend needs vllm, which is not installed ({err}); install it with `{INSTALL_HINT}` "
            "on a CUDA machine, or use backend='hf'"
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
        from veriloop.agents import default_model

        return str(default_model.default_model_path())
    return str(path)


def _load_weights(worker: Any, weights: list[tuple[str, torch.Tensor]]) -> None:
    """Runs on each vLLM worker (via ``collective_rpc``): load HF-named weights in place."""
    worker.model_runner.model.load_weights(weights=weights)


class VLLMBackend:
    """Backend that samples with ``vllm.LLM``.

    Args:
        policy: The policy being trained (its weights or LoRA adapter are synced by :meth:`sync`).
        model_path: Folder with the base model for vLLM (default ``policy.name``).
        processed_logprobs: Record log-probs after temperature/top-k/top-p (see module docstring).
        **llm_kwargs: Passed to ``vllm.LLM`` (e.g. ``gpu_memory_utilization``, ``max_model_len``).
    """

    def __init__(
        self,
        policy: Policy,
        *,
        model_path: str | None = None,
        processed_logprobs: bool = True,
        **llm_kwargs: Any,
    ) -> None:
        self.vllm = import_vllm()
        if policy.is_vision:
            raise NotImplementedError("the vLLM backend serves text policies only; use backend='hf' for VLMs")
        self.policy = policy
        kwargs: dict[str, Any] = {"enable_prefix_caching": True, "enable_lora": policy.is_lora, **llm_kwargs}
        if processed_logprobs:
            kwargs.setdefault("logprobs_mode", "processed_logprobs")
        if policy.is_lora:
            kwargs.setdefault("max_lora_rank", lora_rank_bound(policy.model))
        else:
            os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # see module docstring
        self.llm = self.vllm.LLM(model=vllm_model_path(policy, model_path), **kwargs)
        self._lora_ids = itertools.count(1)
        self._lora_request: Any = None
        self._tmp = tempfile.TemporaryDirectory(prefix="veriloop-lora-")
        self.sync()

    def release(self, key: Hashable) -> None:
        """Nothing to free: vLLM manages its own (prefix) cache."""

    def sync(self) -> None:
        """Push the policy's current weights to vLLM (call after every optimizer step)."""
        if self.policy.is_lora:
            from vllm.lora.request import LoRARequest

            version = next(self._lora_ids)
            path = Path(self._tmp.name) / f"v{version}"
            self.policy.model.save_pretrained(path)
            if self._lora_request is not None:  # served already; never requested again
                shutil.rmtree(self._lora_request.lora_path, ignore_errors=True)
            self._lora_request = LoRARequest(f"veriloop-v{version}", version, str(path))
            return
        weights = [(name, p.detach()) for name, p in self.policy.model.state_dict().items()]
        self.llm.collective_rpc(_load_weights, args=(weights,))
        self.llm.reset_prefix_cache()

    def _params(self, sampling: SamplingParams, max_new_tokens: int, seed: int) -> Any:
        return self.vllm.SamplingParams(
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k if sampling.top_k > 0 else -1,
            max_tokens=max_new_tokens,
            stop=list(sampling.stop) or None,
            include_stop_str_in_output=True,
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
        outputs = self.llm.generate(prompts, params, lora_request=self._lora_request, use_tqdm=False)
        return [self._result(out.outputs[0]) for out in outputs]

    @staticmethod
    def _result(completion: Any) -> GenResult:
        ids = list(completion.token_ids)
        logprobs = [float(step[tok].logprob) for tok, step in zip(ids, completion.logprobs or [])]
        if len(logprobs) != len(ids):
            raise RuntimeError(
                f"vLLM returned {len(logprobs)} log-probs for {len(ids)} tokens; need logprobs=0"
            )
        if completion.finish_reason == "length":
            finish = "length"
        elif isinstance(completion.stop_reason, str):
            finish = "stop"
        else:
            finish = "eos"
        return GenResult(ids, logprobs, finish)
