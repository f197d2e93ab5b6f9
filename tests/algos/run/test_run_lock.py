"""One writer per run folder: a second trainer on a busy run is refused (exit 2, a clear message),
and a ``kill -9``-ed holder never leaves the folder locked."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.test_cli_hardening import TINY  # the one tiny-run override list of the hardening tests
from veriloop.algos.loop.train import train
from veriloop.algos.run.lock import LOCK_FILE, RunBusyError, RunLockFileError, acquire, release, run_lock
from veriloop.algos.run.setup import claim_run_dir
from veriloop.configs.loader import load_config

HOLDER = (
    "import sys, time; from pathlib import Path; from veriloop.algos.run.lock import acquire; "
    "acquire(Path(sys.argv[1])); print('held', flush=True); time.sleep(600)"
)


def _hold(run_dir: Path) -> subprocess.Popen[str]:
    """Another process that holds ``run_dir``'s lock until it is killed."""
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(run_dir)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    return proc


def _kill9(proc: subprocess.Popen[str]) -> None:
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()


def test_a_busy_run_is_refused_and_a_killed_holder_releases_it(tmp_path: Path) -> None:
    run = tmp_path / "run"
    holder = _hold(run)
    try:
        with pytest.raises(RunBusyError, match=rf"in use by another trainer \(pid {holder.pid} on .*since"):
            acquire(run)
    finally:
        _kill9(holder)
    start = time.monotonic()
    fd = acquire(run)  # the kernel dropped the dead holder's lock at once
    assert time.monotonic() - start < 1.0
    assert str(os.getpid()) in (run / LOCK_FILE).read_text()
    release(fd)
    with run_lock(run):  # released: free to take again
        pass


def test_train_and_resume_on_a_busy_run_exit_2_and_change_nothing(tmp_path: Path) -> None:
    """The repro: a --resume (or an SFT warm-up) beside a live trainer of the same run. It stops before any model loads,
    with exit code 2 and one message naming the holder; config.yaml and the metrics are untouched."""
    run = tmp_path / "r"
    run.mkdir()
    (run / "config.yaml").write_text("saved: yes\n")
    (run / "metrics.jsonl").write_text('{"step": 0}\n')
    holder = _hold(run)
    try:
        exe = Path(sys.executable).with_name("veriloop")
        for command, flag in (("train", "--resume"), ("train", "--overwrite"), ("sft", "--resume")):
            args = [str(exe), command, "quickstart", *TINY, f"run.out_dir={tmp_path}", "run.name=r", flag]
            r = subprocess.run(
                [*args, *(["sft.steps=1"] if command == "sft" else [])],
                capture_output=True,
                text=True,
                timeout=120,
            )
            assert r.returncode == 2, r.stderr[-2000:]
            assert "in use by another trainer" in r.stderr and f"pid {holder.pid}" in r.stderr
            assert "Traceback" not in r.stderr
    finally:
        _kill9(holder)
    assert (run / "config.yaml").read_text() == "saved: yes\n"
    assert (run / "metrics.jsonl").read_text() == '{"step": 0}\n'


def test_train_releases_the_lock_when_it_ends(tmp_path: Path) -> None:
    """In one process, a finished (or failed) train gives the folder back: resume right after works."""
    cfg = load_config("quickstart", [*TINY, f"run.out_dir={tmp_path}", "run.name=r"])
    train(cfg, quiet=True)
    with run_lock(tmp_path / "r"):
        pass
    longer = load_config("quickstart", [*TINY, f"run.out_dir={tmp_path}", "run.name=r", "train.steps=2"])
    assert train(longer, resume=True, quiet=True) == tmp_path / "r"


def test_overwrite_keeps_the_lock_file(tmp_path: Path) -> None:
    """--overwrite empties the folder but keeps the lock it holds (deleting it would let a second
    process lock a new file beside it)."""
    cfg = load_config("quickstart", [*TINY, f"run.out_dir={tmp_path}", "run.name=r"])
    run = tmp_path / "r"
    with run_lock(run):
        claim_run_dir(run, cfg, resume=False, overwrite=False)
        (run / "metrics.jsonl").write_text("{}\n")
        inode = (run / LOCK_FILE).stat().st_ino
        claim_run_dir(run, cfg, resume=False, overwrite=True)
        assert (run / LOCK_FILE).stat().st_ino == inode and not (run / "metrics.jsonl").exists()


@pytest.mark.parametrize("kind", ["symlink", "dangling-symlink", "hard-link", "folder", "fifo"])
def test_a_lock_that_is_not_a_regular_file_is_refused_and_its_target_untouched(
    tmp_path: Path, kind: str
) -> None:
    """``.lock`` is truncated and written while held: one pointing elsewhere (a symlink or hard
    link to a file the trainer may write, as root: any file) must not be followed."""
    run, victim = tmp_path / "run", tmp_path / "victim.txt"
    run.mkdir()
    victim.write_text("precious\n")
    lock = run / LOCK_FILE
    if kind == "symlink":
        lock.symlink_to(victim)
    elif kind == "dangling-symlink":
        lock.symlink_to(tmp_path / "created-by-the-lock")
    elif kind == "hard-link":
        os.link(victim, lock)
    elif kind == "folder":
        lock.mkdir()
    else:
        os.mkfifo(lock)
    with pytest.raises(RunLockFileError, match=r"\.lock is .*not the run's lock file; nothing was changed"):
        acquire(run)
    assert victim.read_text() == "precious\n" and not (tmp_path / "created-by-the-lock").exists()


def test_a_lock_folder_is_one_line_exit_2_from_the_cli(tmp_path: Path) -> None:
    (tmp_path / "r" / LOCK_FILE).mkdir(parents=True)
    exe = Path(sys.executable).with_name("veriloop")
    args = [str(exe), "train", "quickstart", *TINY, f"run.out_dir={tmp_path}", "run.name=r"]
    r = subprocess.run(args, capture_output=True, text=True, timeout=120)
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.returncode == 2 and len(lines) == 1, r.stderr[-2000:]
    assert "is a folder, not the run's lock file" in lines[0] and "Remove it" in lines[0]
