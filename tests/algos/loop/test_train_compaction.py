"""`rollout.compaction` in a training run: a 3-turn episode that outgrows `max_context` is compacted
(and split into two samples) instead of truncated, and the step trains on the sample rows."""

from __future__ import annotations

from pathlib import Path

import pytest

import veriloop.algos.eval.in_training as in_training
import veriloop.algos.loop.train as T
from veriloop.agents.compaction import KeepLastTurns, PolicySummary, make_compactor
from veriloop.algos.run.log import read_metrics
from veriloop.configs.loader import load_config
from veriloop.configs.schema import ConfigError

TINY = [
    "policy.model=tiny",
    "env.id=veriloop/MathVerifyRetry-v0",
    "env.kwargs={level: 1}",
    "rollout.prompts_per_step=2",
    "rollout.group_size=2",
    "rollout.max_new_tokens=8",
    "rollout.max_turns=3",
    "rollout.max_context=150",
    "train.steps=1",
    "train.micro_batch_size=2",
    "eval.at_start=false",
    "eval.num_problems=1",
    "eval.n_samples=1",
    "eval.k_list=[1]",
    "eval.greedy=false",
    "eval.every=0",
    "run.tensorboard=false",
    "run.checkpoint_every=0",
]


@pytest.mark.parametrize(("compaction", "split"), [("none", False), ("keep_last", True)])
def test_compaction_in_a_training_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, compaction: str, split: bool
) -> None:
    monkeypatch.setattr(in_training, "evaluate_step", lambda cfg, policy, step, quiet, **kw: {})
    cfg = load_config(
        None,
        [
            *TINY,
            f"run.out_dir={tmp_path}",
            "run.name=c",
            f"rollout.compaction={compaction}",
            "rollout.compaction_keep=0",
        ],
    )
    (row,) = read_metrics(T.train(cfg, quiet=True))
    assert row["updates"] == 1.0
    if split:  # every episode played its 3 turns, in two samples
        assert (row["turns/mean"], row["samples/split_rate"], row["samples/per_episode"]) == (3.0, 1.0, 2.0)
    else:  # the default: cut at max_context, one sample
        assert row["turns/mean"] < 3.0 and row["samples/split_rate"] == 0.0


def test_make_compactor_and_the_config_field() -> None:
    assert make_compactor("none") is None
    assert make_compactor("keep_last", 2) == KeepLastTurns(2) and make_compactor("summary") == PolicySummary()
    with pytest.raises(ValueError, match="keep_last"):
        make_compactor("summarise")
    with pytest.raises(ConfigError, match="compaction_keep"):
        load_config(None, ["rollout.compaction=keep_last", "rollout.compaction_keep=-1"])


@pytest.mark.parametrize(("compaction", "played_out"), [("none", False), ("keep_last", True)])
def test_evaluation_compacts_as_training_does(compaction: str, played_out: bool) -> None:
    """The held-out episodes of a run with `rollout.compaction` are compacted, not cut at max_context."""
    from veriloop.algos.eval.loop import evaluate_config
    from veriloop.algos.run.setup import build_policy

    cfg = load_config(
        None, [*TINY, "eval.num_problems=2", f"rollout.compaction={compaction}", "rollout.compaction_keep=0"]
    )
    report = evaluate_config(cfg, build_policy(cfg))
    turns, cut = report["splits"]["id"]["turns/mean"], report["splits"]["id"]["limit_stop_rate"]
    assert report["meta"]["compactor"] == (None if compaction == "none" else "KeepLastTurns(k=0)")
    if played_out:  # every episode had its 3 turns (the tiny model never solves one), none cut
        assert turns == 3.0 and cut == 0.0
    else:
        assert turns < 3.0 and cut > 0.0
