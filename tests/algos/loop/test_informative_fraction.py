"""`sampling/informative_fraction` is one formula in every mode: the share of the groups played
whose judged episodes (verifier failures left out) have learning signals that differ. The same
four groups give the same number synchronously without dynamic sampling, with it, under the
curriculum's gate, and asynchronously; the asynchronous drop rule judges a group the same way."""

from __future__ import annotations

from typing import Any

import pytest

from veriloop.agents.trajectory import Trajectory


def _groups(make_traj: Any) -> list[list[Trajectory]]:
    """Four groups of two: differing rewards; equal rewards; differing only through an episode
    whose verifier failed (its reward is unknown, so the group teaches nothing); differing."""
    ep = lambda r, gid, error=None: make_traj([([5, 6], [7], r)], group_id=gid, error=error)  # noqa: E731
    return [
        [ep(1.0, 0), ep(0.0, 0)],
        [ep(1.0, 1), ep(1.0, 1)],
        [ep(1.0, 2), ep(0.0, 2, "timeout")],
        [ep(0.0, 3), ep(1.0, 3)],
    ]


def _cfg(*extra: str) -> Any:
    from veriloop.configs.loader import load_config

    return load_config(None, ["rollout.prompts_per_step=2", "rollout.group_size=2", *extra])


class _Sampler:
    """``source.GroupSampler`` replaced by the four groups, all at once (an over-sampling round)."""

    groups: list[list[Trajectory]] = []

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.sampled: list[Trajectory] = []
        self.choose = None

    def __call__(self, n: int) -> list[list[Trajectory]]:
        self.sampled.extend(t for g in self.groups for t in g)
        return [list(g) for g in self.groups]


@pytest.mark.parametrize(
    "extra",
    [(), ("algo.dynamic_sampling=true",), ("curriculum.gate=true",)],
    ids=["sync", "sync_dynamic_sampling", "sync_curriculum_gate"],
)
def test_synchronous_modes_share_the_formula(
    make_traj: Any, monkeypatch: pytest.MonkeyPatch, extra: Any
) -> None:
    import veriloop.algos.loop.source as source
    from veriloop.algos.loop.parts import TrainerState

    monkeypatch.setattr(_Sampler, "groups", _groups(make_traj))
    monkeypatch.setattr(source, "GroupSampler", _Sampler)
    _, sampled, metrics = source.collect(_cfg(*extra), None, TrainerState())  # type: ignore[arg-type]
    assert len(sampled) == 8
    assert metrics["sampling/informative_fraction"] == 0.5  # groups 1 and 4 of 4


@pytest.mark.parametrize("dynamic", [False, True])
def test_asynchronous_mode_shares_the_formula(make_traj: Any, dynamic: bool) -> None:
    from veriloop.algos.loop.async_loop import group_judge, sampling_metrics
    from veriloop.algos.loop.async_worker import Finished

    cfg = _cfg(f"algo.dynamic_sampling={str(dynamic).lower()}")
    judge = group_judge(cfg)
    finished = [Finished(g, judge(g)) for g in _groups(make_traj)]  # each group judged once
    metrics = sampling_metrics(cfg, finished, 0)
    assert metrics["sampling/informative_fraction"] == 0.5
    assert metrics["sampling/kept_fraction"] == (0.5 if dynamic else 1.0)
    drops = [f.drop_reason(cfg.algo.dynamic_sampling) for f in finished]
    assert drops == ([None, "uninformative", "uninformative", None] if dynamic else [None] * 4)
