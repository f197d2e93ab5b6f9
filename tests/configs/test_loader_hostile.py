"""Hostile configs end in a short ConfigError, quickly: alias bombs, deep nesting, huge values,
a run.name that cannot be a folder name, a negative seed, a model that does not exist."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from veriloop.algos.loop.train import train
from veriloop.configs.loader import MAX_DEPTH, MAX_VALUES, load_config
from veriloop.configs.schema import ConfigError


def _bomb(levels: int = 9, width: int = 9) -> str:
    """The "billion laughs": each anchor repeats the previous one ``width`` times (9**9 values)."""
    lines = [f"a0: &a0 [{', '.join(['lol'] * width)}]"]
    for i in range(1, levels):
        lines.append(f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * width)}]")
    return "env:\n  kwargs:\n" + "".join(f"    {line}\n" for line in lines)


def _load_file(tmp_path: Path, text: str) -> ConfigError:
    f = tmp_path / "c.yaml"
    f.write_text(text)
    start = time.monotonic()
    with pytest.raises(ConfigError) as err:
        load_config(str(f))
    assert time.monotonic() - start < 5.0  # refused at once, not after minutes or an OOM
    return err.value


def test_alias_bomb_in_a_file_is_refused_quickly_with_a_short_message(tmp_path: Path) -> None:
    err = _load_file(tmp_path, _bomb())
    assert f"expands to more than {MAX_VALUES} values" in str(err) and "lol" not in str(err)
    assert len(str(err)) < 500


def test_alias_bomb_in_an_override_is_refused(tmp_path: Path) -> None:
    flow = (
        "{a: &a [x,x,x,x,x,x,x,x,x,x], b: &b [*a,*a,*a,*a,*a,*a,*a,*a,*a,*a], c: &c [*b,*b,*b,*b,*b,*b,*b,*b,*b,*b],"
        " d: &d [*c,*c,*c,*c,*c,*c,*c,*c,*c,*c], e: &e [*d,*d,*d,*d,*d,*d,*d,*d,*d,*d]}"
    )
    with pytest.raises(ConfigError, match="expands to more than") as err:
        load_config(None, [f"env.kwargs={flow}"])
    assert len(str(err.value)) < 500


def test_a_few_aliases_are_still_fine(tmp_path: Path) -> None:
    f = tmp_path / "c.yaml"
    f.write_text(
        "env:\n  kwargs: &kw {level: 1}\n  eval_splits:\n    id2: {id: veriloop/MathVerify-v0, kwargs: *kw}\n"
    )
    assert load_config(str(f)).env.kwargs == {"level": 1}


@pytest.mark.parametrize(
    "text",
    [
        "env: " + "[" * 50_000,
        "env: " + "[" * 100 + "]" * 100,
        "".join("  " * i + f"k{i}:\n" for i in range(100)),
    ],
)
def test_deep_nesting_is_a_clear_error_not_a_recursion_error(tmp_path: Path, text: str) -> None:
    err = _load_file(tmp_path, text)
    assert f"nested more than {MAX_DEPTH} levels deep" in str(err)


def test_huge_run_name_is_a_short_clear_error() -> None:
    """5 MB (the repro) is refused as too large a value; a long one under that names run.name."""
    with pytest.raises(ConfigError, match=r"\(5000000 characters\) must be 1 to 200|at most 1000000") as err:
        load_config(None, ["run.name=" + "a" * 5_000_000])
    assert len(str(err.value)) < 600
    with pytest.raises(ConfigError, match=r"run.name .*\(300000 characters\) must be 1 to 200") as err:
        load_config(None, ["run.name=" + "a" * 300_000])
    assert len(str(err.value)) < 600


@pytest.mark.parametrize("name", ["..", ".", "a/b"])
def test_run_name_cannot_leave_the_out_dir(name: str) -> None:
    with pytest.raises(ConfigError, match="run.name"):
        load_config(None, [f"run.name={name}"])


def test_wrong_type_message_does_not_repr_a_huge_value() -> None:
    with pytest.raises(ConfigError, match=r"rollout.group_size: expects int") as err:
        load_config(None, ["rollout.group_size=" + "x" * 1_000_000])
    assert len(str(err.value)) < 800


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("rollout.seed=-1", "rollout.seed must be in 0"),
        ("policy.model=/no/such/model", "policy.model: model"),
    ],
)
def test_bad_seed_or_missing_model_fails_before_anything_is_created(
    tmp_path: Path, override: str, message: str
) -> None:
    """The repro: before, the seed error came after the model loaded and both left a run folder."""
    cfg_args = ["policy.model=tiny", "train.steps=1", f"run.out_dir={tmp_path}", "run.name=r", override]
    with pytest.raises(ConfigError, match=message):
        train(load_config("quickstart", cfg_args), quiet=True)
    assert not (tmp_path / "r").exists()
