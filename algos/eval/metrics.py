"""Evaluation metrics for verifiable tasks: pass@k, avg@k, maj@k and the generalization gap.

Vocabulary (Yue et al. 2025), for one problem with ``n`` judged samples
of which ``c`` are correct:

* **pass@k** -- the probability that at least one of ``k`` samples drawn without replacement
  from the ``n`` is correct, the unbiased estimator ``1 - C(n-c, k) / C(n, k)``. Averaged over
  problems. Unlike "best of the first k" it uses all ``n`` samples, so its variance is lower.
* **avg@n** -- the mean accuracy over the ``n`` samples (pass@1 equals avg@n).
* **maj@k** -- majority vote over the first ``k`` sampled final answers; the problem counts as
  solved when the winning answer is correct.
* **se/avg@n** -- the standard error of avg@n over problems: ``sd(a_1..a_P) / sqrt(P)`` with ``a_j``
  problem j's accuracy over its n samples (sample sd, ddof = 1). It is the noise that drawing the P
  problems puts on avg@n; :func:`paired_difference` gives the SE of a change between two
  evaluations of the same problems, which is smaller when the per-problem results are correlated.

A sample whose verifier failed (timeout, memory, crash; ``Verdict.error`` set) was not judged, and an
answer nobody could check is not a success: in evaluation it counts as UNSOLVED in avg@n, pass@k and
maj@k (it stays in every denominator), and the failures are reported on their own, as
``verifier_errors`` (a count) and ``error_rate`` (their share of the samples). Dropping them instead
would let a policy lift its score by answering what it cannot solve with something the verifier
chokes on. (Training is different: there such episodes are left out of the baselines and get
advantage 0, see :mod:`veriloop.algos.maths.advantages`, since they carry no reward signal either way.)

Pure Python; no torch. Results are plain dicts of floats/ints, ready for logs and JSON.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

#: Metric name prefixes that are rates in [0, 1]; the generalization gap is taken over these.
RATE_PREFIXES = ("pass@", "avg@", "maj@")


@dataclass(frozen=True)
class Sample:
    """One sampled response to one evaluation problem.

    Attributes:
        correct: The verifier's judgement (treated as False when ``error`` is set).
        answer: The extracted final answer used for majority voting, ``None`` when the response
            had none. Compare answers in a canonical form (e.g. the verifier's ``parsed``):
            equal strings vote together, different strings never do.
        error: The verifier's failure kind (``"timeout"``, ``"memory"``, ``"crash"``) or ``None``.
    """

    correct: bool
    answer: str | None = None
    error: str | None = None

    @classmethod
    def from_verdict(cls, verdict: Any) -> Sample:
        """Build from a :class:`veriloop.envs.verifiers.verdict.Verdict` (or anything shaped like it)."""
        return cls(correct=bool(verdict.correct), answer=verdict.parsed, error=verdict.error)


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k for one problem: ``1 - C(n-c, k) / C(n, k)``.

    Computed in product form, which never forms the (huge) binomials:
    ``C(n-c, k) / C(n, k) = prod_{i=n-c+1}^{n} (1 - k / i)``; when ``n - c < k`` every k-subset
    holds a correct sample and the result is exactly 1.

    Args:
        n: Number of judged samples (>= 1).
        c: Number of correct samples, 0 <= c <= n.
        k: Samples drawn, 1 <= k <= n.
    """
    if n < 1:
        raise ValueError(f"pass@k needs n >= 1 judged samples, got n={n}")
    if not 0 <= c <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n, got c={c}, n={n}")
    if not 1 <= k <= n:
        raise ValueError(
            f"pass@k needs 1 <= k <= n, got k={k} with n={n} samples: draw at least k samples per "
            "problem (eval.n_samples) or drop the large k from eval.k_list"
        )
    if n - c < k:
        return 1.0
    miss = math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))
    return 1.0 - miss


def pass_at_k_curve(n: int, correct: Sequence[int], ks: Sequence[int]) -> dict[int, tuple[float, float]]:
    """pass@k over problems with its standard error, for each k (Yue et al. 2025's curve).

    For problem ``j`` with ``c_j`` of its ``n`` samples correct, :func:`pass_at_k` gives
    ``p_j(k) = 1 - C(n - c_j, k) / C(n, k)``; the curve's point is ``mean_j p_j(k)`` and its error
    :func:`standard_error` of the ``p_j(k)``: ``sd_j p_j(k) / sqrt(P)``, the noise of drawing the
    ``P`` problems (the samples' own noise is already averaged by the unbiased estimator).

    Args:
        n: Samples per problem (the same for every problem).
        correct: ``c_j`` per problem.
        ks: The k values, each in 1..n.

    Returns:
        ``{k: (mean, se)}``; ``se`` is ``nan`` for a single problem.
    """
    if not correct:
        raise ValueError("pass@k curve needs at least one problem, got none")
    out: dict[int, tuple[float, float]] = {}
    for k in ks:
        values = [pass_at_k(n, c, k) for c in correct]
        out[k] = (_mean(values), standard_error(values))
    return out


def avg_at_k(correct: Sequence[bool]) -> float:
    """Mean accuracy over the samples of one problem (avg@k with k = len(correct))."""
    if len(correct) == 0:
        raise ValueError("avg@k needs at least one judged sample, got none")
    return sum(bool(x) for x in correct) / len(correct)


def maj_at_k(
    answers: Sequence[str | None],
    correct_by_answer: Mapping[str, bool] | Callable[[str], bool],
    k: int,
) -> bool:
    """Majority vote over the first ``k`` answers; True when the winning answer is correct.

    ``None`` answers (nothing extracted) do not vote; if no answer votes the problem is unsolved.
    Ties go to the answer that appeared *first* among the ``k`` samples, so the result never
    depends on correctness or on dictionary order.

    Args:
        answers: Final answers in sampling order (judged samples only).
        correct_by_answer: Whether an answer is correct: a mapping or a gold-check function.
        k: How many leading samples vote, 1 <= k <= len(answers).
    """
    if not 1 <= k <= len(answers):
        raise ValueError(f"maj@k needs 1 <= k <= {len(answers)} (number of answers), got k={k}")
    counts: dict[str, int] = {}  # insertion order = first appearance
    for answer in answers[:k]:
        if answer is not None:
            counts[answer] = counts.get(answer, 0) + 1
    if not counts:
        return False
    best = max(counts.values())
    winner = next(a for a, count in counts.items() if count == best)
    if callable(correct_by_answer):
        return bool(correct_by_answer(winner))
    return bool(correct_by_answer[winner])


def summarize_split(
    results_per_problem: Sequence[Sequence[Sample]], k_list: Sequence[int]
) -> dict[str, float]:
    """Metrics of one evaluation split.

    Args:
        results_per_problem: For each problem, its samples in sampling order; every problem needs
            at least ``max(k_list)`` samples.
        k_list: The k values to report pass@k and maj@k for.

    Returns:
        ``num_problems``, ``num_samples`` (all of them), ``verifier_errors`` (samples the verifier
        failed on), ``error_rate`` (``verifier_errors / num_samples``), ``avg@n`` (mean over problems
        of the per-problem accuracy) and, for each k, ``pass@k`` and ``maj@k``. A sample with
        ``error`` set counts as unsolved in all of them (module docstring); in maj@k it still votes
        with its answer, which is correct only if another sample with the same answer was judged so.
        maj@k is ``nan`` (shown as n/a) when a correct sample has no extracted answer: the env does
        not set ``Verdict.parsed``, so there is nothing faithful to vote on.
    """
    if not results_per_problem:
        raise ValueError("summarize_split needs at least one problem, got none")
    if any(len(samples) == 0 for samples in results_per_problem):
        raise ValueError("summarize_split needs at least one sample per problem")
    solved = [[s.correct and s.error is None for s in samples] for samples in results_per_problem]
    total = sum(len(samples) for samples in results_per_problem)
    errors = sum(s.error is not None for samples in results_per_problem for s in samples)
    out: dict[str, float] = {
        "num_problems": len(results_per_problem),
        "num_samples": total,
        "verifier_errors": errors,
        "error_rate": errors / total,
        "avg@n": _mean([avg_at_k(c) for c in solved]),
        "se/avg@n": standard_error([avg_at_k(c) for c in solved]),
    }
    # maj@k votes on the extracted answers (``Verdict.parsed``); a judged-correct sample without
    # one means the env does not extract answers, and any vote would be a wrong number: n/a (nan)
    votable = not any(
        s.answer is None and s.correct and s.error is None for samples in results_per_problem for s in samples
    )
    for k in k_list:
        out[f"pass@{k}"] = _mean([pass_at_k(len(c), sum(c), k) for c in solved])
        out[f"maj@{k}"] = (
            _mean(
                [
                    float(maj_at_k([s.answer for s in samples], _vote_truth(samples), k))
                    for samples in results_per_problem
                ]
            )
            if votable
            else math.nan
        )
    return out


def _vote_truth(samples: Sequence[Sample]) -> dict[str, bool]:
    """Answer -> correctness: True when some judged sample with that answer was correct.

    An answer only seen on samples whose verifier failed is not known to be right, so it is False.
    """
    truth: dict[str, bool] = {}
    for s in samples:
        if s.answer is not None:
            truth[s.answer] = truth.get(s.answer, False) or (s.correct and s.error is None)
    return truth


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else math.nan


def standard_error(values: Sequence[float]) -> float:
    """Standard error of the mean: ``sd(values) / sqrt(len(values))``, sample sd (ddof = 1); ``nan``
    for fewer than two values (one value says nothing about its spread)."""
    n = len(values)
    if n < 2:
        return math.nan
    mean = sum(values) / n
    return math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1) / n)


def paired_difference(before: Sequence[float], after: Sequence[float]) -> dict[str, float]:
    """The change in mean accuracy between two evaluations of the same problems, with its SE.

    ``d_j = after_j - before_j`` per problem; ``diff = mean(d)``, ``se = sd(d) / sqrt(P)`` (paired:
    the problems' own difficulty cancels), ``z = diff / se`` (``inf`` when every problem moved
    alike, ``nan`` for no change at all or fewer than two problems).
    """
    if len(before) != len(after):
        raise ValueError(f"paired_difference needs the same problems: {len(before)} vs {len(after)} values")
    d = [a - b for a, b in zip(after, before, strict=True)]
    diff, se = _mean(d), standard_error(d)
    if math.isnan(se) or math.isnan(diff):
        z = math.nan
    elif se == 0:
        z = math.nan if diff == 0 else math.copysign(math.inf, diff)
    else:
        z = diff / se
    return {"diff": diff, "se": se, "z": z, "num_problems": float(len(d))}


def reference_of(split: str, splits: Collection[str], default: str = "id") -> str | None:
    """The split that ``split``'s gap is measured against: ``<name>`` for a split named
    ``<name>.<suffix>`` when ``<name>`` is a split (a mixture env and its OOD variant), else
    ``default`` (the in-distribution split ``id``) when present; None for a reference itself."""
    head = split.split(".", 1)[0]
    if head != split and head in splits:
        return head
    return default if default in splits and split != default else None


def generalization_gap(
    split_metrics: Mapping[str, Mapping[str, float]], reference_split: str = "id"
) -> dict[str, dict[str, float]]:
    """Per split, ``reference - split`` for every rate metric the two share.

    A positive gap means the split scores *lower* than its reference (in-distribution) split,
    which is ``reference_split``, or ``<name>`` for a split named ``<name>.<suffix>`` (see
    :func:`reference_of`). Rate metrics are those named ``pass@*``, ``avg@*`` and ``maj@*``.
    """
    refs = {s: reference_of(s, split_metrics, reference_split) for s in split_metrics}
    if reference_split not in split_metrics and not any(refs.values()):
        raise KeyError(
            f"reference split {reference_split!r} not in the report; splits: {sorted(split_metrics)}"
        )
    gaps: dict[str, dict[str, float]] = {}
    for split, metrics in split_metrics.items():
        ref_name = refs[split]
        if ref_name is None:
            continue
        ref = split_metrics[ref_name]
        gaps[split] = {m: ref[m] - metrics[m] for m in ref if m.startswith(RATE_PREFIXES) and m in metrics}
    return gaps


def markdown_table(report: Mapping[str, Mapping[str, float]], reference_split: str = "id") -> str:
    """Render split metrics as a Markdown table, reference split first, with gap rows.

    One row per split (problems, verifier errors, error rate, then each rate metric), then one
    ``gap <ref>-<split>`` row per other split (empty cells for counts and the error rate). When the reference split
    is absent, no gap rows are added.
    """
    if not report:
        raise ValueError("markdown_table needs at least one split")
    splits = sorted(report, key=lambda s: (s != reference_split, s))
    rates: list[str] = []
    for split in splits:
        rates += [m for m in report[split] if m.startswith(RATE_PREFIXES) and m not in rates]
    header = ["split", "problems", "verifier errors", "error rate", *rates]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for split in splits:
        m = report[split]
        cells = [
            split,
            _int_cell(m.get("num_problems")),
            _int_cell(m.get("verifier_errors")),
            _rate_cell(m.get("error_rate")),
        ]
        lines.append("| " + " | ".join(cells + [_rate_cell(m.get(r)) for r in rates]) + " |")
    if any(reference_of(s, report, reference_split) for s in report):
        for split, gap in generalization_gap(report, reference_split).items():
            cells = [f"gap {reference_of(split, report, reference_split)}-{split}", "", "", ""] + [
                _rate_cell(gap.get(r), signed=True) for r in rates
            ]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _int_cell(value: float | None) -> str:
    return "" if value is None else str(int(value))


def _rate_cell(value: float | None, signed: bool = False) -> str:
    if value is None:
        return ""
    if math.isnan(value):
        return "n/a"
    return f"{value:+.3f}" if signed else f"{value:.3f}"
