"""How good is a yes/no judgement? Per-class recall, balanced accuracy, F1, and a binomial interval.

Pure Python over plain numbers, for environments whose actions judge something (S2R's verify says
"correct" or "incorrect" about the solve before it). Accuracy alone flatters a judge that always
gives the majority answer: if 80% of solves are wrong, always saying "incorrect" is 80% accurate and
checks nothing. Its balanced accuracy is 0.5.

Notation: each judgement is a pair ``(says, truth)`` of booleans ("positive" = ``True``). With
``TP, FN, FP, TN`` the counts of (True, True), (False, True), (True, False), (False, False):

* recall of the positives ``TP / (TP + FN)``, of the negatives ``TN / (TN + FP)``;
* balanced accuracy = the mean of the two recalls (Brodersen et al. 2010), 0.5 for any constant
  judge whatever the base rate; ``nan`` when one class never occurs (the mean is then undefined);
* F1 of a class = ``2 TP / (2 TP + FP + FN)`` with that class as the positive one (the harmonic mean
  of its precision and recall, 0 when the class is never both said and true); ``nan`` when the class
  is never said and never true.

The standard error of the balanced accuracy treats the two recalls as independent binomial
proportions over ``n_pos = TP + FN`` and ``n_neg = TN + FP`` judgements:
``se = 1/2 * sqrt(r_pos (1 - r_pos) / n_pos + r_neg (1 - r_neg) / n_neg)``. It assumes independent
judgements; when several come from one episode or one problem they are correlated and the true
spread is larger. The *clustered* versions take that correlation in: with the judgements grouped
into clusters ``c`` (S2R: the problems, each played several times), a pooled rate
``R = sum_c a_c / sum_c n_c`` (``a_c`` hits of ``n_c`` judgements in cluster ``c``, ``C`` clusters)
has the cluster-robust standard error

``se_C(R) = sqrt(C / (C - 1) * sum_c (a_c - R n_c)^2) / sum_c n_c``,

the linearised variance of a ratio estimator with the clusters as sampling units (Cochran 1977,
*Sampling Techniques*; the "sandwich" form of Cameron & Miller 2015), and the balanced accuracy
``B = (R_pos + R_neg) / 2`` has ``se_C(B) = 1/2 * sqrt(C / (C - 1) * sum_c z_c^2)`` with
``z_c = (a_pos,c - R_pos n_pos,c) / N_pos + (a_neg,c - R_neg n_neg,c) / N_neg``, which keeps the
covariance of the two recalls that share clusters. With one judgement per cluster both reduce to the
independent formulas times ``sqrt(C / (C - 1))``. :func:`clustered_wilson_interval` is the Wilson
interval at the effective sample size ``N / deff``, ``deff = se_C^2 / (R (1 - R) / N)``, never
narrower than the independent one (``deff`` is floored at 1: with a few hundred clusters an estimate
below 1 is more likely noise than real negative correlation).

:func:`wilson_interval` is the Wilson score interval of a binomial proportion (Wilson 1927), which
stays inside [0, 1] and is not degenerate at 0 or n successes, unlike the normal approximation.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

#: z for a two-sided 95% interval (the 0.975 quantile of the standard normal).
Z95 = 1.959963984540054


def wilson_interval(successes: int, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval ``(low, high)`` of the proportion ``successes / n``.

    ``centre = (p + z²/2n) / (1 + z²/n)``, ``half = z / (1 + z²/n) * sqrt(p(1-p)/n + z²/4n²)``
    with ``p = successes / n``. ``(nan, nan)`` when ``n == 0`` (no trials, no interval).
    """
    if n < 0 or not 0 <= successes <= n:
        raise ValueError(f"wilson_interval needs 0 <= successes <= n, got successes={successes}, n={n}")
    if n == 0:
        return math.nan, math.nan
    return _wilson(successes / n, n, z)


def _wilson(p: float, n: float, z: float) -> tuple[float, float]:
    """Wilson interval of the proportion ``p`` over ``n`` (possibly fractional, an effective size)."""
    z2 = z * z
    denom = 1.0 + z2 / n
    centre = (p + z2 / (2 * n)) / denom
    half = z / denom * math.sqrt(p * (1.0 - p) / n + z2 / (4 * n * n))
    low = 0.0 if p == 0.0 else max(0.0, centre - half)  # exactly 0 (and 1) at the ends, where
    high = 1.0 if p == 1.0 else min(1.0, centre + half)  # rounding would leave ~1e-17
    return low, high


def _check_clusters(hits: Sequence[float], counts: Sequence[float]) -> None:
    if len(hits) != len(counts) or any(not 0 <= a <= n for a, n in zip(hits, counts)):
        raise ValueError(
            "clustered rates need one (hits, count) per cluster with 0 <= hits <= count, "
            f"got hits={list(hits)[:5]}..., counts={list(counts)[:5]}..."
        )


def clustered_ratio_se(hits: Sequence[float], counts: Sequence[float]) -> float:
    """Cluster-robust standard error of ``R = sum(hits) / sum(counts)`` (module docstring):
    ``sqrt(C / (C - 1) * sum_c (a_c - R n_c)^2) / sum_c n_c`` over the ``C`` clusters with a count;
    ``nan`` with fewer than two such clusters."""
    _check_clusters(hits, counts)
    used = [(a, n) for a, n in zip(hits, counts) if n > 0]
    c = len(used)
    if c < 2:
        return math.nan
    total = sum(n for _, n in used)
    rate = sum(a for a, _ in used) / total
    return math.sqrt(c / (c - 1) * sum((a - rate * n) ** 2 for a, n in used)) / total


def clustered_wilson_interval(
    hits: Sequence[float], counts: Sequence[float], z: float = Z95
) -> tuple[float, float]:
    """Wilson interval of the pooled rate ``R`` at the effective size ``N / deff`` (module docstring),
    ``deff = max(1, se_C^2 / (R (1 - R) / N))``; at ``R`` = 0 or 1, or with fewer than two clusters,
    the independent interval. ``(nan, nan)`` when nothing was counted."""
    _check_clusters(hits, counts)
    total = float(sum(counts))
    if total == 0:
        return math.nan, math.nan
    rate = sum(hits) / total
    se_c = clustered_ratio_se(hits, counts)
    deff = 1.0
    if 0.0 < rate < 1.0 and not math.isnan(se_c):
        deff = max(1.0, se_c**2 / (rate * (1.0 - rate) / total))
    return _wilson(rate, total / deff, z)


def clustered_balanced_accuracy_se(clusters: Sequence[tuple[int, int, int, int]]) -> float:
    """Cluster-robust standard error of the balanced accuracy (module docstring) from each cluster's
    ``(right positives, positives, right negatives, negatives)``:
    ``1/2 * sqrt(C / (C - 1) * sum_c z_c^2)``, ``z_c = (a_pos,c - R_pos n_pos,c) / N_pos +
    (a_neg,c - R_neg n_neg,c) / N_neg``; ``nan`` when a class is missing or fewer than two clusters
    have judgements."""
    _check_clusters([c[0] for c in clusters], [c[1] for c in clusters])
    _check_clusters([c[2] for c in clusters], [c[3] for c in clusters])
    used = [c for c in clusters if c[1] + c[3] > 0]
    n_pos, n_neg = sum(c[1] for c in used), sum(c[3] for c in used)
    if len(used) < 2 or n_pos == 0 or n_neg == 0:
        return math.nan
    r_pos, r_neg = sum(c[0] for c in used) / n_pos, sum(c[2] for c in used) / n_neg
    zs = [(a_p - r_pos * n_p) / n_pos + (a_n - r_neg * n_n) / n_neg for a_p, n_p, a_n, n_n in used]
    c = len(used)
    return 0.5 * math.sqrt(c / (c - 1) * sum(z * z for z in zs))


def _ratio(num: int, den: int) -> float:
    return num / den if den else math.nan


def balanced_accuracy_se(recall_pos: float, n_pos: int, recall_neg: float, n_neg: int) -> float:
    """Standard error of ``(recall_pos + recall_neg) / 2`` over independent judgements:
    ``1/2 * sqrt(r_pos (1 - r_pos) / n_pos + r_neg (1 - r_neg) / n_neg)``; ``nan`` when a class
    has no judgements."""
    if n_pos <= 0 or n_neg <= 0:
        return math.nan
    return 0.5 * math.sqrt(recall_pos * (1 - recall_pos) / n_pos + recall_neg * (1 - recall_neg) / n_neg)


def judgement_metrics(pairs: Iterable[tuple[bool, bool]]) -> dict[str, float]:
    """Metrics of ``(says, truth)`` judgements (module docstring).

    Returns ``n``, ``positive_share`` (how often the truth is positive), ``recall_positive``,
    ``recall_negative``, ``balanced_accuracy`` with its ``balanced_accuracy_se``, ``f1_positive``,
    ``f1_negative`` and ``macro_f1`` (their mean); a rate with nothing to count is ``nan``.
    """
    tp = fn = fp = tn = 0
    for says, truth in pairs:
        if truth:
            tp, fn = (tp + 1, fn) if says else (tp, fn + 1)
        else:
            fp, tn = (fp + 1, tn) if says else (fp, tn + 1)
    recall_pos, recall_neg = _ratio(tp, tp + fn), _ratio(tn, tn + fp)
    f1_pos, f1_neg = _ratio(2 * tp, 2 * tp + fp + fn), _ratio(2 * tn, 2 * tn + fn + fp)
    return {
        "n": float(tp + fn + fp + tn),
        "positive_share": _ratio(tp + fn, tp + fn + fp + tn),
        "recall_positive": recall_pos,
        "recall_negative": recall_neg,
        "balanced_accuracy": (recall_pos + recall_neg) / 2,  # nan when a class is missing
        "balanced_accuracy_se": balanced_accuracy_se(recall_pos, tp + fn, recall_neg, tn + fp),
        "f1_positive": f1_pos,
        "f1_negative": f1_neg,
        "macro_f1": (f1_pos + f1_neg) / 2,
    }
