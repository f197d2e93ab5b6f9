"""Runs inside a ``vllm serve`` process: the weight-loading method the server backend calls.

Started with ``vllm serve ... --worker-extension-cls veriloop.agents.backends.vllm_worker.WeightLoader``
(``veriloop serve-vllm`` adds it), vLLM mixes :class:`WeightLoader` into each of its workers, so
with ``VLLM_SERVER_DEV_MODE=1`` the server's ``POST /collective_rpc`` can call its methods by name:

    POST /collective_rpc  {"method": "veriloop_load_weights", "args": ["/shared/run/v3.safetensors"]}

The trainer's rank 0 writes the file (HF-named full weights, LoRA merged in; see
:mod:`veriloop.agents.backends.vllm_server`); every worker reads it and loads it in place with
the same routine as the in-process backend (:func:`~veriloop.agents.backends.vllm._reload_weights`:
``reload_weights`` re-runs vLLM's weight processing, then a tied output head is repacked). The
file is read one tensor at a time (``safe_open``), so loading holds one copy of the model at most.
Only string arguments cross ``/collective_rpc`` (vLLM's rule), hence a path rather than tensors.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch


def safetensors_weights(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` for every tensor in the safetensors file at ``path``, one at a time."""
    from safetensors import safe_open

    with safe_open(path, framework="pt", device="cpu") as f:
        for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
            yield name, f.get_tensor(name)


class WeightLoader:
    """Methods vLLM adds to each worker (``--worker-extension-cls``); ``self`` is the worker."""

    def veriloop_load_weights(self, path: str) -> str:
        """Load the HF-named weights in the safetensors file ``path`` into the served model."""
        from veriloop.agents.backends.vllm import _reload_weights

        _reload_weights(self, safetensors_weights(path))
        return path
