"""How big a function may grow: at most 40 statements and 12 arguments (ruff's PLR0915 and PLR0913,
configured in ``pyproject.toml``, where the thresholds are justified), over every ``.py`` file of the
repository, tests and benchmarks included. Counted in statements, not lines, so the formatter is free
to lay code out and nothing is packed onto one line to pass.

``make lint`` runs the same rules; this test keeps them in ``make test`` as well.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

ROOT = Path(__file__).resolve().parents[1]
RULES = ("PLR0915", "PLR0913")


def _ruff() -> str:
    found = shutil.which("ruff") or str(Path(sys.executable).with_name("ruff"))
    if not Path(found).exists():
        pytest.skip("ruff is not installed (pip install -e '.[dev]')")
    return found


def _check(*paths: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    cmd = [_ruff(), "check", "--select", ",".join(RULES), "--output-format", "concise", *paths]
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=120)


def test_the_limits_are_configured():
    lint = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["ruff"]["lint"]
    assert set(RULES) <= set(lint["select"])
    assert lint["pylint"] == {"max-statements": 40, "max-args": 12}


def test_no_function_over_the_limits():
    r = _check(".")
    assert r.returncode == 0, f"functions over the size limits (split them by concept):\n{r.stdout}"


def test_the_check_catches_a_long_function(tmp_path):
    """A function of 41 statements and one of 13 arguments are caught under the project's settings
    (a wrong configuration would pass vacuously)."""
    (tmp_path / "pyproject.toml").write_text((ROOT / "pyproject.toml").read_text())
    body = "\n".join(f"    x{i} = {i}" for i in range(41))
    args = ", ".join(f"a{i}" for i in range(13))
    (tmp_path / "big.py").write_text(f"def long():\n{body}\n\n\ndef wide({args}):\n    return a0\n")
    r = _check("big.py", cwd=tmp_path)
    assert "PLR0915" in r.stdout and "PLR0913" in r.stdout, r.stdout + r.stderr
