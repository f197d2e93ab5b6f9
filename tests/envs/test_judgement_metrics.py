"""Verification quality beyond accuracy: recalls, balanced accuracy, F1, Wilson intervals; S2R's summary."""

from __future__ import annotations

import json
import math

import gymnasium
import pytest

import veriloop.envs  # noqa: F401  (registers the environments)
from veriloop.envs.judgement_metrics import (
    balanced_accuracy_se,
    clustered_balanced_accuracy_se,
    clustered_ratio_se,
    clustered_wilson_interval,
    judgement_metrics,
    wilson_interval,
)
from veriloop.envs.solve_verify import verification_summary

OK, BAD = "<verify>correct</verify>", "<verify>incorrect</verify>"


@pytest.mark.parametrize(
    ("k", "n", "low", "high"),
    [(0, 10, 0.0, 0.2775), (5, 10, 0.2366, 0.7634), (2, 4, 0.1500, 0.8500), (10, 10, 0.7225, 1.0)],
)
def test_wilson_interval_known_values(k, n, low, high):
    """Published 95% Wilson intervals (e.g. 0/10 -> [0, 0.2775]; 5/10 -> [0.2366, 0.7634])."""
    assert wilson_interval(k, n) == pytest.approx((low, high), abs=1e-4)


def test_wilson_interval_invariants():
    for n in (1, 7, 50):
        for k in range(n + 1):
            low, high = wilson_interval(k, n)
            assert 0.0 <= low <= k / n <= high <= 1.0
            mirror = wilson_interval(n - k, n)
            assert (low, high) == pytest.approx((1 - mirror[1], 1 - mirror[0]))  # symmetric in k <-> n-k
    assert all(math.isnan(x) for x in wilson_interval(0, 0))
    with pytest.raises(ValueError, match="0 <= successes <= n"):
        wilson_interval(3, 2)


def test_judgement_metrics_hand_computed():
    """TP 3, FN 1, FP 2, TN 4: recalls 3/4 and 4/6, F1 6/9 and 8/11."""
    pairs = [(True, True)] * 3 + [(False, True)] + [(True, False)] * 2 + [(False, False)] * 4
    m = judgement_metrics(pairs)
    assert m["n"] == 10 and m["positive_share"] == pytest.approx(0.4)
    assert (m["recall_positive"], m["recall_negative"]) == pytest.approx((0.75, 4 / 6))
    assert m["balanced_accuracy"] == pytest.approx((0.75 + 4 / 6) / 2)
    assert (m["f1_positive"], m["f1_negative"]) == pytest.approx((6 / 9, 8 / 11))
    assert m["macro_f1"] == pytest.approx((6 / 9 + 8 / 11) / 2)
    # se = 1/2 sqrt(3/4 * 1/4 / 4 + 4/6 * 2/6 / 6) = 1/2 sqrt(3/64 + 1/27)
    assert m["balanced_accuracy_se"] == pytest.approx(0.5 * math.sqrt(3 / 64 + 1 / 27))


@pytest.mark.parametrize("wrong", [1, 4, 9])
def test_a_constant_judge_has_balanced_accuracy_one_half(wrong):
    """Always saying "wrong" (positive) over ``wrong`` wrong and 10 - wrong right solves."""
    m = judgement_metrics([(True, True)] * wrong + [(True, False)] * (10 - wrong))
    assert m["balanced_accuracy"] == 0.5 and m["recall_positive"] == 1.0 and m["recall_negative"] == 0.0
    assert m["f1_negative"] == 0.0 and m["f1_positive"] == pytest.approx(2 * wrong / (2 * wrong + 10 - wrong))


def test_a_missing_class_leaves_balanced_accuracy_undefined():
    m = judgement_metrics([(True, True), (False, True)])
    assert (
        m["recall_positive"] == 0.5
        and math.isnan(m["recall_negative"])
        and math.isnan(m["balanced_accuracy"])
    )
    assert m["f1_negative"] == 0.0  # never true, but said once: a wrong "negative"
    assert all(math.isnan(v) for k, v in judgement_metrics([]).items() if k != "n")


def test_clustered_ratio_se_hand_computed():
    """Hits 2, 0, 2, 0 of 2 each: R = 1/2, sum (a - R n)^2 = 4, se = sqrt(4/3 * 4) / 8."""
    assert clustered_ratio_se([2, 0, 2, 0], [2, 2, 2, 2]) == pytest.approx(math.sqrt(16 / 3) / 8)
    # one judgement per cluster: the binomial se times sqrt(C / (C - 1))
    hits = [1] * 3 + [0] * 7
    assert clustered_ratio_se(hits, [1] * 10) == pytest.approx(math.sqrt(0.3 * 0.7 / 10 * 10 / 9))
    assert math.isnan(clustered_ratio_se([1], [3])) and math.isnan(clustered_ratio_se([0, 1], [0, 2]))
    with pytest.raises(ValueError, match="0 <= hits <= count"):
        clustered_ratio_se([3], [2])


def test_clustered_wilson_interval_uses_the_effective_size():
    """The clusters above: se_C^2 = 1/12 against the independent 1/32, deff = 8/3, N_eff = 3, so the
    interval is Wilson's at p = 1/2, n = 3: centre 1/2, half-width z/(1 + z^2/3) sqrt(1/12 + z^2/36)."""
    z2 = 1.959963984540054**2
    half = math.sqrt(z2) / (1 + z2 / 3) * math.sqrt(1 / 12 + z2 / 36)
    assert clustered_wilson_interval([2, 0, 2, 0], [2, 2, 2, 2]) == pytest.approx((0.5 - half, 0.5 + half))
    assert half == pytest.approx(0.3747, abs=1e-4)
    # never narrower than the independent interval; at 0 successes, exactly it
    assert clustered_wilson_interval([1, 1, 0, 0], [2, 2, 2, 2]) == pytest.approx(wilson_interval(2, 8))
    assert clustered_wilson_interval([0, 0], [3, 4]) == wilson_interval(0, 7)
    assert all(math.isnan(x) for x in clustered_wilson_interval([0], [0]))


def test_clustered_balanced_accuracy_se_hand_computed():
    """Clusters (right pos, pos, right neg, neg): (1,1,0,1), (0,1,1,1), (1,1,1,1). R_pos = R_neg = 2/3,
    z = -1/9, -1/9, 2/9; se = 1/2 sqrt(3/2 * 6/81) = 1/6."""
    assert clustered_balanced_accuracy_se([(1, 1, 0, 1), (0, 1, 1, 1), (1, 1, 1, 1)]) == pytest.approx(1 / 6)
    # one judgement per cluster: the independent se times sqrt(C / (C - 1))
    clusters = [(1, 1, 0, 0)] * 3 + [(0, 1, 0, 0)] + [(0, 0, 1, 1)] * 4 + [(0, 0, 0, 1)] * 2
    independent = balanced_accuracy_se(0.75, 4, 4 / 6, 6)
    assert clustered_balanced_accuracy_se(clusters) == pytest.approx(independent * math.sqrt(10 / 9))
    assert math.isnan(clustered_balanced_accuracy_se([(1, 1, 0, 0), (0, 1, 0, 0)]))  # no negatives


def test_s2r_intervals_clustered_by_problem_widen_when_a_problems_episodes_agree():
    """Four episodes, two wrong→right (hits 1, 1, 0, 0). As four problems: se_C^2 = 4/3 * 1/16 = 1/12
    against the independent 1/16, N_eff = 3. As two problems whose episodes agree (hits 2, 0 of 2):
    se_C^2 = 2 * 2/16 = 1/4, N_eff = 1. Both are Wilson intervals at p = 1/2."""
    plans = [[False, BAD, True, OK], [False, BAD, True, OK], [True, OK], [True, OK]]
    episodes = _episodes(plans, _right, _wrong)
    apart, together = (
        verification_summary(episodes, [0, 1, 2, 3]),
        verification_summary(episodes, [0, 0, 1, 1]),
    )

    def wilson_half(n):
        z2 = 1.959963984540054**2
        return math.sqrt(z2) / (1 + z2 / n) * math.sqrt(0.25 / n + z2 / (4 * n * n))

    for s, n_eff in ((apart, 3), (together, 1)):
        assert (s["wrong_to_right/cluster_ci95_low"], s["wrong_to_right/cluster_ci95_high"]) == pytest.approx(
            (0.5 - wilson_half(n_eff), 0.5 + wilson_half(n_eff))
        )
        assert (s["wrong_to_right/ci95_low"], s["wrong_to_right/ci95_high"]) == pytest.approx(
            wilson_interval(2, 4)
        )
    # a perfect verifier: every recall 1, no spread clustered or not
    assert (
        together["verify_balanced_acc/cluster_ci95_low"]
        == together["verify_balanced_acc/cluster_ci95_high"]
        == 1.0
    )
    with pytest.raises(ValueError, match="one problem per episode"):
        verification_summary(episodes, [0])


def _episodes(plans, answer_right, answer_wrong):
    """Play SolveVerify-points24 (2 solves) from seed 0 with each plan: True/False = right/wrong solve."""
    env = gymnasium.make("veriloop/SolveVerify-v0", task="points24", max_attempts=2)
    out = []
    for plan in plans:
        _, info = env.reset(seed=0)
        signals = []
        for action in plan:
            text = (
                action
                if isinstance(action, str)
                else (answer_right if action else answer_wrong)(info["task"])
            )
            *_, terminated, truncated, step_info = env.step(text)
            signals.append(step_info["signal"])
            if terminated or truncated:
                break
        out.append(signals)
    return out


def _answer(task, formula):
    return json.dumps({"cards": [c[:-1] for c in task["cards"]], "formula": formula})


def _right(task):
    return _answer(task, task["solution"])


def _wrong(task):
    return _answer(task, "-".join(map(str, task["values"])))  # a legal formula of the wrong value


def test_s2r_always_incorrect_verifier_scores_one_half_whatever_the_base_rate():
    """Accuracy of "always incorrect" is the share of wrong solves (1/4 here); balanced accuracy 0.5."""
    plans = [[True, BAD, True, BAD], [False, BAD, True, BAD]]  # solves: right right | wrong right
    s = verification_summary(_episodes(plans, _right, _wrong), [0, 1])
    assert s["verify_count"] == 4 and s["verify_wrong_share"] == pytest.approx(0.25)
    assert s["verify_balanced_acc"] == 0.5 and s["verify_f1_right"] == 0.0
    # a constant judge's recalls are 1 and 0: no spread, so its interval is the point 0.5
    assert s["verify_balanced_acc/ci95_low"] == s["verify_balanced_acc/ci95_high"] == 0.5
    assert s["verify_f1_wrong"] == pytest.approx(2 / 5)  # TP 1, FP 3: 2*1 / (2*1 + 3)
    # one episode of two went wrong -> right: the Wilson interval of 1/2
    assert (s["wrong_to_right/ci95_low"], s["wrong_to_right/ci95_high"]) == pytest.approx(
        wilson_interval(1, 2)
    )


def test_s2r_perfect_verifier_and_its_step_metrics():
    episodes = _episodes([[False, BAD, True, OK], [True, OK]], _right, _wrong)
    s = verification_summary(episodes, [0, 1])
    assert s["verify_balanced_acc"] == 1.0 and s["verify_f1_right"] == s["verify_f1_wrong"] == 1.0
    verifies = [
        sig.step_metrics
        for sigs in episodes
        for sig in sigs
        if not math.isnan(sig.step_metrics["verify_acc"])
    ]
    assert [m["verify_recall_wrong"] for m in verifies][0] == 1.0 and math.isnan(
        verifies[0]["verify_recall_right"]
    )
    assert all(sig.summarize is verification_summary for sigs in episodes for sig in sigs)
