"""A jailed scorer cannot fill the disk, and what a killed worker leaves behind is swept.

The repro: one jailed answer wrote 1,500 MiB in 5 s (1 MiB files, any number of them), and ~17,700
empty folders made the clean-up overrun the deadline, so the folder stayed in the temp dir for good.
"""

from __future__ import annotations

import concurrent.futures
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from veriloop.envs.verifiers import pool as pool_module
from veriloop.envs.verifiers import sandbox

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the jail uses Linux namespaces")


@pytest.fixture(scope="module")
def root_or_quota() -> None:
    """As root the quota must hold; as another user only where the kernel allows user namespaces."""
    if os.getuid() != 0 and "quota" not in sandbox.isolation():
        pytest.skip("no mount namespace for the jail here: run as root or enable user namespaces")


def _fill(files: int, chunk: int) -> float:
    """Write up to ``files`` files of ``chunk`` bytes in the jail's folder; the bytes that landed."""
    written = 0
    block = b"x" * chunk
    for i in range(files):
        try:
            fd = os.open(f"f{i}", os.O_WRONLY | os.O_CREAT, 0o600)
        except OSError:
            break
        try:
            written += os.write(fd, block)
        except OSError:
            break
        finally:
            os.close(fd)
    return float(written)


def _folders(count: int) -> float:
    made = 0
    for i in range(count):
        try:
            os.mkdir(f"d{i}")
        except OSError:
            break
        made += 1
    return float(made)


def test_a_jail_writes_at_most_its_byte_quota(root_or_quota: None) -> None:
    status, written = sandbox.run_jailed(_fill, (32, sandbox.MAX_FILE_BYTES), 20)
    assert status == "ok"
    assert sandbox.MAX_FILE_BYTES <= written <= sandbox.MAX_JAIL_BYTES  # a scratch file, but not 32 MiB


def test_a_jail_makes_at_most_its_entry_quota(root_or_quota: None) -> None:
    status, made = sandbox.run_jailed(_folders, (3000,), 20)
    assert status == "ok"
    assert 0 < made <= sandbox.MAX_JAIL_ENTRIES


def _folders_then_wait(count: int) -> float:
    made = _folders(count)
    time.sleep(1.5)
    return made


def test_nothing_a_jail_writes_reaches_the_disk_or_outlives_it(
    root_or_quota: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    seen: list[list[Path]] = []
    with concurrent.futures.ThreadPoolExecutor(1) as executor:
        call = executor.submit(sandbox.run_jailed, _folders_then_wait, (30,), 20)
        time.sleep(0.75)  # the jail has made its folders and waits
        seen = [list(folder.iterdir()) for folder in tmp_path.iterdir()]
        assert call.result() == ("ok", 30.0)
    assert seen == [[]]  # its folder, empty on disk: the entries live in the jail's own tmpfs
    assert list(tmp_path.iterdir()) == []


def test_without_the_quota_step_a_jail_may_write_no_byte(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sandbox, "_mount_quota", lambda folder: False)
    assert sandbox.run_jailed(_fill, (4, 1000), 20) == ("ok", 0.0)


def test_a_crowded_folder_is_removed_off_the_clock(tmp_path: Path) -> None:
    folder = tmp_path / "veriloop-jail-crowded"
    for i in range(400):
        (folder / str(i)).mkdir(parents=True)
    start = time.monotonic()
    sandbox._discard(str(folder))
    assert time.monotonic() - start < 0.5  # a detached cleaner does the work
    deadline = time.monotonic() + 30
    while folder.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not folder.exists()


def _dead_pid() -> int:
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


def test_a_scorer_pool_sweeps_the_folders_of_dead_workers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    stale = tmp_path / f"{sandbox.JAIL_PREFIX}{_dead_pid()}-abc"
    (stale / "deep" / "er").mkdir(parents=True)
    (stale / "deep" / "blob").write_bytes(b"x" * 1000)
    live = tmp_path / f"{sandbox.JAIL_PREFIX}{os.getpid()}-abc"  # a running worker's: kept
    other = tmp_path / "veriloop-jail-notapid"  # not ours to judge: kept
    live.mkdir()
    other.mkdir()
    scorers = pool_module.WorkerPool(1, role="scorer")
    try:
        scorers.start()
        deadline = time.monotonic() + 10
        while stale.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        scorers.shutdown()
    assert not stale.exists() and live.is_dir() and other.is_dir()
