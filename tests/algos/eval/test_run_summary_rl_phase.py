"""The run summary's RL-phase line: the start-to-end change on the same held-out problems, paired,
with hand-computed mean, SE and z."""

from __future__ import annotations

from pathlib import Path

from veriloop.algos.eval.report import run_summary, write_report


def _report(step: int | None, per_problem: list[float], checkpoint: str) -> dict:
    mean = sum(per_problem) / len(per_problem)
    return {
        "splits": {"id": {"avg@n": mean, "se/avg@n": 0.1, "num_problems": len(per_problem)}},
        "gap": {},
        "meta": {
            "step": step,
            "num_problems": 4,
            "first_seed": 1000,
            "n_samples": 4,
            "checkpoint": checkpoint,
        },
        "per_problem": {"id": {"avg@n": per_problem}},
    }


def test_summary_states_the_rl_phase_change_paired_by_problem(tmp_path: Path) -> None:
    # d = after - before = [0.5, 0, 0.25, 0]: mean 0.1875; deviations 0.3125, -0.1875, 0.0625, -0.1875,
    # squares sum 0.171875, sd^2 = 0.171875 / 3, SE = sqrt(0.171875 / 3 / 4) = 0.11968; z = 1.567
    write_report(_report(None, [0.0, 0.0, 0.0, 0.0], "base model (before SFT)"), tmp_path, "base")
    write_report(_report(0, [0.0, 0.5, 0.25, 0.25], "start (after SFT)"), tmp_path, "step-000000")
    write_report(_report(4, [0.25, 0.25, 0.25, 0.25], "RL step 4"), tmp_path, "step-000004")
    write_report(_report(8, [0.5, 0.5, 0.5, 0.25], "RL step 8"), tmp_path, "step-000008")
    summary = run_summary(tmp_path)
    line = next(x for x in summary.splitlines() if x.startswith("**RL phase"))
    assert "on 4 held-out problems x 4 samples" in line
    assert "avg@n 0.250 at the start (step 0) -> 0.438 at step 8" in line
    assert "a change of +0.188 ± 0.120 (paired SE, z = 1.6): within 3 SE, so it may be noise" in line
    assert "averaged over the same problems" in line


def test_summary_says_beyond_noise_when_every_problem_gains(tmp_path: Path) -> None:
    # d = [0.25, 0.5, 0.25, 0.5]: mean 0.375, SE = sqrt(4 * 0.125**2 / 3 / 4) = 0.0722, z = 5.2
    write_report(_report(0, [0.0, 0.0, 0.25, 0.25], "start (after SFT)"), tmp_path, "step-000000")
    write_report(_report(12, [0.25, 0.5, 0.5, 0.75], "RL step 12"), tmp_path, "step-000012")
    line = next(x for x in run_summary(tmp_path).splitlines() if x.startswith("**RL phase"))
    assert "a change of +0.375 ± 0.072 (paired SE, z = 5.2): beyond noise" in line


def test_no_rl_phase_line_without_a_later_evaluation(tmp_path: Path) -> None:
    write_report(_report(0, [0.0, 0.5, 0.25, 0.25], "start (after SFT)"), tmp_path, "step-000000")
    assert "RL phase" not in run_summary(tmp_path)
