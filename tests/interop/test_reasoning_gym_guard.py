"""No model text reaches an ``eval``-based parser in reasoning-gym's scorers, and no hedge is paid.

A jailed scorer cannot be kept from writing its own jail's reply, so code in an answer that a scorer
evaluates could set its own reward. Every ``eval``-family call in reasoning-gym is audited here; the
attack payloads below are shown to work against the raw jailed scorer, then to score 0 through the
scorer worker and the environment.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path
from typing import Any

import pytest

import veriloop.envs  # noqa: F401  (registers the ids)
from veriloop.envs.verifiers import sandbox
from veriloop.envs.verifiers.pool import get_scorer_pool
from veriloop.interop.reasoning_gym_env import SCORER_TASK, ReasoningGymEnv
from veriloop.interop.reasoning_gym_guard import (
    EVAL_DATASETS,
    MATH_DATASETS,
    is_hedge,
    is_math_expression,
)
from veriloop.interop.reasoning_gym_scorers import SAFE_SCORERS

rg = pytest.importorskip("reasoning_gym")

# ------------------------------------------------------------------ every eval-family call, audited

_EVAL_FAMILY = {"eval", "exec", "compile", "parse_expr", "sympify", "parse_latex", "lambdify", "S"}
#: (file, enclosing function, callee) -> why model text never reaches it.
AUDITED = {
    ("algebra/intermediate_integration.py", "score_answer", "parse_expr"): "math grammar",
    ("algebra/polynomial_multiplication.py", "score_answer", "parse_expr"): "math grammar",
    ("algebra/simple_integration.py", "score_answer", "parse_expr"): "math grammar",
    ("algorithmic/binary_matrix.py", "score_answer", "eval"): "literal_eval",
    ("algorithmic/spiral_matrix.py", "score_answer", "eval"): "literal_eval",
    ("algorithmic/string_insertion.py", "score_answer", "eval"): "literal_eval",
    ("games/n_queens.py", "score_answer", "eval"): "literal_eval",
    ("games/countdown.py", "score_answer", "parse_expr"): "our own scorer",
    ("games/puzzle24.py", "score_answer", "parse_expr"): "our own scorer",
    ("algorithmic/number_sorting.py", "score_answer", "eval"): "the gold, not the answer",
    ("arithmetic/basic_arithmetic.py", "eval_floordiv", "eval"): "generator",
    ("arithmetic/bitwise_arithmetic.py", "generate_problem", "eval"): "generator",
    ("arithmetic/bitwise_arithmetic.py", "verify_solution", "eval"): "the problem; the answer goes to int()",
    ("arithmetic/gsm_symbolic/generators_00_49.py", "generate_32", "eval"): "generator",
    ("arithmetic/gsm_symbolic/generators_00_49.py", "generate_example", "eval"): "generator",
    ("arithmetic/gsm_symbolic/generators_50_99.py", "generate_69", "eval"): "generator",
    ("arithmetic/gsm_symbolic/generators_50_99.py", "generate_from_variables", "eval"): "generator",
    ("code/bf.py", "compile_bfit_code_to_bf", "compile"): "a Brainfuck compiler",
    ("code/codeio.py", "_generate_io_pair", "exec"): "generator (the dataset's own programs)",
    ("code/contrib/bfit/BF-it.py", "compile_file", "compile"): "a Brainfuck compiler",
    ("code/contrib/bfit/Compiler/Compiler.py", "compile", "compile"): "a Brainfuck compiler",
    ("code/contrib/bfit/Compiler/Lexical_analyzer.py", "analyze", "compile"): "re.compile",
    ("cognition/rubiks_cube.py", "remove_ansi", "compile"): "re.compile",
    ("logic/propositional_logic.py", "from_string", "parse_expr"): "its own recursive parser",
    ("logic/propositional_logic.py", "parse_expr", "parse_expr"): "its own recursive parser",
}


def _eval_family_calls() -> set[tuple[str, str, str]]:
    root = Path(rg.__file__).parent
    found = set()
    for path in sorted(root.rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        if not any(f"{name}(" in text for name in _EVAL_FAMILY):  # no such call: skip the parse
            continue
        tree = ast.parse(text)
        for function in ast.walk(tree):
            if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(function):
                callee = getattr(node, "func", None)
                name = getattr(callee, "id", None) or getattr(callee, "attr", None)
                if isinstance(node, ast.Call) and name in _EVAL_FAMILY:
                    found.add((path.relative_to(root).as_posix(), function.name, name))
    return found


def test_every_eval_family_call_in_reasoning_gym_is_audited() -> None:
    """A new call (a new reasoning-gym version) fails here until someone audits it."""
    assert _eval_family_calls() == set(AUDITED)
    guarded = {f.split("/")[-1][:-3] for (f, _, _), why in AUDITED.items() if why == "math grammar"}
    literal = {f.split("/")[-1][:-3] for (f, _, _), why in AUDITED.items() if why == "literal_eval"}
    ours = {f.split("/")[-1][:-3] for (f, _, _), why in AUDITED.items() if why == "our own scorer"}
    assert (guarded, literal, ours) == (set(MATH_DATASETS), set(EVAL_DATASETS), set(SAFE_SCORERS))


# ------------------------------------------------------------------ the attack and its variants

_FORGE = "import os; os.write(3, b'[\"ok\", 1.0, []]'); os._exit(0)"  # the jail's reply, then exit
_HEX = _FORGE.encode().hex()
_B = "__import__('builtins')"
PAYLOADS = {
    "hex": f"exec({_B}.bytes.fromhex('{_HEX}'),{{}})",
    "getattr": f"getattr({_B},'exec')(getattr(getattr({_B},'bytes'),'fromhex')('{_HEX}'),{{}})",
    "unicode": f"{_B}.\uff45\uff58\uff45\uff43({_B}.bytes.\uff46\uff52\uff4f\uff4d\uff48\uff45\uff58('{_HEX}'),{{}})",
    "lambda": f"(lambda: exec({_B}.bytes.fromhex('{_HEX}'),{{}}))()",
    "dunder": f"{_B}.__dict__['exec']({_B}.__dict__['bytes'].fromhex('{_HEX}'),{{}})",
}
ATTACKED = sorted(MATH_DATASETS | EVAL_DATASETS)


@pytest.fixture(scope="module")
def full_jail() -> None:
    if sys.platform != "linux" or not {"network", "files"} <= set(sandbox.isolation()):
        pytest.skip("the jail needs Linux with root or user namespaces")


@pytest.mark.parametrize("dataset", ATTACKED)
def test_code_in_an_answer_never_sets_its_own_reward(dataset: str, full_jail: None) -> None:
    env = ReasoningGymEnv(dataset, config={"size": 5}, substring_credit=True)  # hedge screen off
    entry = env._data[0]
    task = env.task_from_options(0)
    for kind, payload in PAYLOADS.items():
        # the attack is real: reasoning-gym's scorer, merely jailed, pays it in full
        assert sandbox.run_jailed(env._data.score_answer, (payload, entry), 30) == ("ok", 1.0), kind
        args = (dataset, env.config_json, 0, task["question"], payload, 10.0)
        assert get_scorer_pool().run(SCORER_TASK, args, 30) == ("ok", ["ok", 0.0]), kind
        verdict = env.check(f"<answer>{payload}</answer>", task)
        assert not verdict.correct and verdict.error is None and verdict.details["score"] == 0.0, kind
        if dataset in MATH_DATASETS:
            assert verdict.reason == "unparseable" and verdict.details["guard"] == "math_grammar"
    # a right answer is still paid, through the same path (or, where reasoning-gym's generator
    # depends on Python's hash seed, as polynomial_multiplication's does for some items, the worker
    # refuses the item as not reproducible: a verifier error, never a wrong score)
    for t in map(env.task_from_options, range(3)):
        verdict = env.check(f"<answer>{t['answer']}</answer>", t)
        assert verdict.details.get("score") == 1.0 or (
            dataset == "polynomial_multiplication" and "not reproducible" in verdict.details["message"]
        ), verdict


def test_a_literal_dataset_keeps_its_partial_credit_for_a_list(full_jail: None) -> None:
    env = ReasoningGymEnv("string_insertion", config={"size": 5}, substring_credit=True)
    task = env.task_from_options(0)
    as_list = repr(list(task["answer"]))  # reasoning-gym pays 0.1 for the answer as a list of letters
    # (a comma the gold does not have: a hedge unless substring_credit=True)
    assert env.check(f"<answer>{as_list}</answer>", task).details["score"] == pytest.approx(0.1)


@pytest.mark.parametrize(
    "text",
    [
        "-5*X**9 - 2*X**6/3 + 4*X**3 + C",
        "-exp(x)*sin(x) + exp(x)*cos(x) + C",
        "3*(2*y - 1)**(3/2)",
        "log(x, 2) + sqrt(x)^2 - 0.5*pi",
        "Abs(x) + atan(x)/oo",
    ],
)
def test_math_grammar_accepts_math(text: str) -> None:
    assert is_math_expression(text)


@pytest.mark.parametrize(
    "text",
    [
        *PAYLOADS.values(),
        "x.real",
        "x.__class__",
        "'x'",
        "x[0]",
        "bytes",
        "lambda: 1",
        "0x1f",
        "\uff58 + 1",
        "x\u00a0+ 1",
        "\u0661 + x",
        "x; y",
        "x or y",
        "x == y",
        "a_b",
        "x\\\ny",
        "",
        "  ",
    ],
)
def test_math_grammar_refuses_everything_else(text: str) -> None:
    assert not is_math_expression(text)


def test_every_math_gold_is_in_the_grammar() -> None:
    """Except reasoning-gym's unevaluated ``Integral(...)`` golds: an answer that only restates the
    integral is not an antiderivative, and scores 0."""
    for name in sorted(MATH_DATASETS):
        data = rg.create_dataset(name, seed=0, size=30)
        golds = [str(data[i]["answer"]) for i in range(len(data))]
        assert [g for g in golds if not is_math_expression(g) and "Integral(" not in g] == [], name


# ------------------------------------------------------------------ hedges, in every dataset

SHAPES = ("{g} or {w}", "{w}, {g}", "{g}\n{w}")
NO_GOLD_SHAPES = ("{g} or {w}", "{g} | {w}", "{g}; {w}")  # no gold: any two candidates
SCREENED = ("hedged", "unparseable")  # a math dataset's grammar may refuse a hedge first


def _substantive(text: Any) -> bool:
    return isinstance(text, str) and any(c.isalnum() for c in text)


def _gold_and_wrong(data: Any) -> tuple[int, Any, str]:
    """The item with the shortest gold that has letters or digits, and another item's different
    answer, the shortest (a hedge of both fits the extractor's answer cap)."""
    golds = [data[i]["answer"] for i in range(min(len(data), 6))]
    usable = [i for i, g in enumerate(golds) if _substantive(g)]
    index = min(usable, key=lambda i: len(golds[i])) if usable else 0
    gold = golds[index]
    others = [g for g in golds if _substantive(g) and g != gold and str(gold) not in g]
    return index, gold, min(others, key=len) if others else "zzz"


def _config(name: str) -> dict[str, Any]:
    fields = {f for f in rg.factory.DATASETS[name][1].__dataclass_fields__}
    return {"size": 6} if "size" in fields else {}


def test_no_dataset_pays_a_hedge() -> None:
    """Every dataset, three hedge shapes of its gold and a wrong answer: each scores 0, "hedged",
    without reaching the scorer (so never above a single wrong answer); the gold is no hedge."""
    paid: list[tuple[Any, ...]] = []
    for name in sorted(rg.factory.DATASETS):
        if name == "composite":  # needs a list of datasets to compose
            continue
        env = ReasoningGymEnv(name, config=_config(name))
        index, gold, wrong = _gold_and_wrong(env._data)
        task = env.task_from_options(index)
        shapes = SHAPES if gold is not None else NO_GOLD_SHAPES
        candidate = str(gold) if gold is not None else "yyy"
        for shape in shapes:
            verdict = env.check(f"<answer>{shape.format(g=candidate, w=wrong)}</answer>", task)
            if verdict.reason not in SCREENED or verdict.details.get("score") != 0.0:
                paid.append((name, shape, verdict.reason, verdict.details.get("score")))
        if gold is not None:
            assert not is_hedge(name, str(gold), gold), name
    assert paid == []


@pytest.mark.parametrize(
    ("answer", "gold", "hedge"),
    [
        ("350.0 -4", "350", True),  # gsm_symbolic reads the first number: this was paid 1.0
        ("350/4", "350", True),
        ("350 dollars", "350", True),
        ("J2 D3", "J2", True),
        ("yes no", "Yes", True),
        ("[350, 0]", "350", True),
        ("1,000", "1000", False),  # a thousands separator is one number
        ("-14282.0", "-14282", False),
        ("$350.00", "350", False),
        ("PEGS, BEGS, BEES", "PEGS,BEGS,BEES", False),
        ("48.0 + 36.0i", "48.0+36.0i", False),
        ("Jacob is a knave, and Victoria is a knight", "Victoria is a knight, and Jacob is a knave", False),
    ],
)
def test_hedge_rules_on_hard_cases(answer: str, gold: str, hedge: bool) -> None:
    assert is_hedge("gsm_symbolic", answer, gold) is hedge


def test_math_datasets_keep_equivalent_expressions() -> None:
    gold = "-5*X**9 + C"
    assert not is_hedge("simple_integration", "C - 5*X**9 + 7", gold)  # another antiderivative
    assert is_hedge("simple_integration", f"{gold} or 0", gold) and is_hedge(
        "simple_integration", f"{gold}\n0", gold
    )
