"""``StepLoop``: the step schedule, non-finite guard and log / checkpoint cadence RL and SFT share."""

from __future__ import annotations

import pytest

from veriloop.algos.run.log import RunLog, read_metrics
from veriloop.algos.run.nonfinite import NonFiniteGuard, NonFiniteTrainingError
from veriloop.algos.run.phase import StepLoop


def _loop(total: int = 5, limit: int = 2, **kw) -> StepLoop:  # type: ignore[no-untyped-def]
    return StepLoop(total, "phase", NonFiniteGuard(limit), quiet=True, **kw)


def test_steps_run_from_start_to_total():
    assert list(_loop(5).steps(0)) == [0, 1, 2, 3, 4]
    assert list(_loop(5).steps(3)) == [3, 4]  # a resumed phase
    assert list(_loop(5).steps(5)) == []  # a finished one


def test_log_and_checkpoint_cadence_include_the_last_step():
    loop = _loop(7, log_every=3, checkpoint_every=2)
    assert [d for d in range(1, 8) if loop.log_due(d)] == [3, 6, 7]
    assert [d for d in range(1, 8) if loop.checkpoint_due(d)] == [2, 4, 6, 7]
    only_end = _loop(7, checkpoint_every=0)
    assert [d for d in range(1, 8) if only_end.checkpoint_due(d)] == [7]


def test_observe_stops_after_limit_skipped_steps_in_a_row():
    loop = _loop(limit=3, advice="lower the lr")
    for skipped in (True, True, False, True, True):
        loop.observe(skipped)  # never three in a row
    assert (loop.guard.in_a_row, loop.guard.total) == (2, 4)
    with pytest.raises(NonFiniteTrainingError, match="phase: 3 consecutive steps.*; lower the lr"):
        loop.observe(True)


def test_log_metrics_writes_on_schedule_only(tmp_path):
    log = RunLog(tmp_path, tensorboard=False)
    loop = _loop(5, log_every=2, log=log)
    for step in loop.steps(0):
        loop.log_metrics(step + 1, {"x": float(step)})
    log.close()
    assert [(r["step"], r["x"]) for r in read_metrics(tmp_path)] == [(2, 1.0), (4, 3.0), (5, 4.0)]
    _loop(5).log_metrics(5, {"x": 1.0})  # no log (a rank other than 0): nothing to write, no error
