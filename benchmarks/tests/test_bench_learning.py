"""The learning benchmark's own arithmetic: paired gains, the gain table, the vision table."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def bench():
    """The benchmark script, importing its sibling ``learning_report`` as it does when run."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        yield _load("bench_learning")
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))


@pytest.fixture(scope="module")
def report(bench):
    return sys.modules["learning_report"]


def _run(tmp_path: Path, per_step: dict[int, list[float]], wall: list[float]) -> Path:
    run = tmp_path / "grpo-s0"
    (run / "eval").mkdir(parents=True)
    rows = []
    for step, values in per_step.items():
        report = {
            "meta": {"step": step},
            "per_problem": {"id": {"avg@n": values}},
            "splits": {"id": {"avg@n": sum(values) / len(values)}},
        }
        (run / "eval" / f"step-{step:06d}.json").write_text(json.dumps(report))
        rows.append({"step": step, "eval/id/avg@n": sum(values) / len(values)})
    (run / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    (tmp_path / "grpo-s0.wall.json").write_text(
        json.dumps([{"seconds": s, "exit": 0, "cpus": 2} for s in wall])
    )
    return run


def test_paired_gain_by_hand(bench, report, tmp_path):
    # 4 problems: 0 -> 0.5, 0.25 -> 0.25, 0.5 -> 1, 0.5 -> 0.75: d = (0.5, 0, 0.5, 0.25)
    run = _run(tmp_path, {0: [0.0, 0.25, 0.5, 0.5], 10: [0.5, 0.25, 1.0, 0.75]}, wall=[1800.0, 900.0])
    got = bench.collect(run)
    g = got["gains"]["id"]["10"]
    mean = 0.3125
    sd = math.sqrt(((0.5 - mean) ** 2 * 2 + mean**2 + (0.25 - mean) ** 2) / 3)
    assert g["diff"] == pytest.approx(mean) and g["se"] == pytest.approx(sd / 2)
    assert g["z"] == pytest.approx(mean / (sd / 2))
    assert got["cpu_hours"] == pytest.approx((1800 + 900) * 2 / 3600)  # both attempts of a resumed run
    (row,) = report.gain_table({"grpo": {0: got}})
    assert row["start"] == pytest.approx(0.3125) and row["end"] == pytest.approx(0.625)
    assert row["above_3se"] == (g["z"] > 3) and row["num_problems"] == 4


def test_no_start_evaluation_no_gains(bench, report, tmp_path):
    run = _run(tmp_path, {10: [0.5, 0.25]}, wall=[])
    got = bench.collect(run)
    assert got["gains"] == {} and got["cpu_hours"] is None and report.gain_table({"grpo": {0: got}}) == []


def test_an_arm_without_a_start_evaluation_takes_its_start_arms(bench, report, tmp_path):
    # the start arm (grpo-s0) evaluated the shared warm-up at step 0; process-s0 only at step 10
    start = _run(tmp_path, {0: [0.0, 0.25, 0.5, 0.5], 10: [0.0, 0.0, 0.0, 0.0]}, wall=[])
    other = tmp_path / "other"
    run = _run(other, {10: [0.5, 0.25, 1.0, 0.75]}, wall=[])
    spec = {"start_arm": "grpo"}
    assert bench.start_run(spec, "grpo", 0, tmp_path) is None  # the start arm itself
    assert bench.start_run(spec, "process", 1, tmp_path) is None  # no grpo-s1 folder
    assert bench.start_run(spec, "process", 0, tmp_path) == start
    got = bench.collect(run, start)
    assert got["evals"]["id"]["0"]["avg@n"] == pytest.approx(0.3125)  # the start arm's step 0
    assert got["gains"]["id"]["10"]["diff"] == pytest.approx(0.3125)  # as by hand above
    assert report.summarize({"process": {0: got}})["process"]["id"]["start mean"] == pytest.approx(0.3125)
    assert bench.collect(run)["gains"] == {}  # without it: no start, no gain
    assert got["start_per_problem"] == {"id": [0.0, 0.25, 0.5, 0.5]}


def test_sft_only_and_rl_arms_are_each_paired_with_the_shared_start_and_sft_only(bench, report, tmp_path):
    # an SFT-only arm that goes on from the shared warm-up evaluates once, at its own step 0 (its end):
    # its start is the start arm's step 0, not that
    start = _run(tmp_path, {0: [0.0, 0.25, 0.5, 0.5], 30: [0.5, 0.25, 1.0, 0.75]}, wall=[])
    sft = _run(tmp_path / "sft", {0: [0.25, 0.25, 0.5, 1.0]}, wall=[])
    runs = {"sft_only": {0: bench.collect(sft, start)}, "sft_then_grpo": {0: bench.collect(start)}}
    assert runs["sft_only"][0]["start_per_problem"] == {"id": [0.0, 0.25, 0.5, 0.5]}
    table = report.matched_table(runs, "sft_then_grpo", ["id", "rule_ood"])
    # no such split measured
    assert table["rule_ood"] == {"vs_start": [], "vs_sft_only": [], "vs_start_arm": []}
    sft_row, rl_row = table["id"]["vs_start"]
    # SFT only - start: d = (.25, 0, 0, .5), mean .1875; RL - start: d = (.5, 0, .5, .25), mean .3125
    assert (sft_row["arm"], sft_row["reference"]) == ("sft_only", "start")
    assert sft_row["diff (per seed)"] == pytest.approx([0.1875])
    assert rl_row["arm"] == "sft_then_grpo" and rl_row["diff (per seed)"] == pytest.approx([0.3125])
    # RL - SFT only: d = (.25, 0, .5, -.25), mean .125
    (rl_vs_sft,) = table["id"]["vs_sft_only"]
    assert (rl_vs_sft["arm"], rl_vs_sft["reference"]) == ("sft_then_grpo", "sft_only")
    assert rl_vs_sft["diff (per seed)"] == pytest.approx([0.125])
    assert table["id"]["vs_start_arm"] == []  # no other RL arm; SFT only is not one
    summary = report.summarize_all("points24_easy", runs, "sft_then_grpo")
    assert summary["matched"] == table and "matched" not in report.summarize_all("points24_easy", runs)
    # another RL arm (VIter 1) against the start arm (VIter 3): d = (-.5, .25, -.5, -.75), mean -.375
    runs["viter1"] = {0: bench.collect(_run(tmp_path / "v1", {30: [0.0, 0.5, 0.5, 0.0]}, wall=[]), start)}
    (v1,) = report.matched_table(runs, "sft_then_grpo", ["id"])["id"]["vs_start_arm"]
    assert (v1["arm"], v1["reference"]) == ("viter1", "sft_then_grpo")
    assert v1["diff (per seed)"] == pytest.approx([-0.375])


def test_vision_table_counts_an_absent_reason_as_zero_and_spreads_over_seeds(report):
    def run(acc: float, illegal: float | None) -> dict:
        metrics = {"avg@n": acc, "recognition_acc": 0.5, "reason/wrong_value": 0.1}
        if illegal is not None:
            metrics["reason/illegal_numbers"] = illegal
        return {"evals": {"id": {"0": metrics}}, "base": {}}

    (row,) = report.vision_table({"sft_only": {0: run(0.0, 0.4), 1: run(0.5, None)}})
    assert row["policy"] == "sft_only @ step 0" and row["seeds"] == [0, 1]
    assert row["reason/illegal_numbers"]["per_seed"] == [0.4, 0.0]  # seed 1 gave no illegal answer
    assert row["avg@n"]["mean"] == 0.25 and row["avg@n"]["sd"] == pytest.approx(math.sqrt(0.125))
    assert row["reason/unparseable"]["per_seed"] == [0.0, 0.0]


def test_s2r_summary_spreads_each_policy_over_seeds_and_pairs_process_with_outcome(report):
    def run(bal: float, w2r: float, end: list[float]) -> dict:
        metrics = {"avg@n": sum(end) / len(end), "verify_balanced_acc": bal, "wrong_to_right": w2r}
        return {"evals": {"id": {"20": metrics}}, "base": {}, "train": {}, "end_per_problem": {"id": end}}

    runs = {
        "outcome_rloo": {
            0: run(0.6, 0.00, [0.0, 0.5]),
            1: run(0.5, 0.02, [0.5, 0.5]),
            2: run(0.55, 0.01, [0.0, 0.0]),
        },
        "process_grpo": {
            0: run(0.9, 0.04, [0.5, 0.5]),
            1: run(0.8, 0.06, [0.5, 1.0]),
            2: run(0.85, 0.05, [0.5, 0.0]),
        },
    }
    out = report.summarize_all("s2r_easy", runs)
    rows = {row["policy"]: row for row in out["s2r_table"]}
    bal = rows["process_grpo @ step 20"]["verify_balanced_acc"]
    # (0.9, 0.8, 0.85): mean 0.85, sd 0.05, se 0.05 / sqrt(3)
    assert bal["per_seed"] == [0.9, 0.8, 0.85] and bal["mean"] == pytest.approx(0.85)
    assert bal["sd"] == pytest.approx(0.05) and bal["se"] == pytest.approx(0.05 / math.sqrt(3))
    assert rows["outcome_rloo @ step 20"]["wrong_to_right"]["mean"] == pytest.approx(0.01)
    assert rows["outcome_rloo @ step 20"]["verify_macro_f1"]["se"] is None  # no seed logged it
    (diff,) = out["process_vs_outcome"]
    # per deal, process - outcome: seed 0 (.5, 0) -> .25, seed 1 (0, .5) -> .25, seed 2 (.5, 0) -> .25
    assert diff["arm"] == "process_grpo" and diff["diff (per seed)"] == pytest.approx([0.25, 0.25, 0.25])
    assert diff["diff sd over seeds"] == pytest.approx(0.0)


def test_arm_differences_pair_by_problem_within_a_seed_and_spread_over_seeds(report):
    # seed 0: grpo ends (0, .5, 1, .5), clip_higher (.5, .5, 1, 1): d = (.5, 0, 0, .5), mean .25
    # seed 1: grpo ends (1, 1, 0, 0), clip_higher (1, .5, 0, 0): d = (0, -.5, 0, 0), mean -.125
    runs = {
        "grpo": {
            0: {"end_per_problem": {"id": [0.0, 0.5, 1.0, 0.5]}},
            1: {"end_per_problem": {"id": [1.0, 1.0, 0.0, 0.0]}},
        },
        "clip_higher": {
            0: {"end_per_problem": {"id": [0.5, 0.5, 1.0, 1.0]}},
            1: {"end_per_problem": {"id": [1.0, 0.5, 0.0, 0.0]}},
            2: {"end_per_problem": {"id": [1.0, 0.5, 0.0, 0.0]}},
        },  # no grpo seed 2: left out
    }
    (row,) = report.arm_differences(runs)
    assert row["arm"] == "clip_higher" and row["seeds"] == [0, 1]
    assert row["diff (per seed)"] == pytest.approx([0.25, -0.125])
    # seed 0's SE: sd of (.5, 0, 0, .5) over sqrt(4) problems
    assert row["se_eval (per seed)"][0] == pytest.approx(math.sqrt(4 * 0.25**2 / 3) / 2)
    assert row["diff mean"] == pytest.approx(0.0625)
    sd = math.sqrt(2 * 0.1875**2)  # sample sd of (.25, -.125)
    assert row["diff sd over seeds"] == pytest.approx(sd)
    assert row["se_over_seeds"] == pytest.approx(sd / math.sqrt(2))
    # each part against the row above: token_level's effect is token_level - clip_higher (seed 0 only)
    runs["token_level"] = {0: {"end_per_problem": {"id": [0.5, 0.5, 0.5, 1.0]}}}
    clip, token = report.part_effects(runs)
    assert (clip["arm"], clip["reference"]) == ("clip_higher", "grpo") and clip["diff mean"] == row[
        "diff mean"
    ]
    assert (token["arm"], token["reference"], token["seeds"]) == ("token_level", "clip_higher", [0])
    assert token["diff (per seed)"] == pytest.approx([-0.125])  # d = (0, 0, -.5, 0)


def test_end_per_problem_is_the_last_evaluation(bench, tmp_path):
    run = _run(tmp_path, {0: [0.0, 0.25], 20: [0.5, 1.0], 10: [1.0, 1.0]}, wall=[])
    assert bench.collect(run)["end_per_problem"] == {"id": [0.5, 1.0]}


def test_write_plots_draws_the_suites_plots(report, tmp_path):
    # the sft_only arm (dashed) is placed by its own SFT examples, the RL arm by SFT + episodes
    def run(values: dict[str, float]) -> dict:
        return {"evals": {"id": {s: {"avg@n": v} for s, v in values.items()}}, "base": {}}

    runs = {"sft_only": {0: run({"0": 0.4})}, "sft_then_grpo": {0: run({"0": 0.4, "10": 0.5})}}
    arms = {
        "sft_only": [
            "sft.steps=200",
            "sft.examples=1600",
            "sft.steps=240",
            "sft.examples=1920",
            "train.steps=0",
        ],
        "sft_then_grpo": ["sft.steps=200", "sft.examples=1600"],
    }
    report.write_plots("points24_easy", runs, arms, tmp_path, 1600, "sft_then_grpo")
    drawn = sorted(p.name for p in tmp_path.glob("*.png"))
    assert drawn == [
        "learning_points24_easy.png",
        "learning_points24_easy_by_examples.png",
        "learning_points24_easy_illegal_numbers.png",
    ]
    assert all((tmp_path / name).stat().st_size > 1000 for name in drawn)
    # S2R: success, balanced verification accuracy and wrong -> right by step
    s2r = {"avg@n": 0.3, "verify_balanced_acc": 0.66, "wrong_to_right": 0.05}
    runs = {"outcome_rloo": {0: {"evals": {"id": {"0": s2r, "10": s2r}}, "base": {}}}}
    (tmp_path / "s2r").mkdir()
    report.write_plots("s2r_easy", runs, {"outcome_rloo": []}, tmp_path / "s2r")
    drawn = sorted(p.name for p in (tmp_path / "s2r").glob("*.png"))
    assert drawn == [
        "learning_s2r_easy.png",
        "learning_s2r_easy_balanced_acc.png",
        "learning_s2r_easy_wrong_to_right.png",
    ]


def test_shared_sft_rl_arms_start_from_one_warmup_per_seed(bench, tmp_path, monkeypatch):
    calls = []

    def fake_call(args, cwd, stdout, stderr):  # a finished command writes what the real one would
        calls.append(args[3:])
        name = next(a.split("=", 1)[1] for a in args if a.startswith("run.name="))
        out = next(a.split("=", 1)[1] for a in args if a.startswith("run.out_dir="))
        (Path(out) / name / ("sft/final" if args[3] == "sft" else "final")).mkdir(parents=True)
        return 0

    monkeypatch.setattr(bench.subprocess, "call", fake_call)
    monkeypatch.setattr(bench, "KEPT_WARMUPS", tmp_path / "kept")  # none kept
    for label, config, overrides in bench.SUITES["points24_easy"]["arms"]:
        bench.run_arm("points24_easy", label, config, overrides, 1, tmp_path)
    commands = [c[0] for c in calls]
    assert commands == ["sft", "train", "train", "train", "train"]  # the warm-up, sft_only, 3 RL arms
    warmup, sft_only, *rl = calls
    final = f"policy.model={tmp_path / 'sft-s1' / 'sft' / 'final'}"
    assert all(final in c and c[-1] == "sft.steps=0" for c in rl)
    # SFT only goes on from the warm-up with its own 240 steps on 1920 new examples
    assert final in sft_only and sft_only[-1] == final and "sft.steps=240" in sft_only
    assert (
        "rollout.seed=1000" in warmup and "sft.steps=200" in warmup and "--resume" not in warmup
    )  # a new one
    # fresh_problems: every arm's problems come after the warm-up's 1600 examples
    assert all("rollout.seed=2600" in c for c in [sft_only, *rl])
    assert bench.cpu_hours(tmp_path / "sft-s1.wall.json") is not None  # its cost is recorded once
    # a cut warm-up (no saved policy) is continued (`sft --resume`); a finished one is not run
    calls.clear()
    (tmp_path / "s2r").mkdir()
    for label, config, overrides in bench.SUITES["s2r_easy"]["arms"]:  # outcome and process RL
        bench.run_arm("s2r_easy", label, config, overrides, 0, tmp_path / "s2r")
    assert [c[0] for c in calls] == ["sft", "train", "train", "train"]
    assert "algo.preset=s2r_process_grpo_balanced" in calls[-1]
    assert all(f"policy.model={tmp_path / 's2r' / 'sft-s0' / 'sft' / 'final'}" in c for c in calls[1:])
    assert all("rollout.seed=0" in c for c in calls)  # no fresh_problems: they replay the warm-up's
    calls.clear()
    bench.shared_warmup("points24_easy", "points24_easy_grpo", 1, tmp_path)
    assert calls == []
    (tmp_path / "sft-s2" / "sft" / "step-10").mkdir(parents=True)
    bench.shared_warmup("points24_easy", "points24_easy_grpo", 2, tmp_path)
    assert [c[0] for c in calls] == ["sft"] and "--resume" in calls[0] and "--overwrite" not in calls[0]


def test_a_kept_warmup_is_restored_on_a_fresh_machine_instead_of_trained_again(bench, tmp_path, monkeypatch):
    calls = []

    def fake_call(args, cwd, stdout, stderr):
        calls.append(args[3:])
        name = next(a.split("=", 1)[1] for a in args if a.startswith("run.name="))
        out = next(a.split("=", 1)[1] for a in args if a.startswith("run.out_dir="))
        final = Path(out) / name / ("sft/final" if args[3] == "sft" else "final")
        final.mkdir(parents=True)
        (final / "veriloop.json").write_text('{"kind": "lora-adapter"}')
        (final / "adapter_model.safetensors").write_bytes(b"weights")
        return 0

    monkeypatch.setattr(bench.subprocess, "call", fake_call)
    monkeypatch.setattr(bench, "KEPT_WARMUPS", tmp_path / "kept")
    monkeypatch.setattr(bench, "ROOT", tmp_path)
    first, second = tmp_path / "session1", tmp_path / "session2"
    first.mkdir()
    final = bench.shared_warmup("s2r_easy", "solve_verify_outcome_rloo", 2, first)
    kept = bench.keep_warmup(final, "s2r_easy", 2)
    assert kept == tmp_path / "kept" / "s2r_easy" / "sft-s2"
    assert (kept / "adapter_model.safetensors").read_bytes() == b"weights"
    assert [c[0] for c in calls] == ["sft"]
    assert json.loads((tmp_path / "kept" / "s2r_easy" / "sft-s2.wall.json").read_text())[0]["exit"] == 0
    # the next session's machine has no runs/: the arm starts from the kept copy, with no new warm-up
    second.mkdir()
    arms = {label: (config, o) for label, config, o in bench.SUITES["s2r_easy"]["arms"]}
    bench.run_arm("s2r_easy", "process_grpo", *arms["process_grpo"], 2, second)
    assert [c[0] for c in calls] == ["sft", "train"]
    restored = second / "sft-s2" / "sft" / "final"
    assert f"policy.model={restored}" in calls[-1]
    assert (restored / "adapter_model.safetensors").read_bytes() == b"weights"
    assert bench.cpu_hours(second / "sft-s2.wall.json") is not None  # its cost comes back with it
    # a warm-up of another seed, never kept, is trained
    bench.shared_warmup("s2r_easy", "solve_verify_outcome_rloo", 3, second)
    assert [c[0] for c in calls] == ["sft", "train", "sft"]


def test_an_arm_measures_its_own_start_when_its_start_arms_run_is_not_there(bench, tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(bench.subprocess, "call", lambda args, cwd, stdout, stderr: calls.append(args) or 0)
    (tmp_path / "sft-s0" / "sft" / "final").mkdir(parents=True)  # the seed's warm-up, already made
    arms = {label: (config, o) for label, config, o in bench.SUITES["points24_easy"]["arms"]}
    bench.run_arm("points24_easy", "viter5", *arms["viter5"], 0, tmp_path)
    assert "eval.at_start=true" in calls[-1]  # no sft_then_grpo-s0 to take step 0 from
    assert calls[-1].index("eval.at_start=true") > calls[-1].index("eval.at_start=false")  # it wins
    (tmp_path / "sft_then_grpo-s0").mkdir()
    bench.run_arm("points24_easy", "viter1", *arms["viter1"], 0, tmp_path)
    assert "eval.at_start=false" in calls[-1] and "eval.at_start=true" not in calls[-1]
    bench.run_arm("points24_easy", "sft_then_grpo", *arms["sft_then_grpo"], 0, tmp_path)
    assert not any(a.startswith("eval.at_start") for a in calls[-1])  # the start arm measures it anyway


def test_a_killed_attempt_still_records_its_cost(bench, tmp_path, monkeypatch):
    def interrupted(args, cwd, stdout, stderr):  # `kill` (SIGTERM, made SystemExit) or Ctrl-C mid-run
        raise KeyboardInterrupt

    monkeypatch.setattr(bench.subprocess, "call", interrupted)
    with pytest.raises(KeyboardInterrupt):
        bench._call("grpo-s0", ["python", "-m", "veriloop.cli", "train"], tmp_path)
    (cut,) = json.loads((tmp_path / "grpo-s0.wall.json").read_text())
    assert cut["exit"] == "killed" and cut["seconds"] >= 0 and "estimated" not in cut
    # a SIGKILLed attempt leaves its opening record only: it ends at the log's last write
    wall, log = tmp_path / "sft-s0.wall.json", tmp_path / "sft-s0.log"
    wall.write_text(json.dumps([{"started": 1000.0, "exit": None, "cpus": 2}]))
    log.write_text("step 1")
    os.utime(log, (2800.0, 2800.0))
    assert bench.cpu_hours(wall) == pytest.approx(1800 * 2 / 3600)
    # the next attempt writes that estimate down before the log grows, and adds its own time
    monkeypatch.setattr(bench.subprocess, "call", lambda args, cwd, stdout, stderr: 0)
    bench._call("sft-s0", ["python", "-m", "veriloop.cli", "sft"], tmp_path)
    first, second = json.loads(wall.read_text())
    assert first == {"started": 1000.0, "exit": None, "cpus": 2, "seconds": 1800.0, "estimated": True}
    assert second["exit"] == 0 and second["seconds"] < 60


def test_reeval_pairs_the_rejudged_start_and_end_and_reads_the_logged_gain(tmp_path):
    sys.path.insert(0, str(ROOT / "benchmarks"))  # it reads the logged evaluations through bench_learning
    try:
        reeval = _load("reeval_runs")
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    run = _run(tmp_path, {0: [0.0, 0.5, 1.0, 0.5], 20: [1.0, 1.0, 1.0, 1.0]}, wall=[])
    for label, values, copied in (("start", [0.0, 0.5, 1.0, 0.5], 0.0), ("end", [0.0, 0.25, 0.5, 0.25], 0.5)):
        (run / "reeval" / label).mkdir(parents=True)  # cached reports: nothing is evaluated again
        report = {
            "splits": {"id": {"avg@n": sum(values) / 4, "reason/unevaluated": copied}},
            "per_problem": {"id": {"avg@n": values}},
        }
        (run / "reeval" / label / f"{label}.json").write_text(json.dumps(report))
    row = reeval.compare(run, [])
    # logged: d = (1, .5, 0, .5), mean .5; re-judged: d = (0, -.25, -.5, -.25), mean -.25
    assert row["gain as logged"]["diff"] == pytest.approx(0.5) and row["logged step"] == 20
    assert row["gain now"]["diff"] == pytest.approx(-0.25)
    assert row["end"]["reason/unevaluated"] == 0.5 and row["start"]["reason/correct"] == 0.0


def test_a_report_keeps_the_results_and_warmup_costs_this_checkout_no_longer_holds(
    bench, tmp_path, monkeypatch
):
    results = tmp_path / "results"
    results.mkdir()
    old = {"runs": {"sft_only": {"1": {"evals": {}}}}, "shared_sft_cpu_hours": {"0": 0.7, "1": 0.69}}
    (results / "learning_points24_easy.json").write_text(json.dumps(old))
    out = tmp_path / "runs" / "points24_easy"
    out.mkdir(parents=True)
    (out / "sft-s0.wall.json").write_text(
        json.dumps([{"seconds": 1800, "exit": 0, "cpus": 2}])
    )  # remade here
    (out / "sft-s0" / "sft" / "final").mkdir(parents=True)
    (out / "sft-s2.wall.json").write_text(json.dumps([{"seconds": 900, "exit": "killed", "cpus": 2}]))
    (out / "sft-s2" / "sft").mkdir(parents=True)  # cut, no final policy yet: not counted
    monkeypatch.setattr(bench, "RESULTS", results)
    monkeypatch.setattr(bench, "summarize_all", lambda *a: {})
    monkeypatch.setattr(bench, "write_plots", lambda *a: None)
    argv = ["bench_learning.py", "points24_easy", "--report-only", "--out", str(tmp_path / "runs")]
    monkeypatch.setattr(sys, "argv", argv)
    bench.main()
    new = json.loads((results / "learning_points24_easy.json").read_text())
    assert new["shared_sft_cpu_hours"] == {"0": 1.0, "1": 0.69}  # seed 0's newer record wins
    assert new["runs"] == old["runs"]


def test_efficiency_per_sample_and_per_cpu_hour_and_at_equal_budgets_by_hand(report):
    """A gate that pays twice the episodes (and 1.5x the seconds) for a larger gain: per 1,000 episodes
    and per CPU-hour it is behind, and at the cheaper arm's budget it is read at step 2."""

    def run(eps: float, roll_s: float, gains: dict[str, float], cpu: float) -> dict:
        train = {
            "step": [1, 2, 3, 4],
            "samples/episodes": [eps] * 4,
            "time/rollout_s": [roll_s] * 4,
            "time/train_s": [1.0] * 4,
        }
        return {"train": train, "gains": {"id": {s: {"diff": g} for s, g in gains.items()}}, "cpu_hours": cpu}

    runs = {
        "grpo": {0: run(10.0, 1.0, {"2": 0.1, "4": 0.2}, 0.5)},
        "gate": {0: run(20.0, 2.0, {"2": 0.15, "4": 0.3}, 1.0)},
    }
    rows = {r["arm"]: r for r in report.efficiency_table(runs)}
    assert rows["grpo"]["episodes"] == 40 and rows["gate"]["episodes"] == 80
    assert rows["grpo"]["gain_per_1k_episodes"] == pytest.approx(5.0)  # 1000 * 0.2 / 40
    assert rows["gate"]["gain_per_1k_episodes"] == pytest.approx(3.75)  # 1000 * 0.3 / 80
    assert rows["grpo"]["gain_per_cpu_hour"] == pytest.approx(0.4) and rows["gate"][
        "gain_per_cpu_hour"
    ] == pytest.approx(0.3)
    # budgets: 40 episodes, 8 s (grpo's whole run); the gate drew 40 by step 2 and spent 6 s there, 12 s by step 4
    assert rows["grpo"]["equal_samples"] == {"episodes": 40, "step": 4, "gain": 0.2}
    assert rows["gate"]["equal_samples"] == {"episodes": 40, "step": 2, "gain": 0.15}
    assert rows["gate"]["equal_compute"] == {"seconds": 8.0, "step": 2, "gain": 0.15}
    assert (
        report.efficiency_table({"old": {0: {"train": {"step": [1]}, "gains": {}}}}) == []
    )  # not logged: no row


def test_efficiency_over_seeds_means_and_spread_by_hand(report):
    def row(arm: str, seed: int, gain: float, cpu: float | None) -> dict:
        return {
            "arm": arm,
            "seed": seed,
            "gain": gain,
            "episodes": 100 * (seed + 1),
            "cpu_hours": cpu,
            "gain_per_1k_episodes": 10 * gain / (seed + 1),
            "gain_per_cpu_hour": gain / cpu if cpu else None,
            "equal_samples": {"gain": gain / 2},
            "equal_compute": {"gain": gain / 4},
        }

    rows = [row("a", 0, 0.02, 1.0), row("b", 0, 0.05, None), row("a", 1, 0.04, 2.0)]
    a, b = report.efficiency_over_seeds(rows)
    assert (a["arm"], a["seeds"], b["seeds"]) == ("a", [0, 1], [0])
    assert a["gain mean"] == pytest.approx(0.03)
    assert a["gain sd over seeds"] == pytest.approx(0.02**0.5 * 0.1)  # stdev(0.02, 0.04) = 0.01414
    assert a["se_over_seeds"] == pytest.approx(0.01)
    assert a["episodes mean"] == 150 and a["cpu_hours mean"] == 1.5
    assert a["gain_per_1k_episodes mean"] == pytest.approx((0.2 + 0.2) / 2)
    assert a["gain_per_cpu_hour mean"] == pytest.approx((0.02 + 0.02) / 2)
    assert a["equal_samples gain mean"] == pytest.approx(0.015)
    assert a["equal_compute gain mean"] == pytest.approx(0.0075)
    assert b["gain sd over seeds"] is None and b["se_over_seeds"] is None
    assert b["gain_per_cpu_hour mean"] is None


def test_runs_logged_before_the_episode_count_get_it_from_fixed_settings_only(bench):
    """An arm that trains every group it draws drew prompts x group size per step (the quickstart: 4 x 8,
    here 16 x 8); a gated arm's count varies, so its old runs stay without one (and out of the table)."""
    old = lambda: {"train": {"step": [1, 2, 3], "time/rollout_s": [1.0] * 3}}  # noqa: E731
    runs = {
        "plain": {0: old()},
        "gated": {0: old()},
        "logged": {0: {"train": {"step": [1], "samples/episodes": [7.0]}}},
    }
    arms = [
        ("plain", "quickstart", ["rollout.prompts_per_step=16"]),
        ("gated", "quickstart", ["curriculum.gate=true"]),
        ("logged", "quickstart", []),
    ]
    assert bench.backfill_episodes(runs, arms)
    assert (
        runs["plain"][0]["train"]["samples/episodes"] == [128.0] * 3
        and runs["plain"][0]["episodes_from_settings"]
    )
    assert (
        "samples/episodes" not in runs["gated"][0]["train"]
        and "episodes_from_settings" not in runs["gated"][0]
    )
    assert runs["logged"][0]["train"]["samples/episodes"] == [7.0]
    assert not bench.backfill_episodes(runs, arms)  # nothing left to fill


def test_math_gain_compares_the_per_sample_arms_among_themselves(report):
    """The efficiency table and the paired end differences of math_gain take only the arms at
    grpo_p16_v2's setting: an 8-problem arm would set the equal budgets of another setting."""

    def run(end: list[float], eps: float) -> dict:
        train = {
            "step": [1, 2],
            "samples/episodes": [eps] * 2,
            "time/rollout_s": [1.0] * 2,
            "time/train_s": [1.0] * 2,
        }
        return {
            "evals": {},
            "train": train,
            "end_per_problem": {"id": end},
            "cpu_hours": 1.0,
            "gains": {
                "id": {
                    "2": {
                        "diff": sum(end) / len(end) - 0.5,
                        "se": 0.1,
                        "z": 1.0,
                        "se_start": 0.1,
                        "se_step": 0.1,
                        "num_problems": 4,
                    }
                }
            },
        }

    runs = {
        "grpo_p16_v2": {0: run([1.0, 0.0, 1.0, 0.0], 128.0)},
        "grpo_p16_gate": {0: run([1.0, 1.0, 1.0, 0.0], 160.0)},
        "grpo": {0: run([0.0, 0.0, 0.0, 0.0], 64.0)},
    }
    out = report.summarize_all("math_gain", runs)
    assert {r["arm"] for r in out["efficiency_table"]} == {"grpo_p16_v2", "grpo_p16_gate"}
    assert out["efficiency_table"][0]["equal_samples"]["episodes"] == 256.0  # grpo's 128 left out
    (diff,) = out["vs_grpo_p16_v2"]
    assert diff["arm"] == "grpo_p16_gate" and diff["diff (per seed)"] == [pytest.approx(0.25)]
    assert out["semi_opd_vs_opsd"] == []  # neither distillation arm ran
    runs["opsd_p16_v2"] = {0: run([0.0, 0.0, 1.0, 0.0], 128.0)}
    runs["semi_opd_p16"] = {0: run([1.0, 0.0, 1.0, 1.0], 128.0)}
    (semi,) = report.summarize_all("math_gain", runs)["semi_opd_vs_opsd"]
    assert semi["arm"] == "semi_opd_p16" and semi["diff (per seed)"] == [pytest.approx(0.5)]


def test_math_gain_pairs_the_bf16_arms_with_fp32(report):
    """``bf16_vs_fp32``: each grpo_p16_v2 precision arm's end against fp32's, paired by problem,
    the arm measured before the fp32 adapter sum kept apart; the other arms stay out of it."""

    def run(end: list[float]) -> dict:
        return {"evals": {}, "train": {}, "end_per_problem": {"id": end}}

    runs = {
        "grpo_p16_v2": {1: run([1.0, 0.0, 1.0, 0.0])},
        "grpo_p16_v2_bf16": {1: run([1.0, 1.0, 1.0, 0.0])},
        "grpo_p16_v2_bf16_before_fix": {1: run([0.0, 0.0, 1.0, 0.0])},
        "grpo_p16_gate": {1: run([1.0, 1.0, 1.0, 1.0])},
    }
    rows = {r["arm"]: r for r in report.summarize_all("math_gain", runs)["bf16_vs_fp32"]}
    assert set(rows) == {"grpo_p16_v2_bf16", "grpo_p16_v2_bf16_before_fix"}
    assert rows["grpo_p16_v2_bf16"]["diff (per seed)"] == [pytest.approx(0.25)]
    assert rows["grpo_p16_v2_bf16_before_fix"]["diff (per seed)"] == [pytest.approx(-0.25)]
