"""The ``veriloop`` console script as a user runs it: help, envs, config errors, and a tiny
train -> eval -> plot round trip (``policy.model=tiny``: random weights, the real tokenizer)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

EXE = shutil.which("veriloop") or str(Path(sys.executable).with_name("veriloop"))
TINY = [
    "policy.model=tiny",
    "policy.lora=false",
    "env.kwargs={level: 1}",
    "rollout.prompts_per_step=2",
    "rollout.group_size=2",
    "rollout.max_new_tokens=8",
    "rollout.max_context=256",
    "train.steps=2",
    "train.micro_batch_size=2",
    "eval.num_problems=2",
    "eval.n_samples=2",
    "eval.k_list=[1,2]",
    "eval.greedy=false",
    "eval.every=0",
    "run.tensorboard=false",
    "run.checkpoint_every=1",
]


def veriloop(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([EXE, *args], capture_output=True, text=True, timeout=timeout, env=env)


@pytest.mark.parametrize("command", ["train", "sft", "eval", "plot", "envs", "demo", "quickstart"])
def test_help_everywhere(command: str) -> None:
    r = veriloop(command, "--help")
    assert r.returncode == 0, r.stderr
    assert "usage: veriloop" in r.stdout


def test_train_help_documents_settings_from_the_schema() -> None:
    out = veriloop("train", "--help").stdout
    for key in ("algo.clip_high", "rollout.group_size", "rollout.backend", "eval.k_list", "sft.source"):
        assert key in out


def test_envs_lists_registered_ids_and_splits() -> None:
    r = veriloop("envs")
    assert r.returncode == 0, r.stderr
    for env_id in ("veriloop/MathVerify-v0", "veriloop/Points24-text-v0", "veriloop/SolveVerify-v0"):
        assert env_id in r.stdout
    assert "rule_ood" in r.stdout


def test_unknown_key_is_a_clean_error_with_a_suggestion(tmp_path: Path) -> None:
    r = veriloop("train", "quickstart", "algo.clip_hihg=0.3", f"run.out_dir={tmp_path}")
    assert r.returncode == 2
    assert "Traceback" not in r.stderr
    assert "algo.clip_hihg" in r.stderr and "clip_high" in r.stderr
    assert not any(tmp_path.iterdir())  # nothing was started


def test_bad_yaml_line_names_file_and_line(tmp_path: Path) -> None:
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("env:\n  id: veriloop/MathVerify-v0\nrollout:\n  group_sise: 4\n")
    r = veriloop("train", str(cfg))
    assert r.returncode == 2
    assert f"{cfg}:4" in r.stderr and "group_size" in r.stderr


def test_train_eval_plot_round_trip(tmp_path: Path) -> None:
    r = veriloop("train", "quickstart", *TINY, "sft.steps=0", f"run.out_dir={tmp_path}", "run.name=tiny")
    assert r.returncode == 0, r.stderr[-3000:]
    run = tmp_path / "tiny"
    assert (run / "config.yaml").exists() and (run / "final").is_dir()
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [0, 1, 2]
    assert "eval/id/pass@2" in rows[-1] and "reward/mean" in rows[-1]

    out = tmp_path / "eval-out"
    r = veriloop("eval", "quickstart", *TINY, "--checkpoints", "base", str(run / "final"), "--out", str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    produced = {p.suffix for p in out.rglob("*") if p.is_file()}
    assert {".json", ".md", ".png"} <= produced
    summary = (out / "summary.md").read_text()  # named by run, with SE and the paired change
    assert summary.startswith("## Compared") and "| base | id |" in summary and "vs base |" in summary
    assert "| tiny | id |" in summary and (out / "tiny.json").is_file()

    r = veriloop("plot", str(run))
    assert r.returncode == 0, r.stderr[-3000:]
    assert list((run / "plots").glob("*.png"))


@pytest.mark.slow  # seven CLI starts, ~1 min (`make test-slow`, CI); a run cut after its warm-up is in `make test`
def test_sft_resume_continues_a_cut_warm_up_from_its_checkpoint(tmp_path: Path) -> None:
    """A warm-up cut after its step-2 checkpoint (final/ never written) continues at step 3 with
    --resume; it is refused without a flag, and --resume beside --overwrite is an error."""
    base = [
        *TINY,
        "sft.examples=32",
        "train.log_every=1",
        "run.checkpoint_every=2",
        f"run.out_dir={tmp_path}",
        "run.name=w",
    ]
    r = veriloop("sft", "quickstart", *base, "sft.steps=2")
    assert r.returncode == 0, r.stderr[-3000:]
    sft = tmp_path / "w" / "sft"
    shutil.rmtree(sft / "final")  # as if killed before the end
    r = veriloop("sft", "quickstart", *base, "sft.steps=4")
    assert r.returncode == 2 and "--resume" in r.stderr and "Traceback" not in r.stderr
    assert (sft / "checkpoints").is_dir()  # the refusal changed nothing
    r = veriloop("sft", "quickstart", *base, "sft.steps=4", "--resume", "--overwrite")
    assert r.returncode == 2 and "choose one" in r.stderr
    r = veriloop("sft", "quickstart", *base, "sft.steps=4", "--resume")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "steps 3-4 of 4 (resumed at step 2)" in r.stdout and (sft / "final").is_dir()
    rows = [json.loads(line) for line in (sft / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2, 3, 4]  # each step logged once
    r = veriloop("sft", "quickstart", *base, "sft.steps=4", "--resume")
    assert r.returncode == 0 and "already finished" in r.stdout
    # cut before its first checkpoint: --resume starts over, and the cut attempt's rows are not kept
    shutil.rmtree(sft / "final")
    shutil.rmtree(sft / "checkpoints")
    r = veriloop("sft", "quickstart", *base, "sft.steps=4", "--resume")
    assert r.returncode == 0 and "SFT done: 4 steps, loss" in r.stdout, r.stderr[-3000:]
    rows = [json.loads(line) for line in (sft / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2, 3, 4]
