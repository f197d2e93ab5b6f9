"""Bringing in users' own environments: modules to import, ``module:id`` ids, entry points.

A user's environment is a ``gymnasium.register(...)`` call in a module of theirs. Every veriloop
command finds it in one of three ways, checked in this order:

1. **Modules named in the config or on the command line**: ``env.imports: [mylab_envs]`` or
   ``--import mylab_envs``. The working directory is importable, as with ``python -m``.
2. **Gymnasium's ``module:id`` form**: ``env.id: mylab_envs:mylab/Capitals-v0`` imports
   ``mylab_envs`` and then uses ``mylab/Capitals-v0``.
3. **An installed package's entry point** in the ``veriloop.envs`` group, as Gymnasium plugins do::

       [project.entry-points."veriloop.envs"]
       mylab = "mylab_envs"              # a module whose import registers the envs
       # or  mylab = "mylab_envs:register"  (a function called with no arguments)

An id that is still not registered is an :class:`UnknownEnvError` whose message offers the closest
registered ids and these three ways. No torch is imported here.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.metadata
import os
import sys
from collections.abc import Iterable
from typing import Any

import gymnasium

#: The entry-point group that installed packages use to register environments.
ENTRY_POINT_GROUP = "veriloop.envs"

HOW_TO_IMPORT = (
    "make the module that calls gymnasium.register(...) importable and name it: "
    "`env.imports: [my_envs]` in the config or `--import my_envs` on the command line, "
    "or write the id as `my_envs:ns/Name-v0`, or install a package with a "
    f"`{ENTRY_POINT_GROUP}` entry point; the working directory is importable"
)

_loaded_entry_points: set[str] = set()


class UnknownEnvError(ValueError):
    """An environment id that is not registered, or a module that could not be imported."""


def working_dir_importable() -> None:
    """Put the working directory first on ``sys.path``, as ``python -m`` does (console scripts don't)."""
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.insert(0, cwd)


def import_modules(modules: Iterable[str]) -> None:
    """Import each named module (its import registers environments).

    Raises:
        UnknownEnvError: naming the module and why it failed to import.
    """
    working_dir_importable()
    for name in modules:
        try:
            importlib.import_module(name)
        except ImportError as e:
            raise UnknownEnvError(
                f"cannot import environment module {name!r} ({type(e).__name__}: {e}); it must be a module "
                f"on the import path: a {name.replace('.', '/')}.py file in the working directory "
                f"({os.getcwd()}), an installed package, or a folder on PYTHONPATH"
            ) from e


def load_entry_points() -> list[str]:
    """Load every installed ``veriloop.envs`` entry point once; returns the names loaded now.

    A module entry point is imported; a callable one is called. A broken plugin is an error that
    names it (never silently skipped, so no environment disappears from the registry).
    """
    loaded = []
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        key = f"{ep.name}={ep.value}"
        if key in _loaded_entry_points:
            continue
        try:
            target = ep.load()
            if callable(target):
                target()
        except Exception as e:
            raise UnknownEnvError(
                f"the installed {ENTRY_POINT_GROUP!r} entry point {ep.name!r} ({ep.value}) failed to load: "
                f"{type(e).__name__}: {e}; fix or uninstall that package"
            ) from e
        _loaded_entry_points.add(key)
        loaded.append(ep.name)
    return loaded


def split_module(env_id: str) -> tuple[str | None, str]:
    """``"mod.sub:ns/Name-v0"`` -> ``("mod.sub", "ns/Name-v0")``; a plain id -> ``(None, id)``."""
    if ":" in env_id:
        module, _, bare = env_id.partition(":")
        return module, bare
    return None, env_id


def resolve_env_id(env_id: str, imports: Iterable[str] = ()) -> str:
    """Import what ``env_id`` needs and return the bare registered id.

    Args:
        env_id: A registered id, or ``module:id``.
        imports: Modules to import first (``env.imports`` / ``--import``).

    Raises:
        UnknownEnvError: the id is not registered after every way above was tried; the message has
            a "did you mean" over the registry and how to import a module.
    """
    import veriloop.envs  # noqa: F401  (the project's own environments)

    module, bare = split_module(env_id)
    import_modules([*imports, *([module] if module else [])])
    if bare not in gymnasium.registry:
        load_entry_points()
    if bare not in gymnasium.registry:
        close = difflib.get_close_matches(bare, list(gymnasium.registry), n=3, cutoff=0.6)
        hint = f"did you mean {' or '.join(repr(c) for c in close)}? " if close else ""
        raise UnknownEnvError(
            f"environment {bare!r} is not registered. {hint}To use your own environment, {HOW_TO_IMPORT}. "
            "`veriloop envs` lists the registered ids."
        )
    return bare


def unknown_kwarg_hint(env_id: str, error: BaseException) -> str:
    """For ``gymnasium.make`` failing on ``unexpected keyword argument 'levle'``: `` Did you mean
    'level'?`` and the arguments the environment takes (from its constructor); else ``""``."""
    import inspect
    import re

    from gymnasium.envs.registration import load_env_creator

    match = re.search(r"unexpected keyword argument '(\w+)'", str(error))
    if match is None:
        return ""
    try:
        entry = gymnasium.spec(env_id).entry_point
        creator: Any = load_env_creator(entry) if isinstance(entry, str) else entry
        names = [
            n
            for cls in inspect.getmro(creator)
            if "__init__" in vars(cls)
            for n, p in inspect.signature(vars(cls)["__init__"]).parameters.items()
            if n != "self" and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)
        ]
    except Exception:  # no signature to read: no hint
        return ""
    names = list(dict.fromkeys(names))
    close = difflib.get_close_matches(match.group(1), names, n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    return f"{hint} {env_id} takes: {', '.join(names)}."
