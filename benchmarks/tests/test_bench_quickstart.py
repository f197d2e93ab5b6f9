"""The quickstart-over-seeds and pass@k benchmarks' own arithmetic, on hand-made run folders."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _write(run: Path, name: str, step: int | None, per_problem: list[float]) -> None:
    report = {
        "splits": {
            "id": {"avg@n": sum(per_problem) / len(per_problem), "se/avg@n": 0.1, "reason/correct": 0.5}
        },
        "meta": {"step": step, "num_problems": len(per_problem), "n_samples": 4, "temperature": 0.6},
        "per_problem": {"id": {"avg@n": per_problem}},
    }
    (run / "eval").mkdir(parents=True, exist_ok=True)
    (run / "eval" / f"{name}.json").write_text(json.dumps(report))


def test_collect_pairs_the_rl_phase_and_sums_every_attempt(tmp_path: Path) -> None:
    bench = _load("bench_quickstart")
    run = tmp_path / "s0"
    _write(run, "base", None, [0.0, 0.0, 0.0, 0.0])
    _write(run, "step-000000", 0, [0.0, 0.5, 0.25, 0.25])
    _write(run, "step-000012", 12, [0.5, 0.5, 0.5, 0.25])
    (run / "final").mkdir()
    record = tmp_path / "s0.attempts.json"
    record.write_text(
        json.dumps(
            [
                {"started": 0.0, "seconds": 100.0, "cpu_seconds": 150.0, "maxrss_gb": 1.5},
                {"started": 200.0, "seconds": 50.0, "cpu_seconds": 90.0, "maxrss_gb": 1.2},
            ]
        )
    )
    row = bench.collect(run, record)
    # d = [0.5, 0, 0.25, 0]: mean 0.1875, SE = sqrt(0.171875 / 3 / 4) (hand-computed, as for the summary)
    assert row["rl_phase"]["diff"] == pytest.approx(0.1875)
    assert row["rl_phase"]["se"] == pytest.approx(math.sqrt(0.171875 / 12))
    assert row["sft_phase"]["diff"] == pytest.approx(0.25)
    assert row["accuracy"]["12"]["reason/correct"] == 0.5
    assert (row["wall_s"], row["cpu_s"], row["maxrss_gb"]) == (150.0, 240.0, 1.5)
    summary = bench.summarize({0: row})
    assert summary["after_rl"]["mean"] == pytest.approx(0.4375) and summary["seeds_above_3se"] == 0
    assert summary["base"]["mean"] == 0.0 and summary["rl_gain"]["sd"] is None  # one seed: no sd (no NaN)
    # a run without the base model's evaluation (eval.before_sft=false) has no base row, not a crash
    (run / "eval" / "base.json").unlink()
    summary = bench.summarize({0: bench.collect(run, record)})
    assert summary["base"] is None and summary["rl_gain"]["mean"] == pytest.approx(0.1875)


def test_a_killed_attempt_ends_at_its_logs_last_write(tmp_path: Path) -> None:
    bench = _load("bench_quickstart")
    record, log = tmp_path / "s1.attempts.json", tmp_path / "s1.log"
    log.write_text("x")
    started = log.stat().st_mtime - 30.0
    record.write_text(json.dumps([{"started": started, "exit": None}]))
    (attempt,) = bench.attempts(record)
    assert attempt["exit"] == "killed" and attempt["estimated"] and attempt["seconds"] == pytest.approx(30.0)


def test_pass_at_k_bench_ks_and_crossings() -> None:
    bench = _load("bench_pass_at_k")
    assert bench.ks_up_to(64) == [1, 2, 4, 8, 16, 32, 64] and bench.ks_up_to(6) == [1, 2, 4, 6]
    rl = {1: (0.4, 0.0), 8: (0.6, 0.0), 64: (0.7, 0.0)}
    base = {1: (0.2, 0.0), 8: (0.6, 0.0), 64: (0.9, 0.0)}
    assert bench.crossings(rl, base) == [{"between_k": [1, 64], "before": "a above"}]
    assert bench.crossings(rl, rl) == []


def test_pass_at_k_bench_pairs_by_problem() -> None:
    """Two problems, 4 samples: before c = (1, 0), after c = (2, 0). pass@1: 1/4 -> 2/4 on problem 0,
    0 -> 0 on problem 1, so d = (0.25, 0), diff 0.125, sd 0.1768, SE 0.125; pass@4: 1 -> 1 and 0 -> 0."""
    bench = _load("bench_pass_at_k")
    one = bench.paired_at(1, 4, [1, 0], [2, 0])
    assert (
        one["diff"] == pytest.approx(0.125)
        and one["se"] == pytest.approx(0.125)
        and one["z"] == pytest.approx(1.0)
    )
    four = bench.paired_at(4, 4, [1, 0], [2, 0])
    assert four["diff"] == 0.0 and four["se"] == 0.0
