"""Users' own data: the formats they have, field mapping, errors naming file/row/field, a held-out
part that never overlaps training (for every dataset-backed env), and a dataset + check function."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import gymnasium
import pytest

import veriloop.envs  # noqa: F401  (registers the envs)
from veriloop.configs.env import EnvConfig, MixtureEntry, SplitConfig
from veriloop.configs.errors import ConfigError
from veriloop.envs.datasets import (
    DatasetEnv,
    FieldMap,
    index_range,
    load_rows,
    question_digest,
    register_dataset_env,
    select_part,
    split_rows,
)
from veriloop.envs.math_data import load_problems
from veriloop.envs.verifiers import Verdict

ROWS = [
    {"problem": f"What is {i} + {i}?", "solution": f"Add: \\boxed{{{2 * i}}}", "level": "Level 1"}
    for i in range(60)
]
DATASET_ENV = gymnasium.envs.registration.EnvSpec("test/Dataset-v0", entry_point=DatasetEnv)
MAPPED = {"question_key": "problem", "answer_key": "solution", "answer_extract": "last_boxed", "level": None}


def write_parquet(path: Path, rows: list[dict]) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def write_all_formats(d: Path, rows: list[dict]) -> dict[str, Path]:
    import datasets

    out = {"jsonl": d / "p.jsonl", "json": d / "p.json", "csv": d / "p.csv"}
    out["jsonl"].write_text("".join(json.dumps(r) + "\n" for r in rows))
    out["json"].write_text(json.dumps(rows))
    with out["csv"].open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    out["parquet"] = write_parquet(d / "p.parquet", rows)
    datasets.Dataset.from_list(rows).save_to_disk(str(d / "folder"))
    datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)}).save_to_disk(str(d / "dictfolder"))
    out["folder"], out["dictfolder"] = d / "folder", d / "dictfolder"
    return out


def test_every_format_reads_the_same_problems(tmp_path: Path) -> None:
    paths = write_all_formats(tmp_path, ROWS[:5])
    fields = FieldMap("problem", "solution", "last_boxed")
    for name, path in paths.items():
        split = "test" if name == "dictfolder" else "train"
        problems = load_problems(path, fields=fields, split=split)
        assert [p.question for p in problems] == [r["problem"] for r in ROWS[:5]], name
        assert [p.answer for p in problems] == ["0", "2", "4", "6", "8"], name
        assert [p.level for p in problems] == [1] * 5, name  # "Level 1" (MATH's form) and "1" (CSV) read as 1
        assert problems[1].solution == "Add: \\boxed{2}"  # the solution stays: generator SFT works


def test_extractors_and_errors_name_file_row_and_field(tmp_path: Path) -> None:
    gsm = FieldMap("question", "answer", "after_hashes")
    assert gsm.answer({"answer": "3 + 4 = 7\n#### 7"}, "x") == "7"
    path = write_parquet(tmp_path / "bad.parquet", [ROWS[0], {"problem": "Q?", "level": "2"}])
    with pytest.raises(ValueError, match=r"bad\.parquet row 2: missing field 'solution' \(the answer_key\)"):
        load_problems(path, fields=FieldMap("problem", "solution", "last_boxed"))
    with pytest.raises(ValueError, match=r"bad\.parquet row 1: missing field 'question'.*'problem'"):
        load_problems(path)
    nobox = write_parquet(tmp_path / "nobox.parquet", [{"problem": "Q?", "solution": "just 4"}])
    with pytest.raises(ValueError, match=r"nobox\.parquet row 1: .*no complete \\boxed"):
        load_problems(nobox, fields=FieldMap("problem", "solution", "last_boxed"))
    (tmp_path / "x.txt").write_text("hi")
    with pytest.raises(ValueError, match="unknown data format '.txt'"):
        load_rows(tmp_path / "x.txt")
    with pytest.raises(FileNotFoundError, match="not a file, not a folder"):
        load_rows(tmp_path / "missing.parquet")


def test_split_is_a_partition_by_question_with_duplicates_on_one_side() -> None:
    questions = [f"q{i}" for i in range(10)] + ["q3", "q3 "]  # q3 three times (whitespace collapses)
    train, held = split_rows(questions, "train", 0.2), split_rows(questions, "heldout", 0.2)
    assert sorted(train + held) == list(range(12)) and not set(train) & set(held)
    assert len({questions[i].strip() for i in held}) == 2  # round(0.2 x 10 distinct questions)
    sides = {i in held for i, q in enumerate(questions) if q.strip() == "q3"}
    assert len(sides) == 1  # every copy of q3 on the same side
    # hand-checked: the held-out questions are the two with the smallest SHA-256
    smallest = sorted({question_digest(f"q{i}") for i in range(10)})[:2]
    assert {question_digest(questions[i]) for i in held} == set(smallest)
    # the split depends on the questions only, not their order
    shuffled = questions[::-1]
    assert {shuffled[i] for i in split_rows(shuffled, "heldout", 0.2)} == {questions[i] for i in held}
    assert index_range(10, "heldout", 0.2) == range(8, 10) and index_range(10, "train", 0.2) == range(8)


def test_explicit_heldout_file_removes_its_questions_from_training() -> None:
    rows = ["a", "b", "c", "d"]
    assert select_part(rows, rows, part="train", heldout_fraction=0.2, heldout_questions=["b", "z"]) == [
        "a",
        "c",
        "d",
    ]


def _pool(env_id: str, kwargs: dict) -> set[str]:
    env = gymnasium.make(env_id, **kwargs).unwrapped
    env = getattr(env, "inner", env)  # SolveVerify: its math task env
    try:
        if hasattr(env, "problems"):
            return {p.question for p in env.problems}
        if hasattr(env, "tasks"):
            return {t["question"] for t in env.tasks}
        return {str(i) for i in env._indices}  # ReasoningGym: item indices
    finally:
        env.close()


def _drawn(env_id: str, kwargs: dict, seeds: range) -> set[str]:
    env = gymnasium.make(env_id, **kwargs)
    out = set()
    for s in seeds:
        _, info = env.reset(seed=s)
        out.add(str(info["task"].get("index", info["task"]["question"])))
    env.close()
    return out


def _configs(tmp_path: Path) -> dict[str, EnvConfig]:
    jsonl = tmp_path / "m.jsonl"
    jsonl.write_text(
        "".join(json.dumps({"question": f"Compute {i} - 1.", "answer": str(i - 1)}) + "\n" for i in range(40))
    )
    parquet = write_parquet(tmp_path / "m.parquet", ROWS)
    (tmp_path / "check_fn.py").write_text("def ok(response, answer):\n    return answer in response\n")
    if "userdata/Sums-v0" not in gymnasium.registry:
        register_dataset_env(
            "userdata/Sums-v0",
            data=parquet,
            check="check_fn:ok",
            question_key="problem",
            answer_key="solution",
            answer_extract="last_boxed",
        )
    return {
        "math-jsonl": EnvConfig(kwargs={"data": str(jsonl), "level": None}),
        "math-parquet": EnvConfig(kwargs={"data": str(parquet), **MAPPED}),
        "mixture": EnvConfig(
            mixture={
                "a": MixtureEntry(kwargs={"data": str(jsonl), "level": None}),
                "b": MixtureEntry(kwargs={"data": str(parquet), **MAPPED}),
            }
        ),
        "solve-verify": EnvConfig(id="veriloop/SolveVerify-v0", kwargs={"data": str(jsonl), "level": None}),
        "reasoning-gym": EnvConfig(
            id="veriloop/ReasoningGym-v0", kwargs={"dataset": "chain_sum", "config": {"size": 50}}
        ),
        "dataset+check": EnvConfig(id="userdata/Sums-v0", kwargs={"data": str(parquet)}),
    }


@pytest.mark.parametrize(
    "name", ["math-jsonl", "math-parquet", "mixture", "solve-verify", "reasoning-gym", "dataset+check"]
)
def test_id_evaluation_never_sees_a_training_row(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if name == "reasoning-gym":
        pytest.importorskip("reasoning_gym")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = _configs(tmp_path)[name]
    train, evals = cfg.training_envs, cfg.resolved_eval_splits
    assert set(train) <= set(evals)
    for env_name, t in train.items():
        e = evals[env_name]
        assert t.kwargs["part"] == "train" and e.kwargs["part"] == "heldout"
        trained, held = _pool(str(t.id), t.kwargs), _pool(str(e.id), e.kwargs)
        assert trained and held and not trained & held, f"{name}/{env_name}: held-out rows were trained on"
        # and what episodes actually draw stays inside each part (training seeds vs evaluation seeds)
        assert _drawn(str(t.id), t.kwargs, range(0, 200)) <= trained
        assert _drawn(str(e.id), e.kwargs, range(10_000, 10_050)) <= held


def test_eval_split_on_the_training_file_is_held_out_and_another_file_is_read_whole(tmp_path: Path) -> None:
    parquet = write_parquet(tmp_path / "m.parquet", ROWS)
    other = write_parquet(tmp_path / "test.parquet", ROWS[:7])
    cfg = EnvConfig(
        kwargs={"data": str(parquet), **MAPPED},
        eval_splits={
            "same": SplitConfig(kwargs={"data": str(parquet), **MAPPED, "level": 1}),
            "test": SplitConfig(kwargs={"data": str(other), **MAPPED}),
        },
    )
    splits = cfg.resolved_eval_splits
    assert splits["same"].kwargs["part"] == "heldout" and splits["test"].kwargs["part"] == "all"
    assert len(_pool(str(splits["test"].id), splits["test"].kwargs)) == 7
    with pytest.raises(ConfigError, match="part 'all' would put held-out rows in training"):
        _ = EnvConfig(kwargs={"data": str(parquet), **MAPPED, "part": "all"}).resolved_eval_splits


def test_level_filter_that_keeps_nothing_says_how_to_fix_it(tmp_path: Path) -> None:
    path = tmp_path / "nolevel.jsonl"
    path.write_text("".join(json.dumps({"question": f"Q{i}?", "answer": str(i)}) + "\n" for i in range(5)))
    with pytest.raises(ValueError, match=r"level=null"):
        gymnasium.make("veriloop/MathVerify-v0", data=str(path), level=1)


def test_dataset_env_with_a_plain_check_function(tmp_path: Path) -> None:
    path = write_parquet(
        tmp_path / "caps.parquet",
        [
            {"country": c, "capital": k}
            for c, k in [("France", "Paris"), ("Japan", "Tokyo"), ("Peru", "Lima"), ("Chad", "N'Djamena")]
        ],
    )

    def check(response: str, answer: str) -> bool:
        return answer.lower() in response.lower()

    kw = {
        "data": str(path),
        "question_key": "country",
        "answer_key": "capital",
        "prompt": "What is the capital of {country}?",
        "part": "all",
    }
    env = gymnasium.make(DATASET_ENV, check=check, **kw)
    obs, info = env.reset(seed=0)
    assert obs == f"What is the capital of {info['task']['country']}?"
    _, reward, terminated, _, step_info = env.step(f"It is {info['task']['answer']}.")
    assert reward == 1.0 and terminated and step_info["verdict"].correct
    env.reset(seed=0)
    assert env.step("No idea.")[1] == 0.0

    def crashes(response: str, answer: str) -> bool:
        raise RuntimeError("boom")

    env = gymnasium.make(DATASET_ENV, check=crashes, **kw)
    env.reset(seed=0)
    _, reward, terminated, truncated, step_info = env.step("x")
    assert step_info["verdict"].error == "crash" and reward == 0.0 and truncated and not terminated

    def verdict(response: str, answer: str) -> Verdict:
        return Verdict(correct=False, reason="hedged", feedback="One answer, please.")

    env = gymnasium.make(DATASET_ENV, check=verdict, **kw)
    env.reset(seed=0)
    assert env.step("x")[4]["verdict"].reason == "hedged"
    with pytest.raises(ValueError, match="names 'continent'"):
        gymnasium.make(DATASET_ENV, check=check, **{**kw, "prompt": "{continent}?"})


HUB_SCRIPT = """
import sys
from veriloop.envs.datasets import DatasetEnv, FieldMap, register_dataset_env, load_rows
from veriloop.envs.math_data import load_problems
fields = FieldMap("problem", "solution", "last_boxed")
assert len(load_problems("someone/sums", fields=fields)) == 6
assert [p.answer for p in load_problems("someone/sums", fields=fields, split="test")] == ["12", "14", "16"]
assert len(load_problems("someone/twosets", fields=fields, subset="main")) == 2
try:
    load_rows("someone/twosets")
except ValueError as e:
    assert "subsets ['main', 'socratic']: set subset" in str(e), e
else:
    sys.exit("two subsets were mixed")
try:
    load_rows("someone/nothing")
except FileNotFoundError as e:
    assert "someone/nothing" in str(e) and "HF_HUB_OFFLINE" in str(e), e
else:
    sys.exit("a missing dataset loaded")
"""


def test_hub_dataset_id_reads_from_a_local_hub_cache_offline(tmp_path: Path) -> None:
    """The Hub cache layout an online download leaves (datasets--owner--name/refs, snapshots), read in
    a process with the network off."""
    repo = tmp_path / "hub" / "datasets--someone--sums"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("0" * 40)
    data = repo / "snapshots" / ("0" * 40) / "data"
    data.mkdir(parents=True)
    write_parquet(data / "train-00000-of-00001.parquet", ROWS[:6])
    write_parquet(data / "test-00000-of-00001.parquet", ROWS[6:9])
    two = tmp_path / "hub" / "datasets--someone--twosets"
    (two / "refs").mkdir(parents=True)
    (two / "refs" / "main").write_text("1" * 40)
    for subset, rows in (("main", ROWS[:2]), ("socratic", ROWS[2:5])):
        (two / "snapshots" / ("1" * 40) / subset).mkdir(parents=True)
        write_parquet(two / "snapshots" / ("1" * 40) / subset / "train-00000-of-00001.parquet", rows)
    env = {
        **os.environ,
        "HF_HUB_CACHE": str(tmp_path / "hub"),
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
    }
    r = subprocess.run(
        [sys.executable, "-c", HUB_SCRIPT], env=env, capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stderr[-2000:]


def test_env_kwarg_typo_gets_did_you_mean() -> None:
    with pytest.raises(ConfigError, match=r"has no argument 'levle'.*Did you mean 'level'\?.*takes: data, "):
        EnvConfig(kwargs={"levle": 1}).resolve()


def test_an_empty_training_part_fails_when_the_config_is_resolved(tmp_path: Path) -> None:
    questions = [f"Q{i}?" for i in range(10)]
    level_1 = sorted(questions, key=question_digest)[0]  # held out (smallest hash): the only level-1 row
    rows = [{"question": q, "answer": "1", "level": 1 if q == level_1 else 2} for q in questions]
    path = write_parquet(tmp_path / "levels.parquet", rows)
    EnvConfig(kwargs={"data": str(path), "level": 2}).resolve()  # both parts have level 2 rows
    with pytest.raises(
        ConfigError, match=r"env.kwargs: .*no problem of the train part has a level in \(1,\)"
    ):
        EnvConfig(kwargs={"data": str(path), "level": 1}).resolve()  # the training part has none
    with pytest.raises(ValueError, match=r"no problem of the train part has a level in \(1,\)"):
        gymnasium.make("veriloop/MathVerify-v0", data=str(path), level=1)


def test_split_source_names_the_rows_and_says_when_they_repeat(tmp_path: Path) -> None:
    from veriloop.envs.base import split_source

    path = write_parquet(
        tmp_path / "q.parquet", [{"question": f"Q{i}?", "answer": str(i)} for i in range(20)]
    )
    kwargs = {"data": str(path), "part": "heldout"}
    assert split_source("veriloop/MathVerify-v0", kwargs, range(3)) == (
        f"4 held-out rows of 20 in {path} (heldout_fraction 0.2, split by question hash), drawn by env seeds 0..2"
    )
    assert split_source("veriloop/MathVerify-v0", kwargs, range(10)).endswith(
        "10 problems from 4 rows, so some rows repeat"
    )
    assert split_source("veriloop/MathVerify-v0", {}, range(5, 8)) == "generator, env seeds 5..7"
