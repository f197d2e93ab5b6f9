"""Server mode for real: one CPU ``vllm serve`` on localhost, trainer ranks talking to it over HTTP.

The server is started once for the module with ``veriloop serve-vllm`` (LoRA on, so both weight
routes can be tested on it) and shut down at the end. Checked here, each against the HF path
(tolerance ``ATOL`` as in ``test_vllm_backend.py``):

* token ids in and out unchanged, recorded log-probs equal a fresh HF forward (T = 0.7), a fixed
  seed reproduces the tokens;
* after an optimizer step, a sync changes the samples and the log-probs match the updated HF
  policy: full weights, LoRA merged into full weights, LoRA served as a new adapter;
* two trainer ranks (gloo, launched as ``accelerate`` / ``torchrun`` would) train 2 steps against
  the one server;
* a server that becomes unreachable mid-run stops the trainer with exit code 3 and a message naming
  the URL and ``--resume`` within the bounded retry; ``--resume`` then finishes the run from its
  checkpoint; a killed server gives the same error from the start-up check.

Without vllm these tests skip, unless ``VERILOOP_REQUIRE_VLLM=1`` (``make test-vllm``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch

from veriloop.cli.serve import free_port, running_server, stop_server


def _in_process_tests():
    """The in-process backend's test module, for its HF-comparison helpers (one copy of them)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "vllm_checks", Path(__file__).with_name("test_vllm_backend.py")
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


_checks = _in_process_tests()
ATOL, requires_vllm = _checks.ATOL, _checks.requires_vllm
assert_matches_hf, chat_ids, hf_logprobs, sample, sft_step = (
    _checks.assert_matches_hf,
    _checks.chat_ids,
    _checks.hf_logprobs,
    _checks.sample,
    _checks.sft_step,
)

pytestmark = requires_vllm

#: The trainer settings of the training tests: the default model (the server's), tiny budgets.
#: The quickstart (default model, LoRA) in fp32 as the server is, without its SFT warm-up, its LoRA
#: merged into full weights on every sync (the CPU path), with tiny budgets.
TRAIN = [
    "quickstart",
    "policy.precision=fp32",
    "sft.steps=0",
    "rollout.prompts_per_step=2",
    "rollout.group_size=2",
    "rollout.max_new_tokens=8",
    "train.micro_batch_size=2",
    "train.warmup_steps=0",
    "eval.every=0",
    "eval.at_start=false",
    "eval.num_problems=1",
    "eval.n_samples=1",
    "eval.k_list=[1]",
    "rollout.backend=vllm_server",
    "rollout.server.lora_sync=merge",
]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """``veriloop serve-vllm`` on a free port (its own process group, killed at the end)."""
    log = tmp_path_factory.mktemp("server") / "server.log"
    t0 = time.perf_counter()
    with running_server("--lora-rank", "8", log=log, ready_s=400) as served:
        print(f"server up in {time.perf_counter() - t0:.0f} s")
        yield {"url": served.url, "proc": served.proc}


@pytest.fixture(scope="module")
def base_policy():
    from veriloop.agents.loading import load_policy

    return load_policy("default")


def test_token_ids_in_and_out_and_logprobs_match_hf(server, base_policy):
    from veriloop.agents.backends import eos_token_ids
    from veriloop.agents.backends.vllm_server import VLLMServerBackend

    backend = VLLMServerBackend(base_policy, urls=[server["url"]])
    tok = base_policy.tokenizer
    # a context no tokenizer would produce ("hello" one character per token): re-tokenizing it
    # on the server would change the log-probs below
    head = chat_ids(tok, "Say something about ")
    context = head[:-5] + [tok.convert_tokens_to_ids(c) for c in "hello"] + head[-5:]
    assert tok(tok.decode(context), add_special_tokens=False)["input_ids"] != context
    out = sample(backend, context, n=3, max_new=16, seed=1, temperature=0.7)
    eos = set(eos_token_ids(tok, base_policy.model))
    for r in out:
        assert len(r.token_ids) == len(r.logprobs) and all(lp <= 0 for lp in r.logprobs)
        if r.finish == "eos":
            assert r.token_ids[-1] in eos and not eos & set(r.token_ids[:-1])
        else:
            assert r.finish == "length" and len(r.token_ids) == 16
    assert_matches_hf(base_policy, context, out, temperature=0.7)
    again = sample(backend, context, n=3, max_new=16, seed=1, temperature=0.7)
    assert [r.token_ids for r in again] == [r.token_ids for r in out]
    assert len({tuple(r.token_ids) for r in out}) > 1  # one seed per request: a group's samples differ


def test_greedy_stop_strings_and_max_tokens_as_in_hf(server, base_policy):
    from veriloop.agents.backends import GenRequest
    from veriloop.agents.backends.hf import HFBackend
    from veriloop.agents.backends.vllm_server import VLLMServerBackend
    from veriloop.agents.sampling_params import SamplingParams

    backend, hf = VLLMServerBackend(base_policy, urls=[server["url"]]), HFBackend(base_policy)
    context = chat_ids(base_policy.tokenizer, "List three fruits.")
    reqs, g = [GenRequest("a", context, 12)], torch.Generator()
    greedy = SamplingParams.greedy(max_new_tokens=12)
    v, h = backend.generate(reqs, greedy, g)[0], hf.generate(reqs, greedy, g)[0]
    assert (v.token_ids, v.finish) == (h.token_ids, h.finish) == (h.token_ids, "length")
    stop = base_policy.tokenizer.decode(v.token_ids[4:5]).strip() or "\n"
    params = SamplingParams.greedy(max_new_tokens=12, stop=(stop,))
    v2, h2 = backend.generate(reqs, params, g)[0], hf.generate(reqs, params, g)[0]
    assert v2.finish == h2.finish == "stop" and v2.token_ids == h2.token_ids and len(v2.token_ids) <= 5


@pytest.mark.parametrize("route", ["full", "full-file", "merge", "adapter"])
def test_a_sync_serves_the_updated_policy(server, route):
    """``full`` / ``merge``: full weights without a file (vLLM's weight-transfer API over gloo, which
    ``veriloop serve-vllm`` sets up); ``full-file``: the file route; ``adapter``: a LoRA adapter."""
    from veriloop.agents.backends.vllm_server import VLLMServerBackend
    from veriloop.agents.loading import LoraSettings, load_policy

    lora = None if route.startswith("full") else LoraSettings(r=8, alpha=16)
    policy = load_policy("default", lora=lora)
    sync = "adapter" if route == "adapter" else "merge"
    transfer = "file" if route == "full-file" else "auto"
    backend = VLLMServerBackend(policy, urls=[server["url"]], lora_sync=sync, weight_transfer=transfer)
    assert backend.serves_adapter == (route == "adapter")
    assert backend.transfer == ("file" if route == "full-file" else "gloo")
    context = chat_ids(policy.tokenizer, "What is 7 times 8?")
    before = sample(backend, context, n=2, max_new=16, seed=5)
    assert_matches_hf(policy, context, before)  # whatever an earlier test left on the server
    old = {n: p.detach().clone() for n, p in policy.model.named_parameters()}
    sft_step(policy, context, before, lr=1e-4 if route == "full" else 2e-3)
    times = []
    for _ in range(3):  # the first gloo sync also joins the transfer group
        t0 = time.perf_counter()
        backend.sync()
        times.append(time.perf_counter() - t0)
    print(f"{route} sync (default model, {backend.transfer}): " + ", ".join(f"{t:.2f}" for t in times) + " s")
    after = sample(backend, context, n=2, max_new=16, seed=5)
    assert [r.token_ids for r in after] != [r.token_ids for r in before]  # same seed, new policy
    assert_matches_hf(policy, context, after)
    with torch.no_grad():  # serving the old weights would have shown
        for n, p in policy.model.named_parameters():
            p.copy_(old[n])
        stale = max(
            float((hf_logprobs(policy, context, r.token_ids) - torch.tensor(r.logprobs)).abs().max())
            for r in after
        )
    assert stale > 10 * ATOL


@pytest.mark.parametrize("parallel", ["data", "fsdp"])
def test_two_trainer_ranks_train_two_steps_on_one_server(server, tmp_path, parallel):
    """Both layouts of docs/scaling.md on CPU: two trainer ranks (whole copies, or FSDP2 shards
    gathered for each sync) and one server, weights sent without a file (gloo)."""
    port = str(free_port())
    args = [
        *TRAIN,
        f"rollout.server.urls=[{server['url']}]",
        "train.steps=2",
        f"run.out_dir={tmp_path}",
        "run.name=two",
        "run.checkpoint_every=0",
        f"train.parallel={parallel}",
    ]
    common = {"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "veriloop.cli", "train", *args],
            env={**os.environ, **common, "RANK": str(r), "LOCAL_RANK": str(r)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(2)
    ]
    for p in procs:
        out, _ = p.communicate(timeout=300)
        assert p.returncode == 0, out[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "two" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "sampling/rounds" in r]
    assert [r["step"] for r in steps] == [1, 2] and all(r["updates"] >= 1 for r in steps)
    # the trainer's own log-probs of the server's samples: the same policy, to float rounding
    assert all(r["mismatch/tokens"] > 0 and r["mismatch/abs_log_ratio"] < 1e-3 for r in steps)
    assert (tmp_path / "two" / "final").is_dir()
    print(
        f"{parallel}: weight sync per step "
        + ", ".join(f"{r['time/weight_sync_s']:.2f}" for r in steps)
        + " s"
    )


class _Proxy:
    """A pass-through HTTP proxy to the server that can go away (connections refused) and come back.

    ``completions`` requests to forward before it vanishes mid-run, as a dying server would: the
    one that exceeds the budget gets its connection closed without an answer.
    """

    def __init__(self, upstream: str, port: int, completions: int | None) -> None:
        self.upstream, self.port, self.left = upstream, port, completions
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def do_GET(self):
                self._forward(None)

            def do_POST(self):
                self._forward(self.rfile.read(int(self.headers.get("Content-Length", 0))))

            def _forward(self, body):
                if self.path.startswith("/v1/completions") and proxy.left is not None:
                    if proxy.left <= 0:
                        self.close_connection = True
                        threading.Thread(target=proxy.stop, daemon=True).start()
                        return
                    proxy.left -= 1
                req = urllib.request.Request(
                    proxy.upstream + self.path,
                    data=body,
                    method=self.command,
                    headers={"Content-Type": "application/json"},
                )
                try:
                    with urllib.request.urlopen(req, timeout=120) as r:
                        status, payload = r.status, r.read()
                except urllib.error.HTTPError as e:
                    status, payload = e.code, e.read()
                self.send_response(status)
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def test_an_unreachable_server_stops_the_run_and_resume_finishes_it(server, tmp_path, capsys):
    """Step 1 completes and is checkpointed; the server vanishes during step 2's rollouts: exit 3
    within the bounded retry, naming the URL and --resume; --resume then runs step 2 from step 1's
    checkpoint, and the log holds steps 1 and 2 once each."""
    from veriloop.cli.main import run as cli

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    args = [
        "train",
        *TRAIN,
        f"rollout.server.urls=[{url}]",
        "rollout.server.retries=2",
        "rollout.server.backoff_s=0.2",
        "train.steps=2",
        "run.checkpoint_every=1",
        f"run.out_dir={tmp_path}",
        "run.name=resume",
    ]
    proxy = _Proxy(server["url"], port, completions=5)  # step 1's 4 episodes and its sync probe, then gone
    t0 = time.perf_counter()
    code = cli(args)
    err = capsys.readouterr().err
    assert code == 3, err[-2000:]
    assert url in err and "--resume" in err and "3 tries" in err, err[-2000:]
    run_dir = tmp_path / "resume"
    assert (run_dir / "checkpoints").is_dir() and not (run_dir / "final").exists()
    print(f"failed run: {time.perf_counter() - t0:.1f} s")
    proxy.stop()
    assert cli(args + ["--resume"]) == 3  # nothing there yet: the start-up check fails before any model loads
    assert "GET /health" in capsys.readouterr().err
    proxy = _Proxy(server["url"], port, completions=None)
    try:
        assert cli(args + ["--resume"]) == 0
    finally:
        proxy.stop()
    out = capsys.readouterr().out
    assert "resumed from" in out and "at step 1" in out
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "sampling/rounds" in r] == [1, 2]
    assert (run_dir / "final").is_dir()


def test_a_killed_server_is_named_within_the_bounded_retry(server, base_policy):
    """Last in the module: it kills the server."""
    from veriloop.agents.backends.http_client import RetryPolicy, ServerError, check_servers
    from veriloop.agents.backends.vllm_server import VLLMServerBackend

    backend = VLLMServerBackend(base_policy, urls=[server["url"]], retries=2, backoff_s=0.2)
    context = chat_ids(base_policy.tokenizer, "Hi")
    assert sample(backend, context, n=2, max_new=4)
    stop_server(server["proc"], signal.SIGKILL)
    t0 = time.perf_counter()
    with pytest.raises(ServerError, match="did not answer POST /v1/completions") as err:
        sample(backend, context, n=2, max_new=4)
    assert server["url"] in str(err.value) and "--resume" in str(err.value)
    assert time.perf_counter() - t0 < 5  # 0.2 + 0.4 s of backoff, connections refused at once
    with pytest.raises(ServerError, match="GET /health"):
        check_servers([server["url"]], RetryPolicy(retries=1, backoff_s=0.1))
