"""Training curves from ``metrics.jsonl`` and pass@k-vs-k comparisons, as PNG files.

:func:`plot_run` draws the curves DAPO's authors watch during training, one PNG per group:

    reward.png      reward/mean with a +/- reward/std band
    length.png      response_length/mean and /max; truncation_rate on a second axis
    entropy.png     entropy (collapse = exploration lost)
    token_prob.png  mean_token_prob
    clip.png        clip_frac_low, clip_frac_high
    kl.png          approx_kl (and loss/kl when logged)
    sft.png         the SFT warm-up's loss/sft (learning rate on a second axis); a training run's
                    warm-up is read from ``<run>/sft/metrics.jsonl``, an SFT run folder directly
    eval.png        per split, every eval/<split>/<rate> curve (avg@n, pass@k, maj@k, greedy_acc),
                    shaded +/- 1 standard error where the log has ``eval/<split>/se/<rate>``
    overview.png    the above in one grid

The training loop logs ``eval/<split>/<metric>`` for every metric of
:func:`veriloop.algos.eval.loop.evaluate_policy`'s split dict. A metric missing from the log is
skipped, never an error; a group with nothing to draw produces no file.

:func:`plot_pass_at_k` draws Yue et al. (2025)'s comparison: pass@k against k (log scale), one line
per checkpoint, one panel per split. Matplotlib runs on the Agg backend (no display needed).
"""

from __future__ import annotations

import math
import textwrap
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from veriloop.algos.run.log import read_metrics

#: Group -> (title, curves on the left axis, curves on a right axis).
GROUPS: dict[str, tuple[str, tuple[str, ...], tuple[str, ...]]] = {
    "reward": ("reward", ("reward/mean",), ()),
    "length": (
        "response length (tokens)",
        ("response_length/mean", "response_length/max"),
        ("truncation_rate",),
    ),
    "entropy": ("entropy", ("entropy",), ()),
    "token_prob": ("mean token probability", ("mean_token_prob",), ()),
    "clip": ("clip fraction", ("clip_frac_low", "clip_frac_high"), ()),
    "kl": ("KL to old / reference policy", ("approx_kl", "kl_ref", "loss/kl"), ()),
    "sft": ("SFT warm-up: loss per step (token mean)", ("loss/sft",), ("sft/lr",)),
    "staleness": (
        "staleness of the trained groups (optimizer steps)",
        ("async/staleness_mean", "async/staleness_max"),
        ("async/span_max",),
    ),
    "idle": (
        "idle share of a step (async)",
        ("async/trainer_wait_fraction", "async/generator_wait_fraction"),
        (),
    ),
}
#: Line styles, so that curves with equal values (clip_frac_low under _high) stay visible.
STYLES = (
    {"linestyle": "-", "marker": "v"},
    {"linestyle": "--", "marker": "^"},
    {"linestyle": ":", "marker": "s"},
)
#: Below this, a panel's values are drawn but called "~0" and explained (see :func:`panel_note`).
TINY = 1e-6
#: Eval metrics drawn in eval.png (prefix match); counts such as num_problems are left out.
EVAL_RATES = ("avg@", "pass@", "maj@", "greedy_acc")


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _series(rows: Sequence[Mapping[str, Any]], key: str) -> tuple[list[float], list[float]]:
    """(steps, values) of the rows holding a finite number under ``key``."""
    xs: list[float] = []
    ys: list[float] = []
    for row in rows:
        v = row.get(key)
        if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v):
            xs.append(float(row.get("step", len(xs))))
            ys.append(float(v))
    return xs, ys


def eval_keys(rows: Sequence[Mapping[str, Any]]) -> dict[str, list[str]]:
    """``{split: [rate metric, ...]}`` of the ``eval/<split>/<metric>`` keys in the log."""
    found: dict[str, list[str]] = {}
    for row in rows:
        for key in row:
            parts = key.split("/", 2)
            if len(parts) == 3 and parts[0] == "eval" and parts[2].startswith(EVAL_RATES):
                metrics = found.setdefault(parts[1], [])
                if parts[2] not in metrics:
                    metrics.append(parts[2])
    return found


def _draw_group(ax: Any, rows: Sequence[Mapping[str, Any]], group: str) -> bool:
    """Draw one group into ``ax``; False when the log has none of its metrics."""
    title, left, right = GROUPS[group]
    drawn = False
    for i, key in enumerate(left):
        xs, ys = _series(rows, key)
        if xs:
            ax.plot(xs, ys, label=key, markersize=3, **STYLES[i % len(STYLES)])
            drawn = True
            if key == "reward/mean":
                _std_band(ax, rows, xs, ys)
                title = "reward (band: mean +/- 1 std over the step's episodes)"
    extra: list[Any] = []  # the right axis' lines, listed in the left axis' legend (one box, not two)
    for key in right:
        xs, ys = _series(rows, key)
        if xs:
            twin = ax.twinx()
            extra += twin.plot(xs, ys, color="tab:red", linestyle="--", label=f"{key} (right axis)")
            twin.set_ylabel(key)
            drawn = True
    if drawn:
        note = panel_note(rows, group)
        # the note goes under the title, outside the axes: it never covers a curve
        if note:
            note = "\n".join(textwrap.fill(line, 70) for line in note.splitlines())
        ax.set_title(title if not note else f"{title}\n{note}", fontsize=9 if not note else 7)
        ax.set_xlabel("step")
        handles, labels = ax.get_legend_handles_labels()
        if extra:  # two axes: below the plot, where it covers neither axis' curves
            ax.legend(
                handles + extra,
                labels + [line.get_label() for line in extra],
                fontsize=7,
                loc="upper center",
                bbox_to_anchor=(0.5, -0.18),
                ncol=3,
                frameon=False,
            )
        else:
            ax.legend(loc="best", fontsize=7)
    return drawn


def panel_note(rows: Sequence[Mapping[str, Any]], group: str) -> str | None:
    """Why a panel shows (almost) nothing, when it does: the reader should not have to guess."""
    _, left, right = GROUPS[group]
    values = [abs(v) for key in left + right for v in _series(rows, key)[1]]
    if not values or max(values) >= TINY:
        return None
    single = all(r.get("updates") in (None, 1, 1.0) for r in rows)
    why = {
        "clip": "nothing clipped: with one update per batch the ratio is exactly 1"
        if single
        else "no token's ratio left the clip range",
        "kl": "~0: with one update per batch the policy is the sampler (KL to the reference is kl_ref; "
        "absent without a KL term)"
        if single
        else "the policy barely moved between updates",
    }.get(group, "all values ~0")
    return (
        f"{why}\n(use algo.epochs > 1 or mini-batches to see it move)"
        if single and group in ("clip", "kl")
        else why
    )


def _std_band(ax: Any, rows: Sequence[Mapping[str, Any]], xs: list[float], ys: list[float]) -> None:
    """Shade mean +/- std where reward/std is logged on the same rows."""
    std = dict(zip(*_series(rows, "reward/std")))
    pts = [(x, y, std[x]) for x, y in zip(xs, ys) if x in std]
    if pts:
        ax.fill_between(
            [p[0] for p in pts], [p[1] - p[2] for p in pts], [p[1] + p[2] for p in pts], alpha=0.2
        )


def _draw_eval(ax: Any, rows: Sequence[Mapping[str, Any]], split: str, metrics: Sequence[str]) -> bool:
    drawn = False
    # avg@n is the unbiased pass@1 over n samples: the same number, so one curve says both
    shown = [m for m in metrics if not (m == "pass@1" and "avg@n" in metrics)]
    for i, metric in enumerate(shown):
        xs, ys = _series(rows, f"eval/{split}/{metric}")
        if xs:
            label = "avg@n (= pass@1)" if metric == "avg@n" and "pass@1" in metrics else metric
            (line,) = ax.plot(xs, ys, markersize=4, label=label, **STYLES[i % len(STYLES)])
            drawn = True
            if _se_band(ax, rows, f"eval/{split}/se/{metric}", xs, ys, line.get_color()):
                line.set_label(f"{label} (band: +/- 1 SE)")
    bx, by = _series(rows, f"eval_base/{split}/avg@n")
    if bx:  # the model before the SFT warm-up: where the headline gain starts
        ax.axhline(by[0], color="grey", linestyle="-.", linewidth=1, label=f"base model avg@n = {by[0]:.2f}")
        drawn = True
    if drawn:
        ax.set_title(f"eval: {split}")
        ax.set_xlabel("step")
        ax.set_ylim(-0.02, 1.02)
        ax.legend(fontsize=7)
    return drawn


def _se_band(
    ax: Any, rows: Sequence[Mapping[str, Any]], key: str, xs: list[float], ys: list[float], color: str
) -> bool:
    """Shade value +/- its standard error where ``key`` is logged on the same steps; False if never."""
    se = dict(zip(*_series(rows, key)))
    pts = [(x, y, se[x]) for x, y in zip(xs, ys) if x in se]
    if pts:
        ax.fill_between(
            [p[0] for p in pts],
            [p[1] - p[2] for p in pts],
            [p[1] + p[2] for p in pts],
            color=color,
            alpha=0.15,
            linewidth=0,
        )
    return bool(pts)


def _save(fig: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    _pyplot().close(fig)
    return path


def plot_run(run_dir: str | Path, out_dir: str | Path | None = None) -> list[Path]:
    """Draw a run's curves from ``<run_dir>/metrics.jsonl``; returns the PNG paths written.

    Args:
        run_dir: A run folder holding ``metrics.jsonl``.
        out_dir: Where the PNGs go; None = ``<run_dir>/plots``.
    """
    metrics_file = Path(run_dir) / "metrics.jsonl"
    if not metrics_file.is_file():
        raise FileNotFoundError(
            f"{run_dir} is not a run folder (no metrics.jsonl in it): pass the folder `veriloop train` "
            "printed (runs/NAME) or its sft/ folder"
        )
    rows = read_metrics(run_dir)
    if (Path(run_dir) / "sft" / "metrics.jsonl").is_file():  # a training run's warm-up: its own log
        rows = [
            *rows,
            *(
                {"step": r.get("step"), **{k: v for k, v in r.items() if k.startswith(("loss/sft", "sft/"))}}
                for r in read_metrics(Path(run_dir) / "sft")
            ),
        ]
    out = Path(out_dir) if out_dir is not None else Path(run_dir) / "plots"
    out.mkdir(parents=True, exist_ok=True)
    plt = _pyplot()
    paths: list[Path] = []
    for group in GROUPS:
        fig, ax = plt.subplots(figsize=(6, 4))
        if _draw_group(ax, rows, group):
            paths.append(_save(fig, out / f"{group}.png"))
        else:
            plt.close(fig)
    splits = eval_keys(rows)
    if splits:
        fig, axes = plt.subplots(1, len(splits), figsize=(5 * len(splits), 4), squeeze=False)
        drawn = [_draw_eval(ax, rows, s, m) for ax, (s, m) in zip(axes[0], splits.items())]
        if any(drawn):
            paths.append(_save(fig, out / "eval.png"))
        else:
            plt.close(fig)
    if paths:
        paths.append(_overview(rows, splits, out / "overview.png"))
    return paths


def _overview(rows: Sequence[Mapping[str, Any]], splits: Mapping[str, list[str]], path: Path) -> Path:
    """Every non-empty panel in one grid (3 columns)."""
    plt = _pyplot()
    panels: list[tuple[str, str]] = [
        ("group", g) for g in GROUPS if any(_series(rows, k)[0] for k in GROUPS[g][1] + GROUPS[g][2])
    ]
    panels += [("eval", s) for s in splits]
    cols = min(3, len(panels))
    nrows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(5 * cols, 3.5 * nrows), squeeze=False)
    for ax, (kind, name) in zip(axes.flat, panels):
        if kind == "group":
            _draw_group(ax, rows, name)
        else:
            _draw_eval(ax, rows, name, splits[name])
    spare = list(axes.flat)[len(panels) :]
    for ax in spare:
        ax.axis("off")
    missing = [g for g in GROUPS if ("group", g) not in panels]
    if spare and missing:  # say what is absent rather than leave a blank cell
        spare[0].text(
            0.02,
            0.5,
            "not logged by this run:\n" + "\n".join(f"- {GROUPS[g][0]}" for g in missing),
            transform=spare[0].transAxes,
            va="center",
            fontsize=8,
        )
    return _save(fig, path)


def pass_at_k_curves(report: Mapping[str, Any]) -> dict[str, tuple[list[int], list[float]]]:
    """``{split: (ks, pass@k values)}`` from a report's split metrics, k ascending, nan dropped."""
    curves: dict[str, tuple[list[int], list[float]]] = {}
    for split, metrics in report["splits"].items():
        pts = sorted(
            (int(k[5:]), float(v))
            for k, v in metrics.items()
            if k.startswith("pass@") and k[5:].isdigit() and v is not None and math.isfinite(v)
        )
        if pts:
            curves[split] = ([k for k, _ in pts], [v for _, v in pts])
    return curves


def plot_pass_at_k(reports: Mapping[str, Mapping[str, Any]], out_path: str | Path) -> Path:
    """pass@k vs k (log2 x-axis), one panel per split, one line per checkpoint label.

    Args:
        reports: ``{label: report}`` as returned by :func:`~veriloop.algos.eval.loop.evaluate_policy`.
        out_path: The PNG to write.
    """
    if not reports:
        raise ValueError("plot_pass_at_k needs at least one report, got none")
    curves = {label: pass_at_k_curves(r) for label, r in reports.items()}
    splits = list(dict.fromkeys(s for c in curves.values() for s in c))
    if not splits:
        raise ValueError(f"no pass@k metrics in the reports {sorted(reports)}: evaluate with eval.k_list set")
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(splits), figsize=(5 * len(splits), 4), squeeze=False)
    for ax, split in zip(axes[0], splits):
        for label, c in curves.items():
            if split in c:
                ax.plot(*c[split], marker="o", label=label)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("k")
        ax.set_ylabel("pass@k")
        ax.set_ylim(-0.02, 1.02)
        ax.set_title(split)
        ax.legend(fontsize=7)
    path = Path(out_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return _save(fig, path)
