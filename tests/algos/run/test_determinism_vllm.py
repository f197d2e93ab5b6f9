"""Two fresh runs with the same seed sample the same tokens through vLLM's CPU engine (the
in-process ``rollout.backend: vllm``, one seed per request drawn from the rollout's generator) and
give the same ``metrics.jsonl`` (timings aside) and byte-identical adapter files. Runs under
``make test-vllm``; skipped elsewhere unless ``VERILOOP_REQUIRE_VLLM=1`` makes a missing vLLM a
failure. docs/reliability.md ("Determinism") lists what is and is not deterministic."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.algos.run.test_determinism import TIMING, adapter_files, numbers

requires_vllm = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None and os.environ.get("VERILOOP_REQUIRE_VLLM") != "1",
    reason="needs vLLM: `make setup-vllm`, then `make test-vllm`",
)

WORKER = r"""
import sys
import veriloop.algos.loop.train as T
from veriloop.configs.loader import load_config

T.train(load_config("quickstart", sys.argv[1:]), quiet=True)
"""
#: The quickstart (the default model, LoRA) in fp32, 2 short steps, sampled by the in-process engine.
SHORT = ["policy.precision=fp32", "rollout.backend=vllm", "sft.steps=0", "rollout.prompts_per_step=2",
         "rollout.group_size=4", "rollout.max_new_tokens=16", "train.steps=2", "train.micro_batch_size=4",
         "eval.every=0", "eval.at_start=false", "run.checkpoint_every=0", "run.tensorboard=false"]  # fmt: skip


@requires_vllm
def test_two_fresh_runs_sampled_by_vllm_are_identical(tmp_path: Path) -> None:
    for name in ("a", "b"):  # one after the other: each engine takes every core
        done = subprocess.run(
            [sys.executable, "-c", WORKER, *SHORT, f"run.out_dir={tmp_path}", f"run.name={name}"],
            capture_output=True,
            text=True,
            timeout=900,
        )
        assert done.returncode == 0, done.stderr[-3000:]
    a, b = tmp_path / "a", tmp_path / "b"
    rows = numbers(a)
    assert [r["step"] for r in rows if "grad_norm" in r] == [1, 2]
    assert all(r["mismatch/tokens"] > 0 for r in rows if "grad_norm" in r)  # vLLM sampled them
    assert json.dumps(rows) == json.dumps(numbers(b)), [
        (k, ra[k], rb[k]) for ra, rb in zip(rows, numbers(b)) for k in ra if ra[k] != rb.get(k)
    ][:10]
    assert not any(k.startswith(TIMING) for r in rows for k in r)
    files = adapter_files(a)
    assert "adapter_model.safetensors" in files and files == adapter_files(b)
