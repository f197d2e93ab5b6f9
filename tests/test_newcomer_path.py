"""A newcomer's path: Ctrl-C in the quickstart and the command that continues it, refusals that
leave nothing behind (so the corrected command with the same run name just works), ``--resume``
of a run that does not exist.

The runs are in-process (``cli.main.run``) on the tiny random model, to keep them short."""

from __future__ import annotations

import importlib
import json
import shlex
from pathlib import Path
from typing import Any

import pytest
import torch

from veriloop.cli.main import run as cli_run

cli_main = importlib.import_module("veriloop.cli.main")  # the package's `main` is a function

TINY = [
    "policy.model=tiny", "rollout.prompts_per_step=2", "rollout.group_size=2", "rollout.max_new_tokens=8",
    "rollout.max_context=768", "train.steps=1", "train.micro_batch_size=2", "train.mini_batch_size=null",
    "train.warmup_steps=0", "eval.num_problems=1", "eval.n_samples=1", "eval.k_list=[1]", "eval.every=0",
    "eval.greedy=false", "sft.examples=4", "run.tensorboard=false",
]  # fmt: skip


def _count_evaluations(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Every evaluation the run really plays (a reused report is not one)."""
    from veriloop.algos.eval import loop

    calls: list[Any] = []
    real = loop.evaluate_config

    def counted(cfg: Any, policy: Any, *, step: int | None = None, backend: Any = None) -> dict[str, Any]:
        calls.append(step)
        return real(cfg, policy, step=step, backend=backend)

    monkeypatch.setattr(loop, "evaluate_config", counted)
    return calls


def test_an_interrupted_quickstart_continues_with_the_command_the_message_names(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Ctrl-C in the warm-up (after its step-2 checkpoint): exit 130, the message names the command;
    that command says what it resumes (the warm-up at step 2, not "starting fresh"), does not
    evaluate the base model again, and finishes."""
    from veriloop.algos.sft import train as sft_train

    args = [
        "quickstart",
        *TINY,
        "sft.steps=4",
        "run.checkpoint_every=2",
        f"run.out_dir={tmp_path}",
        "run.name=q",
    ]
    real_step = sft_train._sft_step

    def cut(sft: Any, step: int) -> Any:
        if step == 2:
            raise KeyboardInterrupt
        return real_step(sft, step)

    monkeypatch.setattr(sft_train, "_sft_step", cut)
    evaluations = _count_evaluations(monkeypatch)
    assert cli_run(args) == 130
    err = capsys.readouterr().err
    again = err.split("continue with: ")[1].strip()
    assert again == shlex.join(["veriloop", *args]), err  # the same command, nothing to add
    assert evaluations == [0]  # the base model, before the warm-up

    monkeypatch.setattr(sft_train, "_sft_step", real_step)
    evaluations.clear()
    assert cli_run(shlex.split(again)[1:]) == 0
    out = capsys.readouterr().out
    assert f"continuing the interrupted quickstart in {tmp_path / 'q'}" in out
    assert "the warm-up from step 2 (no RL step done yet)" in out
    assert "sft warm-up: continuing from its checkpoint at step 2 of 4" in out
    assert "base model (before SFT): evaluated before the interruption, reusing" in out
    assert "starting fresh" not in out
    assert evaluations == [0, 1]  # after the warm-up and after RL step 1; not the base model again
    assert "| base model (before SFT) | id |" in (tmp_path / "q" / "summary.md").read_text()


def test_the_resume_command_is_the_one_the_user_typed(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under the Makefile the message names `make quickstart` (with ARGS when there were any);
    trainers get `--resume` added; `--overwrite` is never repeated."""
    monkeypatch.setenv(cli_main.INVOKED_AS_ENV, "make quickstart")
    assert cli_main._again_command(["quickstart"]) == "make quickstart"
    assert cli_main._again_command(["quickstart", "--resume"]) == "make quickstart"
    assert cli_main._again_command(["quickstart", "train.steps=20"]) == "make quickstart ARGS=train.steps=20"
    assert cli_main._again_command(["quickstart", "a.b=1", "c.d=2"]) == "make quickstart ARGS='a.b=1 c.d=2'"
    monkeypatch.delenv(cli_main.INVOKED_AS_ENV)
    again = cli_main._again_command(["train", "points24_grpo", "--overwrite", "run.name=tour"])
    assert cli_main._resume_command("train", again) == "veriloop train points24_grpo run.name=tour --resume"
    assert cli_main._resume_command("quickstart", "veriloop quickstart") == "veriloop quickstart"


def test_a_finished_quickstart_is_refused_naming_what_to_type(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "q" / "final").mkdir(parents=True)
    monkeypatch.setenv(cli_main.INVOKED_AS_ENV, "make quickstart")
    assert cli_run(["quickstart", f"run.out_dir={tmp_path}", "run.name=q"]) == 2
    err = capsys.readouterr().err
    assert "already holds a finished quickstart" in err
    assert f"`make quickstart ARGS='run.out_dir={tmp_path} run.name=q --overwrite'`" in err
    assert sorted(p.name for p in (tmp_path / "q").iterdir()) == ["final"]


def _model_folder(folder: Path, config: dict[str, Any], weights: str) -> str:
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    torch.save({"w": torch.zeros(1)}, folder / weights)
    return str(folder)


def test_each_refusal_writes_nothing_and_the_corrected_command_runs_under_the_same_name(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A CUDA device on a CPU machine, a model needing trust_remote_code, pickle-only weights,
    --resume of a run that does not exist: each exit 2 with one line, no run folder made; then the
    corrected command with the same run.name trains."""
    if torch.cuda.is_available():
        pytest.skip("the CUDA refusal needs a machine without CUDA")
    remote = _model_folder(
        tmp_path / "remote", {"model_type": "mine", "auto_map": {"AutoModel": "m.M"}}, "model.safetensors"
    )
    pickled = _model_folder(tmp_path / "pickled", {"model_type": "llama"}, "pytorch_model.bin")  # fmt: skip
    base = ["train", "quickstart", *TINY, "sft.steps=0", "eval.at_start=false", f"run.out_dir={tmp_path / 'runs'}",
            "run.name=r"]  # fmt: skip
    refusals = {
        "sees no CUDA device": [*base, "policy.device=cuda"],
        "needs trust_remote_code": [*base, f"policy.model={remote}"],
        "only as pickles (pytorch_model.bin)": [*base, f"policy.model={pickled}"],
        f"no run at {tmp_path / 'runs' / 'r'} to resume; drop --resume to start it": [*base, "--resume"],
    }
    for why, args in refusals.items():
        assert cli_run(args) == 2, why
        err = capsys.readouterr().err
        assert why in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
        assert not (tmp_path / "runs").exists(), (
            f"{why}: the refusal left {list((tmp_path / 'runs').rglob('*'))}"
        )
    assert cli_run([*base, "policy.device=cpu"]) == 0, capsys.readouterr().err[-2000:]
    assert (tmp_path / "runs" / "r" / "final").is_dir()


def test_sft_resume_of_nothing_is_refused_before_any_folder(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["sft", "quickstart", "policy.model=tiny", f"run.out_dir={tmp_path}", "run.name=s", "--resume"]
    assert cli_run(args) == 2
    assert (
        f"no run at {tmp_path / 's' / 'sft'} to resume; drop --resume to start it" in capsys.readouterr().err
    )
    assert not (tmp_path / "s").exists()
