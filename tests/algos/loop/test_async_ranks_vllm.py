"""Asynchronous training with two trainer ranks against one vLLM server (``make test-vllm``;
skipped where vLLM is not installed unless ``VERILOOP_REQUIRE_VLLM=1``): the quickstart, as a user
starts it, ``torchrun --nproc_per_node 2 -m veriloop.cli train quickstart train.max_staleness=1
rollout.backend=vllm_server ...``, end to end, data parallel and FSDP. Rank 0 samples from the
server and pushes the weights after every update; both ranks train every step's batch."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from veriloop.cli.serve import running_server

requires_vllm = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None and os.environ.get("VERILOOP_REQUIRE_VLLM") != "1",
    reason="needs vLLM: `make setup-vllm`, then `make test-vllm`",
)

SHORT = ["policy.precision=fp32", "rollout.prompts_per_step=2", "rollout.group_size=2", "rollout.max_new_tokens=16",
         "train.steps=3", "train.micro_batch_size=4", "sft.steps=0", "eval.num_problems=2", "eval.n_samples=1",
         "eval.k_list=[1]", "eval.every=0", "eval.at_start=false", "run.checkpoint_every=0",
         "rollout.backend=vllm_server", "rollout.server.lora_sync=merge", "train.max_staleness=1",
         "algo.rollout_is=truncate"]  # fmt: skip


@requires_vllm
@pytest.mark.parametrize("parallel", ["data", "fsdp"])
def test_quickstart_trains_asynchronously_on_two_ranks_against_a_vllm_server(
    tmp_path: Path, parallel: str
) -> None:
    """Data parallel (whole copies) and FSDP (shards, gathered on every rank while rank 0 pushes)."""
    from veriloop.algos.loop.async_loop import read_ledger

    with running_server(log=tmp_path / "server.log") as server:
        args = [
            *SHORT,
            f"train.parallel={parallel}",
            f"rollout.server.urls=[{server.url}]",
            f"run.out_dir={tmp_path}",
            "run.name=r",
        ]
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            "2",
            "-m",
            "veriloop.cli",
            "train",
            "quickstart",
            *args,
        ]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        done = subprocess.run(cmd, env=env, capture_output=True, timeout=1200)
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    run = tmp_path / "r"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "async/staleness_max" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert all(r["async/staleness_max"] <= 1 and r["updates"] >= 1 for r in steps)
    assert all(r["mismatch/tokens"] > 0 for r in steps)  # mu recorded by the server, pi_prox by the trainer
    assert steps[-1]["async/version"] == 3.0  # rank 0 handed the weights over after every update
    ledger = read_ledger(run)
    trained = [r["seed"] for r in ledger if r["event"] == "trained"]
    assert len(trained) == len(set(trained)) == 3 * 2  # every admitted problem trained once, over both ranks
    assert all(r["version"] - r["v_start"] <= 1 for r in ledger if r["event"] == "trained")
    assert (run / "final").is_dir()
