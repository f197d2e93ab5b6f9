"""Tests for veriloop.algos.eval.metrics: estimators against brute force and hand cases."""

from __future__ import annotations

import itertools
import math

import pytest

from veriloop.algos.eval.metrics import (
    Sample,
    avg_at_k,
    generalization_gap,
    maj_at_k,
    markdown_table,
    pass_at_k,
    summarize_split,
)


def brute_force_pass_at_k(n: int, c: int, k: int) -> float:
    """Fraction of the k-subsets of n samples (the first c correct) holding a correct sample."""
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(i < c for i in s) for s in subsets) / len(subsets)


@pytest.mark.parametrize("n", range(1, 11))
def test_pass_at_k_matches_brute_force(n: int) -> None:
    for c in range(n + 1):
        for k in range(1, n + 1):
            assert pass_at_k(n, c, k) == pytest.approx(brute_force_pass_at_k(n, c, k), abs=1e-12)


def test_pass_at_k_hand_cases_and_invariants() -> None:
    assert pass_at_k(2, 1, 1) == 0.5
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)  # 1 - C(3,2)/C(4,2) = 1 - 3/6
    assert pass_at_k(10, 0, 5) == 0.0
    assert pass_at_k(10, 6, 5) == 1.0  # n - c < k: every subset holds a correct sample
    # pass@1 is the plain accuracy; pass@k grows with k
    assert pass_at_k(7, 3, 1) == pytest.approx(3 / 7)
    values = [pass_at_k(20, 3, k) for k in range(1, 21)]
    assert all(a <= b + 1e-15 for a, b in zip(values, values[1:]))


def test_pass_at_k_is_stable_for_large_n() -> None:
    # C(1024, 512) overflows floats; the product form does not.
    expected = 1.0 - math.comb(1020, 256) / math.comb(1024, 256)
    assert pass_at_k(1024, 4, 256) == pytest.approx(expected, rel=1e-12)
    assert 0.0 < pass_at_k(1024, 1, 1) < 0.001


@pytest.mark.parametrize(("n", "c", "k"), [(4, 1, 5), (4, 1, 0), (4, 5, 1), (4, -1, 1), (0, 0, 1)])
def test_pass_at_k_rejects_bad_arguments(n: int, c: int, k: int) -> None:
    with pytest.raises(ValueError, match="pass@k needs"):
        pass_at_k(n, c, k)


def test_avg_at_k() -> None:
    assert avg_at_k([True, False, False, True]) == 0.5
    assert avg_at_k([False]) == 0.0
    with pytest.raises(ValueError, match="at least one"):
        avg_at_k([])


def test_maj_at_k_hand_cases() -> None:
    gold = {"4": True, "5": False, "6": False}
    assert maj_at_k(["4", "5", "4"], gold, 3) is True
    assert maj_at_k(["5", "5", "4", "4", "4"], gold, 3) is False  # only the first 3 vote
    assert maj_at_k(["5", "5", "4", "4", "4"], gold, 5) is True
    # None answers never vote, even when they are the most common "answer"
    assert maj_at_k([None, None, "4"], gold, 3) is True
    assert maj_at_k([None, None], gold, 2) is False
    # a gold-check function works like the mapping
    assert maj_at_k(["4", "6"], lambda a: a == "4", 1) is True
    with pytest.raises(ValueError, match="maj@k needs"):
        maj_at_k(["4"], gold, 2)


def test_maj_at_k_tie_goes_to_first_appearance() -> None:
    gold = {"a": True, "b": False}
    assert maj_at_k(["a", "b", "b", "a"], gold, 4) is True
    assert maj_at_k(["b", "a", "a", "b"], gold, 4) is False


def test_summarize_split_counts_verifier_errors_as_unsolved() -> None:
    problems = [
        [Sample(True, "4"), Sample(False, "5"), Sample(True, "4"), Sample(False, None)],
        [Sample(False, "1"), Sample(False, "1"), Sample(True, "2"), Sample(False, "2", error="timeout")],
    ]
    out = summarize_split(problems, k_list=[1, 2, 4])
    assert out["num_problems"] == 2
    assert out["num_samples"] == 8
    assert out["verifier_errors"] == 1
    assert out["error_rate"] == pytest.approx(1 / 8)
    assert out["avg@n"] == pytest.approx((2 / 4 + 1 / 4) / 2)
    assert out["pass@1"] == pytest.approx((2 / 4 + 1 / 4) / 2)
    assert out["pass@2"] == pytest.approx((1 - 1 / 6 + 1 - 3 / 6) / 2)
    assert out["pass@4"] == 1.0
    assert out["maj@2"] == pytest.approx(0.5)  # "4","5" tie -> "4" (correct); "1","1" -> wrong
    # problem 2: "1" x2, "2" x2 (one judged correct, one timed out) -> tie, "1" first -> wrong
    assert out["maj@4"] == pytest.approx(0.5)
    assert "excluded@4" not in out


def test_verifier_timeouts_never_lift_a_score() -> None:
    """Bombs in place of the 5 unsolved answers of 10 problems must not lift avg@n."""
    solved = [[Sample(True, "1")] for _ in range(5)]
    unsolved = [[Sample(False, "2")] for _ in range(5)]
    bombs = [[Sample(False, "\\Gamma(10^{7})", error="timeout")] for _ in range(5)]
    honest = summarize_split(solved + unsolved, k_list=[1])
    bombed = summarize_split(solved + bombs, k_list=[1])
    for metric in ("avg@n", "pass@1", "maj@1"):
        assert honest[metric] == bombed[metric] == 0.5
    assert (honest["error_rate"], bombed["error_rate"]) == (0.0, 0.5)
    assert bombed["verifier_errors"] == 5


def test_timed_out_answer_votes_but_never_wins_as_correct() -> None:
    # the same answer string judged correct elsewhere does not make a timed-out vote correct first
    samples = [Sample(False, "7", error="timeout"), Sample(False, "7", error="timeout"), Sample(True, "3")]
    assert summarize_split([samples], k_list=[3])["maj@3"] == 0.0
    mixed = [Sample(False, "7", error="timeout"), Sample(True, "7"), Sample(False, "3")]
    assert summarize_split([mixed], k_list=[3])["maj@3"] == 1.0  # "7" was judged correct once


def test_summarize_split_all_errors_scores_zero() -> None:
    out = summarize_split([[Sample(False, error="crash")]], k_list=[1])
    assert out["verifier_errors"] == 1 and out["error_rate"] == 1.0
    assert out["pass@1"] == 0.0 and out["avg@n"] == 0.0 and out["maj@1"] == 0.0


def test_from_verdict() -> None:
    from veriloop.envs.verifiers.verdict import Verdict

    s = Sample.from_verdict(Verdict(correct=False, error="timeout", parsed="7"))
    assert s == Sample(False, "7", "timeout")


def _report() -> dict[str, dict[str, float]]:
    return {
        "rule_ood": {
            "num_problems": 8,
            "verifier_errors": 1,
            "error_rate": 0.03125,
            "pass@1": 0.25,
            "maj@4": 0.5,
        },
        "id": {"num_problems": 10, "verifier_errors": 0, "error_rate": 0.0, "pass@1": 0.5, "maj@4": 0.75},
    }


def test_generalization_gap() -> None:
    gaps = generalization_gap(_report())
    assert gaps == {"rule_ood": {"pass@1": 0.25, "maj@4": 0.25}}
    with pytest.raises(KeyError, match="reference split 'train'"):
        generalization_gap(_report(), reference_split="train")


def test_markdown_table() -> None:
    table = markdown_table(_report())
    assert table == (
        "| split | problems | verifier errors | error rate | pass@1 | maj@4 |\n"
        "|---|---|---|---|---|---|\n"
        "| id | 10 | 0 | 0.000 | 0.500 | 0.750 |\n"
        "| rule_ood | 8 | 1 | 0.031 | 0.250 | 0.500 |\n"
        "| gap id-rule_ood |  |  |  | +0.250 | +0.250 |\n"
    )
    nan_table = markdown_table({"id": {"num_problems": 1, "verifier_errors": 1, "pass@1": math.nan}})
    assert "| id | 1 | 1 |  | n/a |" in nan_table and "gap" not in nan_table


def test_maj_at_k_is_unavailable_not_zero_when_the_env_extracts_no_answer():
    """A custom env that never sets Verdict.parsed: pass@1 = 1 must not sit beside maj@k = 0."""
    import math

    from veriloop.algos.eval.metrics import Sample, markdown_table, summarize_split

    m = summarize_split([[Sample(True, None), Sample(True, None)]] * 3, [1, 2])
    assert m["pass@1"] == 1.0 and math.isnan(m["maj@1"]) and math.isnan(m["maj@2"])
    assert "n/a" in markdown_table({"id": m})
    with_answers = summarize_split([[Sample(True, "4"), Sample(False, "5")]], [1])
    assert with_answers["maj@1"] == 1.0


def test_standard_error_by_hand():
    from veriloop.algos.eval.metrics import standard_error

    # 1, 2, 3, 4: mean 2.5, sample variance (2.25 + .25 + .25 + 2.25) / 3 = 5/3, SE = sqrt(5/3 / 4)
    assert standard_error([1, 2, 3, 4]) == pytest.approx(math.sqrt(5 / 12))
    assert standard_error([0.5, 0.5, 0.5]) == 0.0
    assert math.isnan(standard_error([1.0])) and math.isnan(standard_error([]))


def test_paired_difference_cancels_problem_difficulty():
    from veriloop.algos.eval.metrics import paired_difference, standard_error

    before = [0.0, 0.25, 0.5, 1.0]
    after = [0.25, 0.5, 0.5, 1.0]  # d = .25, .25, 0, 0: mean .125, sample var 1/48, SE sqrt(1/48 / 4)
    out = paired_difference(before, after)
    assert out["diff"] == pytest.approx(0.125)
    assert out["se"] == pytest.approx(math.sqrt(1 / 192))
    assert out["z"] == pytest.approx(0.125 / math.sqrt(1 / 192)) and out["num_problems"] == 4
    # the unpaired SE of the difference is larger here: the problems' difficulty does not cancel
    assert out["se"] < math.hypot(standard_error(before), standard_error(after))
    assert paired_difference([0, 1], [1, 2])["z"] == math.inf  # every problem moved by the same amount
    assert math.isnan(paired_difference([0, 1], [0, 1])["z"])
    with pytest.raises(ValueError, match="same problems"):
        paired_difference([0, 1], [0])


def test_pass_at_k_curve_mean_and_se_by_hand() -> None:
    from veriloop.algos.eval.metrics import pass_at_k_curve

    # n = 4 samples; problems with c = 0, 1, 2 correct.
    # k = 1: p = 0, 1/4, 2/4 -> mean 0.25; sd = 0.25 -> SE = 0.25 / sqrt(3)
    # k = 2: p = 0, 1 - C(3,2)/C(4,2) = 1/2, 1 - C(2,2)/C(4,2) = 5/6 -> mean 4/9;
    #        deviations -4/9, 1/18, 7/18: sum of squares 16/81 + 1/324 + 49/324 = 114/324; sd^2 = 57/324
    # k = 4: p = 0, 1, 1 -> mean 2/3; sd^2 = (4/9 + 1/9 + 1/9) / 2 = 1/3
    curve = pass_at_k_curve(4, [0, 1, 2], [1, 2, 4])
    assert curve[1] == pytest.approx((0.25, 0.25 / math.sqrt(3)))
    assert curve[2] == pytest.approx((4 / 9, math.sqrt(57 / 324 / 3)))
    assert curve[4] == pytest.approx((2 / 3, math.sqrt(1 / 3 / 3)))
    mean, se = pass_at_k_curve(4, [3], [2])[2]
    assert mean == 1.0 and math.isnan(se)
    with pytest.raises(ValueError, match="at least one problem"):
        pass_at_k_curve(4, [], [1])
