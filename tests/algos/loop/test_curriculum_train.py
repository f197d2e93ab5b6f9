"""The curriculum in the training loop: a mixture run with pools and the gate, and --resume exactness."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from veriloop.configs.loader import load_config

MIX = [
    "env.mixture={math: {id: veriloop/MathVerify-v0, kwargs: {level: 1}, weight: 1}, "
    "p24: {id: veriloop/Points24-text-v0, weight: 1}}",
]
TINY = ["policy.model=tiny", "rollout.prompts_per_step=4", "rollout.group_size=2", "rollout.max_new_tokens=8",
        "rollout.max_context=768", "train.micro_batch_size=2", "eval.num_problems=2", "eval.n_samples=1",
        "eval.k_list=[1]", "eval.greedy=false", "eval.every=0", "eval.at_start=false", "run.tensorboard=false",
        "sft.steps=0", "algo.preset=grpo", "run.checkpoint_every=1"]  # fmt: skip
CURRICULUM = ["curriculum.pools_enabled=true", "curriculum.gate=true", "curriculum.max_rounds=2",
              "curriculum.pools={hard: {low: 0, high: 0.3, weight: 1}, rest: {low: 0.3, high: 1, weight: 0.5}}"]  # fmt: skip
#: Wall-clock values differ between two runs; a run cut after step 1 also evaluates there (its end).
UNEQUAL = ("time", "time/", "throughput/", "eval/")


def _rows(run: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [
        {k: v for k, v in r.items() if not k.startswith(UNEQUAL)} for r in rows if "curriculum/buckets" in r
    ]


def _train(tmp_path: Path, name: str, steps: int, resume: bool = False) -> Path:
    from veriloop.algos.loop.train import train

    cfg = load_config(
        "quickstart",
        [*MIX, *TINY, *CURRICULUM, f"train.steps={steps}", f"run.out_dir={tmp_path}", f"run.name={name}"],
    )
    return train(cfg, quiet=True, resume=resume)


def test_mixture_run_with_pools_and_gate_logs_its_costs_and_resumes_exactly(tmp_path: Path, monkeypatch):
    from veriloop.envs.math_env import MathVerifyEnv
    from veriloop.envs.points24.env import Points24Env
    from veriloop.envs.verifiers import Verdict

    # a deterministic coin as the verifier: the tiny model's groups differ, so the gate keeps some
    def coin(self, response, task):  # the reasons each env pays for
        return Verdict(
            correct=len(response) % 2 == 0, reason="correct" if len(response) % 2 == 0 else "wrong_value"
        )

    monkeypatch.setattr(MathVerifyEnv, "check", coin)
    monkeypatch.setattr(Points24Env, "check", coin)
    whole = _train(tmp_path, "whole", 2)
    rows = _rows(whole)
    assert len(rows) == 2
    for r in rows:
        assert r["curriculum/paid_episodes"] >= 8 and r["curriculum/paid_tokens"] > 0
        assert r["curriculum/pool/hard/drawn"] + r["curriculum/pool/rest/drawn"] >= 4
        assert r["curriculum/rejected_groups"] >= 0 and r["sampling/rounds"] in (1.0, 2.0)
        # what was paid: every episode of every round; what was trained on: the kept groups
        groups = r["curriculum/paid_episodes"] / 2  # played groups of 2, every round
        assert r["curriculum/rejected_groups"] == pytest.approx(groups * (1 - r["sampling/kept_fraction"]))
        assert r["curriculum/wasted_episodes"] == r["curriculum/rejected_groups"] * 2
        assert groups >= 4 and (r["sampling/rounds"] == 1) == (groups == 4)
        # the gate's range is [0, 1]: it keeps exactly the informative groups (none left over)
        assert r["sampling/informative_fraction"] == pytest.approx(r["sampling/kept_fraction"])
    assert sum(r["updates"] for r in rows) >= 1  # the gate kept something to learn from
    buckets = rows[-1]["curriculum/buckets"]
    assert buckets >= 2  # math/1 and at least one Points24 target bucket (p24/24)
    # a run stopped after step 1 and resumed draws the same problems and logs the same step 2
    _train(tmp_path, "cut", 1)
    resumed = _train(tmp_path, "cut", 2, resume=True)
    assert _rows(resumed) == rows
