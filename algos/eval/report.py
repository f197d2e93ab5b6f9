"""Evaluation reports: one JSON + Markdown pair per evaluated checkpoint (``nan`` saved as
``null``), read back with ``nan`` restored, and the run's summary table over every checkpoint.

The report itself is plain data, ``{"splits": {name: metrics}, "gap": {...}, "meta": {...}}``, as
:func:`veriloop.algos.eval.loop.evaluate_policy` returns it (with ``per_problem``, and ``samples``:
a few episodes per split as text, a couple of which the Markdown shows).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from veriloop.algos.eval.loop import REFERENCE_SPLIT
from veriloop.algos.eval.metrics import markdown_table, paired_difference
from veriloop.envs.json_safe import json_safe

#: Non-rate metrics shown in the task table of the Markdown report (when a split has them).
#: The environments' own metrics (``LearnerSignal``) go between ``greedy_acc`` and the rest.
TASK_METRICS = (
    "greedy_acc",
    "attempts/mean",
    "turns/mean",
    "response_length/mean",
    "truncation_rate",
    "limit_stop_rate",
)
#: Metrics every split has (not the environment's own): these names, and the prefixes below.
_GENERIC = {
    *TASK_METRICS,
    "num_problems",
    "num_samples",
    "verifier_errors",
    "error_rate",
    "response_length/max",
}
_GENERIC_PREFIXES = ("pass@", "avg@", "maj@", "reason/", "attempts/", "se/")


def task_table(splits: Mapping[str, Mapping[str, Any]]) -> str:
    """Markdown table of the :data:`TASK_METRICS` and environment metrics any split has (empty
    string when none)."""
    env = [m for s in splits.values() for m in s if m not in _GENERIC and not m.startswith(_GENERIC_PREFIXES)]
    shown = (TASK_METRICS[0], *dict.fromkeys(env), *TASK_METRICS[1:])
    names = [m for m in shown if any(m in s for s in splits.values())]
    names += sorted({m for s in splits.values() for m in s if m.startswith("attempts/level_")})
    if not names:
        return ""
    order = sorted(splits, key=lambda s: (s != REFERENCE_SPLIT, s))
    lines = ["| split | " + " | ".join(names) + " |", "|" + "---|" * (len(names) + 1)]
    for split in order:
        cells = [_cell(splits[split].get(m)) for m in names]
        lines.append(f"| {split} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def report_markdown(report: Mapping[str, Any], title: str = "Evaluation") -> str:
    """Rates with the gap rows (:func:`markdown_table`), then the task metrics."""
    meta = report.get("meta", {})
    head = f"## {title}\n\n" + (f"step {meta['step']}, " if meta.get("step") is not None else "")
    head += f"{meta.get('num_problems', '?')} problems x {meta.get('n_samples', '?')} samples, "
    head += f"T = {meta.get('temperature', '?')}, policy {meta.get('policy', '?')}"
    head += f", checkpoint {meta['checkpoint']}\n\n" if meta.get("checkpoint") else "\n\n"
    return (
        head
        + markdown_table(report["splits"], meta.get("reference_split", REFERENCE_SPLIT))
        + "\n"
        + task_table(report["splits"])
        + sources_markdown(meta)
        + samples_markdown(report.get("samples") or {}, meta.get("reference_split", REFERENCE_SPLIT))
    )


#: Samples shown in a Markdown report, and the characters of each text shown (the JSON keeps more).
SHOWN_SAMPLES, SHOWN_CHARS = 2, 600


def samples_markdown(samples: Mapping[str, Any], reference_split: str = REFERENCE_SPLIT) -> str:
    """The first :data:`SHOWN_SAMPLES` episodes of one split (the reference split when it has any),
    each its last prompt message and its last response cut to :data:`SHOWN_CHARS` characters; empty
    without samples. The model's text goes into code blocks with a fence longer than any run of
    backticks in it, so nothing it writes renders as Markdown or HTML."""
    split = next((s for s in sorted(samples, key=lambda s: s != reference_split) if samples[s]), None)
    if split is None:
        return ""
    rows = samples[split]
    lines = [
        f"\n### Samples (split {split}: {min(len(rows), SHOWN_SAMPLES)} of the {len(rows)} kept per split "
        "in the report's JSON, under `samples`)\n"
    ]
    for row in rows[:SHOWN_SAMPLES]:
        prompt = row.get("prompt") or [{}]
        responses = row.get("responses") or [""]
        verdict = "no verdict" if row.get("correct") is None else ("correct" if row["correct"] else "wrong")
        reason = f" ({row['reason']})" if row.get("reason") else ""
        cut = ", cut at the token limit" if row.get("hit_token_limit") else ""
        lines.append(
            f"**problem {row.get('group')} (env seed {row.get('seed')})**: reward {_cell(row.get('reward'))}, "
            f"{verdict}{_inline(reason)}, {row.get('turns')} turn(s), {row.get('response_tokens')} tokens{cut}\n"
        )
        lines += [
            "prompt (last message):",
            _code(str(prompt[-1].get("content", ""))),
            "response (last turn):",
        ]
        lines.append(_code(str(responses[-1])))
    return "\n".join(lines) + "\n"


def _code(text: str) -> str:
    """``text`` cut to :data:`SHOWN_CHARS` in a fenced code block no backtick run inside can close."""
    shown = text if len(text) <= SHOWN_CHARS else text[:SHOWN_CHARS] + " [...]"
    longest = max((len(run) for run in re.findall(r"`+", shown)), default=0)
    fence = "`" * max(3, longest + 1)
    return f"{fence}text\n{shown}\n{fence}\n"


def _inline(text: str) -> str:
    """A verdict's reason in running text: only letters, digits and ``_ -/.:()`` and spaces are kept."""
    return re.sub(r"[^A-Za-z0-9_ ./:()-]", "", text)


def comparison_markdown(reports: Mapping[str, Mapping[str, Any]], metric: str = "avg@n") -> str:
    """Checkpoints side by side, in the order given: each one's ``metric`` ± its standard error per
    split, and its paired difference with the checkpoint before it on the same problems
    (:func:`~veriloop.algos.eval.metrics.paired_difference`: ``d_j = after_j - before_j``, mean ± SE;
    ``n/a`` when the two were not evaluated on the same problems)."""
    labels = list(reports)
    header = ["checkpoint", "split", f"{metric} ± SE", "paired change ± SE"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for i, label in enumerate(labels):
        report = reports[label]
        for split, m in report["splits"].items():
            value = f"{_cell(m.get(metric))} ± {_cell(m.get(f'se/{metric}'))}"
            change = (
                _paired_cell(reports[labels[i - 1]], report, split, metric) + f" vs {labels[i - 1]}"
                if i
                else ""
            )
            lines.append(f"| {label} | {split} | {value} | {change} |")
    note = (
        f"{metric} ± SE over problems; the change is paired (each problem against itself), so its SE is "
        "smaller than the two SEs together. |change| > 2 SE is unlikely to be noise."
    )
    return "\n".join(lines) + "\n\n" + note + "\n"


def _paired_cell(before: Mapping[str, Any], after: Mapping[str, Any], split: str, metric: str) -> str:
    same = ("num_problems", "first_seed")
    if any(before.get("meta", {}).get(k) != after.get("meta", {}).get(k) for k in same):
        return "n/a (other problems)"
    a = before.get("per_problem", {}).get(split, {}).get(metric)
    b = after.get("per_problem", {}).get(split, {}).get(metric)
    if a is None or b is None or len(a) != len(b):
        return "n/a (no per-problem results)"
    d = paired_difference(a, b)
    return f"{d['diff']:+.3f} ± {_cell(d['se'])}"


def sources_markdown(meta: Mapping[str, Any]) -> str:
    """A list of what each split's problems were drawn from (empty for reports without it)."""
    lines = [f"- {name}: {s['source']}" for name, s in meta.get("splits", {}).items() if s.get("source")]
    return "\nProblems per split:\n\n" + "\n".join(lines) + "\n" if lines else ""


def write_report(report: Mapping[str, Any], out_dir: str | Path, name: str) -> dict[str, Path]:
    """Save ``<out_dir>/<name>.json`` (``nan`` as ``null``) and ``<name>.md``; returns both paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / f"{name}.json", "markdown": out / f"{name}.md"}
    paths["json"].write_text(json.dumps(json_safe(report), indent=2, allow_nan=False) + "\n")
    paths["markdown"].write_text(report_markdown(report, title=name))
    return paths


def run_summary(eval_dir: str | Path) -> str:
    """One table for a run: every evaluated checkpoint (base model, start after SFT, each step) x
    split, from the ``<eval_dir>/*.json`` reports the training loop writes, in step order."""
    reports = []
    for path in Path(eval_dir).glob("*.json"):
        report = read_report(path)
        meta = report.get("meta", {})
        order = (-1 if path.stem == "base" else int(meta.get("step") or 0), path.stem)
        reports.append((order, meta.get("checkpoint") or path.stem, report))
    if not reports:
        raise FileNotFoundError(f"no evaluation reports (*.json) in {eval_dir}")
    reports.sort(key=lambda r: r[0])
    rates = list(
        dict.fromkeys(
            k
            for _, _, r in reports
            for m in r["splits"].values()
            for k in m
            if k.startswith(("avg@", "pass@", "maj@", "greedy_acc", "se/")) and k != "pass@1"
        )
    )
    header = ["checkpoint", "split", *rates, "error rate"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for _, label, report in reports:
        for split, m in report["splits"].items():
            cells = [_cell(m.get(k)) for k in [*rates, "error_rate"]]
            lines.append("| " + " | ".join([label, split, *cells]) + " |")
    note = "avg@n is the unbiased pass@1; n/a = not measurable (e.g. maj@k without extracted answers)."
    change = rl_phase_markdown([(order[0], r) for order, _, r in reports])
    return "\n".join(lines) + "\n\n" + note + "\n" + change + sources_markdown(reports[-1][2].get("meta", {}))


def rl_phase_markdown(reports: list[tuple[int, Mapping[str, Any]]], split: str = REFERENCE_SPLIT) -> str:
    """The RL phase's change on held-out problems, paired by problem, in words: from the start
    (step 0, after any SFT warm-up) to the last evaluated step, ``avg@n`` before and after and
    :func:`~veriloop.algos.eval.metrics.paired_difference` (``d_j = after_j - before_j``, mean ± SE,
    ``z = mean / SE``). ``reports``: ``(step, report)`` pairs, the base model's step -1. Empty when
    the run has no step-0 and later evaluation of the same problems with per-problem results."""
    steps = {step: r for step, r in reports if step >= 0}
    if 0 not in steps or max(steps) == 0:
        return ""
    start, end, last = steps[0], steps[max(steps)], max(steps)
    a = start.get("per_problem", {}).get(split, {}).get("avg@n")
    b = end.get("per_problem", {}).get(split, {}).get("avg@n")
    meta = end.get("meta", {})
    if (
        a is None
        or b is None
        or len(a) != len(b)
        or start.get("meta", {}).get("first_seed") != meta.get("first_seed")
    ):
        return ""
    d = paired_difference(a, b)
    verdict = "beyond noise" if abs(d["z"]) > 3 else "within 3 SE, so it may be noise"
    return (
        f"\n**RL phase, on {len(a)} held-out problems x {meta.get('n_samples', '?')} samples** (split {split}): "
        f"avg@n {sum(a) / len(a):.3f} at the start (step 0) -> {sum(b) / len(b):.3f} at step {last}, "
        f"a change of {d['diff']:+.3f} ± {_cell(d['se'])} (paired SE, z = {d['z']:.1f}): {verdict}. "
        "The change is each problem's share of right answers after RL minus before, averaged over the same "
        "problems (their difficulty cancels), so above 3 SE RL's gain is unlikely to be sampling luck.\n"
    )


def _cell(value: Any) -> str:
    if value is None:
        return ""
    return "n/a" if isinstance(value, float) and math.isnan(value) else f"{float(value):.3f}"


def read_report(path: str | Path) -> dict[str, Any]:
    """Load a report written by :func:`write_report` (``null`` metrics come back as ``nan``)."""
    report = json.loads(Path(path).read_text())
    report["splits"] = {
        s: {k: math.nan if v is None else v for k, v in m.items()} for s, m in report["splits"].items()
    }
    return report
