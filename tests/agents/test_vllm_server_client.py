"""Server mode without vLLM: the HTTP client's retry and errors, the request/answer mapping, routing
and who pushes weights, against a stand-in server (the real one: ``test_vllm_server.py``)."""

from __future__ import annotations

import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
import torch

from veriloop.agents.backends import GenRequest
from veriloop.agents.backends.http_client import RetryPolicy, ServerClient, ServerError, check_servers
from veriloop.agents.backends.vllm_server import WORKER_EXTENSION, VLLMServerBackend, _result, serve_command
from veriloop.agents.sampling_params import SamplingParams


class FakeServer:
    """Answers like ``vllm serve`` (dev mode, worker extension on): each completion samples
    ``[7, 8]`` with log-probs -0.5, -0.25; ``fail`` statuses are answered first, one per request."""

    def __init__(self, fail: list[int] | None = None, lora: bool = False) -> None:
        self.calls: list[tuple[str, Any]] = []
        self.fail = list(fail or [])
        config = {
            "model_config": {"logprobs_mode": "processed_logprobs"},
            "parallel_config": {"worker_extension_cls": WORKER_EXTENSION},
            "lora_config": {"max_lora_rank": 8} if lora else None,
        }
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                self._answer(None)

            def do_POST(self) -> None:
                self._answer(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))

            def _answer(self, body: Any) -> None:
                fake.calls.append((self.path, body))
                status, out = (fake.fail.pop(0), {"error": {"message": "nope"}}) if fake.fail else (200, None)
                if out is None:
                    out = {
                        "/health": {},
                        "/v1/models": {"data": [{"id": "base", "parent": None}]},
                        "/server_info?config_format=json": {"vllm_config": config},
                        "/reset_prefix_cache": {"success": True},
                    }.get(self.path, {})
                    if self.path == "/v1/completions":
                        out = {
                            "choices": [
                                {
                                    "token_ids": [7, 8],
                                    "finish_reason": "length",
                                    "stop_reason": None,
                                    "logprobs": {"token_logprobs": [-0.5, -0.25]},
                                }
                            ]
                        }
                payload = json.dumps(out).encode()
                self.send_response(status)
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def paths(self, prefix: str = "") -> list[str]:
        return [p for p, _ in self.calls if p.startswith(prefix)]

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def fakes():
    made: list[FakeServer] = []

    def make(**kw: Any) -> FakeServer:
        made.append(FakeServer(**kw))
        return made[-1]

    yield make
    for f in made:
        f.close()


def _dead_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"  # closed again: connections are refused


def test_an_unreachable_server_is_retried_with_backoff_then_named_with_the_fix() -> None:
    url = _dead_url()
    t0 = time.perf_counter()
    with pytest.raises(ServerError) as err:
        ServerClient(url, RetryPolicy(retries=2, backoff_s=0.1)).get("/health")
    assert 0.3 <= time.perf_counter() - t0 < 3  # waited 0.1 + 0.2 s
    msg = str(err.value)
    assert (
        err.value.url == url and url in msg and "3 tries" in msg and "--resume" in msg and "serve-vllm" in msg
    )
    assert RetryPolicy(retries=4, backoff_s=1.0).total_wait_s == 15.0
    with pytest.raises(ServerError, match="GET /health"):
        check_servers([url], RetryPolicy(retries=0))


def test_busy_answers_are_retried_and_bad_requests_are_not(fakes) -> None:
    server = fakes(fail=[503, 503])
    assert ServerClient(server.url, RetryPolicy(retries=2, backoff_s=0.01)).get("/health") == {}
    assert len(server.calls) == 3
    server = fakes(fail=[400])
    with pytest.raises(ServerError, match="refused POST /v1/completions: HTTP 400: nope"):
        ServerClient(server.url, RetryPolicy(retries=3, backoff_s=0.01)).post("/v1/completions", {})
    assert len(server.calls) == 1


def test_a_choice_maps_to_a_gen_result_as_in_the_in_process_backend() -> None:
    def choice(finish: str, stop: Any) -> dict[str, Any]:
        return {
            "choices": [
                {
                    "token_ids": [1, 2],
                    "finish_reason": finish,
                    "stop_reason": stop,
                    "logprobs": {"token_logprobs": [-1.0, -2.0]},
                }
            ]
        }

    assert _result("u", choice("length", None)).finish == "length"
    assert _result("u", choice("stop", "\n")).finish == "stop"
    assert _result("u", choice("stop", 2)).finish == "eos"  # a stop token id: the end-of-turn id
    r = _result("u", choice("stop", None))
    assert (r.token_ids, r.logprobs, r.finish) == ([1, 2], [-1.0, -2.0], "eos")
    with pytest.raises(ServerError, match="1 log-probs for 2 tokens"):
        _result("u", {"choices": [{"token_ids": [1, 2], "logprobs": {"token_logprobs": [-1.0]}}]})


class Rank:
    """One rank of a group whose ranks run one after the other: rank 0 records what it broadcasts,
    the others read those values in order."""

    def __init__(self, rank: int, sent: list[Any]) -> None:
        self.rank, self.sent, self.read = rank, sent, 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def broadcast_object(self, obj: Any) -> Any:
        if self.rank == 0:
            self.sent.append(obj)
            return obj
        self.read += 1
        return self.sent[self.read - 1]


def test_rank_0_pushes_full_weights_and_episodes_go_round_robin_with_affinity(fakes) -> None:
    from veriloop.agents.testing import tiny_policy

    a, b, shared = fakes(), fakes(), []
    policy = tiny_policy(lora=False)
    main = VLLMServerBackend(policy, urls=[a.url, b.url], dist=Rank(0, shared))
    other = VLLMServerBackend(policy, urls=[a.url, b.url], dist=Rank(1, shared))
    assert main.tag == other.tag and main.model_name == "base"
    loads = [p for p, body in a.calls if p == "/collective_rpc"]
    assert len(loads) == 1 and len(b.paths("/collective_rpc")) == 1  # rank 0's start-up push only
    assert a.paths("/reset_prefix_cache") and b.paths("/reset_prefix_cache")
    reqs = [GenRequest(k, [1, 2, 3], 2) for k in "wxyz"]
    out = main.generate(reqs, SamplingParams(max_new_tokens=2), torch.Generator().manual_seed(0))
    assert [r.token_ids for r in out] == [[7, 8]] * 4 and out[0].logprobs == [-0.5, -0.25]
    assert len(a.paths("/v1/completions")) == len(b.paths("/v1/completions")) == 2
    bodies = [body for p, body in a.calls + b.calls if p == "/v1/completions"]
    assert len({body["seed"] for body in bodies}) == 4 and all(body["prompt"] == [1, 2, 3] for body in bodies)
    assert all(body["logprobs"] == 0 and body["return_token_ids"] for body in bodies)
    assert (
        main._route == {"w": 0, "x": 1, "y": 0, "z": 1} and other._server_of("w") == 1
    )  # rank 1 starts at b
    main.generate(reqs[:1], SamplingParams(max_new_tokens=2), torch.Generator())
    assert main._route["w"] == 0  # the same episode's next turn: the same server (its prefix cache)
    main.release("w")
    assert "w" not in main._route


def test_a_failed_push_on_rank_0_fails_every_rank(fakes) -> None:
    from veriloop.agents.testing import tiny_policy

    a, shared = fakes(), []
    policy = tiny_policy(lora=False)
    main = VLLMServerBackend(policy, urls=[a.url], dist=Rank(0, shared), retries=0)
    other = VLLMServerBackend(policy, urls=[a.url], dist=Rank(1, shared), retries=0)
    a.fail = [500]
    with pytest.raises(ServerError, match="POST /collective_rpc"):
        main.sync()
    with pytest.raises(ServerError, match="POST /collective_rpc"):
        other.sync()  # told by rank 0's broadcast: nobody samples from stale weights


def test_lora_adapters_get_a_new_name_per_version(fakes) -> None:
    from veriloop.agents.testing import tiny_policy

    a = fakes(lora=True)
    backend = VLLMServerBackend(tiny_policy(lora=True), urls=[a.url])  # auto: the server has LoRA on
    assert backend.serves_adapter and backend.model_name.endswith("-v1")
    backend.sync()
    loads = [body["lora_name"] for p, body in a.calls if p == "/v1/load_lora_adapter"]
    unloads = [body["lora_name"] for p, body in a.calls if p == "/v1/unload_lora_adapter"]
    assert loads == [f"veriloop-{backend.tag}-v1", f"veriloop-{backend.tag}-v2"] and unloads == loads[:1]
    assert backend.model_name == loads[-1]
    assert a.paths("/collective_rpc")  # the base weights, once: an earlier merged policy may be loaded


def test_serve_command_sets_what_the_backend_checks() -> None:
    argv, env = serve_command("m", port=9, lora_rank=12, cpu=True)
    line = " ".join(argv)
    for flag in (
        "--logprobs-mode processed_logprobs",
        "--generation-config vllm",
        "--max-lora-rank 16",
        f"--worker-extension-cls {WORKER_EXTENSION}",
        "--no-enable-chunked-prefill",
        "--kv-cache-memory-bytes 1073741824",
        "--block-size 64",
        "--port 9",
    ):
        assert flag in line
    assert env["VLLM_SERVER_DEV_MODE"] == "1" and env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
    gpu, _ = serve_command("m")
    assert "--enable-lora" not in gpu and "--kv-cache-memory-bytes" not in gpu and "--block-size" not in gpu


def test_server_settings_are_checked_when_the_config_loads() -> None:
    from veriloop.configs.loader import load_config
    from veriloop.configs.schema import ConfigError

    with pytest.raises(ConfigError, match="must start with http://"):
        load_config(None, ["rollout.backend=vllm_server", "rollout.server.urls=[localhost:8000]"])


def test_cpu_defaults_fill_only_what_is_not_given(monkeypatch: pytest.MonkeyPatch) -> None:
    from veriloop.agents.backends.vllm import CPU_BLOCK_SIZE, _cpu_defaults

    for name in ("VLLM_CPU_OMP_THREADS_BIND", "VLLM_USE_AOT_COMPILE"):
        monkeypatch.delenv(name, raising=False)
    kwargs: dict = {}
    _cpu_defaults(kwargs)
    assert kwargs["block_size"] == CPU_BLOCK_SIZE == 64 and kwargs["enable_chunked_prefill"] is False
    assert kwargs["kv_cache_memory_bytes"] == 1 << 30
    given = {"block_size": 128, "gpu_memory_utilization": 0.5}
    _cpu_defaults(given)
    assert given["block_size"] == 128 and "kv_cache_memory_bytes" not in given
