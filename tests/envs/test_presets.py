"""Benchmark file presets: small files written in MATH-500's, GSM8K's, AIME's and the generic boxed
layout train and evaluate with ``env.kwargs.preset`` alone; MATH-500 evaluates a checkpoint from the CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from veriloop.envs.math_env import MathVerifyEnv

MATH500 = [  # MATH-500's JSONL: problem, solution, answer, subject, level, unique_id
    {
        "problem": f"What is ${i} + \\frac{{1}}{{2}}$?",
        "solution": f"It is $\\boxed{{{2 * i + 1}/2}}$.",
        "answer": f"\\frac{{{2 * i + 1}}}{{2}}",
        "subject": "Algebra",
        "level": 1 + i % 5,
        "unique_id": f"test/{i}.json",
    }
    for i in range(10)
]
GSM8K = [{"question": f"Tom has {i} apples and buys 3. How many?", "answer": f"{i} + 3 = {i + 3}\n#### {i + 3}"}
         for i in range(6)]  # fmt: skip
AIME = [{"id": i, "problem": f"Find the remainder of {100 + i} divided by 7.", "solution": "...", "answer": f"{(100 + i) % 7:03d}"}
        for i in range(6)]  # fmt: skip
BOXED = [{"problem": f"Compute {i}*2.", "solution": f"Twice {i} is $\\boxed{{{2 * i}}}$."} for i in range(6)]


def write(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize(
    ("preset", "rows", "question", "gold"),
    [
        ("math500", MATH500, MATH500[3]["problem"], "\\frac{7}{2}"),
        ("gsm8k", GSM8K, GSM8K[3]["question"], "6"),
        ("aime", AIME, AIME[3]["problem"], "5"),  # "005" read as the integer 5
        ("boxed", BOXED, BOXED[3]["problem"], "6"),
    ],
)
def test_each_layout_loads_with_its_preset(
    tmp_path: Path, preset: str, rows: list[dict], question: str, gold: str
) -> None:
    env = MathVerifyEnv(data=write(tmp_path / f"{preset}.jsonl", rows), preset=preset, part="all")
    problem = next(p for p in env.problems or [] if p.question == question)
    assert problem.answer == gold
    assert env.check(f"The answer is $\\boxed{{{gold}}}$.", problem).correct
    assert not env.check("The answer is $\\boxed{12345}$.", problem).correct


def test_without_the_preset_the_layout_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="question"):  # the default fields are question / answer
        MathVerifyEnv(data=write(tmp_path / "m.jsonl", MATH500), part="all")


def test_a_contradicting_key_or_unknown_preset_is_an_error(tmp_path: Path) -> None:
    data = write(tmp_path / "m.jsonl", MATH500)
    with pytest.raises(ValueError, match="preset 'math500' reads answer_key='answer'"):
        MathVerifyEnv(data=data, preset="math500", answer_key="solution")
    with pytest.raises(ValueError, match="preset must be one of"):
        MathVerifyEnv(data=data, preset="math-500")


def test_aime_wants_integer_answers(tmp_path: Path) -> None:
    bad = [*AIME, {"problem": "Find x.", "answer": "1/2"}]
    with pytest.raises(ValueError, match=r"preset 'aime' wants an integer answer 0-999, got '1/2'"):
        MathVerifyEnv(data=write(tmp_path / "a.jsonl", bad), preset="aime", part="all")


def test_math500_as_training_data_keeps_a_heldout_part(tmp_path: Path) -> None:
    data = write(tmp_path / "math500.jsonl", MATH500)
    train = MathVerifyEnv(data=data, preset="math500")
    held = MathVerifyEnv(data=data, preset="math500", part="heldout")
    assert len(train.problems or []) + len(held.problems or []) == 10
    assert not {p.question for p in train.problems or []} & {p.question for p in held.problems or []}


def test_math500_evaluates_a_checkpoint_from_the_cli(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from veriloop.agents.loading import save_policy
    from veriloop.algos.run.setup import build_policy
    from veriloop.cli.main import run as cli_run
    from veriloop.configs.loader import load_config

    torch.set_num_threads(1)
    tiny = [
        "policy.model=tiny",
        "policy.lora=false",
        "rollout.max_new_tokens=8",
        "rollout.max_context=256",
        "eval.num_problems=2",
        "eval.n_samples=2",
        "eval.k_list=[1,2]",
        "eval.greedy=false",
    ]
    data = write(tmp_path / "math500.jsonl", MATH500)
    ckpt = tmp_path / "ckpt"
    save_policy(build_policy(load_config("quickstart", tiny)), ckpt)
    split = (
        f"env.eval_splits={{math500: {{kwargs: {{data: {data}, preset: math500, part: all, level: null}}}}}}"
    )
    out = tmp_path / "eval-out"
    rc = cli_run(["eval", "quickstart", *tiny, split, "--checkpoints", str(ckpt), "--out", str(out)])
    assert rc == 0
    report = json.loads(next(out.rglob("*.json")).read_text())
    assert report["splits"]["math500"]["num_problems"] == 2
    assert str(data) in report["meta"]["splits"]["math500"]["source"]
    assert report["meta"]["splits"]["math500"]["kwargs"]["preset"] == "math500"


def test_math500_as_the_env_evaluates_a_checkpoint_from_the_cli(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`env.kwargs.data=math500.jsonl env.kwargs.preset=math500` is all it takes: the held-out split
    is the file's held-out part, graded against its `answer` column."""
    import torch

    from veriloop.agents.loading import save_policy
    from veriloop.algos.run.setup import build_policy
    from veriloop.cli.main import run as cli_run
    from veriloop.configs.loader import load_config

    torch.set_num_threads(1)
    golds: list[str] = []
    check = MathVerifyEnv.check

    def recording(self, response, task):  # type: ignore[no-untyped-def]
        golds.append(task.answer)
        return check(self, response, task)

    monkeypatch.setattr(MathVerifyEnv, "check", recording)
    tiny = [
        "policy.model=tiny",
        "policy.lora=false",
        "rollout.max_new_tokens=8",
        "rollout.max_context=256",
        "eval.num_problems=2",
        "eval.n_samples=2",
        "eval.k_list=[1,2]",
        "eval.greedy=false",
    ]
    data = write(tmp_path / "math500.jsonl", MATH500)
    ckpt = tmp_path / "ckpt"
    save_policy(build_policy(load_config("quickstart", tiny)), ckpt)
    env = [f"env.kwargs.data={data}", "env.kwargs.preset=math500", "env.kwargs.level=null"]
    out = tmp_path / "eval-out"
    assert cli_run(["eval", "quickstart", *tiny, *env, "--checkpoints", str(ckpt), "--out", str(out)]) == 0
    report = json.loads(next(out.rglob("*.json")).read_text())
    (split,) = report["splits"]
    assert report["splits"][split]["num_problems"] == 2
    assert report["meta"]["splits"][split]["kwargs"]["preset"] == "math500"
    held = {
        p.question: p.answer
        for p in MathVerifyEnv(data=data, preset="math500", part="heldout").problems or []
    }
    asked = report["per_problem"][split]["problem"]
    assert sorted(asked) == sorted(held)  # the file's 2 held-out rows of 10, named by their question
    assert set(golds) == {held[q] for q in asked}  # graded against their `answer` column
