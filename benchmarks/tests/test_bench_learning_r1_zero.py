"""The r1_zero suite: RL from the base model with R1-Zero's prompt and reward, and its curves by step."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import gymnasium as gym
import pytest

import veriloop.envs  # noqa: F401  (registers the environments)
from veriloop.configs.loader import load_config

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(ROOT / "benchmarks"))  # it imports its sibling learning_report
    try:
        spec = importlib.util.spec_from_file_location(
            "bench_learning", ROOT / "benchmarks" / "bench_learning.py"
        )
        module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
        spec.loader.exec_module(module)  # type: ignore[union-attr]
        yield module
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))


@pytest.fixture(scope="module")
def report(bench):
    return sys.modules["learning_report"]


def test_rl_starts_from_the_base_model_with_r1_zeros_prompt_and_reward(bench, tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(bench.subprocess, "call", lambda args, cwd, stdout, stderr: calls.append(args) or 0)
    arms = {label: (config, overrides) for label, config, overrides in bench.SUITES["r1_zero"]["arms"]}
    assert set(arms) == {"gemma_r1_zero", "gemma_r1_zero_think"}
    # the primed arm differs in its assistant prefix alone
    assert arms["gemma_r1_zero_think"] == (
        "quickstart",
        [*arms["gemma_r1_zero"][1], "env.assistant_prefix=<think>"],
    )
    assert load_config("quickstart", arms["gemma_r1_zero_think"][1]).env.assistant_prefix == "<think>"
    label, (config, overrides) = "gemma_r1_zero", arms["gemma_r1_zero"]
    bench.run_arm("r1_zero", label, config, overrides, 1, tmp_path)
    ((*_, command, name),) = [c[:5] for c in calls]  # python -m veriloop.cli train CONFIG OVERRIDES...
    args = calls[0][5:]
    assert (command, name) == ("train", "quickstart") and "rollout.seed=1000" in args
    cfg = load_config(name, args)
    assert cfg.policy.model == "gemma3-270m" and cfg.sft.steps == 0  # the base model, no warm-up
    assert not cfg.eval.before_sft and cfg.eval.at_start  # step 0's evaluation is the base model's
    # the env pays 1 for a right answer and 0.1 for the shape; the trainer adds no second format bonus
    assert cfg.env.kwargs["reward"] == "r1" and cfg.algo.format_reward == 0
    assert (cfg.train.steps, cfg.eval.every, cfg.rollout.prompts_per_step, cfg.rollout.group_size) == (
        30,
        10,
        8,
        8,
    )
    assert (cfg.eval.num_problems, cfg.eval.n_samples, cfg.rollout.backend) == (128, 2, "vllm")
    # a run in which nothing is informative goes on to its end (what happens is the result)
    assert cfg.train.max_uninformative_steps == 0 and cfg.train.untrained_after_groups == 0
    env = gym.make(cfg.env.id, **cfg.env.kwargs)
    prompt, _ = env.reset(seed=3)
    assert "<think>" in prompt and "<answer>" in prompt  # R1-Zero's prompt


def _r1_run(tmp_path: Path) -> Path:
    """A run's log: held-out evaluations at steps 0, 2 and 4, RL rows at steps 1-4."""
    run = tmp_path / "gemma_r1_zero-s0"
    run.mkdir()
    held = {
        0: {"avg@n": 0.0, "se/avg@n": 0.0, "format_rate": 0.0, "response_length/mean": 128.0, "truncation_rate": 1.0},
        2: {"avg@n": 0.1, "se/avg@n": 0.05, "format_rate": 0.25, "response_length/mean": 100.0, "truncation_rate": 0.5},
        4: {"avg@n": 0.2, "se/avg@n": 0.06, "format_rate": 0.75, "response_length/mean": 60.0, "truncation_rate": 0.25},
    }  # fmt: skip
    train = {  # step: (format_rate, success_rate, response_length/mean)
        1: (0.0, 0.0, 128.0),
        2: (0.5, 0.25, 110.0),
        3: (0.25, 0.5, 90.0),
        4: (1.0, 0.0, 50.0),
    }
    rows = [{"step": 0, **{f"eval/id/{k}": v for k, v in held[0].items()}}]
    for step, (fmt, acc, length) in train.items():
        row = {"step": step, "reward/mean": acc + 0.1 * fmt, "format_rate": fmt, "success_rate": acc}
        row["sampling/informative_fraction"] = 0.0 if step == 1 else 0.5
        row["response_length/mean"] = length
        row.update({f"eval/id/{k}": v for k, v in held.get(step, {}).items()})
        rows.append(row)
    (run / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return run


def test_the_curves_by_step_are_collected_tabled_and_plotted(bench, report, tmp_path):
    got = bench.collect(_r1_run(tmp_path))
    assert got["train"]["step"] == [1, 2, 3, 4]
    assert got["train"]["format_rate"] == [0.0, 0.5, 0.25, 1.0]
    assert got["train"]["success_rate"] == [0.0, 0.25, 0.5, 0.0]
    runs = {"gemma_r1_zero": {0: got}}
    # held-out at each evaluated step; training averaged over the RL rows since the evaluation before
    start, mid, end = report.r1_zero_table(runs)
    assert (start["step"], start["train steps"], start["train format_rate"]) == (0, [], None)
    assert (start["heldout format_rate"], start["heldout response_length/mean"]) == (0.0, 128.0)
    assert mid["train steps"] == [1, 2] and mid["train format_rate"] == pytest.approx(0.25)
    assert mid["train success_rate"] == pytest.approx(0.125) and mid["train response_length/mean"] == 119.0
    assert (
        mid["train sampling/informative_fraction"] == 0.25
        and end["train sampling/informative_fraction"] == 0.5
    )
    assert end["train steps"] == [3, 4] and end["train format_rate"] == pytest.approx(0.625)
    assert end["train response_length/mean"] == 70.0
    assert (end["heldout avg@n"], end["heldout se/avg@n"], end["heldout truncation_rate"]) == (
        0.2,
        0.06,
        0.25,
    )
    summary = report.summarize_all("r1_zero", runs)
    assert summary["r1_zero_table"] == [start, mid, end]
    assert summary["format_rate"]["gemma_r1_zero"]["id"]["end mean"] == 0.75
    assert summary["response_length/mean"]["gemma_r1_zero"]["id"]["start mean"] == 128.0
    report.write_plots("r1_zero", runs, {"gemma_r1_zero": []}, tmp_path)
    drawn = sorted(p.name for p in tmp_path.glob("*.png"))
    assert drawn == ["learning_r1_zero.png", "learning_r1_zero_curves.png"]
    assert (tmp_path / "learning_r1_zero_curves.png").stat().st_size > 1000
