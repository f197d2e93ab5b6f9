"""Two fresh runs with the same seed give the same numbers: ``metrics.jsonl`` equal key for key and
digit for digit (timings aside) and byte-identical adapter files.

Each run is its own process (``veriloop``'s ``train()`` on the tiny Llama, LoRA, CPU, fp32, the HF
engine sampling at temperature 1), as two invocations of ``veriloop train`` are. What is and is not
deterministic is listed in docs/reliability.md ("Determinism").
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

WORKER = r"""
import sys
from veriloop.envs.math_env import MathVerifyEnv
from veriloop.envs.verifiers import Verdict
import veriloop.algos.loop.train as T
from veriloop.configs.loader import load_config

# a deterministic coin as the math check, so that groups have differing rewards
MathVerifyEnv.check = lambda self, r, task: Verdict(correct=len(r) % 2 == 0, reason="coin")
T.train(load_config(None, sys.argv[1:]), quiet=True)
"""
CONFIG = [
    "policy.model=tiny",
    "policy.lora=true",
    "env.id=veriloop/MathVerify-v0",
    "env.kwargs={level: 1}",
    "run.algo_preset=rloo",
    "rollout.prompts_per_step=2",
    "rollout.group_size=4",
    "rollout.max_new_tokens=8",
    "rollout.max_context=256",
    "train.micro_batch_size=2",
    "train.lr=1e-2",
    "train.steps=3",
    "run.checkpoint_every=0",
    "eval.every=0",
    "eval.at_start=false",
    "eval.num_problems=1",
    "eval.n_samples=1",
    "eval.k_list=[1]",
    "run.tensorboard=false",
]
#: Wall-clock keys: when and how fast, never what was computed.
TIMING = ("time", "time/", "throughput/")


def numbers(run: Path) -> list[dict[str, Any]]:
    """``metrics.jsonl`` without its timing keys."""
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line]
    return [{k: v for k, v in r.items() if not k.startswith(TIMING)} for r in rows]


def fresh_runs(tmp: Path, extra: list[str]) -> tuple[Path, Path]:
    """Two runs of the same config, each in its own process (both at once)."""
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", WORKER, *CONFIG, *extra, f"run.out_dir={tmp}", f"run.name={n}"],
            env={**os.environ, "OMP_NUM_THREADS": "1"},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        for n in ("a", "b")
    ]
    for p in procs:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err.decode()[-3000:]
    return tmp / "a", tmp / "b"


def adapter_files(run: Path) -> dict[str, bytes]:
    return {
        f.name: f.read_bytes() for f in sorted((run / "final").iterdir()) if f.name.startswith("adapter_")
    }


def test_two_fresh_synchronous_runs_are_identical(tmp_path: Path) -> None:
    a, b = fresh_runs(tmp_path, [])
    rows = numbers(a)
    assert [r["step"] for r in rows if "grad_norm" in r] == [1, 2, 3]
    assert any(r["grad_norm"] > 0 for r in rows if "grad_norm" in r)  # it trained: equal is not all zeros
    assert json.dumps(rows) == json.dumps(numbers(b))
    files = adapter_files(a)
    assert set(files) == {"adapter_config.json", "adapter_model.safetensors"}
    assert files == adapter_files(b)


#: The asynchronous loop's snapshot of its scheduler when the step is logged (how far generation
#: got meanwhile) and its wait shares: thread timing, like the wall clock.
ASYNC_TIMING = ("async/admitted", "async/capacity", "async/running", "async/queued", "async/generator_wait_fraction",
                "async/trainer_wait_fraction")  # fmt: skip


def test_two_fresh_asynchronous_runs_are_identical_when_groups_start_at_the_same_versions(
    tmp_path: Path,
) -> None:
    """K = 1 with generation faster than training (the tiny model, 8 tokens): every group starts
    under the same weight version in both runs (``prompts.jsonl``), and then the numbers and the
    adapter are the same too; only the scheduler's snapshot and wait shares differ."""
    a, b = fresh_runs(tmp_path, ["train.max_staleness=1", "algo.rollout_is=truncate", "train.steps=4"])
    ledger = (a / "prompts.jsonl").read_text()
    assert ledger == (b / "prompts.jsonl").read_text()
    rows = [json.loads(line) for line in ledger.splitlines()]
    assert [r["seed"] for r in rows if r["event"] == "trained"] == list(range(8))
    assert max(r["version"] - r["v_start"] for r in rows if r["event"] == "trained") == 1  # it ran ahead
    strip = [{k: v for k, v in r.items() if k not in ASYNC_TIMING} for r in numbers(a)]
    assert [r["step"] for r in strip if "grad_norm" in r] == [1, 2, 3, 4]
    assert any(r["grad_norm"] > 0 for r in strip if "grad_norm" in r)
    assert any(k.startswith("async/") for k in strip[0])  # the staleness, span and drop counts compared
    assert json.dumps(strip) == json.dumps(
        [{k: v for k, v in r.items() if k not in ASYNC_TIMING} for r in numbers(b)]
    )
    assert adapter_files(a) == adapter_files(b)
