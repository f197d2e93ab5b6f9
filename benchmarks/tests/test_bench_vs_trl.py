"""bench_vs_trl's bookkeeping: arms by framework and precision, speed-ups against TRL in the same
precision, phases against the peak of the dtype they ran in (the benchmark itself is not run here)."""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("bench_vs_trl", ROOT / "benchmarks" / "bench_vs_trl.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_arms_split_into_framework_and_precision(bench) -> None:  # type: ignore[no-untyped-def]
    assert len(bench.ARMS) == 6
    assert bench.split_arm("veriloop_vllm_bf16") == ("veriloop_vllm", "bf16")
    assert bench.split_arm("trl_fp32") == ("trl", "fp32")
    with pytest.raises(ValueError, match="unknown arm"):
        bench.split_arm("veriloop_fp16")
    args = argparse.Namespace(vllm_dtype="same")
    assert bench.sampler_dtype("veriloop_vllm_bf16", args) == "bfloat16"
    assert bench.sampler_dtype("veriloop_fp32", args) == "float32"
    assert bench.sampler_dtype("veriloop_vllm_fp32", argparse.Namespace(vllm_dtype="bfloat16")) == "bfloat16"


def test_speedups_are_against_trl_in_the_same_precision(bench) -> None:  # type: ignore[no-untyped-def]
    summary = {
        name: {"step_s": {"mean": s}}
        for name, s in {
            "trl_fp32": 40.0,
            "veriloop_fp32": 20.0,
            "trl_bf16": 30.0,
            "veriloop_bf16": 10.0,
        }.items()
    }
    assert bench.speedups_by_precision(summary) == {"veriloop_fp32": 2.0, "veriloop_bf16": 3.0}


def test_phases_are_fractions_of_their_dtype_peak(bench) -> None:  # type: ignore[no-untyped-def]
    args = argparse.Namespace(prompts=1, group=2)
    # two steps (the first a discarded warm-up): 10 generated tokens in 1 s, 100 processed in 2 s
    records = [
        {
            "wall_s": 3.0,
            "rollout_s": 1.0,
            "train_s": 2.0,
            "gen_tokens": 10.0,
            "train_tokens": 20.0,
            "hwm_mb": 1.0,
        }
        for _ in range(2)
    ]
    out = bench.summarize(
        records, [40, 40], args, n_params=1_000_000_000, peaks={"rollout": 100.0, "train": 200.0}
    )
    assert out["rollout_gen_tokens_per_s"] == pytest.approx(10.0)
    assert out["train_processed_tokens_per_s"] == pytest.approx(50.0)  # (2 x 40 + 20) / 2 s
    assert out["rollout_fraction_of_matmul_peak"] == pytest.approx(2 * 1e9 * 10 / 100e9)  # 2 N per token
    assert out["train_fraction_of_matmul_peak"] == pytest.approx(4 * 1e9 * 50 / 200e9)  # 4 N per token
    bare = bench.summarize(records, [40, 40], args, n_params=1, peaks={"rollout": None, "train": None})
    assert "train_fraction_of_matmul_peak" not in bare  # no peak measured for that dtype: no fraction
