"""``veriloop compare``: paired differences on fake run folders that hold the files a real run writes
(``config.yaml`` from the config loader, ``eval/step-*.json`` from ``write_report``), and the docs'
example on two real tiny runs of ``veriloop train quickstart``."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from veriloop.algos.eval.compare import bootstrap_ci, compare_markdown, curve, group_runs, load_run
from veriloop.algos.eval.metrics import standard_error
from veriloop.algos.eval.report import write_report
from veriloop.cli.main import run as cli_run
from veriloop.configs.loader import config_to_yaml, load_config


def fake_run(
    root: Path,
    name: str,
    curves: dict[int, list[float]],
    *,
    seed: int = 0,
    preset: str = "grpo",
    first_seed: int = 1_000_000,
) -> Path:
    """A run folder as ``veriloop train`` leaves it: its config and one report per evaluated step,
    ``curves[step]`` the per-problem avg@n of split ``id``."""
    run = root / name
    run.mkdir(parents=True)
    cfg = load_config(
        "quickstart",
        [f"run.name={name}", f"run.out_dir={root}", f"rollout.seed={seed}", f"algo.preset={preset}"],
    )
    (run / "config.yaml").write_text(config_to_yaml(cfg))
    (run / "metrics.jsonl").write_text("")
    for step, per in curves.items():
        split = {"avg@n": sum(per) / len(per), "se/avg@n": standard_error(per), "num_problems": len(per)}
        meta = {
            "splits": {"id": {"id": "veriloop/MathVerify-v0", "kwargs": {"level": 1}, "source": "generated"}},
            "num_problems": len(per),
            "first_seed": first_seed,
            "n_samples": 2,
            "step": step,
        }
        report = {"splits": {"id": split}, "gap": {}, "meta": meta, "per_problem": {"id": {"avg@n": per}}}
        write_report(report, run / "eval", f"step-{step:06d}")
    return run


def test_bootstrap_interval_by_hand() -> None:
    """[0, 0, 0, 1]: the resampled mean is k/4 with k ~ Binomial(4, 1/4); P(k <= 2) = 0.949,
    P(k <= 3) = 0.996, so the 2.5% and 97.5% quantiles are 0 and 3/4."""
    assert bootstrap_ci([0.0, 0.0, 0.0, 1.0]) == pytest.approx((0.0, 0.75))
    assert bootstrap_ci([0.3, 0.3, 0.3]) == pytest.approx((0.3, 0.3))
    assert all(math.isnan(x) for x in bootstrap_ci([0.5]))


def test_two_runs_paired_by_problem(tmp_path: Path, capsys) -> None:
    """d = [0.5, 0, 0, 0.5]: +0.250, paired SE = sd(d)/2 = 0.144; n = 4 < 100 and one seed are noted."""
    a = fake_run(tmp_path, "base_run", {0: [0, 0, 0, 0], 4: [0, 0.5, 1, 0]})
    b = fake_run(tmp_path, "longer_run", {0: [0, 0, 0, 0], 4: [0.5, 0.5, 1, 0.5]})
    assert cli_run(["compare", str(a), str(b)]) == 0
    text = (tmp_path / "compare" / "compare.md").read_text()
    assert "| longer_run | veriloop/MathVerify-v0 | id | 0 | +0.250 ± 0.144 | +0.250 ± 0.144 (eval) |" in text
    assert (
        "| base_run | veriloop/MathVerify-v0 | id | 0 | 0.375 | 0.375 ± 0.239 (eval) | needs ≥ 3 seeds | 4 |"
        in text
    )
    assert "n = 4 problems (< 100)" in text and "one seed" in text and "different problems" not in text
    assert (tmp_path / "compare" / "compare.png").stat().st_size > 10_000
    assert text in capsys.readouterr().out


def test_runs_on_different_problems_are_not_paired(tmp_path: Path) -> None:
    a = fake_run(tmp_path, "a", {2: [0, 1, 1, 0]})
    b = fake_run(tmp_path, "b", {2: [1, 1, 1, 0]}, first_seed=5)
    text = compare_markdown(group_runs([load_run(a), load_run(b)]))
    se = math.sqrt(standard_error([0, 1, 1, 0]) ** 2 + standard_error([1, 1, 1, 0]) ** 2)
    assert f"+0.250 ± {se:.3f}" in text and text.rstrip().endswith(
        "the training's own noise (another seed) is not in it"
    )
    assert "b and a were evaluated on different problems: the difference is unpaired" in text
    assert "| no |" in text


def test_two_arms_two_seeds(tmp_path: Path) -> None:
    """Per seed d = +0.25 (seed 0) and +0.5 (seed 1): mean +0.375, SE over seeds sd/sqrt(2) = 0.125."""
    start = [0.0, 0.0, 0.5, 0.0]  # step 0, the same base policy: the curves start together
    runs = [
        fake_run(tmp_path, "g0", {0: start, 4: [0, 0.5, 1, 0]}, seed=0, preset="grpo"),
        fake_run(tmp_path, "g1", {0: start, 4: [0, 0, 0, 0]}, seed=1, preset="grpo"),
        fake_run(tmp_path, "d0", {0: start, 4: [0.5, 0.5, 1, 0.5]}, seed=0, preset="rloo"),
        fake_run(tmp_path, "d1", {0: start, 4: [1, 1, 0, 0]}, seed=1, preset="rloo"),
    ]
    out = tmp_path / "cmp"
    assert cli_run(["compare", *map(str, runs), "--group-by", "algo.name", "--out", str(out)]) == 0
    text = (out / "compare.md").read_text()
    row = "| algo.name=rloo | veriloop/MathVerify-v0 | id | 0, 1 | +0.250 ± 0.144, +0.500 ± 0.289 | +0.375 ± 0.125 | needs ≥ 3 seeds | yes |"
    assert row in text
    assert "| algo.name=grpo | veriloop/MathVerify-v0 | id | 0, 1 | 0.375, 0.000 | 0.188 ± 0.188 |" in text
    assert (out / "compare.png").stat().st_size > 10_000  # the two arms' curves with their bands
    # rloo's curve: seeds 0.625 and 0.5 at step 4, mean 0.5625, SE over seeds sd/sqrt(2) = 0.0625
    steps, means, bands = curve(
        group_runs([load_run(r, "algo.name") for r in runs])["algo.name=rloo"], "id", "avg@n"
    )
    assert (steps, means, bands) == ([0, 4], [0.125, 0.5625], [0.0, pytest.approx(0.0625)])


def test_three_seeds_get_a_bootstrap_interval(tmp_path: Path) -> None:
    per = {0: ([0, 0, 0, 0], [0, 0, 0, 0]), 1: ([0, 0, 0, 0], [0, 0, 0, 0]), 2: ([0, 0, 0, 0], [1, 1, 1, 1])}
    runs = [
        fake_run(tmp_path, f"{arm}{s}", {3: p[i]}, seed=s, preset=arm)
        for s, p in per.items()
        for i, arm in enumerate(("grpo", "rloo"))
    ]
    text = compare_markdown(group_runs([load_run(r, "algo.name") for r in runs]))
    lo, hi = bootstrap_ci([0.0, 0.0, 1.0])  # Binomial(3, 1/3)/3: P(0) = 0.296, P(<= 2/3) = 0.963 -> [0, 1]
    assert (lo, hi) == pytest.approx((0.0, 1.0))
    assert "| +0.333 ± 0.333 | [+0.000, +1.000] | yes |" in text


def test_bad_input_is_one_line_and_writes_nothing(tmp_path: Path, capsys) -> None:
    a = fake_run(tmp_path, "a", {1: [0, 1]})
    empty = fake_run(tmp_path, "empty", {})
    assert cli_run(["compare", str(a), str(empty)]) == 2
    assert "has no evaluation (eval/step-*.json)" in capsys.readouterr().err
    twin = fake_run(tmp_path, "twin", {1: [1, 1]})
    assert cli_run(["compare", str(a), str(twin), "--group-by", "rollout.seed"]) == 2
    assert "are both arm 'rollout.seed=0' with rollout.seed=0" in capsys.readouterr().err
    assert cli_run(["compare", str(a), str(tmp_path / "nowhere")]) == 2
    assert "is not a run folder" in capsys.readouterr().err
    assert not (tmp_path / "compare").exists()


def test_two_quickstart_runs_from_veriloop_train(tmp_path: Path, capsys) -> None:
    """The docs' example on real run folders: two tiny `veriloop train quickstart` runs, one with
    another loss, evaluated at the start and after their one step on the same 2 held-out problems."""
    import torch

    torch.set_num_threads(1)
    tiny = [
        "policy.model=tiny",
        "rollout.prompts_per_step=2",
        "rollout.group_size=2",
        "rollout.max_new_tokens=8",
        "rollout.max_context=256",
        "train.steps=1",
        "train.micro_batch_size=2",
        "sft.steps=0",
        "eval.at_start=true",
        "eval.num_problems=2",
        "eval.n_samples=2",
        "eval.k_list=[1]",
        "eval.greedy=false",
        "run.tensorboard=false",
        "run.checkpoint_every=0",
        f"run.out_dir={tmp_path}",
    ]
    assert cli_run(["train", "quickstart", *tiny, "run.name=qs_grpo"]) == 0
    assert cli_run(["train", "quickstart", *tiny, "run.name=qs_rloo", "algo.preset=rloo"]) == 0
    capsys.readouterr()
    assert cli_run(["compare", str(tmp_path / "qs_grpo"), str(tmp_path / "qs_rloo")]) == 0
    text = (tmp_path / "compare" / "compare.md").read_text()
    assert "| qs_grpo | veriloop/MathVerify-v0 | id | 0 |" in text  # the reference row, its accuracy
    paired = "| qs_rloo | veriloop/MathVerify-v0 | id | 0 | +0.000 ± 0.000 | +0.000 ± 0.000 (eval) | needs ≥ 3 seeds | yes |"
    assert paired in text  # minus the first, paired by problem (a tiny random model solves nothing)
    assert "n = 2 problems (< 100)" in text and "different problems" not in text
    assert (tmp_path / "compare" / "compare.png").stat().st_size > 10_000
    assert text in capsys.readouterr().out
