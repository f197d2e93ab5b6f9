"""Asynchronous training through the in-process vLLM engine (``make test-vllm``; skipped where
vLLM is not installed unless ``VERILOOP_REQUIRE_VLLM=1``): the quickstart's model and task with
``train.max_staleness=1``, the worker sampling with vLLM while the trainer updates, the weights
pushed (and the prefix cache reset) between two turns."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest

requires_vllm = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None and os.environ.get("VERILOOP_REQUIRE_VLLM") != "1",
    reason="needs vLLM: `make setup-vllm`, then `make test-vllm`",
)

SHORT = ["rollout.prompts_per_step=2", "rollout.group_size=2", "rollout.max_new_tokens=16", "train.steps=3",
         "train.micro_batch_size=4", "sft.steps=0", "eval.num_problems=2", "eval.n_samples=1", "eval.k_list=[1]",
         "eval.every=0", "eval.at_start=false", "run.checkpoint_every=0", "rollout.backend=vllm",
         "train.max_staleness=1", "algo.rollout_is=truncate"]  # fmt: skip


@requires_vllm
def test_quickstart_trains_asynchronously_with_vllm(tmp_path: Path) -> None:
    from veriloop.algos.async_loop import read_ledger
    from veriloop.algos.train import train
    from veriloop.configs.loader import load_config

    run = train(load_config("quickstart", [*SHORT, f"run.out_dir={tmp_path}", "run.name=a"]), quiet=True)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "async/staleness_max" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert all(r["async/staleness_max"] <= 1 and r["updates"] >= 1 for r in steps)
    assert steps[-1]["async/version"] == 3.0
    # pi_prox recomputed by the trainer, mu recorded by vLLM: the decoupled ratio's IS weights are logged
    assert all(r["mismatch/tokens"] > 0 for r in steps)
    trained = [r["seed"] for r in read_ledger(run) if r["event"] == "trained"]
    assert len(trained) == len(set(trained)) == 3 * 2
    assert (run / "final").is_dir()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@requires_vllm
def test_quickstart_trains_asynchronously_against_a_vllm_server(tmp_path: Path) -> None:
    """One ``veriloop serve-vllm`` process beside the trainer: the worker sends each turn over HTTP;
    between two turns the trainer pushes its (LoRA merged) weights to the server and resumes it."""
    import signal
    import subprocess
    import sys
    import time
    import urllib.request

    from veriloop.algos.async_loop import read_ledger
    from veriloop.algos.train import train
    from veriloop.configs.loader import load_config

    port = _free_port()
    env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    log = (tmp_path / "server.log").open("w")
    proc = subprocess.Popen([sys.executable, "-m", "veriloop.cli", "serve-vllm", "--port", str(port)],
                            stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        t0 = time.monotonic()
        while True:
            assert proc.poll() is None, (tmp_path / "server.log").read_text()[-3000:]
            assert time.monotonic() - t0 < 400, "the server never answered /health"
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(1)
        over = [*SHORT[:-3], "rollout.backend=vllm_server", f"rollout.server.urls=[{url}]",
                "rollout.server.lora_sync=merge", "train.max_staleness=1", "algo.rollout_is=truncate"]  # fmt: skip
        run = train(load_config("quickstart", [*over, f"run.out_dir={tmp_path}", "run.name=s"]), quiet=True)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "async/staleness_max" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert all(
        r["async/staleness_max"] <= 1 and r["updates"] >= 1 and r["mismatch/tokens"] > 0 for r in steps
    )
    trained = [r["seed"] for r in read_ledger(run) if r["event"] == "trained"]
    assert len(trained) == len(set(trained)) == 3 * 2
