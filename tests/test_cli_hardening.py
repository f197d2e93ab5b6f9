"""What an operator meets: Ctrl-C, a full disk, a read-only folder, leftovers of a killed save,
resuming with fewer steps, a moved run folder, and where ``veriloop eval`` writes. Each ends in
one clear message (no traceback) or just works."""

from __future__ import annotations

import errno
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from veriloop.algos.loop.train import train
from veriloop.algos.run import checkpoint as ck
from veriloop.algos.run.setup import claim_run_dir
from veriloop.cli.eval import _default_eval_dir, run_folder_of
from veriloop.cli.main import run as cli_run
from veriloop.configs.loader import load_config
from veriloop.configs.schema import ConfigError

EXE = shutil.which("veriloop") or str(Path(sys.executable).with_name("veriloop"))
TINY = [
    "policy.model=tiny",
    "policy.lora=false",
    "env.kwargs={level: 1}",
    "rollout.prompts_per_step=2",
    "rollout.group_size=2",
    "rollout.max_new_tokens=8",
    "rollout.max_context=256",
    "train.steps=1",
    "train.micro_batch_size=2",
    "eval.num_problems=1",
    "eval.n_samples=1",
    "eval.k_list=[1]",
    "eval.greedy=false",
    "eval.every=0",
    "eval.at_start=false",
    "run.tensorboard=false",
    "run.checkpoint_every=1",
    "sft.steps=0",
]


def _sigint_as_in_a_terminal() -> None:
    """SIGINT at its default and not blocked, as in a terminal's foreground job: an ignored or blocked
    SIGINT is inherited through exec, and an earlier test in the same process may have left it so."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def test_ctrl_c_is_one_message_and_keeps_the_checkpoints(tmp_path: Path) -> None:
    """SIGINT to the whole process group (what a terminal's Ctrl-C does) mid-run: exit 130, one
    line, no traceback; the committed checkpoints stay complete."""
    args = [EXE, "train", "quickstart", *TINY, "train.steps=500", f"run.out_dir={tmp_path}", "run.name=r"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        args,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
        preexec_fn=_sigint_as_in_a_terminal,
    )
    ckpts = tmp_path / "r" / "checkpoints"
    end = time.monotonic() + 240
    while not (ckpts / "step-000001" / "COMPLETE").exists():
        assert proc.poll() is None and time.monotonic() < end, proc.communicate()[1][-3000:]
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-3000:]
    assert "Traceback" not in err and "interrupted" in err and "--resume" in err
    assert ck.latest_checkpoint(tmp_path / "r") is not None


@pytest.mark.parametrize(
    ("code", "expected"),
    [(errno.ENOSPC, "No space left on device"), (errno.EROFS, "Read-only file system")],
)
def test_a_refused_write_is_one_message(
    tmp_path: Path, monkeypatch, capsys, code: int, expected: str
) -> None:
    """A full disk or a read-only folder (simulated: tests may run as root, which ignores modes)."""

    def refuse(path: Path, text: str) -> None:
        raise OSError(code, os.strerror(code), str(path))

    monkeypatch.setattr("veriloop.algos.run.setup.write_text_atomic", refuse)
    rc = cli_run(["train", "quickstart", *TINY, f"run.out_dir={tmp_path}", "run.name=r"])
    err = capsys.readouterr().err
    assert rc == 1 and expected in err and "config.yaml" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


def test_a_full_disk_during_a_checkpoint_save_is_reported_and_leaves_nothing(
    tmp_path: Path, monkeypatch
) -> None:
    """torch.save reports a full disk as a RuntimeError; the save turns it into ENOSPC and removes
    its half-written folder."""

    def full(*args: object, **kwargs: object) -> None:
        raise RuntimeError(
            "[enforce fail at inline_container.cc:672] . PytorchStreamWriter failed writing file"
        )

    monkeypatch.setattr(ck, "_torch_save", full)
    monkeypatch.setattr(ck.shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10, 10, 0))  # type: ignore[attr-defined]
    with pytest.raises(OSError, match="no space left on the device while saving step-000001") as err:
        ck.save_checkpoint(tmp_path, 1, model=torch.nn.Linear(2, 2))
    assert err.value.errno == errno.ENOSPC
    assert not any((tmp_path / "checkpoints").iterdir())


def _cfg(tmp_path: Path, *extra: str):  # type: ignore[no-untyped-def]
    return load_config("quickstart", [*TINY, f"run.out_dir={tmp_path}", "run.name=r", *extra])


def test_stale_temporaries_of_a_killed_final_save_are_removed(tmp_path: Path) -> None:
    run = tmp_path / "r"
    claim_run_dir(run, _cfg(tmp_path), resume=False, overwrite=False)
    leftovers = [
        run / ".tmp-final-1a2b3c4d",
        run / "sft" / ".tmp-final-9f8e7d6c",
        run / ".old-final-0a0b0c0d",
    ]
    for p in leftovers:
        p.mkdir(parents=True)
        (p / "model.safetensors").write_bytes(b"x" * 10)
    (run / ".tmp-config.yaml-5e5e5e5e").write_text("half")
    claim_run_dir(run, _cfg(tmp_path), resume=True, overwrite=False)
    assert not any(p.exists() for p in leftovers) and not (run / ".tmp-config.yaml-5e5e5e5e").exists()


def test_resuming_with_fewer_steps_than_the_checkpoint_is_refused(tmp_path: Path) -> None:
    run = tmp_path / "r"
    claim_run_dir(run, _cfg(tmp_path, "train.steps=6"), resume=False, overwrite=False)
    ck.save_checkpoint(run, 6, model=torch.nn.Linear(2, 2))
    saved = (run / "config.yaml").read_text()
    with pytest.raises(ConfigError, match=r"checkpoint at step 6, past train.steps=2.*train.steps >= 6"):
        claim_run_dir(run, _cfg(tmp_path, "train.steps=2"), resume=True, overwrite=False)
    assert (run / "config.yaml").read_text() == saved  # not rewritten


def test_a_moved_run_folder_resumes_where_it_lies(tmp_path: Path) -> None:
    """Train, rename the folder, resume from its config.yaml: the moved folder continues (the
    original place stays empty), and a refused resume names the moved folder's config."""
    train(_cfg(tmp_path / "a"), quiet=True)
    moved = tmp_path / "b" / "renamed"
    moved.parent.mkdir()
    os.rename(tmp_path / "a" / "r", moved)
    cfg = load_config(str(moved / "config.yaml"), ["train.steps=2"])
    assert Path(cfg.run.out_dir) / cfg.run_name == moved.resolve()
    assert train(cfg, resume=True, quiet=True) == moved.resolve()
    assert (moved / "checkpoints" / "step-000002").is_dir() and not (tmp_path / "a" / "r").exists()
    other = load_config(str(moved / "config.yaml"), ["train.steps=3", "train.lr=0.5"])
    with pytest.raises(ConfigError, match=f"veriloop train {moved.resolve() / 'config.yaml'} --resume"):
        claim_run_dir(moved.resolve(), other, resume=True, overwrite=False)


def test_eval_writes_into_the_evaluated_checkpoints_run_folder(tmp_path: Path) -> None:
    run = tmp_path / "elsewhere" / "myrun"
    (run / "final").mkdir(parents=True)
    (run / "checkpoints" / "step-000002").mkdir(parents=True)
    (run / "config.yaml").write_text("{}\n")
    cfg = _cfg(tmp_path)  # its own run folder is tmp_path/r
    assert run_folder_of(run / "final") == run.resolve()
    assert _default_eval_dir(cfg, [str(run / "final")]) == run.resolve() / "eval-cli"
    assert (
        _default_eval_dir(cfg, ["base", str(run / "checkpoints" / "step-000002")])
        == run.resolve() / "eval-cli"
    )
    assert _default_eval_dir(cfg, ["base"]) == tmp_path / "r" / "eval-cli"


def test_eval_of_a_missing_base_model_fails_before_making_any_folder(tmp_path: Path) -> None:
    from veriloop.cli.eval import run_eval_cli

    with pytest.raises(ConfigError, match="policy.model"):
        run_eval_cli("quickstart", ["base"], ["policy.model=/no/such/model", f"run.out_dir={tmp_path}"])
    assert not any(tmp_path.iterdir())


def test_a_full_disk_reported_by_a_foreign_writer_is_one_message_too(
    tmp_path: Path, monkeypatch, capsys
) -> None:
    """safetensors (final/) reports ENOSPC as its own exception type, with the OS text in it."""

    class SafetensorError(Exception):
        pass

    def refuse(path: Path, text: str) -> None:
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr("veriloop.algos.run.setup.write_text_atomic", refuse)
    rc = cli_run(["train", "quickstart", *TINY, f"run.out_dir={tmp_path}", "run.name=r"])
    err = capsys.readouterr().err
    assert rc == 1 and "most likely a full disk" in err and "Free some space" in err and "--resume" in err
    assert len(err.strip().splitlines()) == 1
