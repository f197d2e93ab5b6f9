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
spread is larger, so read a balanced accuracy as above 0.5 only with margin to spare.

:func:`wilson_interval` is the Wilson score interval of a binomial proportion (Wilson 1927), which
stays inside [0, 1] and is not degenerate at 0 or n successes, unlike the normal approximation.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

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
    p, z2 = successes / n, z * z
    denom = 1.0 + z2 / n
    centre = (p + z2 / (2 * n)) / denom
    half = z / denom * math.sqrt(p * (1.0 - p) / n + z2 / (4 * n * n))
    low = 0.0 if successes == 0 else max(0.0, centre - half)  # exactly 0 (and 1) at the ends, where
    high = 1.0 if successes == n else min(1.0, centre + half)  # rounding would leave ~1e-17
    return low, high


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
