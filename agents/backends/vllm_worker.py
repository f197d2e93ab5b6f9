"""Runs inside a ``vllm serve`` process: the weight-loading method the server backend calls.

Started with ``vllm serve ... --worker-extension-cls veriloop.agents.backends.vllm_worker.WeightLoader``
(``veriloop serve-vllm`` adds it), vLLM mixes :class:`WeightLoader` into each of its workers, so
with ``VLLM_SERVER_DEV_MODE=1`` the server's ``POST /collective_rpc`` can call its methods by name:

    POST /collective_rpc  {"method": "veriloop_load_weights", "args": ["/shared/run/v3.safetensors"]}

The trainer's rank 0 writes the file (HF-named full weights, LoRA merged in; see
:mod:`veriloop.agents.backends.vllm_server`); every worker reads it and loads it in place with
the same routine as the in-process backend (:func:`reload_weights`:
``reload_weights`` re-runs vLLM's weight processing, then a tied output head is repacked). The
file is read one tensor at a time (``safe_open``), so loading holds one copy of the model at most.
Only string arguments cross ``/collective_rpc`` (vLLM's rule), hence a path rather than tensors.
"""

from __future__ import annotations

import datetime
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch


def safetensors_weights(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` for every tensor in the safetensors file at ``path``, one at a time."""
    from safetensors import safe_open

    with safe_open(path, framework="pt", device="cpu") as f:
        for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
            yield name, f.get_tensor(name)


def reload_weights(worker: Any, weights: Iterator[tuple[str, torch.Tensor]]) -> None:
    """Runs on each vLLM worker (``collective_rpc``): load HF-named weights in place.

    ``worker.reload_weights`` (vLLM >= 0.12) re-runs each layer's weight processing (the CPU
    build's prepacking included); older vLLM only has ``model.load_weights``. A tied output head
    (SmolLM2's) receives no weights of its own, so its processed copy is rebuilt from the
    (shared, now updated) embedding; on GPUs that processing is a no-op.
    """
    model = worker.model_runner.model
    if hasattr(worker, "reload_weights"):
        worker.reload_weights(weights_iterator=weights)
    else:
        model.load_weights(weights=weights)
    repack_tied_head(model)


class WeightLoader:
    """Methods vLLM adds to each worker (``--worker-extension-cls``); ``self`` is the worker."""

    def veriloop_load_weights(self, path: str) -> str:
        """Load the HF-named weights in the safetensors file ``path`` into the served model."""
        reload_weights(self, safetensors_weights(path))
        return path


# ------------------------------------------------------------- weights over gloo (no file on disk)
#
# vLLM's weight-transfer API (``init_weight_transfer_engine`` -> ``start_weight_update`` ->
# ``update_weights`` -> ``finish_weight_update``, HTTP endpoints in dev mode) has only CUDA
# transports in vllm 0.32 (nccl, ipc, ...). ``veriloop_gloo`` is a transport for the same API over
# a torch gloo group (TCP): it runs on CPU servers, and on GPU servers fed by a CPU trainer. The
# trainer (``vllm_server.GlooWeightSender``) is rank 0 of a group with every worker of a server;
# each update sends the HF-named weights in buckets of one dtype, the workers load them with
# vLLM's layerwise reload (the same processing as a load from disk).

#: The name a server's ``--weight-transfer-config '{"backend": "veriloop_gloo"}'`` selects.
GLOO_BACKEND = "veriloop_gloo"
#: Most bytes broadcast at once (one bucket of tensors of one dtype; a larger tensor goes alone).
BUCKET_BYTES = 256 << 20


def buckets(dtypes: list[torch.dtype], numels: list[int]) -> list[list[int]]:
    """Indices of consecutive tensors of one dtype, grouped up to :data:`BUCKET_BYTES` each.

    Sender and receivers compute it from the same metadata, so they cut the stream alike.
    """
    out: list[list[int]] = []
    current: list[int] = []
    size = 0
    for i, (dtype, n) in enumerate(zip(dtypes, numels)):
        nbytes = n * torch.empty((), dtype=dtype).element_size()
        if current and (dtype != dtypes[current[0]] or size + nbytes > BUCKET_BYTES):
            out.append(current)
            current, size = [], 0
        current.append(i)
        size += nbytes
    if current:
        out.append(current)
    return out


def open_gloo_group(host: str, port: int, rank: int, world_size: int, timeout_s: float) -> Any:
    """Join the trainer-and-workers gloo group (rank 0, the trainer, hosts the store)."""
    timeout = datetime.timedelta(seconds=timeout_s)
    store = torch.distributed.TCPStore(host, port, world_size, is_master=False, timeout=timeout)
    return torch.distributed.ProcessGroupGloo(store, rank, world_size, timeout)


def broadcast(group: Any, tensor: torch.Tensor) -> None:
    """Rank 0's ``tensor`` into every rank's ``tensor`` (in place)."""
    opts = torch.distributed.BroadcastOptions()
    opts.rootRank, opts.rootTensor = 0, 0
    group.broadcast([tensor], opts).wait()


def receive_weights(
    group: Any, names: list[str], dtypes: list[torch.dtype], shapes: list[list[int]]
) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` as rank 0 sends them (:func:`buckets` of the same metadata)."""
    numels = [math.prod(s) for s in shapes]
    for idx in buckets(dtypes, numels):
        flat = torch.empty(sum(numels[i] for i in idx), dtype=dtypes[idx[0]])
        broadcast(group, flat)
        offset = 0
        for i in idx:
            yield names[i], flat[offset : offset + numels[i]].view(shapes[i])
            offset += numels[i]


def repack_tied_head(model: Any) -> None:
    """A tied output head receives no weights of its own: rebuild its processed copy from the
    (shared, now updated) embedding (vLLM's CPU build prepacks it; on GPUs a no-op)."""
    head: Any = getattr(model, "lm_head", None)
    inner = getattr(model, "model", None)
    embed = (
        model.get_input_embeddings()
        if hasattr(model, "get_input_embeddings")
        else getattr(inner, "embed_tokens", None)
    )
    weight = getattr(head, "weight", None)
    if weight is not None and embed is not None and weight.data_ptr() == embed.weight.data_ptr():
        head.quant_method.process_weights_after_loading(head)


try:  # inside a vLLM worker (its --worker-extension-cls imports this module): the engine below
    from vllm.distributed.weight_transfer.base import (
        WeightTransferEngine,
        WeightTransferInitInfo,
        WeightTransferUpdateInfo,
    )
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
except ImportError:  # no vLLM (the trainer's side), or one without the weight-transfer API
    WeightTransferEngineFactory = None

if WeightTransferEngineFactory is not None:

    @dataclass
    class GlooInitInfo(WeightTransferInitInfo):
        """``/init_weight_transfer_engine``'s ``init_info`` for ``veriloop_gloo``."""

        master_address: str
        master_port: int
        rank_offset: int
        world_size: int
        timeout_s: float = 600.0

    @dataclass
    class GlooUpdateInfo(WeightTransferUpdateInfo):
        """``/update_weights``' ``update_info``: what the next broadcasts carry, in order."""

        names: list[str]
        dtype_names: list[str]
        shapes: list[list[int]]

    class GlooWeightTransferEngine(WeightTransferEngine[GlooInitInfo, GlooUpdateInfo]):
        """Worker side of ``veriloop_gloo`` (see the section comment above)."""

        init_info_cls = GlooInitInfo
        update_info_cls = GlooUpdateInfo
        supports_draft_weight_update = False

        def init_transfer_engine(self, init_info: GlooInitInfo) -> None:
            p = self.parallel_config
            rank = init_info.rank_offset + p.data_parallel_index * p.world_size + p.rank
            self.group = open_gloo_group(
                init_info.master_address,
                init_info.master_port,
                rank,
                init_info.world_size,
                init_info.timeout_s,
            )

        def start_weight_update(self) -> None:
            from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

            initialize_layerwise_reload(self.model)

        def finish_weight_update(self) -> None:
            from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

            finalize_layerwise_reload(self.model, self.model_config)
            repack_tied_head(self.model)

        def update_weights(self, update_info: dict[str, Any]) -> None:
            self.receive_weights(self.parse_update_info(update_info))  # CPU: nothing to synchronize

        def receive_weights(self, update_info: GlooUpdateInfo) -> None:
            dtypes = [getattr(torch, d) for d in update_info.dtype_names]
            for name, tensor in receive_weights(self.group, update_info.names, dtypes, update_info.shapes):
                self.model.load_weights([(name, tensor.to(self.device))])

        def shutdown(self) -> None:
            self.group = None

    if GLOO_BACKEND not in getattr(WeightTransferEngineFactory, "_registry", {}):
        WeightTransferEngineFactory.register_engine(GLOO_BACKEND, GlooWeightTransferEngine)
