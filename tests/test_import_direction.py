"""Every import in the package, read from the source (function-local imports included), keeps the
floors: nothing forms a circle, and no arrow points up.

Floors, lowest first (a module may import its own package and any floor below it)::

    envs  <-  configs  <-  agents  <-  algos, interop  <-  cli

* ``envs`` (environments, verifiers) imports no other veriloop package: a worker task is named as
  a ``"module:function"`` string, never imported from above.
* ``configs`` (settings) reads ``envs`` only: it imports neither ``agents`` nor ``algos``.
* ``algos`` (training) and ``interop`` (other frameworks) sit side by side above ``agents`` and
  import neither each other.
* ``cli`` (commands) is the top floor: nothing imports it.

Inside ``algos`` the rooms keep their own rules (each room's ``__init__`` states it), and the top
level of ``algos`` holds no module of its own:

* the maths room (``algos.maths``) imports no other part of ``algos`` and no model code
  (``veriloop.agents``, ``transformers``, ``peft``, ``vllm``);
* the learner (``algos.learner``: one batch in, metrics out) never imports the loop, evaluation or
  SFT rooms;
* ``algos.run``, ``algos.eval`` and ``algos.sft`` never import the loop, and of the learner only its
  records (``learner.batch``, ``learner.critic``, ``learner.signal``); evaluation and SFT never import
  each other, and ``run`` imports neither;
* the loop (``algos.loop``) may import every other room: nothing imports it but ``veriloop.cli``.

The code that builds the default models (``agents.models``) is reached from the rest of ``agents``
only by function-local imports.

An import inside ``if TYPE_CHECKING:`` is an arrow (it must point down) but runs nothing, so it
cannot close a circle; still, no two modules import each other in any form (type-only or
function-local included): between two modules the arrow points one way.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("envs", "configs", "agents", "algos", "interop", "cli")
FLOOR = {"envs": 0, "configs": 1, "agents": 2, "algos": 3, "interop": 3, "cli": 4}
ALGOS_ROOMS = ("maths", "learner", "loop", "run", "eval", "sft")
#: what the run, evaluation and SFT rooms may take from the learner: its records, not its update
LEARNER_RECORDS = (
    "veriloop.algos.learner.batch",
    "veriloop.algos.learner.critic",
    "veriloop.algos.learner.signal",
)
MODEL_CODE = ("veriloop.agents", "transformers", "peft", "vllm")
#: The old name of ``agents.models.text``, kept for users: it is the module, so it imports it.
ALIASES = {"veriloop.agents.default_model"}


@dataclass(frozen=True)
class Arrow:
    source: str  # the importing module
    target: str  # the imported name, resolved to a module where it is one
    line: int
    runtime: bool  # False inside ``if TYPE_CHECKING:``
    top_level: bool  # a statement of the module itself, not inside a function


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(["veriloop", *parts])


def _resolve(name: str, modules: set[str]) -> str:
    """The longest prefix of ``name`` that is a module of ours, else ``name`` (a third-party one)."""
    parts = name.split(".")
    for i in range(len(parts), 1, -1):
        if ".".join(parts[:i]) in modules:
            return ".".join(parts[:i])
    return name


def _type_checking_lines(tree: ast.AST) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for inner in node.body:
                lines.update(range(inner.lineno, (inner.end_lineno or inner.lineno) + 1))
    return lines


def arrows_of(source: str, module: str, modules: set[str], is_package: bool = False) -> list[Arrow]:
    """Every import statement in ``source`` (the text of ``module``), resolved against ``modules``."""
    tree = ast.parse(source)
    typing_only = _type_checking_lines(tree)
    top = {id(n) for n in tree.body} | {
        id(n) for s in tree.body if isinstance(s, ast.If | ast.Try) for n in ast.walk(s)
    }
    package = module if is_package else module.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from package (level 1) or above it
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}".rstrip(".")
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        for name in dict.fromkeys(names):
            target = _resolve(name, modules)
            if target != module:
                found.append(
                    Arrow(module, target, node.lineno, node.lineno not in typing_only, id(node) in top)
                )
    return found


def package_arrows(root: Path = ROOT) -> list[Arrow]:
    files = {module_name(p, root): p for d in PACKAGES for p in (root / d).rglob("*.py")}
    modules = set(files)
    return [
        a
        for m, p in sorted(files.items())
        for a in arrows_of(p.read_text(), m, modules, p.name == "__init__.py")
    ]


def circles(arrows: list[Arrow]) -> list[list[str]]:
    """The import circles (strongly connected groups of two or more modules) among runtime arrows."""
    graph: dict[str, set[str]] = {}
    for a in arrows:
        if a.runtime and a.target.startswith("veriloop."):
            graph.setdefault(a.source, set()).add(a.target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's algorithm
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def mutual(arrows: list[Arrow]) -> list[tuple[str, str]]:
    """Pairs of our modules that import each other, counting every arrow (type-only and
    function-local ones too)."""
    pairs = {(a.source, a.target) for a in arrows if a.target.startswith("veriloop.")}
    return sorted({(min(p), max(p)) for p in pairs if (p[1], p[0]) in pairs})


def _package(module: str) -> str:
    return module.split(".")[1]


def _room(module: str) -> str:
    """``algos.maths`` / ``algos.run`` / ``algos.eval`` / ``algos.sft``, or ``algos`` (the top level)."""
    parts = module.split(".")
    return f"algos.{parts[2]}" if len(parts) > 2 and parts[2] in ALGOS_ROOMS else "algos"


def upward(arrows: list[Arrow]) -> list[str]:
    """Arrows from a package to one on its own floor or above (its own package excepted)."""
    bad = []
    for a in arrows:
        if not a.target.startswith("veriloop.") or a.source in ALIASES:
            continue
        src, dst = _package(a.source), _package(a.target)
        if src != dst and FLOOR[dst] >= FLOOR[src]:
            bad.append(
                f"{a.source}:{a.line} imports {a.target} ({src} is on floor {FLOOR[src]}, {dst} on {FLOOR[dst]})"
            )
    return bad


def room_breaches(arrows: list[Arrow]) -> list[str]:
    """Arrows against the rooms' rules (see the module docstring)."""
    bad = []
    for a in arrows:
        src_room = _room(a.source) if _package(a.source) == "algos" else None
        here = f"{a.source}:{a.line} imports {a.target}"
        if src_room == "algos.maths":
            if a.target.startswith(MODEL_CODE):
                bad.append(f"{here}: the maths room imports no model code")
            elif a.target.startswith("veriloop.algos.") and _room(a.target) != "algos.maths":
                bad.append(f"{here}: the maths room imports nothing else of algos")
        elif src_room == "algos.learner" and _room(a.target) in ("algos.loop", "algos.eval", "algos.sft"):
            bad.append(f"{here}: the learner never imports the loop, evaluation or SFT rooms")
        elif src_room in ("algos.run", "algos.eval", "algos.sft") and a.target.startswith("veriloop.algos."):
            dst_room = _room(a.target)
            if dst_room == "algos.loop" or (dst_room == "algos.learner" and a.target not in LEARNER_RECORDS):
                bad.append(f"{here}: {src_room} never imports the RL loop or the learner's update")
            elif {src_room, dst_room} == {"algos.eval", "algos.sft"} or (
                src_room == "algos.run" and dst_room in ("algos.eval", "algos.sft")
            ):
                bad.append(f"{here}: {src_room} and {dst_room} are separate rooms")
        elif src_room != "algos.loop" and _room(a.target) == "algos.loop" and _package(a.source) != "cli":
            bad.append(f"{here}: only the command line imports the loop")
        if (
            _package(a.source) == "agents"
            and not a.source.startswith("veriloop.agents.models")
            and a.target.startswith("veriloop.agents.models")
            and a.top_level
            and a.source not in ALIASES
        ):
            bad.append(
                f"{here}: the model builders are imported where a default model is asked for, not at import"
            )
    return bad


# ------------------------------------------------------------------------------------------ tests


def test_no_import_circle():
    found = circles(package_arrows())
    assert not found, "import circles (break each by moving the shared part down a floor): " + "; ".join(
        " <-> ".join(c) for c in found
    )


def test_no_two_modules_import_each_other():
    found = mutual(package_arrows())
    assert not found, "modules importing each other (move what one needs from the other): " + "; ".join(
        " <-> ".join(p) for p in found
    )


def test_a_type_only_import_back_counts_as_a_pair():
    arrows = [
        Arrow("veriloop.algos.run.a", "veriloop.algos.run.b", 1, True, False),
        Arrow("veriloop.algos.run.b", "veriloop.algos.run.a", 1, False, True),
    ]
    assert mutual(arrows) == [("veriloop.algos.run.a", "veriloop.algos.run.b")]
    assert not circles(arrows)  # the circle check alone lets this pair through


def test_no_arrow_points_up():
    bad = upward(package_arrows())
    assert not bad, (
        "imports against the floors envs <- configs <- agents <- algos, interop <- cli:\n" + "\n".join(bad)
    )


def test_the_rooms_of_algos_keep_their_import_rules():
    bad = room_breaches(package_arrows())
    assert not bad, "\n".join(bad)


def test_the_top_level_of_algos_holds_only_rooms():
    modules = sorted(p.name for p in (ROOT / "algos").glob("*.py") if p.name != "__init__.py")
    assert not modules, f"algos/ keeps its code in rooms ({', '.join(ALGOS_ROOMS)}); move {modules} into one"


def test_every_room_states_its_import_rule():
    for room in (*(ROOT / "algos" / r for r in ALGOS_ROOMS), ROOT / "agents" / "models"):
        doc = ast.get_docstring(ast.parse((room / "__init__.py").read_text())) or ""
        assert "Import rule" in doc, f"{room}/__init__.py states no import rule"


def test_the_reader_sees_local_relative_and_typing_only_imports():
    source = (
        "from typing import TYPE_CHECKING\n"
        "import veriloop.agents.engine\n"
        "from . import sibling\n"
        "if TYPE_CHECKING:\n    from veriloop.algos.loop.train import RunParts\n"
        "def f():\n    from veriloop.interop.trl_env import make\n"
    )
    modules = {
        "veriloop.envs.x",
        "veriloop.envs.sibling",
        "veriloop.agents.engine",
        "veriloop.algos.loop.train",
        "veriloop.interop.trl_env",
    }
    got = {(a.target, a.runtime, a.top_level) for a in arrows_of(source, "veriloop.envs.x", modules)}
    assert got >= {
        ("veriloop.agents.engine", True, True),
        ("veriloop.envs.sibling", True, True),
        ("veriloop.algos.loop.train", False, True),
        ("veriloop.interop.trl_env", True, False),
    }


def test_the_checks_catch_a_bad_import():
    """A circle, an upward arrow (also a function-local one), a maths room importing a model, the learner
    importing the loop and the run room importing the learner's update."""
    a = [
        Arrow("veriloop.agents.engine", "veriloop.agents.episode_log", 1, True, True),
        Arrow("veriloop.agents.episode_log", "veriloop.agents.engine", 9, True, False),
    ]
    assert circles(a) == [["veriloop.agents.engine", "veriloop.agents.episode_log"]]
    assert (
        circles([a[0], Arrow("veriloop.agents.episode_log", "veriloop.agents.engine", 9, False, True)]) == []
    )
    up = [
        Arrow("veriloop.envs.verifiers._worker", "veriloop.interop.reasoning_gym_env", 89, True, False),
        Arrow("veriloop.configs.schema", "veriloop.agents.policy", 3, True, True),
        Arrow("veriloop.algos.loop.train", "veriloop.interop.trl_env", 3, True, True),
        Arrow("veriloop.agents.engine", "veriloop.cli.main", 3, True, True),
    ]
    assert len(upward(up)) == 4
    assert upward([Arrow("veriloop.cli.main", "veriloop.algos.loop.train", 1, True, True)]) == []
    rooms = [
        Arrow("veriloop.algos.maths.losses", "transformers", 1, True, True),
        Arrow("veriloop.algos.maths.losses", "veriloop.algos.learner.batch", 1, True, False),
        Arrow("veriloop.algos.eval.loop", "veriloop.algos.loop.train", 1, True, False),
        Arrow("veriloop.algos.sft.train", "veriloop.algos.eval.loop", 1, True, True),
        Arrow("veriloop.agents.loading", "veriloop.agents.models.text", 1, True, True),
        Arrow("veriloop.algos.learner.update", "veriloop.algos.loop.sampling", 1, True, False),
        Arrow("veriloop.algos.run.fsdp", "veriloop.algos.learner.update", 1, True, True),
    ]
    assert len(room_breaches(rooms)) == 7
    assert (
        room_breaches(
            [
                Arrow("veriloop.algos.run.fsdp", "veriloop.algos.learner.batch", 1, True, True),
                Arrow("veriloop.algos.loop.train", "veriloop.algos.learner.update", 1, True, True),
            ]
        )
        == []
    )
    assert (
        room_breaches([Arrow("veriloop.agents.loading", "veriloop.agents.models.text", 1, True, False)]) == []
    )
