"""A user's own environment through the CLI, runs that are never destroyed, errors before slow work.

The user's path and its hardening: each test here failed on the code before them.
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from veriloop.configs.loader import load_config
from veriloop.configs.schema import ConfigError

VERILOOP = [sys.executable, "-m", "veriloop.cli"]

ENV_MODULE = textwrap.dedent(
    """
    import gymnasium
    from veriloop.envs import VerifierEnv
    from veriloop.envs.verifiers import Verdict

    class Echo(VerifierEnv):
        def sample_task(self):
            return {"answer": str(int(self.np_random.integers(10)))}
        def prompt(self, task):
            return f"Say {task['answer']}."
        def check(self, response, task):
            ok = response.strip() == task["answer"]
            return Verdict(correct=ok, reason="correct" if ok else "wrong_value", feedback="ok" if ok else "no")
        def reward(self, verdict, task):
            return (1.0 if verdict.correct else 0.0), {}

    gymnasium.register("userlab/Echo-v0", entry_point=Echo, kwargs={"max_attempts": 1})
    """
)


def cli(*args: str, cwd: Path, env: dict[str, str] | None = None, timeout: float = 120):
    return subprocess.run(
        [*VERILOOP, *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


@pytest.fixture
def user_dir(tmp_path: Path) -> Path:
    (tmp_path / "userlab_envs.py").write_text(ENV_MODULE)
    return tmp_path


def test_unknown_env_id_exits_2_before_any_model_loads_and_writes_nothing(tmp_path: Path) -> None:
    t0 = time.monotonic()
    r = cli(
        "train", "quickstart", "env.id=veriloop/MathVerfy-v0", f"run.out_dir={tmp_path}/runs", cwd=tmp_path
    )
    assert r.returncode == 2, r.stderr[-2000:]
    assert "did you mean 'veriloop/MathVerify-v0'" in r.stderr and "--import" in r.stderr
    assert "Traceback" not in r.stderr
    assert not (tmp_path / "runs").exists()
    assert time.monotonic() - t0 < 60


@pytest.mark.parametrize(
    "how",
    [
        ["--import", "userlab_envs", "env.id=userlab/Echo-v0", "env.kwargs={}"],
        ["env.imports=[userlab_envs]", "env.id=userlab/Echo-v0", "env.kwargs={}"],
        ["env.id=userlab_envs:userlab/Echo-v0", "env.kwargs={}"],
    ],
)
def test_every_way_of_naming_a_users_module_resolves_from_the_working_directory(user_dir: Path, how) -> None:
    """--import / env.imports / module:id, each through the console entry (cwd importable)."""
    code = (
        "import sys; from veriloop.cli.main import _load, parse_args; "
        "from veriloop.envs.plugins import working_dir_importable; working_dir_importable(); "
        "cfg = _load(parse_args(sys.argv[1:])); print(cfg.env.id, cfg.env.imports)"
    )
    r = subprocess.run(
        [sys.executable, "-c", code, "train", "quickstart", *how],
        cwd=user_dir,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "userlab/Echo-v0 ['userlab_envs']"


def test_an_installed_packages_entry_point_registers_its_envs(tmp_path: Path) -> None:
    site = tmp_path / "site"
    (site / "userlab_plugin-1.0.dist-info").mkdir(parents=True)
    (site / "userlab_plugin-1.0.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: userlab-plugin\nVersion: 1.0\n"
    )
    (site / "userlab_plugin-1.0.dist-info" / "entry_points.txt").write_text(
        "[veriloop.envs]\nuserlab = userlab_envs\n"
    )
    (site / "userlab_envs.py").write_text(ENV_MODULE)
    r = cli("envs", cwd=tmp_path, env={"PYTHONPATH": str(site)})
    assert r.returncode == 0, r.stderr
    assert "userlab/Echo-v0" in r.stdout and "userlab" in r.stdout


def test_a_broken_module_is_a_clear_error(user_dir: Path) -> None:
    r = cli("envs", "--import", "no_such_envs", cwd=user_dir)
    assert r.returncode == 2 and "cannot import environment module 'no_such_envs'" in r.stderr


@pytest.mark.parametrize("override", ["train.lr=.nan", "train.lr=1e38", "sft.lr=inf", "algo.clip_high=.nan"])
def test_non_finite_or_absurd_numbers_are_config_errors(override: str) -> None:
    with pytest.raises(ConfigError):
        load_config("quickstart", [override])


def test_malformed_dataset_and_bad_kwargs_fail_before_the_model(tmp_path: Path) -> None:
    (tmp_path / "bad.jsonl").write_text('{"question": "1+1?", "answer": "2"}\nnot json\n')
    r = cli(
        "train", "quickstart", "env.kwargs={data: bad.jsonl}", f"run.out_dir={tmp_path}/runs", cwd=tmp_path
    )
    assert r.returncode == 2 and "bad.jsonl:2" in r.stderr and "Traceback" not in r.stderr
    r = cli("eval", "quickstart", "env.kwargs={no_such_kwarg: 1}", cwd=tmp_path)
    assert r.returncode == 2 and "no_such_kwarg" in r.stderr
    assert not (tmp_path / "runs").exists()


def test_sft_source_that_cannot_work_names_the_ones_that_can(user_dir: Path) -> None:
    r = cli(
        "sft",
        "quickstart",
        "--import",
        "userlab_envs",
        "env.id=userlab/Echo-v0",
        "env.kwargs={}",
        "sft.steps=2",
        "sft.source=generator",
        cwd=user_dir,
    )
    assert r.returncode == 2, r.stderr[-2000:]
    assert "needs a math env" in r.stderr and "'rejection'" in r.stderr


# ------------------------------------------------------------------------------ run folders


def _finished_run(root: Path) -> Path:
    run = root / "v"
    (run / "checkpoints" / "step-000001").mkdir(parents=True)
    (run / "metrics.jsonl").write_text('{"step": 1, "reward/mean": 0.5}\n')
    return run


def test_reusing_a_run_name_never_touches_the_old_run(tmp_path: Path) -> None:
    from veriloop.algos.loop.train import train

    run = _finished_run(tmp_path)
    before = (run / "metrics.jsonl").read_text()
    cfg = load_config("quickstart", ["policy.model=tiny", f"run.out_dir={tmp_path}", "run.name=v"])
    with pytest.raises(ConfigError, match="--resume.*--overwrite"):
        train(cfg, quiet=True)
    assert (run / "metrics.jsonl").read_text() == before
    # the CLI: the same, as exit code 2, also when the new config is itself broken
    r = cli(
        "train",
        "quickstart",
        "run.name=v",
        f"run.out_dir={tmp_path}",
        "env.id=veriloop/MathVerfy-v0",
        cwd=tmp_path,
    )
    assert r.returncode == 2 and (run / "metrics.jsonl").read_text() == before


def test_resume_refuses_a_different_config(tmp_path: Path) -> None:
    from veriloop.algos.run.setup import claim_run_dir

    cfg = load_config("quickstart", ["policy.model=tiny", f"run.out_dir={tmp_path}", "run.name=v"])
    claim_run_dir(tmp_path / "v", cfg, resume=False, overwrite=False)
    (tmp_path / "v" / "metrics.jsonl").write_text("{}\n")
    changed = load_config(
        "quickstart",
        [
            "policy.model=tiny",
            f"run.out_dir={tmp_path}",
            "run.name=v",
            "env.id=veriloop/MathVerifyRetry-v0",
            "train.steps=99",
        ],
    )
    with pytest.raises(ConfigError, match="env.id"):
        claim_run_dir(tmp_path / "v", changed, resume=True, overwrite=False)
    longer = load_config(
        "quickstart", ["policy.model=tiny", f"run.out_dir={tmp_path}", "run.name=v", "train.steps=99"]
    )
    claim_run_dir(tmp_path / "v", longer, resume=True, overwrite=False)  # more steps: allowed
    claim_run_dir(tmp_path / "v", changed, resume=False, overwrite=True)  # asked for: replaced
    assert not (tmp_path / "v" / "metrics.jsonl").exists()


def test_metrics_rewrite_on_resume_survives_a_failed_write(tmp_path: Path, monkeypatch) -> None:
    """A full disk in the middle of the rewrite leaves the old metrics.jsonl whole."""
    import builtins
    import io

    from veriloop.algos.run.log import RunLog

    rows = "".join(json.dumps({"step": s, "x": "y" * 100}) + "\n" for s in range(1, 6))
    (tmp_path / "metrics.jsonl").write_text(rows)
    real_open = builtins.open

    class Full(io.StringIO):
        def write(self, text: str) -> int:
            raise OSError(errno.ENOSPC, "No space left on device")

    def full_disk_open(file, mode="r", *a, **k):  # type: ignore[no-untyped-def]
        if "metrics.jsonl" in str(file) and "w" in mode:
            real_open(file, mode, *a, **k).close()  # the truncation a real open does
            return Full()
        return real_open(file, mode, *a, **k)

    monkeypatch.setattr(builtins, "open", full_disk_open)
    monkeypatch.setattr(io, "open", full_disk_open)
    with pytest.raises(OSError):
        RunLog(tmp_path, tensorboard=False, resume_from_step=3)
    monkeypatch.undo()
    assert (tmp_path / "metrics.jsonl").read_text() == rows


def test_final_policy_is_written_atomically(tmp_path: Path, monkeypatch) -> None:
    """A save that dies half way (full disk) leaves the previous final/ whole and loadable."""
    from veriloop.agents.loading import save_policy
    from veriloop.agents.testing import tiny_policy

    policy = tiny_policy(lora=True)
    final = save_policy(policy, tmp_path / "final")
    before = sorted(p.name for p in final.iterdir())

    def dies(path, *a, **k):  # type: ignore[no-untyped-def]
        Path(path, "adapter_model.safetensors").write_bytes(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(policy.model, "save_pretrained", dies)
    with pytest.raises(OSError):
        save_policy(policy, final)
    assert sorted(p.name for p in final.iterdir()) == before
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]
    monkeypatch.undo()
    from peft import PeftModel

    from veriloop.agents.testing import tiny_policy as fresh

    loaded = PeftModel.from_pretrained(fresh(lora=False).model, final)  # the old adapter, whole
    assert loaded.peft_config


def test_saved_adapter_is_portable_and_has_a_model_card(tmp_path: Path) -> None:
    from veriloop.agents.loading import DEFAULT_MODEL_HUB_ID, portable_base_name, save_policy
    from veriloop.agents.testing import tiny_policy

    policy = tiny_policy(lora=True)
    policy.meta["base_model"] = "default"
    out = save_policy(policy, tmp_path / "final", card="# trained by test\n")
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == DEFAULT_MODEL_HUB_ID
    assert (out / "README.md").read_text() == "# trained by test\n"
    assert portable_base_name("/some/local/model") == "/some/local/model"


def test_demo_agent_labelled_succeeds_does_succeed() -> None:
    import veriloop.envs
    from veriloop.envs.demo import play

    for env_id in veriloop.envs.registered_ids():
        assert play(env_id, 0, True, echo=False) > play(env_id, 1, False, echo=False), env_id
    assert play("veriloop/MathVerify-v0", 0, True, echo=False) > 0


def test_a_run_reads_well_in_a_log_file(tmp_path: Path) -> None:
    """Output to a file: a line per phase, no warnings noise, one summary table naming each
    checkpoint, and a model card in final/ saying what trained it."""
    from tests.test_readme import TINY

    r = cli(
        "quickstart", *TINY, "sft.steps=2", "run.name=q", f"run.out_dir={tmp_path}", cwd=tmp_path, timeout=600
    )
    assert r.returncode == 0, r.stderr[-3000:]
    out = r.stdout
    for phase in (
        "evaluating base model (before SFT)",
        "sft warm-up: ",
        "RL: 1 steps",
        "step    1/1",
    ):
        assert phase in out, f"no {phase!r} line in:\n{out[-3000:]}"
    assert "FutureWarning" not in r.stderr and "is_gradient_checkpointing" not in r.stderr
    summary = (tmp_path / "q" / "summary.md").read_text()
    assert "| base model (before SFT) | id |" in summary and "| start (after SFT) | id |" in summary
    assert "| RL step 1 | id |" in summary
    card = (tmp_path / "q" / "final" / "README.md").read_text()
    assert "2 SFT steps (generator), then 1 RL steps" in card and "RL step 1" in card
