"""SFT warm-up data: chat examples built by stepping the real environments.

Every example is an actual episode: the user turns are exactly the observations ``env.reset()`` and
``env.step()`` returned, the assistant turns are target responses, and each response was checked by
the environment's own verifier while the example was built. So the warm-up sees the same prompts
RL will see, and a demonstration that does not verify is a bug that raises, never a silent row.

Sources (``SFTConfig.source``):

========== ==================================================================================
solver     :func:`points24_solver_examples`: the exact solver's formula as the requested JSON.
generator  :func:`math_generator_examples`: the generator's step-by-step solution + ``\\boxed{}``.
s2r        :func:`s2r_traces`: solve/verify/correct traces for ``veriloop/SolveVerify-v0``
           (S2R behaviour initialisation: wrong solves are context, not targets).
rejection  :func:`rejection_examples`: the policy's own samples whose final answer verified.
========== ==================================================================================

An :class:`SFTExample` holds ``messages`` (role/content dicts), ``trainable`` (one flag per
assistant message: does its loss count) and ``meta`` (seed, env id, how it was made). Files are
JSONL, one example per line (:func:`save_examples`, :func:`load_examples`).
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np

import veriloop.envs  # noqa: F401  (registers the veriloop/... ids)
from veriloop.algos.sft import s2r_trainable_actions
from veriloop.envs.base import VerifierEnv
from veriloop.envs.math_data import latex
from veriloop.envs.points24.cards import RANK_NAMES
from veriloop.envs.points24.solver import solve
from veriloop.envs.solve_verify import SolveVerifyEnv

ROLES = ("system", "user", "assistant")
S2R_ENV_ID = "veriloop/SolveVerify-v0"
VERIFY_CORRECT = "<verify>correct</verify>"
VERIFY_INCORRECT = "<verify>incorrect</verify>"


class SFTDataError(ValueError):
    """A malformed SFT example (in memory, or in a JSONL file at a given line)."""


@dataclass(frozen=True)
class SFTExample:
    """One chat demonstration.

    Attributes:
        messages: ``{"role": "system"|"user"|"assistant", "content": str}`` in conversation order.
        trainable: One flag per assistant message: True = its tokens are in the SFT loss.
        meta: JSON-ready facts about the example (``source``, ``env_id``, ``seed`` ...).
    """

    messages: tuple[dict[str, str], ...]
    trainable: tuple[bool, ...]
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "messages", tuple(dict(m) for m in self.messages))
        object.__setattr__(self, "trainable", tuple(self.trainable))
        problem = _problem(self.messages, self.trainable, self.meta)
        if problem:
            raise SFTDataError(problem)

    def to_dict(self) -> dict[str, Any]:
        return {
            "messages": [dict(m) for m in self.messages],
            "trainable": list(self.trainable),
            "meta": dict(self.meta),
        }


def _problem(messages: Any, trainable: Any, meta: Any) -> str | None:
    """What is wrong with an example's fields, or None."""
    if not isinstance(messages, (list, tuple)) or not messages:
        return f"'messages' must be a non-empty list of role/content dicts, got {type(messages).__name__}"
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or set(m) != {"role", "content"}:
            return f"message {i} must be a dict with exactly 'role' and 'content', got {m!r:.80}"
        if m["role"] not in ROLES or not isinstance(m["content"], str):
            return f"message {i}: role must be one of {ROLES} and content a str, got {m['role']!r} / {type(m['content']).__name__}"
    n_asst = sum(m["role"] == "assistant" for m in messages)
    if not isinstance(trainable, (list, tuple)) or not all(isinstance(t, bool) for t in trainable):
        return f"'trainable' must be a list of booleans (one per assistant message), got {trainable!r:.80}"
    if len(trainable) != n_asst:
        return f"'trainable' has {len(trainable)} flags but 'messages' has {n_asst} assistant messages"
    if not any(trainable):
        return "no assistant message is trainable: the example would teach nothing"
    if not isinstance(meta, Mapping):
        return f"'meta' must be a dict, got {type(meta).__name__}"
    return None


# ------------------------------------------------------------------------------ JSONL files
def save_examples(path: str | Path, examples: Sequence[SFTExample]) -> Path:
    """Write ``examples`` as JSONL (one ``{"messages", "trainable", "meta"}`` object per line)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for ex in examples:
            f.write(json.dumps(ex.to_dict(), ensure_ascii=False) + "\n")
    return path


def load_examples(path: str | Path) -> list[SFTExample]:
    """Read a JSONL file written by :func:`save_examples`; blank lines are skipped.

    Raises:
        SFTDataError: naming the file, the 1-based line and what is wrong with it.
    """
    path = Path(path)
    out = []
    for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise SFTDataError(f"{path}:{lineno}: not valid JSON ({err.msg} at column {err.colno})") from None
        if not isinstance(row, dict) or not {"messages", "trainable"} <= set(row):
            got = sorted(row) if isinstance(row, dict) else type(row).__name__
            raise SFTDataError(
                f"{path}:{lineno}: expected an object with 'messages' and 'trainable' (and 'meta'), got {got}"
            )
        problem = _problem(row["messages"], row["trainable"], row.get("meta", {}))
        if problem:
            raise SFTDataError(f"{path}:{lineno}: {problem}")
        out.append(SFTExample(tuple(row["messages"]), tuple(row["trainable"]), dict(row.get("meta", {}))))
    return out


# ------------------------------------------------------------------------------ stepping envs
class _Episode:
    """An env episode recorded as chat messages: reset once, then :meth:`act` per response."""

    def __init__(self, env: gym.Env, seed: int) -> None:
        obs, info = env.reset(seed=int(seed))
        self.env, self.task = env, info["task"]
        self.messages: list[dict[str, str]] = [{"role": "user", "content": _text(obs)}]
        self.done = False

    def act(self, response: str) -> dict[str, Any]:
        """Step ``response``; append it and (unless the episode ended) the next observation."""
        if self.done:
            raise RuntimeError(f"episode already over; cannot add response {response!r:.60}")
        obs, _reward, terminated, truncated, info = self.env.step(response)
        self.messages.append({"role": "assistant", "content": response})
        self.done = bool(terminated or truncated)
        if not self.done:
            self.messages.append({"role": "user", "content": _text(obs)})
        return info


def _text(obs: Any) -> str:
    if not isinstance(obs, str):
        raise SFTDataError(
            f"SFT data builders need text observations, got {type(obs).__name__}; use a text env id "
            "(e.g. veriloop/Points24-text-v0, not the vision variant)"
        )
    return obs


def _verified(info: Mapping[str, Any], what: str, env_id: str, seed: int) -> None:
    verdict = info.get("verdict")
    if verdict is None or not verdict.correct:
        reason = getattr(verdict, "reason", None) or info.get("verifier_error")
        raise RuntimeError(
            f"{what} for {env_id} seed {seed} did not verify (reason {reason!r}); this is a bug"
        )


# ------------------------------------------------------------------------------ solver / generator
def points24_response(task: Mapping[str, Any]) -> str:
    """The requested JSON answer for a Points24 ``info["task"]``: card ranks and the solver's formula."""
    formula = solve(task["values"], task["target"])
    if formula is None:
        raise SFTDataError(
            f"hand {task['cards']} cannot reach {task['target']}; build solver examples with solvable_only=True"
        )
    cards = [RANK_NAMES[int(r) - 1] for r in task["ranks"]]
    return json.dumps({"cards": cards, "formula": formula})


def points24_solver_examples(
    env_id: str, env_kwargs: Mapping[str, Any] | None, seeds: Sequence[int]
) -> list[SFTExample]:
    """One verified single-turn example per seed: the env's prompt -> the solver's JSON answer."""
    env = gym.make(env_id, **dict(env_kwargs or {}))
    try:
        out = []
        for seed in seeds:
            ep = _Episode(env, seed)
            _verified(ep.act(points24_response(ep.task)), "solver answer", env_id, seed)
            meta = {"source": "solver", "env_id": env_id, "seed": int(seed), "cards": ep.task["cards"]}
            out.append(SFTExample(tuple(ep.messages[:2]), (True,), meta))
        return out
    finally:
        env.close()


def demonstration_examples(
    env_id: str, env_kwargs: Mapping[str, Any] | None, seeds: Sequence[int]
) -> list[SFTExample]:
    """One verified single-turn example per seed: the env's prompt -> its own
    :meth:`~veriloop.envs.base.VerifierEnv.demonstration` (any env that defines one)."""
    env = gym.make(env_id, **dict(env_kwargs or {}))
    try:
        out = []
        for seed in seeds:
            ep = _Episode(env, seed)
            answer = env.unwrapped.demonstration(env.unwrapped.task)  # type: ignore[attr-defined]
            if answer is None:
                raise SFTDataError(
                    f"{env_id} seed {seed}: demonstration() returned None (no solver for this task)"
                )
            _verified(ep.act(answer), "demonstration", env_id, seed)
            out.append(
                SFTExample(
                    tuple(ep.messages[:2]), (True,), {"source": "solver", "env_id": env_id, "seed": int(seed)}
                )
            )
        return out
    finally:
        env.close()


def math_response(task: Mapping[str, Any], reward_scheme: str = "dapo") -> str:
    """The generator's worked solution (ending in ``\\boxed{answer}``), shaped as the prompt asks."""
    solution = task.get("solution")
    if not solution:
        raise SFTDataError(
            f"math task {task.get('question', '')!r:.60} has no 'solution'; generator examples need "
            "generated problems (data=None) or JSONL rows with a 'solution' field"
        )
    if reward_scheme != "r1":
        return str(solution)
    return f"<think>\n{solution}\n</think>\n<answer>\\boxed{{{task['answer']}}}</answer>"


def math_generator_examples(
    env_id: str, env_kwargs: Mapping[str, Any] | None, seeds: Sequence[int]
) -> list[SFTExample]:
    """One verified single-turn example per seed: the env's prompt -> the generator's solution."""
    env = gym.make(env_id, **dict(env_kwargs or {}))
    try:
        scheme = getattr(env.unwrapped, "reward_scheme", "dapo")
        out = []
        for seed in seeds:
            ep = _Episode(env, seed)
            _verified(ep.act(math_response(ep.task, scheme)), "generator solution", env_id, seed)
            meta = {"source": "generator", "env_id": env_id, "seed": int(seed), "level": ep.task.get("level")}
            out.append(SFTExample(tuple(ep.messages[:2]), (True,), meta))
        return out
    finally:
        env.close()


# ------------------------------------------------------------------------------ S2R traces
def _wrong_math(task: Mapping[str, Any], rng: np.random.Generator, used: set[str]) -> str:
    """A plausible wrong solve: the worked steps, but a final answer off by a small amount."""
    raw = (task.get("meta") or {}).get("value") or task["answer"]
    try:
        gold = Fraction(str(raw))
    except (ValueError, ZeroDivisionError):
        raise SFTDataError(
            f"cannot make a wrong answer near gold {task['answer']!r}: not a plain number"
        ) from None
    steps = str(task.get("solution") or "").splitlines()[:-1]
    for _ in range(100):
        delta = Fraction(
            int(rng.choice([-3, -2, -1, 1, 2, 3])), gold.denominator if rng.random() < 0.5 else 1
        )
        wrong = latex(gold + delta)
        if wrong not in used:
            used.add(wrong)
            return "\n".join([*steps, f"The answer is $\\boxed{{{wrong}}}$."])
    raise RuntimeError(f"no fresh wrong answer near {task['answer']!r} after 100 draws")


_OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


def _wrong_points24(task: Mapping[str, Any], rng: np.random.Generator, used: set[str]) -> str:
    """The right cards in a formula of the wrong value: ``((a op b) op c) op d`` over a shuffled hand."""
    values, target = [int(v) for v in task["values"]], int(task["target"])
    for _ in range(200):
        order = [values[i] for i in rng.permutation(len(values))]
        value, text = Fraction(order[0]), str(order[0])
        for number in order[1:]:
            op = str(rng.choice(list(_OPS)))
            value, text = _OPS[op](value, Fraction(number)), f"({text}{op}{number})"
        formula = text[1:-1] if text.startswith("(") else text
        if value != target and formula not in used:
            used.add(formula)
            cards = [RANK_NAMES[int(r) - 1] for r in task["ranks"]]
            return json.dumps({"cards": cards, "formula": formula})
    raise RuntimeError(f"no fresh wrong formula over {values} after 200 draws")


def s2r_traces(
    task: str,
    seeds: Sequence[int],
    *,
    rng: np.random.Generator,
    p_wrong_first: float,
    env_kwargs: Mapping[str, Any] | None = None,
) -> list[SFTExample]:
    """S2R behaviour-initialisation traces, one per seed, made by stepping ``veriloop/SolveVerify-v0``.

    With probability ``p_wrong_first`` a problem is treated as hard: ``k ~ U{1, max_attempts-1}``
    pairs (wrong solve, ``<verify>incorrect</verify>``) come before (right solve,
    ``<verify>correct</verify>``); otherwise the trace is just the last pair. Wrong solves are
    plausible (math: the worked steps with the gold answer off by ±1..3 or ±1..3/denominator;
    Points24: the dealt cards in a formula of the wrong value). Trainable flags follow
    :func:`~veriloop.algos.sft.s2r_trainable_actions`: wrong solves are masked, everything else trained.

    Args:
        task: ``"math"`` or ``"points24"`` (the ``SolveVerify-v0`` task).
        rng: Draws hardness, attempt counts and wrong answers (the problems come from the seeds).
        env_kwargs: Extra ``SolveVerify-v0`` kwargs (``max_attempts``, ``level`` ...).
    """
    if not 0.0 <= p_wrong_first <= 1.0:
        raise ValueError(f"p_wrong_first must be a probability in [0, 1], got {p_wrong_first}")
    env = gym.make(S2R_ENV_ID, task=task, **dict(env_kwargs or {}))
    inner = env.unwrapped
    assert isinstance(inner, SolveVerifyEnv)
    if p_wrong_first > 0 and inner.max_attempts < 2:
        raise ValueError(
            "hard traces need max_attempts >= 2 (a wrong solve, then a right one); raise it or set p_wrong_first=0"
        )
    try:
        return [_s2r_trace(env, task, int(seed), rng, p_wrong_first, inner.max_attempts) for seed in seeds]
    finally:
        env.close()


def _s2r_trace(
    env: gym.Env, task: str, seed: int, rng: np.random.Generator, p_wrong: float, max_attempts: int
) -> SFTExample:
    ep = _Episode(env, seed)
    n_wrong = int(rng.integers(1, max_attempts)) if rng.random() < p_wrong else 0
    used: set[str] = set()
    right = points24_response(ep.task) if task == "points24" else math_response(ep.task)
    plan = []
    for _ in range(n_wrong):
        wrong = _wrong_points24(ep.task, rng, used) if task == "points24" else _wrong_math(ep.task, rng, used)
        plan += [wrong, VERIFY_INCORRECT]
    plan += [right, VERIFY_CORRECT]
    kinds, correct = [], []
    for response in plan:
        info = ep.act(response)
        kinds.append(info["action_kind"])
        correct.append(info["solve_correct"] if info["action_kind"] == "solve" else None)
    expected = [False, None] * n_wrong + [True, None]
    if kinds != ["solve", "verify"] * (n_wrong + 1) or correct != expected or not ep.done:
        raise RuntimeError(
            f"S2R trace for {task} seed {seed} did not play as planned: kinds {kinds}, correct {correct}"
        )
    meta = {"source": "s2r", "env_id": S2R_ENV_ID, "task": task, "seed": seed, "wrong_attempts": n_wrong}
    return SFTExample(tuple(ep.messages), tuple(s2r_trainable_actions(kinds, correct)), meta)


# ------------------------------------------------------------------------------ rejection sampling
def final_correct(traj: Any) -> bool:
    """Did the episode end with a verified-correct answer? (SolveVerify: its last solve was right.)"""
    if not traj.turns:
        return False
    last = traj.turns[-1]
    if "stats" in last.info:
        return bool(last.info["stats"].get("final_correct")) and bool(traj.terminated)
    return bool((last.verdict or {}).get("correct"))


def _turn_trainable(turn: Any) -> bool:
    """Keep a turn's loss unless it is a wrong answer or an invalid action (S2R masking)."""
    kind = turn.info.get("action_kind")
    if kind == "verify":
        return True
    if kind == "invalid":
        return False
    return bool((turn.verdict or {}).get("correct"))


def rejection_examples(
    policy: Any,
    env_id: str,
    env_kwargs: Mapping[str, Any] | None,
    seeds: Sequence[int],
    *,
    samples: int,
    sampling: Any,
    limits: Any = None,
    backend: Any = None,
    system_prompt: str | None = None,
) -> list[SFTExample]:
    """Rejection-sampled SFT data: ``samples`` episodes per seed, kept when the final answer verified.

    Wrong attempts inside a kept multi-turn episode stay as context but are not trainable (as in
    S2R); ``meta["kept"]`` / ``meta["sampled"]`` on every example record the acceptance rate.
    """
    from veriloop.agents.engine import grouped_specs, rollout

    specs = grouped_specs(env_id, dict(env_kwargs or {}), list(seeds), samples)
    trajs = rollout(
        policy, specs, sampling=sampling, limits=limits, backend=backend, system_prompt=system_prompt
    )
    kept = [t for t in trajs if final_correct(t)]
    out = []
    for t in kept:
        messages = tuple({"role": m["role"], "content": m["content"]} for m in t.messages)
        flags = tuple(_turn_trainable(turn) for turn in t.turns)
        meta = {
            "source": "rejection",
            "env_id": env_id,
            "seed": t.seed,
            "kept": len(kept),
            "sampled": len(trajs),
        }
        out.append(SFTExample(messages, flags, meta))
    return out


# ------------------------------------------------------------------------------ one entry point
SOURCES = ("solver", "generator", "s2r", "rejection")
#: S2R traces: share of problems treated as hard (wrong solves before the right one).
DEFAULT_P_WRONG_FIRST = 0.5


def supported_sources(env_id: str, env_kwargs: Mapping[str, Any] | None = None) -> dict[str, str | None]:
    """Which SFT sources can build demonstrations for an env: ``{source: None}`` when it works,
    else ``{source: why not}``. ``rejection`` works for every env (it keeps the policy's own
    verified-correct episodes); the others need an exact answer the project can write."""
    entry = gym.spec(env_id).entry_point
    name = (
        entry
        if isinstance(entry, str)
        else f"{getattr(entry, '__module__', '')}.{getattr(entry, '__name__', '')}"
    )
    is_p24 = "points24" in name
    is_math = "math_env" in name
    env_cls = entry if isinstance(entry, type) else None
    has_demo = (
        env_cls is not None and getattr(env_cls, "demonstration", None) is not VerifierEnv.demonstration
    )
    return {
        "solver": None
        if is_p24 or has_demo
        else "needs an env that can answer its own tasks: Points24 (the exact 24-game solver), or one "
        "that overrides VerifierEnv.demonstration(task)",
        "generator": None
        if is_math
        else "needs a math env (the problem generator writes the worked solutions)",
        "s2r": None if env_id == S2R_ENV_ID else f"builds solve-verify-correct traces for {S2R_ENV_ID} only",
        "rejection": None,
    }


def check_source(source: str, env_id: str, env_kwargs: Mapping[str, Any] | None = None) -> None:
    """Raise :class:`ConfigError` unless ``source`` can build demonstrations for ``env_id``; the
    message says why and which sources do work for it. Cheap: call it before loading a model."""
    from veriloop.configs.schema import ConfigError

    if source not in SOURCES:
        hint = difflib.get_close_matches(str(source), SOURCES, n=1)
        raise ConfigError(
            f"sft.source: unknown source {source!r}; choose one of {SOURCES}"
            + (f" (did you mean {hint[0]!r}?)" if hint else "")
        )
    table = supported_sources(env_id, env_kwargs)
    if table[source] is not None:
        works = [f"{s!r}" for s, why in table.items() if why is None]
        raise ConfigError(
            f"sft.source={source!r} cannot build demonstrations for {env_id!r}: it {table[source]}. "
            f"Sources that work for this env: {', '.join(works)} ('rejection' keeps the policy's own "
            "verified-correct episodes, so the policy must already solve some)"
        )


def build_examples(
    source: str,
    env_id: str,
    env_kwargs: Mapping[str, Any] | None,
    seeds: Sequence[int],
    *,
    seed: int = 0,
    system_prompt: str | None = None,
    policy: Any = None,
    samples: int = 1,
    sampling: Any = None,
    limits: Any = None,
) -> list[SFTExample]:
    """Demonstrations from ``source`` for the training env (dispatch for ``SFTConfig.source``).

    ``solver`` needs a Points24 text env, ``generator`` a math env, ``s2r`` ``SolveVerify-v0`` (its
    ``task`` kwarg picks the task; ``seed`` seeds hardness and wrong answers), ``rejection`` a
    ``policy``, ``samples`` per seed and ``sampling``. ``system_prompt`` is put first in every
    chat, as the rollout does, so warm-up and RL see the same context.
    """
    kwargs = dict(env_kwargs or {})
    check_source(source, env_id, kwargs)
    if source == "rejection":
        if policy is None or sampling is None:
            raise ValueError("source 'rejection' needs the policy and sampling settings to draw episodes")
        return rejection_examples(
            policy,
            env_id,
            kwargs,
            seeds,
            samples=samples,
            sampling=sampling,
            limits=limits,
            system_prompt=system_prompt,
        )
    if source == "s2r":
        if env_id != S2R_ENV_ID:
            raise ValueError(
                f"source 's2r' builds traces for {S2R_ENV_ID}, but the env is {env_id!r}; use 'solver' or 'generator'"
            )
        task = kwargs.pop("task", "math")
        out = s2r_traces(
            task,
            seeds,
            rng=np.random.default_rng(seed),
            p_wrong_first=DEFAULT_P_WRONG_FIRST,
            env_kwargs=kwargs,
        )
    else:
        entry = gym.spec(env_id).entry_point
        p24 = source == "solver" and isinstance(entry, str) and "points24" in entry
        build = {"solver": demonstration_examples, "generator": math_generator_examples}[source]
        out = (points24_solver_examples if p24 else build)(env_id, kwargs, seeds)
    if system_prompt is None:
        return out
    system = {"role": "system", "content": system_prompt}
    return [SFTExample((system, *ex.messages), ex.trainable, ex.meta) for ex in out]
