"""The non-finite guard RL and SFT share, and the named sampling-stream formula."""

from __future__ import annotations

from veriloop.algos.loop.sampling import MAX_RANKS, ROUNDS_PER_STEP, sampling_stream
from veriloop.algos.run.nonfinite import NonFiniteGuard


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


def test_rl_step_loop_takes_its_guard_from_the_config_and_the_resumed_state():
    """RL's ``StepLoop``: limit ``train.max_consecutive_nonfinite``, counts from ``TrainerState``
    (checkpointed), which ``guard_nonfinite`` keeps up to date, also on the step that stops the run."""
    from types import SimpleNamespace

    import pytest

    from veriloop.algos.loop.parts import TrainerState
    from veriloop.algos.loop.run_steps import guard_nonfinite, step_loop
    from veriloop.algos.run.nonfinite import NonFiniteTrainingError
    from veriloop.configs.loader import load_config

    cfg = load_config("quickstart", overrides=["train.max_consecutive_nonfinite=2", "train.log_every=3"])
    state = TrainerState(step=4, consecutive_nonfinite=1, skipped_steps=5)
    loop = step_loop(SimpleNamespace(cfg=cfg, state=state, log=None, quiet=True))  # type: ignore[arg-type]
    assert (loop.total, loop.guard.limit, loop.guard.in_a_row, loop.guard.total) == (cfg.train.steps, 2, 1, 5)
    assert loop.log_every == 3 and loop.checkpoint_every == cfg.run.checkpoint_every
    metrics = {"skipped": 0.0}
    guard_nonfinite(loop, state, metrics)  # a finite step resets the run of skipped steps
    assert (state.consecutive_nonfinite, state.skipped_steps) == (0, 5)
    assert metrics["nonfinite_skipped_total"] == 5.0
    guard_nonfinite(loop, state, {"skipped": 1.0})
    stopping = {"skipped": 1.0}
    with pytest.raises(NonFiniteTrainingError, match="train: 2 consecutive steps"):
        guard_nonfinite(loop, state, stopping)
    assert (state.consecutive_nonfinite, state.skipped_steps) == (2, 7)  # the state says how it ended
    assert stopping["nonfinite_skipped_total"] == 7.0
