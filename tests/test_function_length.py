"""No function or method over 60 lines outside benchmarks/.

Counted from the ``def`` line to the last line of its body (docstring included), over every
``.py`` file of the repository. Left out: ``tests/`` and ``benchmarks/`` (and build outputs).
"""

from __future__ import annotations

import ast
from pathlib import Path

MAX_LINES = 60
ROOT = Path(__file__).resolve().parents[1]
SKIPPED_FOLDERS = {"tests", "benchmarks", "build"}  # and hidden folders (.venv, .git...)
EXCLUDED: tuple[str, ...] = ()


def _sources() -> list[Path]:
    files = sorted(ROOT.glob("*.py"))
    for folder in sorted(p for p in ROOT.iterdir() if p.is_dir()):
        if folder.name in SKIPPED_FOLDERS or folder.name.startswith(".") or folder.name.endswith(".egg-info"):
            continue
        files += sorted(folder.rglob("*.py"))
    return files


def _long_functions() -> list[str]:
    found = []
    for path in _sources():
        rel = path.relative_to(ROOT)
        if any(rel.match(pattern) for pattern in EXCLUDED):
            continue
        for node in ast.walk(ast.parse(path.read_text(), filename=str(rel))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                if lines > MAX_LINES:
                    found.append(f"{rel}:{node.lineno} {node.name} ({lines} lines)")
    return found


def test_no_function_over_60_lines():
    long = _long_functions()
    assert not long, f"functions over {MAX_LINES} lines (split them by concept): " + "; ".join(long)


def test_the_check_sees_the_package():
    """The walk really reads the package (a wrong ROOT would pass vacuously)."""
    assert ROOT / "algos" / "learner" / "update.py" in _sources()
    assert not any("tests" in p.relative_to(ROOT).parts[:1] for p in _sources())
    assert ROOT / "agents" / "models" / "vision_build.py" in _sources()
