"""The non-finite guard RL and SFT share, and the named sampling-stream formula."""

from __future__ import annotations

from veriloop.algos.nonfinite import NonFiniteGuard
from veriloop.algos.train import MAX_RANKS, ROUNDS_PER_STEP, sampling_stream


def test_guard_counts_in_a_row_and_in_total():
    guard = NonFiniteGuard(limit=3)
    assert [guard.observe(s) for s in (True, True, False, True, True)] == [False] * 5
    assert (guard.in_a_row, guard.total) == (2, 4)
    assert guard.observe(True)  # the third in a row stops the run
    assert (guard.in_a_row, guard.total) == (3, 5)


def test_guard_resumes_from_saved_counts():
    guard = NonFiniteGuard(limit=2, in_a_row=1, total=7)
    assert guard.observe(True) and guard.total == 8


def test_sampling_stream_formula_and_distinct_draws():
    assert sampling_stream(step=2, round_=1, rank=3) == (2 * 16 + 1) * 64 + 3
    streams = {
        sampling_stream(s, r, k) for s in range(3) for r in range(ROUNDS_PER_STEP) for k in range(MAX_RANKS)
    }
    assert len(streams) == 3 * ROUNDS_PER_STEP * MAX_RANKS
