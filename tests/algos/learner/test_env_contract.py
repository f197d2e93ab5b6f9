"""``algos/`` reads environments only through the learner contract (``veriloop.envs.base``).

A grep-style AST check over every module of ``algos/``: no import of a particular environment's
module, no identifier or string (docstrings and comments aside) that names an environment, and no
string equal to an environment's own ``info`` key. A new algorithm that needs something from an
environment adds it to ``LearnerSignal`` (documented in ``envs/base.py``) instead."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ALGOS = Path(__file__).resolve().parents[3] / "algos"
#: What algos may import from envs: the package (registers ids), the contract, the verifiers and
#: the helpers every floor shares (``json_safe``, ``_package_name``: no environment knowledge).
ALLOWED_ENV_MODULES = (
    "veriloop.envs",
    "veriloop.envs.base",
    "veriloop.envs.verifiers",
    "veriloop.envs.json_safe",
    "veriloop.envs._package_name",
    "veriloop.envs.datasets",  # reading data files (JSONL rows): no environment's knowledge
)
#: Lower-case fragments that name an environment (class, module or id).
ENV_NAMES = ("points24", "solveverify", "solve_verify", "mathverify", "math_env", "math_data",
             "reasoninggym", "reasoning_gym", "veriloop/")  # fmt: skip
#: ``info`` keys that one environment documents (SolveVerify, Points24): the contract carries these.
ENV_INFO_KEYS = {"process_reward", "outcome_reward", "action_kind", "action_index", "solve_correct",
                 "verify_says_correct", "verify_matches_truth", "history", "stats", "recognition"}  # fmt: skip


def _docstrings(tree: ast.AST) -> set[int]:
    """ids of string constants that are docstrings or bare string statements (attribute docs)."""
    out = set()
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Expr)
            and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str)
        ):
            out.add(id(node.value))
    return out


def _lookups(tree: ast.AST) -> set[int]:
    """ids of string constants used as a key: ``x["k"]``, ``x.get("k")`` / ``.pop("k")``, ``"k" in x``."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Subscript):
            out.add(id(node.slice))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args:
            if node.func.attr in ("get", "pop", "setdefault"):
                out.add(id(node.args[0]))
        elif isinstance(node, ast.Compare) and any(isinstance(op, ast.In | ast.NotIn) for op in node.ops):
            out.add(id(node.left))
    return out


def violations(source: str) -> list[str]:
    """Every place in ``source`` that names an environment or looks up an env-specific info key."""
    tree = ast.parse(source)
    docs, lookups = _docstrings(tree), _lookups(tree)
    found = []
    for node in ast.walk(tree):
        line = getattr(node, "lineno", 0)
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("veriloop.envs"):
            modules = [node.module or ""]
            if node.module == "veriloop.envs":
                modules = [f"veriloop.envs.{a.name}" for a in node.names if a.name[:1].islower()]
            for mod in modules:
                if not any(mod == ok or mod.startswith(ok + ".") for ok in ALLOWED_ENV_MODULES[1:]):
                    if mod != "veriloop.envs":
                        found.append(f"line {line}: imports {mod}")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("veriloop.envs.") and not alias.name.startswith(
                    ALLOWED_ENV_MODULES[1:]
                ):
                    found.append(f"line {line}: imports {alias.name}")
        names = []
        if isinstance(node, ast.Name):
            names = [node.id]
        elif isinstance(node, ast.Attribute):
            names = [node.attr]
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names = [node.name]
        elif isinstance(node, ast.arg):
            names = [node.arg]
        for name in names:
            if any(env in name.lower() for env in ENV_NAMES):
                found.append(f"line {line}: identifier {name!r} names an environment")
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
            text = node.value
            if text in ENV_INFO_KEYS and id(node) in lookups:
                found.append(f"line {line}: env-specific info key {text!r} (use LearnerSignal)")
            if any(env in text.lower().replace(" ", "") for env in ENV_NAMES):
                found.append(f"line {line}: string {text[:60]!r} names an environment")
    return found


@pytest.mark.parametrize("path", sorted(ALGOS.rglob("*.py")), ids=lambda p: str(p.relative_to(ALGOS)))
def test_algos_read_only_the_contract(path):
    bad = violations(path.read_text())
    assert not bad, f"{path.name} knows an environment:\n" + "\n".join(bad)


def test_the_check_catches_what_it_should():
    assert violations('x = info["process_reward"]\n') and violations('y = turn.info.get("stats")\n')
    assert violations('ok = "recognition" in tr.info\n')
    assert violations("from veriloop.envs.solve_verify import correction_stats\n")
    assert violations('ENV = "veriloop/Points24-text-v0"\n')
    assert violations("def points24_examples(): pass\n")
    assert not violations(
        '"""Points24\'s recognition is an example in a docstring."""\nx = turn.signal.process_reward\n'
    )
    assert not violations("from veriloop.envs.base import LearnerSignal\nimport veriloop.envs\n")
