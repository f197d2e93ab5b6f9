"""Writing a folder atomically: build it beside its destination, fsync it, rename it into place.

Used for saved policies (``final/``) and small files such as ``metrics.jsonl`` rewritten on
resume. A kill or a full disk at any moment leaves either the old content or the new, never a
truncated mix (the same recipe as checkpoints, see ``veriloop.algos.run.checkpoint``).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(folder: Path) -> None:
    """fsync every file and folder under ``folder``, bottom up."""
    for dirpath, _, files in os.walk(folder, topdown=False):
        for name in files:
            fd = os.open(Path(dirpath) / name, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(Path(dirpath))


@contextlib.contextmanager
def replace_folder(path: Path) -> Iterator[Path]:
    """Yield an empty temporary folder; on success it replaces ``path`` in one rename.

    An old ``path`` is first renamed aside and deleted only after the new one is in place. On any
    error the temporary folder is removed and ``path`` is untouched.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    tag = uuid.uuid4().hex[:8]
    tmp = path.parent / f".tmp-{path.name}-{tag}"
    tmp.mkdir()
    try:
        yield tmp
        fsync_tree(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = path.parent / f".old-{path.name}-{tag}"
    if path.exists():
        os.rename(path, old)
    os.rename(tmp, path)
    fsync_dir(path.parent)
    shutil.rmtree(old, ignore_errors=True)


def write_text_atomic(path: Path, text: str) -> None:
    """Replace a file's content in one rename (a kill leaves the old file or the new one)."""
    tmp = path.with_name(f".tmp-{path.name}-{uuid.uuid4().hex[:8]}")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)
