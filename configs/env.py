"""The ``env`` section: the training environment (or a mixture of them) and the evaluation splits.

Seeds alone do not keep a dataset's rows apart, so a dataset-backed env is split by rows: training
reads ``part: train``, the ``id`` evaluation ``part: heldout`` (:attr:`EnvConfig.resolved_eval_splits`,
:mod:`veriloop.envs.datasets`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from veriloop.configs.errors import ConfigError


@dataclass
class SplitConfig:
    """One evaluation split: an environment id and its constructor arguments.

    Attributes:
        id: Registered environment id; None = the training environment's ``env.id``.
        kwargs: Arguments for ``gymnasium.make``, e.g. ``{face_cards: "11-12-13"}`` for rule OOD.
    """

    id: str | None = None
    kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass
class MixtureEntry:
    """One environment of a training mixture (``env.mixture``).

    Attributes:
        id: Registered environment id (or ``module:id``).
        kwargs: Arguments for ``gymnasium.make``.
        weight: Relative share of each step's problems (> 0); a group never mixes environments.
    """

    id: str = "veriloop/MathVerify-v0"
    kwargs: dict[str, Any] = field(default_factory=dict)
    weight: float = 1.0


@dataclass
class EnvConfig:
    """The training environment and the evaluation splits.

    Attributes:
        id: Registered Gymnasium id of the training environment, e.g. ``veriloop/MathVerify-v0``.
        kwargs: Keyword arguments for ``gymnasium.make`` of the training environment; your own
            dataset is ``data`` (a JSONL / JSON / CSV / Parquet file, a ``save_to_disk`` folder or
            a Hub dataset id) with ``question_key`` / ``answer_key`` / ``answer_extract`` (docs/data.md).
        eval_splits: Named evaluation splits (e.g. ``rule_ood``, ``visual_ood``). The
            in-distribution split ``id`` (training env; held-out seeds, or a dataset's held-out
            rows) is always evaluated; see ``resolved_eval_splits``.
        system_prompt: System message for the policy; None = the environment's own prompt.
        assistant_prefix: Text every model turn starts with, written after the chat template's
            generation prompt, e.g. ``"<think>"`` to prime R1-Zero-style reasoning (as TinyZero and
            Open-Reasoner-Zero do). The model continues it; the environment reads it as the start of
            the response; it is never a training target (loss 0). Rollouts and evaluations use it;
            SFT demonstrations are not rewritten. None = no prefix.
        imports: Modules to import before the environments are made, so that their
            ``gymnasium.register(...)`` calls run (your own environments; the working directory is
            importable). Also ``--import MODULE`` on the command line, or write an id as
            ``module:ns/Name-v0``.
        mixture: Train on several environments in one run: ``{name: {id, kwargs, weight}}``. It
            replaces ``id``/``kwargs``; each step's problems are shared out by weight, every group
            stays within one environment, and each environment is evaluated on its own held-out
            split ``<name>`` (an ``eval_splits`` entry ``<name>.<suffix>``, e.g. ``math.ood``, is
            compared with it in the gap table). Empty = the single environment ``id``.
    """

    id: str = "veriloop/MathVerify-v0"
    kwargs: dict[str, Any] = field(default_factory=dict)
    eval_splits: dict[str, SplitConfig] = field(default_factory=dict)
    system_prompt: str | None = None
    assistant_prefix: str | None = None
    imports: list[str] = field(default_factory=list)
    mixture: dict[str, MixtureEntry] = field(default_factory=dict)

    @property
    def training_envs(self) -> dict[str, SplitConfig]:
        """``{name: (id, kwargs)}`` of the environments training draws from, with their weights
        in :attr:`mixture_weights`; one entry ``id`` without a mixture. A dataset-backed env gets
        ``part: train`` (see :mod:`veriloop.envs.datasets`)."""
        from veriloop.envs.datasets import with_part

        if not self.mixture:
            return {"id": SplitConfig(self.id, with_part(self.id, self.kwargs, "train"))}
        return {
            name: SplitConfig(m.id, with_part(m.id, m.kwargs, "train")) for name, m in self.mixture.items()
        }

    @property
    def mixture_weights(self) -> dict[str, float]:
        return {name: m.weight for name, m in self.mixture.items()} or {"id": 1.0}

    @property
    def resolved_eval_splits(self) -> dict[str, SplitConfig]:
        """Every split with its id filled in: the in-distribution split of each training env
        first (``id``, or one per mixture entry), then ``eval_splits``. A dataset-backed training
        env is evaluated on its held-out rows (``part: heldout``), as is an ``eval_splits`` entry
        that reads the same rows as a training env (``source_key``); one with other ``data`` reads
        all of it."""
        from veriloop.envs.datasets import heldout_kwargs, source_key, with_part

        train = self.training_envs
        try:
            out = {name: SplitConfig(s.id, heldout_kwargs(str(s.id), s.kwargs)) for name, s in train.items()}
        except ValueError as e:
            raise ConfigError(f"env.kwargs.part: {e}") from None
        trained_on = [source_key(str(s.id), s.kwargs) for s in train.values()]
        for name, split in self.eval_splits.items():
            env_id, kwargs = split.id or self.id, dict(split.kwargs)
            if source_key(env_id, kwargs) in trained_on and source_key(env_id, kwargs) is not None:
                kwargs = with_part(env_id, kwargs, "heldout")
            elif "data" in kwargs:
                kwargs = with_part(env_id, kwargs, "all")
            out[name] = SplitConfig(env_id, kwargs)
        return out

    def resolve(self) -> None:
        """Import the modules the environments need and check every id is registered.

        ``module:id`` ids become bare ids with ``module`` added to ``imports`` (so the saved config
        says what to import). Cheap: no model is loaded; call it before anything slow starts.

        Raises:
            ConfigError: an id that is not registered (with "did you mean") or a module that fails
                to import.
        """
        from veriloop.envs.plugins import UnknownEnvError, resolve_env_id, split_module

        modules = [m for m in (split_module(i)[0] for i in self._ids()) if m]
        self.imports = list(dict.fromkeys([*self.imports, *modules]))
        try:
            self.id = resolve_env_id(self.id, self.imports)
            for entry in self.mixture.values():
                entry.id = resolve_env_id(entry.id, self.imports)
            for split in self.eval_splits.values():
                if split.id is not None:
                    split.id = resolve_env_id(split.id)
        except UnknownEnvError as e:
            raise ConfigError(f"env: {e}") from e
        for name, split in self.resolved_eval_splits.items():
            where = f"env.mixture.{name}" if name in self.mixture else f"env.eval_splits.{name}"
            _try_make("env.kwargs" if name == "id" and not self.mixture else where, split)
        for name, split in self.training_envs.items():  # a dataset's training part is made too
            if split.kwargs.get("part") == "train":
                _try_make(f"env.mixture.{name}" if self.mixture else "env.kwargs", split)

    def _ids(self) -> list[str]:
        return [
            self.id,
            *(m.id for m in self.mixture.values()),
            *(s.id for s in self.eval_splits.values() if s.id is not None),
        ]

    def validate(self) -> None:
        if self.assistant_prefix is not None and (
            not isinstance(self.assistant_prefix, str) or not self.assistant_prefix
        ):
            raise ConfigError(
                f"env.assistant_prefix must be a non-empty string or null, got {self.assistant_prefix!r}"
            )
        for name, entry in self.mixture.items():
            if not re.fullmatch(r"[A-Za-z0-9_-]+", name) or name == "id":
                raise ConfigError(f"env.mixture: name {name!r} must match [A-Za-z0-9_-]+ and not be 'id'")
            if not entry.weight > 0:
                raise ConfigError(f"env.mixture.{name}.weight must be > 0, got {entry.weight}")
        clash = sorted(set(self.mixture) & set(self.eval_splits))
        if clash:
            raise ConfigError(
                f"env.eval_splits {clash} share names with env.mixture: each mixture env "
                "already has its held-out split of that name; rename the eval split"
            )
        unnamed = [n for n, sp in self.eval_splits.items() if sp.id is None]
        if self.mixture and unnamed:
            raise ConfigError(
                f"env.eval_splits {unnamed} need an id with env.mixture (which env would they use?)"
            )
        for name in self.eval_splits:
            if not re.fullmatch(r"[A-Za-z0-9_.-]+", name):
                raise ConfigError(
                    f"env.eval_splits: split name {name!r} must match [A-Za-z0-9_.-]+ (used in metric names)"
                )


def _try_make(where: str, split: SplitConfig) -> None:
    """Make (and close) one environment, so bad kwargs or a malformed dataset fail before any model loads."""
    import gymnasium

    try:
        env = gymnasium.make(str(split.id), **split.kwargs)
    except Exception as e:  # anything the env's constructor rejects: its message says what
        from veriloop.envs.plugins import unknown_kwarg_hint

        hint = unknown_kwarg_hint(str(split.id), e)
        bad = re.search(r"unexpected keyword argument '(\w+)'", str(e))
        if hint and bad:  # a misspelt argument: name it and the right ones, not the call's internals
            raise ConfigError(f"{where}: {split.id} has no argument {bad.group(1)!r}.{hint}") from None
        # gymnasium repeats the kwargs after the constructor's own message: one copy is enough
        said = re.sub(r" was raised from the environment creator for .*", "", str(e), flags=re.S)
        raise ConfigError(f"{where}: {split.id} refused its arguments: {type(e).__name__}: {said}") from e
    env.close()
