"""No package code may evaluate text as code: model output is hostile (style guide, "Real or nothing").

Scans every ``.py`` file under the package folders for calls to the builtins ``eval``/``exec``/
``compile`` and to sympy's ``sympify``/``parse_expr``/``lambdify``/``S`` (as a name or an
attribute, through ``getattr(..., "eval")``, or imported under another name). math-verify parses
LaTeX with sympy inside the sandboxed verifier workers, with its LaTeX extraction only (its plain
expression mode goes through ``parse_expr``; tests/envs/test_hostile_inputs.py watches for that at
run time).

Third-party scorers that evaluate text (reasoning-gym's) are the other door: package code calls a
``score_answer`` only on trusted text (the warm-up on a dataset's own gold), and hands it model text
only by reference, to the jail (tests/interop/test_reasoning_gym_isolation.py); at run time no
``score_answer`` runs in the caller's process.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE_DIRS = ("envs", "agents", "algos", "cli", "configs", "interop")
#: ``(file, function)`` where package code may call a third-party ``score_answer``: trusted text only.
SCORE_ANSWER_CALLS = {("interop/reasoning_gym_env.py", "_warm")}
BUILTINS = frozenset({"eval", "exec", "compile"})
SYMPY_EVALUATORS = frozenset({"sympify", "parse_expr", "lambdify"})
NAMES = BUILTINS | SYMPY_EVALUATORS


def forbidden_calls(source: str, filename: str = "<src>") -> list[str]:
    """``"line: name"`` for every forbidden call in ``source``."""
    hits = []
    for node in ast.walk(ast.parse(source, filename=filename)):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in {"sympy", "builtins"}:
            hits += [f"{node.lineno}: import {a.name}" for a in node.names if a.name in NAMES | {"S"}]
            continue
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        if isinstance(func, ast.Name) and func.id == "getattr" and len(node.args) > 1:
            obj, name = node.args[0], node.args[1]
            on_builtins = isinstance(obj, ast.Name) and obj.id in {"builtins", "__builtins__"}
            if isinstance(name, ast.Constant) and (
                name.value in SYMPY_EVALUATORS or (on_builtins and name.value in BUILTINS)
            ):
                hits.append(f"{node.lineno}: getattr {name.value}")
            continue
        if isinstance(func, ast.Attribute) and func.attr == "S":
            if isinstance(func.value, ast.Name) and func.value.id in {"sympy", "sp"}:
                hits.append(f"{node.lineno}: S")
            continue
        if isinstance(func, ast.Name) and func.id in BUILTINS | SYMPY_EVALUATORS:
            hits.append(f"{node.lineno}: {func.id}")
        elif isinstance(func, ast.Attribute):
            via_builtins = isinstance(func.value, ast.Name) and func.value.id in {"builtins", "__builtins__"}
            if func.attr in SYMPY_EVALUATORS or (via_builtins and func.attr in BUILTINS):
                hits.append(f"{node.lineno}: {func.attr}")
    return hits


def _package_files() -> list[Path]:
    return sorted(p for d in PACKAGE_DIRS if (ROOT / d).is_dir() for p in (ROOT / d).rglob("*.py"))


@pytest.mark.parametrize(
    "snippet",
    [
        "eval(x)",
        "exec('1')",
        "compile(s, 'f', 'eval')",
        "sympify(s)",
        "sympy.sympify(s)",
        "from sympy.parsing.sympy_parser import parse_expr\nparse_expr(s)",
        "sp.lambdify(x, e)",
        "builtins.eval(s)",
        "from sympy import sympify as s\ns(x)",
        "from sympy.parsing.sympy_parser import parse_expr as p",
        "sympy.S(s)",
        "getattr(builtins, 'eval')(s)",
        "getattr(__builtins__, 'exec')",
    ],
)
def test_scanner_catches(snippet: str) -> None:
    assert forbidden_calls(snippet)


@pytest.mark.parametrize(
    "snippet",
    [
        "re.compile('a')",
        "ast.parse(s, mode='eval')",
        "model.eval()",
        "x = 'eval(1)'",
        "getattr(m, 'eval')",
        "from sympy import Rational",
        "torch.S",
    ],
)
def test_scanner_allows_lookalikes(snippet: str) -> None:
    assert forbidden_calls(snippet) == []


def test_package_code_never_evaluates_text() -> None:
    files = _package_files()
    assert any(p.parts[-3:-1] == ("envs", "verifiers") for p in files), "scan found no package files"
    offenders = {
        str(p.relative_to(ROOT)): hits
        for p in files
        if (hits := forbidden_calls(p.read_text(encoding="utf-8"), str(p)))
    }
    assert offenders == {}, f"calls that evaluate text as code: {offenders}"


def score_answer_calls(source: str) -> list[tuple[str, int]]:
    """``(enclosing function, line)`` of every ``<x>.score_answer(...)`` call in ``source``."""
    found: list[tuple[str, int]] = []

    def visit(node: ast.AST, function: str) -> None:
        for child in ast.iter_child_nodes(node):
            name = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else function
            if isinstance(child, ast.Call) and isinstance(child.func, ast.Attribute):
                if child.func.attr == "score_answer":
                    found.append((function, child.lineno))
            visit(child, name)

    visit(ast.parse(source), "<module>")
    return found


def test_third_party_scorers_see_model_text_only_in_the_jail() -> None:
    calls = {
        (str(p.relative_to(ROOT)), function, line)
        for p in _package_files()
        for function, line in score_answer_calls(p.read_text(encoding="utf-8"))
    }
    assert calls, "the scan found no score_answer call: has the warm-up moved?"
    assert {(f, fn) for f, fn, _ in calls} <= SCORE_ANSWER_CALLS, calls


def test_no_reasoning_gym_scorer_runs_in_the_callers_process(monkeypatch: pytest.MonkeyPatch) -> None:
    gymnasium = pytest.importorskip("gymnasium")
    rg = pytest.importorskip("reasoning_gym")
    import veriloop.envs  # noqa: F401  (registers the ids)

    calls: list[str] = []
    for name in ("puzzle24", "countdown", "simple_integration"):
        cls = rg.factory.DATASETS[name][0]
        monkeypatch.setattr(cls, "score_answer", lambda self, answer, entry, _n=name: calls.append(_n))
    for name in ("puzzle24", "countdown", "simple_integration"):
        env = gymnasium.make("veriloop/ReasoningGym-v0", dataset=name)
        _, info = env.reset(seed=0)
        env.step(f"<answer>{info['task']['answer']}</answer>")
    assert calls == []
