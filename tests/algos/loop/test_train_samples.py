"""``run.log_samples`` in the training loop: what the model wrote, in ``RUN/samples.jsonl`` and in the
evaluation reports, for the synchronous and the asynchronous loop, cut back on ``--resume``.

Tiny settings as in test_train.py: 2 level-1 math problems x 2 samples per step, 8 new tokens."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from veriloop.agents.testing import TINY_MATH_GRPO
from veriloop.algos.loop.train import train
from veriloop.algos.run.log import read_metrics
from veriloop.algos.run.samples import read_samples
from veriloop.configs.loader import load_config

HERE = Path(__file__).parent
FAST = [
    *TINY_MATH_GRPO,
    "train.micro_batch_size=2",
    "train.lr=1e-2",
    "eval.num_problems=1",
    "eval.n_samples=2",
    "eval.k_list=[1]",
    "eval.greedy=false",
    "eval.every=0",
    "eval.at_start=false",
    "run.tensorboard=false",
]
#: Every record's keys (``algos/run/samples.episode_record``) and the training line's own.
KEYS = {
    "env",
    "seed",
    "task_id",
    "group",
    "prompt",
    "responses",
    "reward",
    "reward_components",
    "correct",
    "reason",
    "verifier_error",
    "hit_token_limit",
    "stop_reason",
    "turns",
    "response_tokens",
}


pytestmark = pytest.mark.usefixtures("one_thread")


def _train(tmp_path: Path, name: str, *extra: str, resume: bool = False) -> Path:
    cfg = load_config(None, [*FAST, *extra, f"run.out_dir={tmp_path}", f"run.name={name}"])
    return train(cfg, quiet=True, resume=resume)


def test_every_step_writes_its_first_k_episodes(tmp_path: Path) -> None:
    run = _train(tmp_path, "k3", "train.steps=2", "run.checkpoint_every=0", "run.log_samples=3")
    rows = read_samples(run)
    assert [r["step"] for r in rows] == [1, 1, 1, 2, 2, 2]  # the steps as metrics.jsonl counts them
    assert [r["step"] for r in read_metrics(run)] == [1, 2]
    for r in rows:
        assert KEYS | {"step", "kept"} <= set(r), sorted(KEYS - set(r))
        assert r["env"] == "veriloop/MathVerify-v0" and isinstance(r["seed"], int)
        assert [m["role"] for m in r["prompt"]] == ["user"] and "math problem" in r["prompt"][0]["content"]
        assert len(r["responses"]) == r["turns"] == 1 and isinstance(r["responses"][0], str)
        assert 1 <= r["response_tokens"] <= 8 and isinstance(r["hit_token_limit"], bool)
        assert r["reward"] == sum(r["reward_components"].values())  # math: one component, "accuracy"
        assert isinstance(r["correct"], bool) and r["reason"] and r["kept"] is True
    # the batch's first episodes: the step's first group's two samples, then the second group's first
    first = rows[:3]
    assert first[0]["group"] == first[1]["group"] != first[2]["group"]
    assert first[0]["seed"] == first[1]["seed"] and first[0]["prompt"] == first[1]["prompt"]
    # the evaluation at the end keeps each problem's first episode as text too, and shows them in its table
    report = json.loads((run / "eval" / "step-000002.json").read_text())
    (sample, *_) = report["samples"]["id"]
    assert len(report["samples"]["id"]) == 1  # 1 problem (x 2 samples): its first, under log_samples=3
    assert sample["seed"] == report["per_problem"]["id"]["seed"][0] and "math problem" in str(
        sample["prompt"]
    )
    md = (run / "eval" / "step-000002.md").read_text()
    assert "### Samples" in md and sample["responses"][0].strip() in md


def test_log_samples_zero_writes_no_samples(tmp_path: Path) -> None:
    run = _train(tmp_path, "none", "train.steps=1", "run.checkpoint_every=0", "run.log_samples=0")
    assert [r["step"] for r in read_metrics(run)] == [1]
    assert not (run / "samples.jsonl").exists()
    report = json.loads((run / "eval" / "step-000001.json").read_text())
    assert "samples" not in report and "### Samples" not in (run / "eval" / "step-000001.md").read_text()


def test_resume_cuts_samples_back_to_the_checkpoint(tmp_path: Path) -> None:
    """Step 3's checkpoint is lost: the resumed run plays step 3 again, and its lines replace the
    first run's step-3 lines (as metrics.jsonl's rows are) instead of following them."""
    extra = ("train.steps=3", "run.checkpoint_every=1", "run.keep_last=3", "run.log_samples=2")
    run = _train(tmp_path, "r", *extra)
    first = read_samples(run)
    assert [r["step"] for r in first] == [1, 1, 2, 2, 3, 3]
    shutil.rmtree(run / "checkpoints" / "step-000003")
    _train(tmp_path, "r", *extra, resume=True)
    again = read_samples(run)
    assert [r["step"] for r in again] == [1, 1, 2, 2, 3, 3]
    assert again[:4] == first[:4]  # steps 1 and 2 untouched
    assert [r["step"] for r in read_metrics(run)] == [1, 2, 3]


def test_the_asynchronous_loop_writes_samples_of_multi_turn_episodes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """K = 1, the long-tail env (every third problem takes four turns): the lines show the turns."""
    monkeypatch.syspath_prepend(str(HERE))
    run = _train(
        tmp_path,
        "async",
        "env.id=long_tail_env:test/LongTail-v0",
        "env.kwargs={}",
        "rollout.max_turns=4",
        "rollout.prompts_per_step=3",
        "train.steps=2",
        "train.max_staleness=1",
        "algo.rollout_is=truncate",
        "run.checkpoint_every=0",
        "run.log_samples=6",
    )
    rows: list[dict[str, Any]] = read_samples(run)
    assert sorted({r["step"] for r in rows}) == [1, 2] and all(
        len(r["responses"]) == r["turns"] for r in rows
    )
    long = [r for r in rows if r["turns"] > 1]
    assert long, "no four-turn episode among the samples"
    for r in long:  # the conversation after the prompt: the model's turns and the env's replies
        roles = [m["role"] for m in r["conversation"]]
        assert roles[0] == "assistant" and roles.count("assistant") == r["turns"]
        assert [m["content"] for m in r["conversation"] if m["role"] == "assistant"] == r["responses"]
        assert "Go on." in [m["content"] for m in r["conversation"]]
