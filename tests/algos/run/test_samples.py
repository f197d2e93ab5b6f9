"""The samples log (``algos/run/samples.py``): records of hand-made episodes, hostile text capped and
only ever stored as JSON strings, and the file cut back on resume."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from veriloop.agents.trajectory import Trajectory, TurnRecord
from veriloop.algos.run.samples import (
    CUT_MARK,
    MAX_SAMPLE_CHARS,
    SampleLog,
    capped,
    episode_record,
    read_samples,
)
from veriloop.envs.verifiers import Verdict

#: Text a model may write: a megabyte, JSON and Markdown that try to break out, control characters.
HOSTILE = '"}\n{"step": 0, "injected": true}\n```\n<script>alert(1)</script>\x1b[2J\x00' + "A" * 1_000_000


def episode(texts: list[str], *, prompt: str = "What is 2+2?", rewards: tuple[float, ...] = ()) -> Trajectory:
    """An episode with one turn per text; the last turn judged wrong (reason ``wrong_value``)."""
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": prompt}]
    turns = []
    for k, text in enumerate(texts):
        last = k == len(texts) - 1
        verdict = Verdict(correct=False, reason="wrong_value", parsed=text[:5]) if last else None
        reward = rewards[k] if rewards else (-1.0 if last else 0.0)
        info = {"reward_components": {"accuracy": reward, "format": 0.5}}
        turns.append(TurnRecord(k, 0, 0, text, reward, verdict, info, hit_token_limit=last))
        messages.append({"role": "assistant", "content": text})
        if not last:
            messages.append({"role": "user", "content": "Try again."})
    return Trajectory(
        "test-v0",
        {},
        7,
        3,
        [1, 2, 3],
        [0, 1, 1],
        [0.0, -1.0, -1.0],
        [-1, 0, 0],
        tuple(turns),
        True,
        False,
        messages=messages,
        task={"id": "problem-7"},
    )


def test_one_turn_record() -> None:
    r = episode_record(episode(["It is 5."]))
    assert r["prompt"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2+2?"},
    ]
    assert r["responses"] == ["It is 5."] and "conversation" not in r
    assert (r["env"], r["seed"], r["group"], r["task_id"]) == ("test-v0", 7, 3, "problem-7")
    assert r["reward"] == -1.0 and r["reward_components"] == {"accuracy": -1.0, "format": 0.5}
    assert (r["correct"], r["reason"], r["verifier_error"]) == (False, "wrong_value", None)
    assert r["hit_token_limit"] is True and r["turns"] == 1 and r["response_tokens"] == 2


def test_multi_turn_record_keeps_the_turns() -> None:
    r = episode_record(episode(["5", "4"], rewards=(0.0, 1.0)))
    assert r["responses"] == ["5", "4"] and r["turns"] == 2 and r["reward"] == 1.0
    assert r["conversation"] == [
        {"role": "assistant", "content": "5"},
        {"role": "user", "content": "Try again."},
        {"role": "assistant", "content": "4"},
    ]
    assert r["reward_components"] == {"accuracy": 1.0, "format": 1.0}  # summed over the turns


def test_hostile_text_is_capped_and_stays_a_string(tmp_path: Path) -> None:
    log = SampleLog(tmp_path, 2)
    log.write(5, [episode([HOSTILE], prompt=HOSTILE)])
    text = (tmp_path / "samples.jsonl").read_text()
    assert len(text.splitlines()) == 1  # the newlines in the model's text are escaped, not new lines
    assert len(text) < 3 * MAX_SAMPLE_CHARS + 2_000  # prompt and response capped: not a megabyte
    (row,) = read_samples(tmp_path)
    assert row["step"] == 5 and "injected" not in row and row["kept"] is False
    mark = CUT_MARK.format(len(HOSTILE) - MAX_SAMPLE_CHARS)
    for stored in (row["responses"][0], row["prompt"][1]["content"]):
        assert stored == HOSTILE[:MAX_SAMPLE_CHARS] + mark
    assert capped("short") == "short" and capped("x" * MAX_SAMPLE_CHARS) == "x" * MAX_SAMPLE_CHARS


def test_the_first_k_episodes_and_which_were_trained(tmp_path: Path) -> None:
    played = [replace(episode([f"answer {i}"]), group_id=i // 2) for i in range(5)]
    log = SampleLog(tmp_path, 3)
    log.write(1, played, trained=played[2:])
    rows = read_samples(tmp_path)
    assert [r["responses"] for r in rows] == [["answer 0"], ["answer 1"], ["answer 2"]]
    assert [r["group"] for r in rows] == [0, 0, 1] and [r["kept"] for r in rows] == [False, False, True]
    SampleLog(tmp_path, 0).write(2, played)  # 0 = off: nothing appended
    assert len(read_samples(tmp_path)) == 3


def test_resume_keeps_the_lines_before_the_step(tmp_path: Path) -> None:
    log = SampleLog(tmp_path, 1)
    for step in (1, 2, 3):
        log.write(step, [episode([f"step {step}"])])
    with (tmp_path / "samples.jsonl").open("a") as f:
        f.write('{"step": 4, "torn')  # a line cut by a kill
    SampleLog(tmp_path, 1, resume_from_step=3)  # resumed from step 2's checkpoint: step 3 is played again
    assert [json.loads(line)["step"] for line in (tmp_path / "samples.jsonl").read_text().splitlines()] == [
        1,
        2,
    ]
