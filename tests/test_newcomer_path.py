"""A newcomer's path: Ctrl-C in the quickstart and the command that continues it, refusals that
leave nothing behind (so the corrected command with the same run name just works), ``--resume``
of a run that does not exist.

The runs are in-process (``cli.main.run``) on the tiny random model, to keep them short."""

from __future__ import annotations

import importlib
import json
import re
import shlex
from pathlib import Path
from typing import Any

import pytest
import torch

from veriloop.cli.main import run as cli_run

cli_main = importlib.import_module("veriloop.cli.main")  # the package's `main` is a function

TINY = [
    "policy.model=tiny",
    "rollout.prompts_per_step=2",
    "rollout.group_size=2",
    "rollout.max_new_tokens=8",
    "rollout.max_context=768",
    "train.steps=1",
    "train.micro_batch_size=2",
    "train.mini_batch_size=null",
    "train.warmup_steps=0",
    "eval.num_problems=1",
    "eval.n_samples=1",
    "eval.k_list=[1]",
    "eval.every=0",
    "eval.greedy=false",
    "sft.examples=4",
    "run.tensorboard=false",
]


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
    assert "modes: bf16 mixed precision, synchronous\n" in out  # what is on, once at the start
    assert "step lines: R = mean reward on the environment's scale" in out  # the step line's legend
    assert not (tmp_path / "q" / "sft" / "checkpoints").exists()  # step 0's checkpoint holds the warm-up
    assert f"run folder: {tmp_path / 'q'} (" in out  # with what takes its space
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
    pickled = _model_folder(tmp_path / "pickled", {"model_type": "llama"}, "pytorch_model.bin")
    base = [
        "train",
        "quickstart",
        *TINY,
        "sft.steps=0",
        "eval.at_start=false",
        f"run.out_dir={tmp_path / 'runs'}",
        "run.name=r",
    ]
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
    assert "| RL step 1 | id |" in capsys.readouterr().out  # train ends with its table, as quickstart does


def test_sft_resume_of_nothing_is_refused_before_any_folder(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["sft", "quickstart", "policy.model=tiny", f"run.out_dir={tmp_path}", "run.name=s", "--resume"]
    assert cli_run(args) == 2
    assert (
        f"no run at {tmp_path / 's' / 'sft'} to resume; drop --resume to start it" in capsys.readouterr().err
    )
    assert not (tmp_path / "s").exists()


def test_eval_labels_checkpoints_by_run_and_phase(tmp_path: Path) -> None:
    from veriloop.cli.eval import _label

    run = tmp_path / "quickstart"
    for folder in ("final", "sft/final", "checkpoints/step-000004", "sft/checkpoints/step-000016"):
        (run / folder).mkdir(parents=True)
    (run / "config.yaml").write_text("{}\n")
    labels = [
        _label(str(run / f))
        for f in ("sft/final", "final", "checkpoints/step-000004", "sft/checkpoints/step-000016")
    ]
    assert labels == ["quickstart/sft", "quickstart", "quickstart/step-4", "quickstart/sft/step-16"]
    assert _label("base") == "base"


def test_eval_compares_checkpoints_with_se_and_the_paired_change() -> None:
    """Hand-computed: per-problem accuracies [0, 0, 1, 1] then [1, 0, 1, 1]: d = [1, 0, 0, 0],
    mean 0.25, sd 0.5, SE 0.5 / 2 = 0.25."""
    from veriloop.algos.eval.report import comparison_markdown

    def report(acc: list[float], se: float) -> dict[str, Any]:
        mean = sum(acc) / len(acc)
        return {
            "splits": {"id": {"avg@n": mean, "se/avg@n": se}},
            "per_problem": {"id": {"avg@n": acc}},
            "meta": {"num_problems": 4, "first_seed": 7},
        }

    table = comparison_markdown(
        {"quickstart/sft": report([0, 0, 1, 1], 0.289), "quickstart": report([1, 0, 1, 1], 0.25)}
    )
    rows = table.splitlines()
    assert rows[2] == "| quickstart/sft | id | 0.500 ± 0.289 |  |"
    assert rows[3] == "| quickstart | id | 0.750 ± 0.250 | +0.250 ± 0.250 vs quickstart/sft |"
    other = report([1, 0, 1, 1], 0.25)
    other["meta"]["first_seed"] = 8
    assert "n/a (other problems)" in comparison_markdown({"a": report([0, 0, 1, 1], 0.3), "b": other})


def test_a_long_unit_of_work_is_never_silent(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Not at a terminal: while one batch runs (nothing finished yet), a progress line every
    LOG_INTERVAL_S seconds all the same; none after the phase is closed."""
    import time

    from veriloop.algos.run import progress

    monkeypatch.setattr(progress, "LOG_INTERVAL_S", 0.2)
    monkeypatch.setattr(progress, "at_terminal", lambda: False)
    bar = progress.Progress(128, "eval id", "episodes")
    time.sleep(0.9)
    bar.update(64)
    bar.close()
    time.sleep(0.5)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "eval id: 128 episodes to go"
    waiting = [
        line for line in lines if line.startswith("eval id: 0/128 episodes (") and "none finished yet" in line
    ]
    assert len(waiting) >= 2, lines
    assert len(lines) <= 2 + len(waiting) + 1  # nothing after close


def test_the_first_step_says_what_the_rest_will_cost(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import time

    from veriloop.algos.run import progress
    from veriloop.algos.run.nonfinite import NonFiniteGuard
    from veriloop.algos.run.phase import StepLoop

    monkeypatch.setattr(progress, "at_terminal", lambda: False)
    loop = StepLoop(301, "train", NonFiniteGuard(3))
    for step in loop.steps(1):
        time.sleep(0.3)
        if step == 2:
            break
    out = capsys.readouterr().out
    measured = r"train: ≈ \d+ (s|min) on this machine for the 299 steps left \(0\.\d s a step, measured after step 2\)"
    assert re.search(measured, out), out
    assert out.count("≈") == 1  # once, after the first step this process ran


def test_the_curriculum_gate_reports_as_itself_and_an_idle_step_does_not_warn(
    caplog: pytest.LogCaptureFixture,
) -> None:
    import warnings

    from veriloop.algos.loop.run_steps import advance_schedule
    from veriloop.algos.loop.sampling import dynamic_sampling

    with caplog.at_level("WARNING"):
        dynamic_sampling(
            lambda n: [[1, 1]] * n,
            num_groups=4,
            max_rounds=1,
            reward_fn=float,
            accept=lambda g: False,
            name="the curriculum gate",
        )
    assert "the curriculum gate kept 0 of 4 groups after 1 rounds" in caplog.text
    assert "dynamic sampling" not in caplog.text
    optimizer = torch.optim.AdamW(torch.nn.Linear(2, 2).parameters())
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda k: 1.0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        advance_schedule(scheduler)  # a step that trained nothing: no optimizer.step() before it
    assert not caught and scheduler.last_epoch == 1


def test_the_modes_say_what_is_on_and_count_what_they_did() -> None:
    from veriloop.algos.loop.metrics import modes_line, modes_tally
    from veriloop.configs.loader import load_config

    cfg = load_config(
        "quickstart", ["rollout.compaction=keep_last", "algo.rollout_is=truncate", "train.max_staleness=2"]
    )
    assert modes_line(cfg) == (
        "modes: bf16 mixed precision, async (max_staleness=2, corrected by rollout_is=truncate), compaction keep_last "
        f"(keep {cfg.rollout.compaction_keep})"
    )
    rows = [
        {
            "samples/split_rate": 0.25,
            "samples/episodes": 32.0,
            "async/staleness_max": 1.0,
            "async/dropped": 0.0,
        },
        {
            "samples/split_rate": 0.5,
            "samples/episodes": 32.0,
            "async/staleness_max": 2.0,
            "async/dropped": 3.0,
        },
    ]
    assert modes_tally(rows, cfg) == (
        "the modes did: compaction split 24 episodes; async: staleness at most 2 steps, 3 groups dropped before training (nothing to learn in them)"
    )
    plain = load_config("quickstart", ["policy.precision=fp32"])
    assert modes_line(plain) == "modes: fp32, synchronous" and modes_tally(rows, plain) is None


def test_held_out_problems_are_named_in_the_per_problem_results() -> None:
    from types import SimpleNamespace

    from veriloop.algos.eval.loop import problem_ids

    trajs = [
        SimpleNamespace(group_id=1, task={"question": "What is 2+2?"}),
        SimpleNamespace(group_id=0, task={"question": "q", "meta": {"id": "row-17"}}),
        SimpleNamespace(group_id=2, task={}),
    ]
    assert problem_ids(trajs, 3) == ["row-17", "What is 2+2?", None]  # type: ignore[arg-type]


def test_no_docstring_formula_renders_as_a_link() -> None:
    """``S[pi](s_t)`` outside backticks is Markdown for a link to a page "s_t": broken on the docs
    site. Formulas that look like links go in double backticks."""
    root = Path(__file__).resolve().parents[1]
    link = re.compile(r"\[[^\]\[]*\]\([A-Za-z_][\w.]*\)")
    found = []
    for folder in ("agents", "algos", "envs", "configs", "cli", "interop"):
        for path in (root / folder).rglob("*.py"):
            for n, line in enumerate(path.read_text().splitlines(), 1):
                bare = re.sub(r"``.*?``|`[^`]*`|\"[^\"]*\"|'[^']*'", "", line)
                if link.search(bare):
                    found.append(f"{path.relative_to(root)}:{n}: {line.strip()}")
    assert not found, "\n".join(found)


def test_a_misspelt_env_argument_is_one_short_line() -> None:
    from veriloop.configs.loader import load_config
    from veriloop.configs.schema import ConfigError

    cfg = load_config("quickstart", ["env.kwargs={levle: 1}"])
    with pytest.raises(ConfigError) as err:
        cfg.env.resolve()
    message = str(err.value)
    assert message.startswith(
        "env.kwargs: veriloop/MathVerify-v0 has no argument 'levle'. Did you mean 'level'?"
    )
    assert (
        message.count("levle") == 1 and "'part': 'heldout'" not in message and "gymnasium.make" not in message
    )


def test_train_without_a_config_asks_for_the_config_only(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli_main.parse_args(["train"])
    err = capsys.readouterr().err
    assert "train needs CONFIG" in err and "quickstart" in err and "KEY=VALUE" not in err.splitlines()[-1]


def test_the_run_folder_line_says_what_takes_the_space(tmp_path: Path) -> None:
    run = tmp_path / "q"
    for name, size in (
        ("checkpoints/step-000004/optimizer.pt", 3_000_000),
        ("final/adapter.safetensors", 2_000_000),
        ("metrics.jsonl", 500),
    ):
        (run / name).parent.mkdir(parents=True, exist_ok=True)
        (run / name).write_bytes(b"0" * size)
    assert cli_main.folder_sizes(run) == (
        f"{run} (5 MB: checkpoints/ 3 MB (resume points: trained weights + optimizer state), "
        "final/ 2 MB (the trained policy))"
    )
