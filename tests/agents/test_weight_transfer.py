"""The ``veriloop_gloo`` weight transfer without vLLM: the trainer's sender against a stand-in
server that plays vLLM's four endpoints with the workers' receiving code (the real server is
tested in ``test_vllm_server.py``: ``make test-vllm``)."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
import torch

from veriloop.agents.backends import vllm_worker
from veriloop.agents.backends.http_client import RetryPolicy, ServerClient, ServerError
from veriloop.agents.backends.vllm_server import GlooWeightSender
from veriloop.agents.backends.vllm_worker import buckets, open_gloo_group, receive_weights


def test_buckets_cut_at_dtype_changes_and_at_the_size_cap(monkeypatch: pytest.MonkeyPatch) -> None:
    f32, bf16 = torch.float32, torch.bfloat16
    monkeypatch.setattr(vllm_worker, "BUCKET_BYTES", 100)  # 25 float32 values
    # 10 + 10 float32 fit (80 B); the third would make 120 B; bf16 starts its own; 30 float32 alone
    assert buckets([f32, f32, f32, bf16, bf16, f32], [10, 10, 10, 5, 5, 30]) == [[0, 1], [2], [3, 4], [5]]
    assert buckets([], []) == []


class _StandIn(BaseHTTPRequestHandler):
    """vLLM's weight-transfer endpoints, receiving as ``vllm_worker``'s engine does."""

    calls: list[str] = []
    received: dict[str, torch.Tensor] = {}
    group: Any = None
    refuse = False  # answer /update_weights with an error, as a failing server would

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
        cls = type(self)
        cls.calls.append(self.path)
        if self.path == "/update_weights" and cls.refuse:
            self.send_response(500)
            self.end_headers()
            return
        if self.path == "/init_weight_transfer_engine":
            info = body["init_info"]
            cls.group = open_gloo_group(
                info["master_address"],
                info["master_port"],
                info["rank_offset"],
                info["world_size"],
                info["timeout_s"],
            )
        elif self.path == "/update_weights":
            info = body["update_info"]
            dtypes = [getattr(torch, d) for d in info["dtype_names"]]
            for name, t in receive_weights(cls.group, info["names"], dtypes, info["shapes"]):
                cls.received[name] = t.clone()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(b"{}")

    def log_message(self, *args: Any) -> None:
        pass


def test_sender_delivers_every_weight_through_the_four_calls(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(vllm_worker, "BUCKET_BYTES", 64)  # several buckets even for these tensors
    _StandIn.calls, _StandIn.received, _StandIn.refuse = [], {}, False
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _StandIn)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        client = ServerClient(f"http://127.0.0.1:{httpd.server_port}", RetryPolicy(0, 0.1, 60))
        sender = GlooWeightSender(client, host="127.0.0.1", workers=1, timeout_s=60)
        g = torch.Generator().manual_seed(0)
        weights = [
            ("a.weight", torch.randn(4, 8, generator=g)),
            ("a.bias", torch.randn(4, generator=g)),
            ("b.weight", torch.randn(3, 3, generator=g).to(torch.bfloat16)),
            ("c.weight", torch.randn(40, generator=g)),
        ]
        for round_ in range(2):  # the group is joined once and reused
            sent = [(n, w + round_) for n, w in weights]
            sender.send(sent)
            for name, w in sent:
                assert torch.equal(_StandIn.received[name], w)
        assert (
            _StandIn.calls
            == ["/init_weight_transfer_engine"]
            + ["/start_weight_update", "/update_weights", "/finish_weight_update"] * 2
        )
    finally:
        httpd.shutdown()


def test_a_refused_update_is_a_server_error_not_a_hang() -> None:
    _StandIn.calls, _StandIn.received, _StandIn.refuse = [], {}, True
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _StandIn)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        client = ServerClient(f"http://127.0.0.1:{httpd.server_port}", RetryPolicy(0, 0.1, 60))
        sender = GlooWeightSender(client, host="127.0.0.1", workers=1, timeout_s=5)
        t0 = time.perf_counter()
        with pytest.raises(ServerError, match=str(httpd.server_port)):  # at the latest after timeout_s
            sender.send([("w", torch.ones(3))])
        assert time.perf_counter() - t0 < 30
        assert "/finish_weight_update" not in _StandIn.calls
    finally:
        httpd.shutdown()
