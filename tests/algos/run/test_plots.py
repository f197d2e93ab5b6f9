"""Plots from a synthetic metrics.jsonl and from evaluation reports: real, non-empty PNG files."""

from __future__ import annotations

import argparse
import json
import math

import pytest

from veriloop.algos.run.plots import eval_keys, pass_at_k_curves, plot_pass_at_k, plot_run
from veriloop.cli.plot import cli_plot

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def write_metrics(run_dir, with_clip=True):
    """Step 0: eval only (as the training loop logs the base policy); steps 1-6: training rows."""
    rows = [
        {
            "step": 0,
            "time": 0.0,
            "eval/id/avg@n": 0.1,
            "eval/id/pass@4": 0.3,
            "eval/id/num_problems": 8,
            "eval/rule_ood/avg@n": 0.05,
            "eval/rule_ood/greedy_acc": 0.0,
        }
    ]
    for s in range(1, 7):
        row = {
            "step": s,
            "time": float(s),
            "reward/mean": 0.1 * s,
            "reward/std": 0.05,
            "response_length/mean": 40.0 + s,
            "response_length/max": 64.0,
            "truncation_rate": 0.1,
            "entropy": 1.0 / s,
            "mean_token_prob": 0.5 + 0.05 * s,
            "approx_kl": 0.01 * s,
            "grad_norm": math.nan,
        }
        if with_clip:
            row.update({"clip_frac_low": 0.01, "clip_frac_high": 0.02})
        if s % 3 == 0:
            row.update(
                {
                    "eval/id/avg@n": 0.1 + 0.05 * s,
                    "eval/id/pass@4": 0.3 + 0.05 * s,
                    "eval/rule_ood/avg@n": 0.05 + 0.02 * s,
                    "eval/rule_ood/greedy_acc": 0.1,
                }
            )
        rows.append(row)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 7, "tor')


def is_png(path):
    data = path.read_bytes()
    return data[:8] == PNG_MAGIC and len(data) > 2000


def test_plot_run_writes_every_group_and_skips_missing(tmp_path):
    run = tmp_path / "run"
    write_metrics(run, with_clip=False)
    paths = plot_run(run)
    names = sorted(p.name for p in paths)
    assert names == sorted(
        ["reward.png", "length.png", "entropy.png", "token_prob.png", "kl.png", "eval.png", "overview.png"]
    )
    assert all(p.parent == run / "plots" and is_png(p) for p in paths)
    assert not (run / "plots" / "clip.png").exists()  # clip fractions were never logged


def test_plot_run_to_chosen_folder_with_cli(tmp_path, capsys):
    run = tmp_path / "run"
    write_metrics(run)
    assert cli_plot(argparse.Namespace(run=str(run), out=str(tmp_path / "figs"))) == 0
    printed = capsys.readouterr().out.split()
    assert len(printed) == 8 and all(is_png(tmp_path / "figs" / p.rsplit("/", 1)[-1]) for p in printed)


def test_eval_keys_find_rate_metrics_per_split(tmp_path):
    rows = [{"eval/id/avg@n": 1, "eval/id/num_problems": 3, "eval/ood/maj@4": 0.5, "reward/mean": 1.0}]
    assert eval_keys(rows) == {"id": ["avg@n"], "ood": ["maj@4"]}


def test_plot_run_without_metrics_file_says_what_to_pass(tmp_path):
    with pytest.raises(FileNotFoundError, match="metrics.jsonl"):
        plot_run(tmp_path)


def report(values):
    return {
        "splits": {
            "id": {f"pass@{k}": v for k, v in values.items()} | {"avg@n": 0.2, "num_problems": 4},
            "rule_ood": {"pass@1": 0.1, "pass@8": math.nan},
        }
    }


def test_pass_at_k_curves_sorted_and_nan_dropped():
    curves = pass_at_k_curves(report({8: 0.9, 1: 0.2, 2: 0.4}))
    assert curves == {"id": ([1, 2, 8], [0.2, 0.4, 0.9]), "rule_ood": ([1], [0.1])}


def test_plot_pass_at_k_two_checkpoints(tmp_path):
    out = plot_pass_at_k(
        {"base": report({1: 0.2, 8: 0.9}), "rl": report({1: 0.5, 8: 0.8})}, tmp_path / "p.png"
    )
    assert out == tmp_path / "p.png" and is_png(out)
    with pytest.raises(ValueError, match="pass@k"):
        plot_pass_at_k({"x": {"splits": {"id": {"avg@n": 0.1}}}}, tmp_path / "q.png")


def test_empty_panels_say_why_and_eval_shows_the_base_model():
    from veriloop.algos.run.plots import _draw_eval, _pyplot, panel_note

    rows = [
        {
            "step": s,
            "clip_frac_low": 0.0,
            "clip_frac_high": 0.0,
            "approx_kl": 1e-9 * (-1) ** s,
            "updates": 1.0,
            "eval/id/avg@n": 0.1 * s,
            "eval/id/pass@1": 0.1 * s,
        }
        for s in range(1, 4)
    ]
    rows.insert(0, {"step": 0, "eval_base/id/avg@n": 0.0, "eval/id/avg@n": 0.2, "eval/id/pass@1": 0.2})
    assert "ratio is exactly 1" in panel_note(rows, "clip")
    assert panel_note(rows, "kl").startswith("~0")
    assert panel_note([{"step": 1, "clip_frac_low": 0.1}], "clip") is None
    fig, ax = _pyplot().subplots()
    _draw_eval(ax, rows, "id", ["avg@n", "pass@1"])
    labels = ax.get_legend_handles_labels()[1]
    assert labels == ["avg@n (= pass@1)", "base model avg@n = 0.00"]
    _pyplot().close(fig)


def test_eval_curves_carry_their_standard_error_band():
    from veriloop.algos.run.plots import _draw_eval, _pyplot

    rows = [
        {"step": s, "eval/id/avg@n": 0.1 * s, "eval/id/se/avg@n": 0.05, "eval/id/pass@4": 0.2 * s}
        for s in range(3)
    ]
    fig, ax = _pyplot().subplots()
    _draw_eval(ax, rows, "id", ["avg@n", "pass@4"])
    labels = ax.get_legend_handles_labels()[1]
    assert labels == ["avg@n (band: +/- 1 SE)", "pass@4"]  # pass@4 has no SE logged: no band claimed
    (band,) = ax.collections
    ys = band.get_paths()[0].vertices[:, 1]
    assert min(ys) == pytest.approx(-0.05) and max(ys) == pytest.approx(0.25)  # 0.0 - 0.05 .. 0.2 + 0.05
    _pyplot().close(fig)


def test_kl_note_sits_above_the_axes_not_on_the_curve():
    from veriloop.algos.run.plots import _draw_group, _pyplot

    rows = [{"step": s, "approx_kl": 1e-9, "updates": 1.0} for s in range(1, 4)]
    fig, ax = _pyplot().subplots()
    assert _draw_group(ax, rows, "kl")
    assert len(ax.texts) == 0  # nothing drawn inside the axes
    assert "~0" in ax.get_title() and ax.get_title().startswith("KL")
    _pyplot().close(fig)


def test_sft_loss_is_plotted_for_an_sft_folder_and_a_training_run(tmp_path):
    sft_rows = [{"step": s, "loss/sft": 2.0 / s, "sft/lr": 1e-4} for s in range(1, 6)]
    sft = tmp_path / "sft-only"
    sft.mkdir()
    (sft / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in sft_rows))
    assert [p.name for p in plot_run(sft)] == ["sft.png", "overview.png"]
    run = tmp_path / "run"
    write_metrics(run)
    (run / "sft").mkdir()
    (run / "sft" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in sft_rows))
    assert is_png(run / "plots" / "sft.png") if "sft.png" in [p.name for p in plot_run(run)] else False


def test_plot_cli_on_a_wrong_folder_is_one_line_and_exit_2(tmp_path, capsys):
    assert cli_plot(argparse.Namespace(run=str(tmp_path / "nope"), out=None)) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not a run folder" in err and "Traceback" not in err
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "metrics.jsonl").write_text('{"step": 1, "time": 0.5}\n')
    assert cli_plot(argparse.Namespace(run=str(empty), out=None)) == 1
    assert "nothing to draw" in capsys.readouterr().err
