"""What the Points24 answers were, by verdict reason, for several policies on both splits.

Reads evaluation reports (``veriloop eval`` / a training run's ``eval/*.json``), copies them to
``benchmarks/results/points24_evals/`` and writes ``results/points24_rules.json`` and ``.png``:
per policy and split, success (avg@n) and the share of answers that broke the split's J/Q/K rule
(``reason/illegal_numbers``), were legal but of the wrong value (``reason/wrong_value``) or could
not be parsed. A policy that memorised "J/Q/K = 10" answers the rule-OOD split with illegal numbers.

    python benchmarks/report_points24_rules.py LABEL=REPORT.json [LABEL=REPORT.json ...]
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
REASONS = [
    "reason/illegal_numbers",
    "reason/wrong_value",
    "reason/unparseable",
    "reason/wrong_cards",
    "reason/correct",
]
KEYS = ["avg@n", *REASONS]


def main() -> None:
    if sys.argv[1:] in (["-h"], ["--help"]):
        print(f"usage: report_points24_rules.py LABEL=REPORT.json ...\n{__doc__}")
        return
    if len(sys.argv) < 2 or any("=" not in a for a in sys.argv[1:]):
        raise SystemExit(__doc__)
    table: dict[str, dict] = {}
    (RESULTS / "points24_evals").mkdir(parents=True, exist_ok=True)
    for arg in sys.argv[1:]:
        label, path = arg.split("=", 1)
        report = json.loads(Path(path).read_text())
        shutil.copy(path, RESULTS / "points24_evals" / f"{label}.json")
        table[label] = {s: {k: m.get(k, 0.0) for k in KEYS} for s, m in report["splits"].items()}
        table[label]["source"] = path
    (RESULTS / "points24_rules.json").write_text(json.dumps(table, indent=1))
    plot(table, RESULTS / "points24_rules.png")
    for label, by_split in table.items():
        print(
            label, {s: {k: round(v, 3) for k, v in m.items()} for s, m in by_split.items() if s != "source"}
        )


def plot(table: dict[str, dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(table)
    splits = ["id", "rule_ood"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8), sharey=True)
    for ax, split in zip(axes, splits):
        bottom = [0.0] * len(labels)
        for i, key in enumerate(REASONS):  # the rest: no answer, hedged, division by zero, ...
            vals = [table[lb].get(split, {}).get(key, 0.0) for lb in labels]
            name = key.split("/")[-1]
            ax.bar(labels, vals, bottom=bottom, color=f"C{i}", label=name)
            bottom = [b + v for b, v in zip(bottom, vals)]
        ax.set_title(f"Points24 {split}: what the answers were")
        ax.tick_params(axis="x", rotation=20)
        ax.grid(axis="y", alpha=0.3)
    axes[0].set_ylabel("share of judged answers (all turns)")
    axes[1].legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
