"""Each folder is importable only as ``veriloop.<folder>`` (pyproject's package-dir)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("folder", ["envs", "agents", "algos", "configs", "cli", "interop"])
def test_a_folder_under_its_bare_name_fails_and_says_how_to_import_it(folder: str) -> None:
    r = subprocess.run([sys.executable, "-c", f"import {folder}"], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode != 0
    assert f"import veriloop.{folder}" in r.stderr and "ImportError" in r.stderr


def test_the_package_names_import() -> None:
    r = subprocess.run(
        [sys.executable, "-c", "import veriloop.algos.learner.update, veriloop.cli"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr
