"""Several environments in one run (env.mixture): the draw, groups within one env, per-env evaluation."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from veriloop.algos.loop.mixture import assign_envs
from veriloop.configs.loader import load_config
from veriloop.configs.schema import ConfigError

MIX = [
    "env.mixture={math: {id: veriloop/MathVerify-v0, kwargs: {level: 1}, weight: 1}, "
    "p24: {id: veriloop/Points24-text-v0, weight: 3}}",
    "env.eval_splits={p24.ood: {id: veriloop/Points24-text-ruleood-v0}}",
]
TINY = ["policy.model=tiny", "rollout.prompts_per_step=4", "rollout.group_size=2", "rollout.max_new_tokens=8",
        "rollout.max_context=768", "train.steps=1", "train.micro_batch_size=2", "eval.num_problems=2",
        "eval.n_samples=1", "eval.k_list=[1]", "eval.greedy=false", "eval.every=0", "run.tensorboard=false",
        "sft.steps=0", "algo.preset=grpo"]  # fmt: skip


def test_assign_envs_follows_the_weights_and_depends_on_the_seed_alone():
    names = assign_envs({"a": 1.0, "b": 3.0}, range(4000), run_seed=0)
    share = Counter(names)["b"] / 4000
    assert 0.72 < share < 0.78  # 3/4, within sampling noise (sd ~0.007)
    assert assign_envs({"a": 1.0, "b": 3.0}, [17, 5], 0) == [names[17], names[5]]  # order/batch-free
    assert assign_envs({"id": 1.0}, [1, 2, 3]) == ["id"] * 3
    assert assign_envs({"a": 1.0, "b": 1.0}, range(50), 1) != assign_envs({"a": 1.0, "b": 1.0}, range(50), 2)
    with pytest.raises(ValueError):
        assign_envs({"a": 0.0}, [1])


def test_mixture_config_errors():
    with pytest.raises(ConfigError, match="weight must be > 0"):
        load_config("quickstart", [*TINY, "env.mixture={a: {weight: 0}}"])
    with pytest.raises(ConfigError, match="need an id"):
        load_config("quickstart", [*TINY, "env.mixture={a: {}}", "env.eval_splits={ood: {kwargs: {}}}"])
    with pytest.raises(ConfigError, match="sft"):
        load_config("quickstart", [*MIX, *TINY, "sft.steps=2"])


def test_a_two_env_mixture_trains_and_evaluates_every_env(tmp_path: Path):
    import veriloop.algos.loop.train as T
    import veriloop.algos.run.setup as S
    from veriloop.algos.loop.parts import TrainerState
    from veriloop.algos.loop.source import collect

    cfg = load_config("quickstart", [*MIX, *TINY, f"run.out_dir={tmp_path}", "run.name=mix"])
    cfg.env.resolve()
    policy = S.build_policy(cfg)
    trajs, _, _ = collect(cfg, policy, TrainerState(next_seed=0))
    by_group: dict[int, set[str]] = {}
    for t in trajs:
        by_group.setdefault(t.group_id, set()).add(t.env_id)
    assert all(len(ids) == 1 for ids in by_group.values())  # a group never mixes environments
    assert {i for ids in by_group.values() for i in ids} == {
        "veriloop/MathVerify-v0",
        "veriloop/Points24-text-v0",
    }

    run = T.train(cfg, quiet=True)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    last = rows[-1]
    assert last["env/math/episodes"] + last["env/p24/episodes"] == 8
    assert {"eval/math/avg@n", "eval/p24/avg@n", "eval/p24.ood/avg@n"} <= set(last)
    table = (run / "eval" / "step-000001.md").read_text()
    assert "gap p24-p24.ood" in table and "gap math" not in table
