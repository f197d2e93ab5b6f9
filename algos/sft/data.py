"""SFT warm-up data: chat examples built by stepping the real environments.

Every example is an actual episode: the user turns are exactly the observations ``env.reset()`` and
``env.step()`` returned, the assistant turns are target responses, and each response was checked by
the environment's own verifier while the example was built. So the warm-up sees the same prompts
RL will see, and a demonstration that does not verify is a bug that raises, never a silent row.

Sources (``SFTConfig.source``):

========== ==================================================================================
solver     the env's own ``demonstration(task)`` (e.g. an exact solver's answer)
generator  the same, for envs whose demonstration is the problem generator's worked solution
s2r        the env's ``demonstration_episode(task, rng)``: solve/verify/correct traces (S2R
           behaviour initialisation: wrong solves are context, not targets)
rejection  :func:`rejection_examples`: the policy's own samples whose final answer verified.
========== ==================================================================================

The first three are written by the environment through the learner contract
(:mod:`veriloop.envs.base`) and played by :func:`demonstration_examples`; which one an env serves
is its ``demonstration_source``. Nothing here knows any particular environment.

An :class:`SFTExample` holds ``messages`` (role/content dicts), ``trainable`` (one flag per
assistant message: does its loss count) and ``meta`` (seed, env id, how it was made). Files are
JSONL, one example per line (:func:`save_examples`, :func:`load_examples`).

Vision envs (observations ``{"text", "image"}``): with ``images=True`` the builders keep each
observation's image on the example (``images``, and ``image_messages``: the user message each one
belongs to, shown before its text as the rollout engine does). Such examples live in memory only
(rebuilt from env seeds, never written to JSONL); :mod:`veriloop.algos.sft.vision` tokenises them.
"""

from __future__ import annotations

import difflib
import json
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium.envs.registration import load_env_creator

import veriloop.envs  # noqa: F401  (registers the veriloop/... ids)
from veriloop.configs.schema import SFTSource
from veriloop.envs.base import VerifierEnv, signal_of
from veriloop.envs.datasets import jsonl_rows

ROLES = ("system", "user", "assistant")


class SFTDataError(ValueError):
    """A malformed SFT example (in memory, or in a JSONL file at a given line)."""


@dataclass(frozen=True)
class SFTExample:
    """One chat demonstration.

    Attributes:
        messages: ``{"role": "system"|"user"|"assistant", "content": str}`` in conversation order.
        trainable: One flag per assistant message: True = its tokens are in the SFT loss.
        meta: JSON-ready facts about the example (``source``, ``env_id``, ``seed`` ...).
        images: Observation images (arrays [H, W, 3] uint8), one per image-bearing user message;
            empty for text examples.
        image_messages: For each image, the index in ``messages`` of the user message it belongs
            to (the image comes before that message's text), increasing.
    """

    messages: tuple[dict[str, str], ...]
    trainable: tuple[bool, ...]
    meta: dict[str, Any] = field(default_factory=dict)
    images: tuple[Any, ...] = ()
    image_messages: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "messages", tuple(dict(m) for m in self.messages))
        object.__setattr__(self, "trainable", tuple(self.trainable))
        object.__setattr__(self, "images", tuple(self.images))
        object.__setattr__(self, "image_messages", tuple(int(i) for i in self.image_messages))
        problem = _problem(self.messages, self.trainable, self.meta) or _image_problem(self)
        if problem:
            raise SFTDataError(problem)

    def with_system(self, system_prompt: str) -> SFTExample:
        """The same example with a system message first (image positions shift with it)."""
        system = {"role": "system", "content": system_prompt}
        shifted = tuple(i + 1 for i in self.image_messages)
        return SFTExample((system, *self.messages), self.trainable, self.meta, self.images, shifted)

    def with_assistant_prefix(self, prefix: str) -> SFTExample:
        """The same example with every assistant message starting with ``prefix`` (``env.assistant_prefix``,
        which rollouts write before each turn), where it does not already."""
        messages = tuple(
            {**m, "content": m["content"] if m["content"].startswith(prefix) else prefix + m["content"]}
            if m["role"] == "assistant"
            else m
            for m in self.messages
        )
        return SFTExample(messages, self.trainable, self.meta, self.images, self.image_messages)

    def to_dict(self) -> dict[str, Any]:
        if self.images:
            raise SFTDataError(
                "a vision example holds images, which are not written to JSONL; rebuild vision examples "
                "from env seeds (demonstration_examples(..., images=True)) instead of saving them"
            )
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


def _image_problem(ex: SFTExample) -> str | None:
    """What is wrong with an example's images, or None."""
    if len(ex.images) != len(ex.image_messages):
        return f"{len(ex.images)} images but {len(ex.image_messages)} image_messages (one message index per image)"
    if list(ex.image_messages) != sorted(set(ex.image_messages)):
        return f"image_messages must be increasing message indices, got {ex.image_messages}"
    bad = [i for i in ex.image_messages if not 0 <= i < len(ex.messages) or ex.messages[i]["role"] != "user"]
    if bad:
        return f"image_messages {bad} do not point at user messages (images belong to observations)"
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
    out = []
    try:
        for where, row in jsonl_rows(Path(path)):
            if not {"messages", "trainable"} <= set(row):
                raise SFTDataError(
                    f"{where}: expected an object with 'messages' and 'trainable' (and 'meta'), got {sorted(row)}"
                )
            problem = _problem(row["messages"], row["trainable"], row.get("meta", {}))
            if problem:
                raise SFTDataError(f"{where}: {problem}")
            out.append(SFTExample(tuple(row["messages"]), tuple(row["trainable"]), dict(row.get("meta", {}))))
    except SFTDataError:
        raise
    except ValueError as err:  # the line is not a JSON object
        raise SFTDataError(str(err)) from None
    return out


# ------------------------------------------------------------------------------ stepping envs
class _Episode:
    """An env episode recorded as chat messages: reset once, then :meth:`act` per response.
    With ``images``, a vision observation's image is kept (``images`` / ``image_messages``)."""

    def __init__(self, env: gym.Env, seed: int, images: bool = False) -> None:
        obs, info = env.reset(seed=int(seed))
        self.env, self.task, self.keep_images = env, info["task"], images
        self.images: list[Any] = []
        self.image_messages: list[int] = []
        self.messages: list[dict[str, str]] = []
        self._observe(obs)
        self.done = False

    def _observe(self, obs: Any) -> None:
        if self.keep_images and isinstance(obs, dict) and obs.get("image") is not None:
            self.images.append(obs["image"])
            self.image_messages.append(len(self.messages))
            obs = str(obs["text"])
        self.messages.append({"role": "user", "content": _text(obs)})

    def example(self, trainable: Sequence[bool], meta: dict[str, Any]) -> SFTExample:
        return SFTExample(
            tuple(self.messages), tuple(trainable), meta, tuple(self.images), tuple(self.image_messages)
        )

    def act(self, response: str) -> dict[str, Any]:
        """Step ``response``; append it and (unless the episode ended) the next observation."""
        if self.done:
            raise RuntimeError(f"episode already over; cannot add response {response!r:.60}")
        obs, _reward, terminated, truncated, info = self.env.step(response)
        self.messages.append({"role": "assistant", "content": response})
        self.done = bool(terminated or truncated)
        if not self.done:
            self._observe(obs)
        return info


def _text(obs: Any) -> str:
    if not isinstance(obs, str):
        raise SFTDataError(
            f"SFT data builders need text observations, got {type(obs).__name__}; use the env's text "
            "variant, or pass images=True to keep the images (for a vision-language policy)"
        )
    return obs


# ------------------------------------------------------------------------------ env demonstrations
def demonstration_examples(
    env_id: str,
    env_kwargs: Mapping[str, Any] | None,
    seeds: Sequence[int],
    *,
    rng: np.random.Generator | None = None,
    p_wrong_first: float = 0.0,
    images: bool = False,
) -> list[SFTExample]:
    """One verified example per seed, written by the environment itself: its
    :meth:`~veriloop.envs.base.VerifierEnv.demonstration_episode` (by default the single
    :meth:`~veriloop.envs.base.VerifierEnv.demonstration`), played from ``reset(seed)``.

    Each response must play as the env planned it: a step's ``LearnerSignal.imitate`` equals the
    response's trainable flag, and the episode ends solved (anything else is a bug and raises).
    ``rng`` draws what the env leaves to chance (e.g. wrong first attempts, with probability
    ``p_wrong_first``, in correction traces); ``meta["wrong_attempts"]`` counts untrained responses.
    ``images``: keep vision observations' images on the examples (else a vision env raises).
    """
    if not 0.0 <= p_wrong_first <= 1.0:
        raise ValueError(f"p_wrong_first must be a probability in [0, 1], got {p_wrong_first}")
    rng = rng if rng is not None else np.random.default_rng(0)
    env = gym.make(env_id, **dict(env_kwargs or {}))
    base: Any = env.unwrapped
    source = getattr(base, "demonstration_source", "solver")
    try:
        out = []
        for seed in seeds:
            ep = _Episode(env, seed, images)
            plan = base.demonstration_episode(base.task, rng, p_wrong_first=p_wrong_first)
            if plan is None:
                raise SFTDataError(f"{env_id} seed {seed}: the env has no demonstration for this task")
            for k, (response, trainable) in enumerate(plan):
                info = ep.act(response)
                signal = signal_of(info)
                last = k == len(plan) - 1
                if signal.imitate != trainable or (last and not (ep.done and signal.solved)):
                    verdict = info.get("verdict")
                    reason = getattr(verdict, "reason", None) or info.get("verifier_error")
                    raise RuntimeError(
                        f"demonstration {k} for {env_id} seed {seed} did not play as planned (reason "
                        f"{reason!r}, imitate {signal.imitate}, done {ep.done}); this is a bug"
                    )
            flags = tuple(t for _, t in plan)
            meta = {
                "source": source,
                "env_id": env_id,
                "seed": int(seed),
                "wrong_attempts": flags.count(False),
            }
            out.append(ep.example(flags, meta))
        return out
    finally:
        env.close()


# ------------------------------------------------------------------------------ rejection sampling
def final_correct(traj: Any) -> bool:
    """Did the episode end with its task solved (the last turn's ``LearnerSignal.solved``)?"""
    return bool(traj.turns) and traj.turns[-1].signal.solved


def _turn_trainable(turn: Any) -> bool:
    """Keep a turn's loss when the env calls its response worth imitating (``LearnerSignal.imitate``):
    wrong answers and invalid actions stay as context only."""
    return bool(turn.signal.imitate)


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
    assistant_prefix: str | None = None,
) -> list[SFTExample]:
    """Rejection-sampled SFT data: ``samples`` episodes per seed, kept when the final answer verified.

    Wrong attempts inside a kept multi-turn episode stay as context but are not trainable (as in
    S2R); ``meta["kept"]`` / ``meta["sampled"]`` on every example record the acceptance rate.
    Episodes a vision-language policy played (with image inputs) are replayed from their seed to
    get their images back (:func:`_replayed`).
    """
    from veriloop.agents.engine import grouped_specs, rollout

    specs = grouped_specs(env_id, dict(env_kwargs or {}), list(seeds), samples)
    trajs = rollout(
        policy,
        specs,
        sampling=sampling,
        limits=limits,
        backend=backend,
        system_prompt=system_prompt,
        assistant_prefix=assistant_prefix,
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
        if t.extras:  # a vision episode: the trajectory has pixel values, not the images
            out.append(_replayed(t, env_id, dict(env_kwargs or {}), flags, meta, system_prompt))
        else:
            out.append(SFTExample(messages, flags, meta))
    return out


def _replayed(
    traj: Any,
    env_id: str,
    env_kwargs: dict[str, Any],
    flags: tuple[bool, ...],
    meta: dict[str, Any],
    system_prompt: str | None,
) -> SFTExample:
    """A sampled vision episode as an example with its images: the env is reset with the episode's
    seed and stepped with its responses, which gives back the same observations (images included)."""
    env = gym.make(env_id, **env_kwargs)
    try:
        ep = _Episode(env, traj.seed, images=True)
        for turn in traj.turns:
            ep.act(turn.text)
    finally:
        env.close()
    ex = ep.example(flags, meta)
    return ex.with_system(system_prompt) if system_prompt is not None else ex


# ------------------------------------------------------------------------------ one entry point
SOURCES: tuple[str, ...] = typing.get_args(SFTSource)
#: S2R traces: share of problems treated as hard (wrong solves before the right one).
DEFAULT_P_WRONG_FIRST = 0.5


def _env_class(env_id: str) -> type | None:
    """The class a registered id makes (its entry point, imported), or None for a factory function
    or an entry point whose optional dependency is missing."""
    entry: Any = gym.spec(env_id).entry_point
    if isinstance(entry, str):
        try:
            entry = load_env_creator(entry)
        except Exception:  # noqa: BLE001  (a missing optional dependency: the env cannot serve anything)
            return None
    return entry if isinstance(entry, type) else None


def _serves(cls: type | None) -> str | None:
    """The SFT source an env class writes demonstrations for (its ``demonstration_source``), or None
    when it overrides neither ``demonstration`` nor ``demonstration_episode``."""
    writes = cls is not None and (
        getattr(cls, "demonstration", None) is not VerifierEnv.demonstration
        or getattr(cls, "demonstration_episode", None) is not VerifierEnv.demonstration_episode
    )
    return getattr(cls, "demonstration_source", "solver") if writes else None


#: Why a source cannot work for an env that does not serve it.
_NEEDS = {
    "solver": "needs an env that can answer its own tasks: one that overrides VerifierEnv.demonstration(task) "
    "(e.g. with an exact solver)",
    "generator": "needs a math env, or another whose demonstration(task) is its problem generator's worked "
    "solution (demonstration_source = 'generator')",
    "s2r": "needs an env whose demonstration_episode(task, rng) writes solve-verify-correct traces "
    "(demonstration_source = 's2r')",
}


def supported_sources(env_id: str, env_kwargs: Mapping[str, Any] | None = None) -> dict[str, str | None]:
    """Which SFT sources can build demonstrations for an env: ``{source: None}`` when it works,
    else ``{source: why not}`` (naming the registered envs that do serve it). ``rejection`` works
    for every env (it keeps the policy's own verified-correct episodes); the others need the env to
    write its own demonstrations (the learner contract, ``VerifierEnv.demonstration`` /
    ``demonstration_episode``) for the source its ``demonstration_source`` names."""
    serves = _serves(_env_class(env_id))
    out: dict[str, str | None] = {}
    for source, why in _NEEDS.items():
        if serves == source:
            out[source] = None
            continue
        named = sorted(i for i, spec in gym.registry.items() if spec.namespace)  # not Gymnasium's own
        ids = [i for i in named if _serves(_env_class(i)) == source]
        out[source] = why + (f"; registered envs that do: {', '.join(ids)}" if ids else "")
    return {**out, "rejection": None}


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
    if source != "rejection":
        _check_demonstrations(source, env_id, env_kwargs)


def _check_demonstrations(source: str, env_id: str, env_kwargs: Mapping[str, Any] | None) -> None:
    """The env's own word (``demonstrations_missing()``) on whether its tasks can all be demonstrated,
    e.g. dataset rows without a worked solution: refused here, not minutes into the warm-up."""
    from veriloop.configs.schema import ConfigError

    env = gym.make(env_id, **dict(env_kwargs or {}))
    try:
        missing = getattr(env.unwrapped, "demonstrations_missing", None)
        why = missing() if callable(missing) else None
    finally:
        env.close()
    if why:
        raise ConfigError(f"sft.source={source!r} cannot build demonstrations for {env_id!r}: {why}")


def build_examples(
    source: str,
    env_id: str,
    env_kwargs: Mapping[str, Any] | None,
    seeds: Sequence[int],
    *,
    seed: int = 0,
    system_prompt: str | None = None,
    assistant_prefix: str | None = None,
    policy: Any = None,
    samples: int = 1,
    sampling: Any = None,
    limits: Any = None,
    images: bool = False,
) -> list[SFTExample]:
    """Demonstrations from ``source`` for the training env (dispatch for ``SFTConfig.source``).

    ``solver`` / ``generator`` / ``s2r`` need an env that serves that source (``supported_sources``;
    ``seed`` seeds what its demonstrations leave to chance), ``rejection`` a ``policy``,
    ``samples`` per seed and ``sampling``. ``system_prompt`` is put first in every
    chat, as the rollout does, and ``assistant_prefix`` starts every assistant message (a
    demonstration's, as a target; a rejection-sampled episode already has it), so warm-up and RL see
    the same context. ``images``: keep vision
    observations' images (for a vision-language policy; see :func:`demonstration_examples`).
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
            assistant_prefix=assistant_prefix,
        )
    out = demonstration_examples(
        env_id,
        kwargs,
        seeds,
        rng=np.random.default_rng(seed),
        p_wrong_first=DEFAULT_P_WRONG_FIRST if source == "s2r" else 0.0,
        images=images,
    )
    if assistant_prefix:
        out = [ex.with_assistant_prefix(assistant_prefix) for ex in out]
    if system_prompt is None:
        return out
    return [ex.with_system(system_prompt) for ex in out]
