"""Runs side by side: the evaluations of several run folders (or arms x seeds), paired by problem.

``veriloop compare RUN [RUN ...]`` reads each run's ``config.yaml`` and ``eval/*.json`` (the reports
the training loop writes, with ``per_problem`` accuracies in problem order) and, per environment and
split, puts every arm against the first (the reference):

* per seed, the difference in held-out accuracy at the last evaluation, paired by problem
  (:func:`~veriloop.algos.eval.metrics.paired_difference`: the problems' own difficulty cancels);
* over seeds, the mean difference with its SE (sd over seeds / sqrt(seeds), which also holds the
  training's own noise) and, with >= 3 seeds, a percentile bootstrap 95% interval
  (:func:`bootstrap_ci`);
* a note when a split has fewer than :data:`FEW_PROBLEMS` problems, or when two runs were evaluated on
  different problems (then the difference is unpaired: ``sqrt(se_a^2 + se_b^2)``).

Arms are the runs themselves, or with ``group_by`` the values of one config key (``algo.name``,
``run.algo_preset``...), each arm's runs told apart by ``rollout.seed``.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from veriloop.algos.eval.metrics import paired_difference, standard_error

#: Fewer problems than this in a split: the table says its SEs are rough.
FEW_PROBLEMS = 100
#: Per-problem lists of a report (``per_problem[split]``) by metric name.
PER_PROBLEM = {"avg@n": "avg@n", "greedy_acc": "greedy"}


class CompareError(ValueError):
    """Runs that cannot be compared (one line naming the run and the fix)."""


@dataclass
class Run:
    """One run folder's evaluations: ``reports[step]`` (``eval/step-*.json``), its arm and seed."""

    path: Path
    arm: str
    seed: int
    reports: dict[int, dict[str, Any]] = field(default_factory=dict)

    @property
    def last(self) -> dict[str, Any]:
        return self.reports[max(self.reports)]


def bootstrap_ci(
    values: Sequence[float], level: float = 0.95, n_boot: int = 20_000, seed: int = 0
) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean (Efron 1979; Efron & Tibshirani 1993, eq. 13.5).

    Resample the ``n`` values with replacement ``n_boot`` times, ``m*_b = mean(x*_b)``; the interval
    is ``[q_{(1-level)/2}(m*), q_{(1+level)/2}(m*)]``. Seeded, so a table is reproducible. With a
    handful of seeds it is a rough interval (it cannot be wider than the values' range).
    """
    import numpy as np

    x = np.asarray(values, dtype=np.float64)
    if x.size < 2 or not np.isfinite(x).all():
        return math.nan, math.nan
    idx = np.random.default_rng(seed).integers(0, x.size, size=(n_boot, x.size))
    means = x[idx].mean(axis=1)
    lo, hi = np.quantile(means, [(1 - level) / 2, (1 + level) / 2])
    return float(lo), float(hi)


def _get(cfg: Mapping[str, Any], key: str) -> Any:
    node: Any = cfg
    for part in key.split("."):
        if not isinstance(node, Mapping) or part not in node:
            raise KeyError(key)
        node = node[part]
    return node


def load_run(path: str | Path, group_by: str | None = None) -> Run:
    """A run folder's config and evaluation reports; :class:`CompareError` when it has none."""
    from veriloop.algos.eval.report import read_report

    run = Path(path)
    if not (run / "config.yaml").is_file():
        raise CompareError(
            f"{run} is not a run folder (no config.yaml): pass folders that `veriloop train` wrote"
        )
    cfg = yaml.safe_load((run / "config.yaml").read_text()) or {}
    reports = {}
    for p in sorted((run / "eval").glob("step-*.json")):
        reports[int(p.stem.removeprefix("step-"))] = read_report(p)
    if not reports:
        raise CompareError(
            f"{run} has no evaluation (eval/step-*.json): evaluate it first, e.g. "
            f"`veriloop train {run / 'config.yaml'} --resume` after a finished run writes one"
        )
    try:
        arm = f"{group_by}={_get(cfg, group_by)}" if group_by else run.name
    except KeyError:
        raise CompareError(
            f"{run}/config.yaml has no setting {group_by!r}: --group-by takes a config key "
            "such as algo.name or run.algo_preset"
        ) from None
    seed = _get(cfg, "rollout.seed") if isinstance(cfg.get("rollout"), Mapping) else 0
    return Run(run, arm, int(seed), reports)


def group_runs(runs: Sequence[Run]) -> dict[str, dict[int, Run]]:
    """``arm -> seed -> run``, arms in the order they first appear; two runs of one arm and seed
    are an error (which one would count?)."""
    arms: dict[str, dict[int, Run]] = {}
    for r in runs:
        seeds = arms.setdefault(r.arm, {})
        if r.seed in seeds:
            raise CompareError(
                f"{seeds[r.seed].path} and {r.path} are both arm {r.arm!r} with rollout.seed="
                f"{r.seed}: pass one of them, or --group-by a key that tells them apart"
            )
        seeds[r.seed] = r
    return arms


def problems_of(report: Mapping[str, Any], split: str) -> str:
    """What a split was evaluated on: the environment, its kwargs and the problem seeds."""
    meta = report.get("meta", {})
    s = meta.get("splits", {}).get(split, {})
    return json.dumps(
        [s.get("id"), s.get("kwargs"), meta.get("first_seed"), meta.get("num_problems")],
        sort_keys=True,
        default=str,
    )


def env_of(report: Mapping[str, Any], split: str) -> str:
    return str(report.get("meta", {}).get("splits", {}).get(split, {}).get("id") or "?")


def difference(ref: Run, other: Run, split: str, metric: str) -> dict[str, Any] | None:
    """``other - ref`` on ``split`` at each run's last evaluation: paired by problem when both were
    evaluated on the same problems, else unpaired (``paired: False``). None when a run lacks it."""
    a, b = ref.last, other.last
    if split not in a["splits"] or split not in b["splits"]:
        return None
    pa = a.get("per_problem", {}).get(split, {}).get(PER_PROBLEM[metric])
    pb = b.get("per_problem", {}).get(split, {}).get(PER_PROBLEM[metric])
    if pa and pb and len(pa) == len(pb) and problems_of(a, split) == problems_of(b, split):
        return {**paired_difference(pa, pb), "paired": True}
    ma, mb = a["splits"][split].get(metric, math.nan), b["splits"][split].get(metric, math.nan)
    sa, sb = (
        a["splits"][split].get(f"se/{metric}", math.nan),
        b["splits"][split].get(f"se/{metric}", math.nan),
    )
    n = min(a["splits"][split].get("num_problems", 0), b["splits"][split].get("num_problems", 0))
    return {"diff": mb - ma, "se": math.sqrt(sa**2 + sb**2), "num_problems": float(n), "paired": False}


def over_seeds(values: Sequence[float]) -> dict[str, Any]:
    """Mean, SE over seeds (nan for one seed) and, with >= 3 seeds, the bootstrap 95% interval."""
    ci = bootstrap_ci(values) if len(values) >= 3 else (math.nan, math.nan)
    mean = statistics.fmean(values) if values else math.nan
    return {"mean": mean, "se": standard_error(values), "ci95": ci, "seeds": len(values)}


def _splits(arms: Mapping[str, Mapping[int, Run]]) -> list[str]:
    names = [s for seeds in arms.values() for r in seeds.values() for s in r.last["splits"]]
    return sorted(dict.fromkeys(names), key=lambda s: (s != "id", names.index(s)))


def _pairs(ref: Mapping[int, Run], other: Mapping[int, Run]) -> list[tuple[Run, Run]]:
    """The runs to difference: the same seed in both arms, or the one run of each."""
    common = sorted(ref.keys() & other.keys())
    if common:
        return [(ref[s], other[s]) for s in common]
    if len(ref) == 1 and len(other) == 1:
        return [(next(iter(ref.values())), next(iter(other.values())))]
    return []


def _fmt(x: float, signed: bool = False) -> str:
    return "n/a" if x is None or math.isnan(x) else (f"{x:+.3f}" if signed else f"{x:.3f}")


def _mean_se(s: Mapping[str, Any], one_se: float, signed: bool = False) -> str:
    """``mean ± SE over seeds``; one seed: ``value ± the evaluation's own SE (eval)``."""
    if s["seeds"] == 1:
        return f"{_fmt(s['mean'], signed)} ± {_fmt(one_se)} (eval)"
    return f"{_fmt(s['mean'], signed)} ± {_fmt(s['se'])}"


def _ci(s: Mapping[str, Any]) -> str:
    lo, hi = s["ci95"]
    return "needs ≥ 3 seeds" if math.isnan(lo) else f"[{_fmt(lo, True)}, {_fmt(hi, True)}]"


def accuracy_rows(arms: Mapping[str, Mapping[int, Run]], metric: str) -> list[dict[str, Any]]:
    """Per arm and split: the metric at each seed's last evaluation and its spread over seeds."""
    rows = []
    for split in _splits(arms):
        for arm, seeds in arms.items():
            runs = [r for _, r in sorted(seeds.items()) if split in r.last["splits"]]
            if not runs:
                continue
            vals = [float(r.last["splits"][split].get(metric, math.nan)) for r in runs]
            rows.append(
                {
                    "arm": arm,
                    "split": split,
                    "env": env_of(runs[0].last, split),
                    "seeds": [r.seed for r in runs],
                    "values": vals,
                    "over_seeds": over_seeds(vals),
                    "eval_se": float(runs[0].last["splits"][split].get(f"se/{metric}", math.nan)),
                    "problems": min(int(r.last["splits"][split].get("num_problems", 0)) for r in runs),
                }
            )
    return rows


def difference_rows(arms: Mapping[str, Mapping[int, Run]], metric: str) -> list[dict[str, Any]]:
    """Per non-reference arm and split: the difference to the first arm, per seed and over seeds."""
    names = list(arms)
    rows = []
    for split in _splits(arms):
        for arm in names[1:]:
            pairs = _pairs(arms[names[0]], arms[arm])
            diffs = [(a, b, d) for a, b in pairs if (d := difference(a, b, split, metric)) is not None]
            if not diffs:
                continue
            values = [d["diff"] for _, _, d in diffs]
            rows.append(
                {
                    "arm": arm,
                    "reference": names[0],
                    "split": split,
                    "env": env_of(diffs[0][1].last, split),
                    "seeds": [b.seed for _, b, _ in diffs],
                    "per_seed": [d for _, _, d in diffs],
                    "over_seeds": over_seeds(values),
                    "paired": all(d["paired"] for _, _, d in diffs),
                    "problems": int(min(d["num_problems"] for _, _, d in diffs)),
                }
            )
    return rows


def notes(acc: Sequence[Mapping[str, Any]], diffs: Sequence[Mapping[str, Any]]) -> list[str]:
    """What makes a row weaker than it looks: few problems, different problems, one seed."""
    out = []
    for split, n in sorted({(r["split"], r["problems"]) for r in acc}):
        if n < FEW_PROBLEMS:
            out.append(
                f"{split}: n = {n} problems (< {FEW_PROBLEMS}): the SEs are rough; evaluate on more "
                "problems (eval.num_problems) before trusting a difference of a few points"
            )
    for d in diffs:
        if not d["paired"]:
            out.append(
                f"{d['split']}: {d['arm']} and {d['reference']} were evaluated on different problems: "
                "the difference is unpaired (SE = sqrt(se_a² + se_b²)) and the problems' difficulty does not cancel"
            )
    if any(r["over_seeds"]["seeds"] == 1 for r in acc):
        out.append(
            "one seed: ± is the evaluation's SE over problems only; the training's own noise "
            "(another seed) is not in it"
        )
    return out


def compare_markdown(arms: Mapping[str, Mapping[int, Run]], metric: str = "avg@n") -> str:
    """The comparison's tables (accuracy per arm, differences to the first arm) and its notes."""
    acc, diffs = accuracy_rows(arms, metric), difference_rows(arms, metric)
    head = [
        "arm",
        "environment",
        "split",
        "seeds",
        f"{metric} per seed",
        "mean ± SE",
        "95% CI (bootstrap over seeds)",
        "problems",
    ]
    lines = [
        f"## {metric} at each run's last evaluation\n",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    for r in acc:
        cells = [
            r["arm"],
            r["env"],
            r["split"],
            ", ".join(map(str, r["seeds"])),
            ", ".join(map(_fmt, r["values"])),
            _mean_se(r["over_seeds"], r["eval_se"]),
            _ci(r["over_seeds"]),
            str(r["problems"]),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    if diffs:
        ref = diffs[0]["reference"]
        head = [
            "arm − " + ref,
            "environment",
            "split",
            "seeds",
            "difference per seed (± SE)",
            "mean ± SE",
            "95% CI (bootstrap over seeds)",
            "paired by problem",
        ]
        lines += ["", f"## Difference to {ref}\n", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for r in diffs:
            per = ", ".join(f"{_fmt(d['diff'], True)} ± {_fmt(d['se'])}" for d in r["per_seed"])
            cells = [
                r["arm"],
                r["env"],
                r["split"],
                ", ".join(map(str, r["seeds"])),
                per,
                _mean_se(r["over_seeds"], r["per_seed"][0]["se"], signed=True),
                _ci(r["over_seeds"]),
                "yes" if r["paired"] else "no",
            ]
            lines.append("| " + " | ".join(cells) + " |")
    said = notes(acc, diffs)
    return (
        "\n".join(lines) + "\n" + ("\nNotes:\n\n" + "\n".join(f"- {n}" for n in said) + "\n" if said else "")
    )


def curve(seeds: Mapping[int, Run], split: str, metric: str) -> tuple[list[int], list[float], list[float]]:
    """Steps every seed evaluated, the mean over seeds there and its band: the SE over seeds, or one
    run's own evaluation SE."""
    runs = [r for r in seeds.values() if any(split in rep["splits"] for rep in r.reports.values())]
    steps = (
        sorted(
            set.intersection(*[{s for s, rep in r.reports.items() if split in rep["splits"]} for r in runs])
        )
        if runs
        else []
    )
    means, bands = [], []
    for s in steps:
        vals = [float(r.reports[s]["splits"][split].get(metric, math.nan)) for r in runs]
        means.append(statistics.fmean(vals))
        one = float(runs[0].reports[s]["splits"][split].get(f"se/{metric}", math.nan))
        bands.append(standard_error(vals) if len(vals) > 1 else one)
    return steps, means, bands


def plot_compare(arms: Mapping[str, Mapping[int, Run]], path: str | Path, metric: str = "avg@n") -> Path:
    """One PNG: a panel per split, a curve per arm (mean over seeds) with a ± 1 SE band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    splits = _splits(arms)
    fig, axes = plt.subplots(1, len(splits), figsize=(5 * len(splits), 3.6), squeeze=False)
    for ax, split in zip(axes[0], splits, strict=True):
        for i, (arm, seeds) in enumerate(arms.items()):
            steps, means, bands = curve(seeds, split, metric)
            if not steps:
                continue
            ax.plot(
                steps,
                means,
                marker="o",
                color=f"C{i}",
                label=f"{arm} ({len(seeds)} seed{'s' * (len(seeds) > 1)})",
            )
            lo = [m - b if not math.isnan(b) else m for m, b in zip(means, bands, strict=True)]
            hi = [m + b if not math.isnan(b) else m for m, b in zip(means, bands, strict=True)]
            ax.fill_between(steps, lo, hi, color=f"C{i}", alpha=0.2)
        ax.set_title(f"{split} ({env_of(next(iter(next(iter(arms.values())).values())).last, split)})")
        ax.set_xlabel("RL step")
        ax.set_ylabel(f"{metric} (held-out; band ± 1 SE)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
