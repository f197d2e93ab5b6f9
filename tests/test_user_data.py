"""A user's own Parquet dataset, with its own field names, from the command line: training draws only
training rows, the ``id`` evaluation only held-out rows, and the reports say which rows they were."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from veriloop.cli.main import run
from veriloop.envs.math_env import MathVerifyEnv

TINY = [
    "policy.model=tiny",
    "policy.lora=false",
    "rollout.prompts_per_step=2",
    "rollout.group_size=2",
    "rollout.max_new_tokens=8",
    "rollout.max_context=256",
    "train.steps=2",
    "train.micro_batch_size=2",
    "eval.num_problems=6",
    "eval.n_samples=1",
    "eval.k_list=[1]",
    "eval.greedy=false",
    "eval.every=0",
    "run.tensorboard=false",
    "run.checkpoint_every=0",
]


def test_parquet_dataset_trains_and_evaluates_on_a_held_out_part(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [
        {
            "problem": f"Compute {i} + {i + 1}.",
            "worked": f"{i} + {i + 1} = {2 * i + 1}, so \\boxed{{{2 * i + 1}}}.",
            "difficulty": "Level 1",
        }
        for i in range(60)
    ]
    data = tmp_path / "mine.parquet"
    pq.write_table(pa.Table.from_pylist(rows), data)
    seen: dict[str | None, set[str]] = {"train": set(), "heldout": set()}
    original = MathVerifyEnv.sample_task

    def spy(self: MathVerifyEnv):  # type: ignore[no-untyped-def]
        task = original(self)
        seen[self.part].add(task.question)
        return task

    monkeypatch.setattr(MathVerifyEnv, "sample_task", spy)
    kwargs = [
        f"env.kwargs.data={data}",
        "env.kwargs.question_key=problem",
        "env.kwargs.answer_key=worked",
        "env.kwargs.answer_extract=last_boxed",
        "env.kwargs.level=null",
    ]
    out = tmp_path / "runs"
    code = run(
        [
            "train",
            "quickstart",
            *TINY,
            *kwargs,
            "sft.source=generator",
            "sft.steps=1",
            "sft.examples=4",
            f"run.out_dir={out}",
            "run.name=mine",
        ]
    )
    assert code == 0
    assert seen["train"] and seen["heldout"], seen
    assert not seen["train"] & seen["heldout"], "the held-out evaluation drew training rows"
    report = json.loads(sorted((out / "mine" / "eval").glob("*.json"))[-1].read_text())
    source = report["meta"]["splits"]["id"]["source"]
    assert "12 held-out rows of 60" in source and "mine.parquet" in source, source
    assert "12 held-out rows of 60" in (out / "mine" / "summary.md").read_text()
    assert "held-out problems" in (out / "mine" / "final" / "README.md").read_text()


def test_generator_sft_on_rows_without_solutions_is_refused_before_any_model_loads(
    tmp_path: Path, capsys
) -> None:  # type: ignore[no-untyped-def]
    data = tmp_path / "plain.jsonl"
    data.write_text("".join(json.dumps({"question": f"Q{i}?", "answer": str(i)}) + "\n" for i in range(10)))
    out = tmp_path / "runs"
    code = run(
        [
            "train",
            "quickstart",
            *TINY,
            f"env.kwargs.data={data}",
            "env.kwargs.level=null",
            "sft.source=generator",
            "sft.steps=2",
            f"run.out_dir={out}",
        ]
    )
    err = capsys.readouterr().err
    assert code == 2 and "no 'solution'" in err and "sft.source=rejection" in err, err
    assert not out.exists()  # no run folder to block the rerun


def test_help_names_presets_experiments_and_model_choices(capsys) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(SystemExit):
        run(["train", "--help"])
    out = capsys.readouterr().out
    assert "algorithm presets (algo.preset=NAME): " in out and "grpo" in out and "dapo" in out
    assert "shipped experiments (CONFIG): " in out and "quickstart" in out
    assert "``tiny``" in out and "Hub id" in out and "docs/data.md" in out
