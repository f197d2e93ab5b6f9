"""Exact Points24 solver: search every binary expression tree over the numbers with Fractions.

For ``n`` numbers the search repeatedly picks an (unordered) pair, replaces it by ``a+b``,
``a-b``, ``b-a``, ``a·b``, ``a/b`` or ``b/a`` (no division by zero) and recurses; with ``n = 4``
that is at most 6·6 · 3·6 · 1·6 = 3,888 leaves; value multisets already known to fail are
skipped. A hand takes a few milliseconds; results are cached by the sorted numbers and the target. The returned formula uses ``+ - * /`` and only the
parentheses that precedence requires, e.g. ``8/(3-8/3)`` for ``[3, 3, 8, 8]``.
"""

from __future__ import annotations

from collections.abc import Sequence
from fractions import Fraction
from functools import lru_cache
from typing import Any

# An expression node: exact value, text, precedence of its top operator (3 = atom, 2 = * /, 1 = + -).
_Node = tuple[Fraction, str, int]


def _wrap(node: _Node, needs: bool) -> str:
    return f"({node[1]})" if needs else node[1]


def _combine(a: _Node, b: _Node) -> list[_Node]:
    """Every node made by one operator from ``a`` and ``b`` (both orders where it matters)."""
    (va, _, pa), (vb, _, pb) = a, b
    out = [
        (va + vb, f"{a[1]}+{b[1]}", 1),
        (va - vb, f"{a[1]}-{_wrap(b, pb == 1)}", 1),
        (vb - va, f"{b[1]}-{_wrap(a, pa == 1)}", 1),
        (va * vb, f"{_wrap(a, pa == 1)}*{_wrap(b, pb == 1)}", 2),
    ]
    if vb != 0:
        out.append((va / vb, f"{_wrap(a, pa == 1)}/{_wrap(b, pb < 3)}", 2))
    if va != 0:
        out.append((vb / va, f"{_wrap(b, pb == 1)}/{_wrap(a, pa < 3)}", 2))
    return out


def _search(nodes: tuple[_Node, ...], target: Fraction, dead: set[tuple[Fraction, ...]]) -> str | None:
    """Depth-first search; ``dead`` remembers value multisets already known to miss the target."""
    if len(nodes) == 1:
        return nodes[0][1] if nodes[0][0] == target else None
    key = tuple(sorted(n[0] for n in nodes))
    if key in dead:
        return None
    for i in range(len(nodes)):
        for j in range(i + 1, len(nodes)):
            rest = tuple(n for k, n in enumerate(nodes) if k not in (i, j))
            for node in _combine(nodes[i], nodes[j]):
                found = _search((*rest, node), target, dead)
                if found is not None:
                    return found
    dead.add(key)
    return None


@lru_cache(maxsize=8192)
def _solve_sorted(values: tuple[int, ...], target: int) -> str | None:
    nodes = tuple((Fraction(v), str(v), 3) for v in values)
    return _search(nodes, Fraction(target), set())


def solve(values: Sequence[int], target: int = 24) -> str | None:
    """A formula using every number of ``values`` exactly once that equals ``target``, or ``None``."""
    if not values:
        raise ValueError("solve() needs at least one number")
    return _solve_sorted(tuple(sorted(int(v) for v in values)), int(target))


def is_solvable(values: Sequence[int], target: int = 24) -> bool:
    """True when some formula over ``values`` reaches ``target``."""
    return solve(values, target) is not None


def random_formula(values: Sequence[int], rng: Any) -> tuple[Fraction, str]:
    """A random formula over every number of ``values`` once, written as :func:`solve` writes its
    answers (``+ - * /``, only the parentheses precedence requires), and its exact value.

    Built like the search: combine a random pair by a random one of its operations until one node is
    left. ``rng`` is a ``numpy.random.Generator``. For wrong answers that look like right ones."""
    if not values:
        raise ValueError("random_formula() needs at least one number")
    nodes = [(Fraction(v), str(v), 3) for v in values]
    while len(nodes) > 1:
        i, j = (int(k) for k in rng.choice(len(nodes), size=2, replace=False))
        options = _combine(nodes[i], nodes[j])
        node = options[int(rng.integers(len(options)))]
        nodes = [n for k, n in enumerate(nodes) if k not in (i, j)] + [node]
    return nodes[0][0], nodes[0][1]
