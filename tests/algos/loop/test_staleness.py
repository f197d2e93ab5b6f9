"""Bounded staleness without models: the admission rule, the trainer's batch rule, the metrics,
and the configuration. The simulated trainer and generator are tested beside the benchmark
(``benchmarks/tests/test_staleness_sim.py``)."""

from __future__ import annotations

import pytest

from veriloop.algos.loop.staleness import (
    Scheduler,
    admission_capacity,
    count_metrics,
    histogram,
    idle_shares,
    staleness,
    staleness_metrics,
)


def test_admission_capacity_by_hand() -> None:
    # (K + v + 1) n - (accepted + running): K=1, v=2, n=4 -> 16 - (9 + 3) = 4
    assert admission_capacity(2, 1, 4, accepted=9, running=3) == 4
    assert admission_capacity(0, 0, 4, accepted=0, running=4) == 0  # K = 0: one step's groups
    assert admission_capacity(0, 0, 4, accepted=2, running=5) == 0  # never negative
    with pytest.raises(ValueError, match="K >= 0"):
        admission_capacity(0, -1, 4, 0, 0)


def test_staleness_counts_optimizer_steps() -> None:
    assert staleness(5, 3) == 2
    with pytest.raises(ValueError, match="earlier step"):
        staleness(2, 3)


def test_k0_is_synchronous() -> None:
    """K = 0: exactly one step's groups start, the step waits for all of them, then the next ones."""
    s = Scheduler(0, 2)
    a, b = s.admit(10), s.admit(11)
    assert s.capacity() == 0
    s.finish(b.gid)
    assert s.take(0) is None  # a is due and running
    s.finish(a.gid)
    assert [g.seed for g in s.take(0) or []] == [10, 11]
    assert s.capacity() == 0  # no new group before the update
    s.trained()
    assert s.capacity() == 2


def test_overtaking_cannot_break_the_bound() -> None:
    """K = 2, n = 1: two slow groups admitted at v=0 while short ones overtake them. The trainer
    must not take the short group at step 1 (then two groups would be due at step 2)."""
    s = Scheduler(2, 1)
    slow = [s.admit(0), s.admit(1)]
    short = s.admit(2)
    s.finish(short.gid)
    assert s.take(0) == [short]  # leaving both slow ones is still feasible
    s.trained()
    later = s.admit(3)
    s.finish(later.gid)
    assert s.take(1) is None  # taking `later` would leave 2 groups with v_start <= 0 for step 2
    s.finish(slow[0].gid)
    assert s.take(1) == [slow[0]]
    s.trained()
    assert s.take(2) is None  # slow[1] is due (v_start 0 + K 2) and still running
    s.finish(slow[1].gid)
    assert s.take(2) == [slow[1]]
    assert staleness(2, slow[1].v_start) == 2


def test_dropped_groups_free_capacity_and_are_counted() -> None:
    s = Scheduler(1, 2)
    groups = [s.admit(i) for i in range(4)]
    assert s.capacity() == 0
    s.finish(groups[0].gid, keep=False, reason="uninformative")
    assert s.capacity() == 1 and s.dropped == 1
    assert groups[0].dropped == "uninformative"
    assert s.pending_seeds() == [1, 2, 3]
    left = s.close()
    assert [g.dropped for g in left] == ["run_end"] * 3 and s.dropped == 4


def test_budget_caps_admission_and_allows_a_short_last_batch() -> None:
    s = Scheduler(1, 2, budget=3)
    for i in range(3):
        s.finish(s.admit(i).gid)
    assert s.capacity() == 0
    assert len(s.take(0) or []) == 2
    s.trained()
    assert [g.seed for g in s.take(1) or []] == [2]  # nothing more can come: a short batch


def test_metrics_by_hand() -> None:
    s = Scheduler(2, 2)
    a, b = s.admit(0), s.admit(1)
    s.trained()
    s.finish(a.gid)
    s.trained()
    s.finish(b.gid)
    m = staleness_metrics(2, [a, b])  # staleness 2, 2; spans 1, 2
    assert m == {
        "async/staleness_mean": 2.0,
        "async/staleness_max": 2.0,
        "async/span_mean": 1.5,
        "async/span_max": 2.0,
    }
    assert staleness_metrics(0, [])["async/staleness_mean"] is None
    counts = count_metrics(s)
    assert counts["async/admitted"] == 2 and counts["async/queued"] == 2 and counts["async/running"] == 0
    assert idle_shares(1.0, 3.0, 4.0) == {
        "async/trainer_wait_fraction": 0.25,
        "async/generator_wait_fraction": 0.75,
    }
    assert histogram([0, 1, 1, 2], 2) == [1, 2, 1]
    with pytest.raises(ValueError, match="outside"):
        histogram([3], 2)


# ------------------------------------------------------------------------------- configuration


def _config(*overrides: str):  # type: ignore[no-untyped-def]
    from veriloop.configs.loader import load_config

    base = [
        "policy.model=tiny",
        "env.id=veriloop/MathVerify-v0",
        "rollout.prompts_per_step=2",
        "rollout.group_size=2",
        "rollout.max_new_tokens=8",
        "rollout.max_context=256",
        "train.micro_batch_size=2",
        "train.steps=2",
    ]
    return load_config(None, [*base, *overrides])


def test_config_refuses_negative_staleness() -> None:
    from veriloop.configs.schema import ConfigError

    with pytest.raises(ConfigError, match="train.max_staleness must be >= 0"):
        _config("train.max_staleness=-1").validate()


def test_config_refuses_staleness_without_a_correction() -> None:
    from veriloop.configs.schema import ConfigError

    # nothing written: decoupled PPO with truncated IS is switched on; an explicit none is refused
    assert _config("train.max_staleness=1").algo.rollout_is == "truncate"
    assert _config("train.max_staleness=0").algo.rollout_is == "none"
    with pytest.raises(ConfigError, match="algo.rollout_is=truncate"):
        _config("train.max_staleness=1", "algo.rollout_is=none").validate()
    _config("train.max_staleness=1", "algo.rollout_is=truncate").validate()  # decoupled PPO
    _config("train.max_staleness=2", "algo.rollout_seq_mask=true").validate()
    _config("train.max_staleness=1", "algo.policy_loss=dppo").validate()  # bypass: ratio against mu
    _config("train.max_staleness=0").validate()  # synchronous: nothing to correct


def test_config_counts_the_problems_admitted_ahead() -> None:
    """K steps of problems may be admitted beyond the last step: evaluation seeds must stay clear of them."""
    sync = _config("train.max_staleness=0").train_seed_range
    ahead = _config("train.max_staleness=2", "algo.rollout_is=truncate").train_seed_range
    assert len(ahead) == len(sync) + 2 * 2


def test_async_on_several_ranks_refuses_only_sharded_weights_without_servers() -> None:
    """Several data-parallel ranks train asynchronously (rank 0 generates); sharded ranks need the
    vLLM servers, which take the gathered weights (``tests/algos/loop/test_async_ranks.py`` runs them)."""
    from types import SimpleNamespace

    from veriloop.algos.loop.async_loop import check_async
    from veriloop.configs.schema import ConfigError

    cfg = _config("train.max_staleness=1", "algo.rollout_is=truncate")
    check_async(cfg, SimpleNamespace(enabled=False, sharded=False))
    check_async(cfg, SimpleNamespace(enabled=True, sharded=False))
    with pytest.raises(ConfigError, match="rollout.backend=vllm_server"):
        check_async(cfg, SimpleNamespace(enabled=True, sharded=True))
    served = _config("train.max_staleness=1", "algo.rollout_is=truncate", "rollout.backend=vllm_server")
    check_async(served, SimpleNamespace(enabled=True, sharded=True))


def test_in_process_vllm_adapters_need_k_plus_two_slots_at_load() -> None:
    from veriloop.configs.schema import ConfigError

    over = ["train.max_staleness=2", "rollout.backend=vllm", "policy.lora=true"]
    with pytest.raises(ConfigError, match="rollout.vllm_kwargs.max_loras=4"):
        _config(*over, "rollout.vllm_kwargs={lora_sync: adapter, max_loras: 3}").validate()
    _config(*over, "rollout.vllm_kwargs={lora_sync: adapter, max_loras: 4}").validate()
    _config(*over, "rollout.vllm_kwargs={lora_sync: merge}").validate()  # one version at a time


def test_adapter_slots_must_hold_k_plus_two_versions() -> None:
    from veriloop.algos.loop.async_loop import check_adapter_slots
    from veriloop.configs.schema import ConfigError

    check_adapter_slots(3, 1)  # K + 2 = 3 slots: enough
    check_adapter_slots(None, 4)  # the servers do not say: nothing to check
    with pytest.raises(ConfigError, match="--max-loras 4"):
        check_adapter_slots(3, 2)
