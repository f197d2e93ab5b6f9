"""Golds that are not values, and rows that no model could read, are refused at load, naming file,
row and field; a NaN gold reaching the math check is never paid."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from veriloop.envs.datasets import MAX_FIELD_CHARS, load_rows
from veriloop.envs.math_data import load_jsonl, load_problems
from veriloop.envs.verifiers import check_math


def _write(path: Path, answers: list[object]) -> Path:
    rows = [{"question": f"q{i}", "answer": a} for i, a in enumerate(answers)]
    if path.suffix == ".parquet":
        pa = pytest.importorskip("pyarrow")
        pq = pytest.importorskip("pyarrow.parquet")
        pq.write_table(pa.Table.from_pylist(rows), path)
    elif path.suffix == ".csv":
        path.write_text("question,answer\n" + "".join(f"{r['question']},{r['answer']}\n" for r in rows))
    elif path.suffix == ".json":
        path.write_text(json.dumps(rows))  # NaN / Infinity literals, as Python's json writes them
    else:
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize("suffix", [".parquet", ".csv", ".json", ".jsonl"])
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf, "NaN", "-inf"])
def test_a_nan_or_infinite_gold_is_refused_naming_file_row_and_field(
    tmp_path: Path, suffix: str, bad: object
) -> None:
    path = _write(tmp_path / f"d{suffix}", [1.5, bad] if not isinstance(bad, str) else ["1.5", bad])
    with pytest.raises(ValueError, match=rf"d{suffix}(:2| row 2): field 'answer' is .*not a gold answer"):
        load_problems(path)


def test_pandas_missing_floats_are_refused(tmp_path: Path) -> None:
    pd = pytest.importorskip("pandas")
    frame = pd.DataFrame({"question": ["a", "b", "c"], "answer": [1.0, None, 3.0]})
    frame.to_parquet(tmp_path / "p.parquet")
    with pytest.raises(ValueError, match=r"p.parquet row 2: missing field 'answer'"):  # stored as null
        load_problems(tmp_path / "p.parquet")
    frame.to_csv(tmp_path / "p.csv", index=False)  # an empty field
    with pytest.raises(ValueError, match=r"p.csv row 2: the gold answer \(field 'answer'\) is empty"):
        load_problems(tmp_path / "p.csv")
    frame.to_csv(tmp_path / "n.csv", index=False, na_rep="NaN")
    with pytest.raises(ValueError, match=r"n.csv row 2: field 'answer' is 'NaN'"):
        load_problems(tmp_path / "n.csv")


def test_the_math_loader_refuses_a_nan_gold_too(tmp_path: Path) -> None:
    (tmp_path / "m.jsonl").write_text(
        '{"question": "q", "answer": "1"}\n{"question": "r", "answer": "nan"}\n'
    )
    with pytest.raises(ValueError, match=r"m.jsonl:2: field 'answer' is 'nan'"):
        load_jsonl(tmp_path / "m.jsonl")


@pytest.mark.parametrize("gold", ["nan", "NaN", "-inf", "Infinity"])
def test_a_nan_gold_is_never_paid(gold: str) -> None:
    verdict = check_math(f"\\boxed{{{gold}}}", gold)
    assert not verdict.correct and verdict.error == "crash" and "not a value" in verdict.details["message"]


def test_infinity_in_latex_is_still_an_answer() -> None:
    assert check_math("\\boxed{\\infty}", "\\infty").correct


def test_an_oversized_question_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "big.jsonl"
    path.write_text(json.dumps({"question": "x" * (MAX_FIELD_CHARS + 1), "answer": "1"}) + "\n")
    with pytest.raises(
        ValueError, match=r"big.jsonl:1: field 'question' is 100,001 characters, over the limit"
    ):
        load_problems(path)
    with pytest.raises(ValueError, match=r"big.jsonl:1: field 'question' is 100,001 characters"):
        load_jsonl(path)


def test_csv_non_utf8_and_overlong_fields_name_file_and_row(tmp_path: Path) -> None:
    bad = tmp_path / "bad.csv"
    bad.write_bytes(b"question,answer\nq1,1\n\xff\xfe what,2\n")
    with pytest.raises(ValueError, match=r"bad.csv row 2 \(line 3\): field 'question' is not UTF-8 text"):
        load_rows(bad)
    long = tmp_path / "long.csv"
    long.write_text('question,answer\nq1,1\n"' + "q" * 200_000 + '",1\n')
    with pytest.raises(ValueError, match=r"long.csv row 2: unreadable CSV \(field larger than field limit"):
        load_rows(long)
