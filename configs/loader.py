"""Load an :class:`ExperimentConfig` from YAML and ``key=value`` overrides, with errors that teach.

Order of precedence (later wins): field defaults < algorithm preset (``algo: {preset: dapo}`` or
``run.algo_preset``) < keys in the YAML file < command-line overrides such as
``algo.clip_high=0.3 rollout.group_size=8`` (values parsed as YAML, so ``8``, ``0.3``, ``true``
and ``[1, 4, 8]`` have their natural types).

Every problem is reported with where it came from (``file.yaml:12`` or the override text):
unknown keys with the closest valid keys, wrong types with the expected type, ``Literal``
violations with the choices, and cross-field conflicts with a fix (see
:meth:`ExperimentConfig.validate`). :func:`dump_config` gives the fully resolved config that each
run saves; loading it back gives an equal config.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.resources
import re
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import yaml

from veriloop.configs.algo import AlgoConfig
from veriloop.configs.describe import _plain, describe, type_name
from veriloop.configs.errors import ConfigError
from veriloop.configs.presets import load_preset
from veriloop.configs.schema import ExperimentConfig

_Key = tuple[str, ...]
_NUMBER = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?")


@dataclasses.dataclass
class _Context:
    """Where each raw key came from, and the errors found so far."""

    sources: dict[_Key, str] = dataclasses.field(default_factory=dict)
    errors: list[str] = dataclasses.field(default_factory=list)

    def where(self, key: _Key) -> str:
        for n in range(len(key), -1, -1):  # the key itself, else its closest parent
            if key[:n] in self.sources:
                return self.sources[key[:n]]
        return "defaults"

    def error(self, key: _Key, message: str) -> None:
        self.errors.append(f"{self.where(key)}: {'.'.join(key)}: {message}")


# ---------------------------------------------------------------------------------- public API


def load_config(path: str | Path | None = None, overrides: Sequence[str] = ()) -> ExperimentConfig:
    """Build and validate an experiment config.

    Args:
        path: A YAML file, or the name of a shipped experiment (``points24_grpo``); None = defaults.
        overrides: ``dotted.key=value`` strings applied after the file.

    Raises:
        ConfigError: listing every problem found, each with its location and a fix.
    """
    ctx = _Context()
    raw: dict[str, Any] = {}
    if path is not None:
        file = _resolve_path(path)
        raw = _read_yaml(file, ctx)
        _locate_run(raw, file, ctx)
    for text in overrides:
        _apply_override(raw, text, ctx)
    return config_from_dict(raw, ctx)


def config_from_dict(raw: Mapping[str, Any], ctx: _Context | None = None) -> ExperimentConfig:
    """Build and validate an experiment config from nested plain data (e.g. a dumped config)."""
    ctx = ctx or _Context()
    raw = dict(raw)
    algo_raw = raw.get("algo", {})
    if isinstance(algo_raw, Mapping):
        raw["algo"] = _with_preset(dict(algo_raw), raw, ctx)
    cfg = _build(ExperimentConfig, raw, (), ctx)
    if ctx.errors:
        raise ConfigError(_summary(ctx.errors))
    assert isinstance(cfg, ExperimentConfig)
    _async_correction(cfg, algo_raw)  # what was written, before the preset
    cfg.validate()
    return cfg


def _async_correction(cfg: ExperimentConfig, algo_raw: Any) -> None:
    """``train.max_staleness > 0`` trains on samples of older policies: where nothing corrects that gap
    and ``algo.rollout_is`` was not set, it is decoupled PPO with truncated IS (clip against the trainer's
    own pi_prox, weigh by min(pi_prox / mu, C)), as the asynchronous trainers default to. An explicit
    ``algo.rollout_is=none`` is left as written (and refused by the staleness check)."""
    explicit = isinstance(algo_raw, Mapping) and "rollout_is" in algo_raw
    frozen = cfg.algo.frozen_sampler  # refused with asynchrony by the config check, as written
    if cfg.train.max_staleness > 0 and not cfg.algo.needs_sampler_logprobs and not explicit and not frozen:
        cfg.algo = dataclasses.replace(cfg.algo, rollout_is="truncate")


def dump_config(cfg: ExperimentConfig) -> dict[str, Any]:
    """The fully resolved config as plain data (every field, presets already applied)."""
    return _plain(cfg)


def config_to_yaml(cfg: ExperimentConfig) -> str:
    """:func:`dump_config` as YAML, in field order (what each run saves as ``config.yaml``)."""
    return yaml.safe_dump(dump_config(cfg), sort_keys=False, allow_unicode=True)


def shipped_experiments() -> list[str]:
    """Names of the experiment configs shipped in ``veriloop/configs/experiments``."""
    folder = importlib.resources.files("veriloop.configs") / "experiments"
    return sorted(p.name[:-5] for p in folder.iterdir() if p.name.endswith(".yaml"))


# ------------------------------------------------------------------------------------ reading


def _resolve_path(path: str | Path) -> Path:
    file = Path(path)
    if file.is_file():
        return file
    name = str(path)
    if "/" not in name and not name.endswith((".yaml", ".yml")):
        shipped = importlib.resources.files("veriloop.configs") / "experiments" / f"{name}.yaml"
        if shipped.is_file():
            return Path(str(shipped))
    names = shipped_experiments()
    close = difflib.get_close_matches(Path(name).stem, names, n=3)
    hint = f" Did you mean {', '.join(close)}?" if close else ""
    raise ConfigError(f"config file {name!r} not found.{hint} Shipped experiments: {', '.join(names)}")


#: Limits on what a config may hold: a real one is a few hundred values, a few levels deep, a few
#: kB. They refuse alias bombs (a few anchors expanding to billions of values) and deep nesting
#: (``[[[[...``, which PyYAML's composer would recurse into) before PyYAML builds anything.
MAX_CONFIG_BYTES = 1_000_000
MAX_VALUES = 100_000
MAX_DEPTH = 64


def _check_yaml_shape(text: str, where: str) -> None:
    """Refuse YAML that is too large, nested too deeply or expands (through aliases) to too many
    values. Works on PyYAML's event stream, which needs no recursion and expands nothing."""
    if len(text) > MAX_CONFIG_BYTES:
        raise ConfigError(f"{where}: {len(text)} characters; a config holds at most {MAX_CONFIG_BYTES}")
    sizes: dict[str, int] = {}  # anchor -> number of values its node expands to
    stack: list[tuple[str | None, int]] = []  # open collections: (anchor, values so far)
    total = 0
    for event in yaml.parse(text, Loader=yaml.SafeLoader):
        if isinstance(event, yaml.CollectionStartEvent):
            stack.append((event.anchor, 1))
            if len(stack) > MAX_DEPTH:
                raise ConfigError(f"{where}: nested more than {MAX_DEPTH} levels deep; a config needs a few")
            continue
        if isinstance(event, yaml.CollectionEndEvent):
            anchor, count = stack.pop()
        elif isinstance(event, yaml.AliasEvent):
            anchor, count = None, sizes.get(str(event.anchor), 1)
        elif isinstance(event, yaml.ScalarEvent):
            anchor, count = event.anchor, 1
        else:
            continue
        if anchor is not None:
            sizes[anchor] = count
        if stack:
            stack[-1] = (stack[-1][0], stack[-1][1] + count)
        else:
            total += count
        if total + sum(c for _, c in stack) > MAX_VALUES:
            raise ConfigError(
                f"{where}: expands to more than {MAX_VALUES} values (YAML aliases such as *name repeat "
                "their anchor's content); a config holds a few hundred: write the values out"
            )


def _read_yaml(file: Path, ctx: _Context) -> dict[str, Any]:
    text = file.read_text()
    try:
        _check_yaml_shape(text, str(file))
        node = yaml.compose(text)
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"{file}: not valid YAML: {_shorten(str(e), 600)}") from e
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"{file}: the top level must be a mapping of sections (env:, rollout:, ...), got {type(data).__name__}"
        )
    if node is not None:
        _record_marks(node, (), str(file), ctx)
    if ctx.errors:
        raise ConfigError(_summary(ctx.errors))
    return data


#: What marks a folder as a run (what ``train`` writes beside the ``config.yaml`` it saves).
_RUN_MARKS = ("checkpoints", "metrics.jsonl", "final", "sft")


def _locate_run(raw: dict[str, Any], file: Path, ctx: _Context) -> None:
    """A run's own ``config.yaml`` names the folder it lies in: a run folder that was moved,
    renamed or copied is resumed (``veriloop train RUN/config.yaml --resume``) where it is now,
    not where it was first written. Overrides of run.out_dir / run.name still win."""
    folder = file.resolve().parent
    if file.name != "config.yaml" or not any((folder / m).exists() for m in _RUN_MARKS):
        return
    if not re.fullmatch(r"[A-Za-z0-9_.=-]{1,200}", folder.name):
        return  # the folder's name is not a possible run.name: keep the saved one
    run = raw.get("run")
    if run is None or isinstance(run, dict):
        raw["run"] = {**(run or {}), "out_dir": str(folder.parent), "name": folder.name}
        ctx.sources[("run", "out_dir")] = ctx.sources[("run", "name")] = f"{file} (the run folder it lies in)"


def _record_marks(node: yaml.Node, prefix: _Key, file: str, ctx: _Context) -> None:
    """Map each dotted key of a YAML document to ``file:line``; duplicate keys are errors."""
    if not isinstance(node, yaml.MappingNode):
        return
    seen: set[str] = set()
    for key_node, value_node in node.value:
        key = (*prefix, str(key_node.value))
        where = f"{file}:{key_node.start_mark.line + 1}"
        if key[-1] in seen:
            ctx.errors.append(
                f"{where}: {'.'.join(key)}: duplicate key (the earlier value would be silently lost)"
            )
        seen.add(key[-1])
        ctx.sources[key] = where
        _record_marks(value_node, key, file, ctx)


def _apply_override(raw: dict[str, Any], text: str, ctx: _Context) -> None:
    dotted, sep, value_text = text.partition("=")
    dotted = dotted.strip()
    if not sep or not dotted:
        raise ConfigError(f"override {_shown(text)} must look like key=value, e.g. rollout.group_size=8")
    try:
        _check_yaml_shape(value_text, f"override {_shown(text)}")
        value = yaml.safe_load(value_text)
    except yaml.YAMLError as e:
        raise ConfigError(f"override {_shown(text)}: value is not valid YAML: {_shorten(str(e), 600)}") from e
    key = tuple(dotted.split("."))
    node = raw
    for i, part in enumerate(key[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {_shown(text)}: {'.'.join(key[: i + 1])} is a value, not a section")
        node = child
    node[key[-1]] = value
    ctx.sources[key] = f"override {_shown(text)}"


# ------------------------------------------------------------------------------------ presets


def _with_preset(algo_raw: dict[str, Any], raw: dict[str, Any], ctx: _Context) -> dict[str, Any]:
    """Algo keys = the preset's fields, then the explicit keys; the preset name goes to run."""
    run_raw = raw.get("run")
    run_raw = dict(run_raw) if isinstance(run_raw, Mapping) else {}
    in_algo, in_run = algo_raw.pop("preset", None), run_raw.get("algo_preset")
    if in_algo is not None and in_run is not None and in_algo != in_run:
        ctx.error(
            ("algo", "preset"), f"names preset {in_algo!r} but run.algo_preset names {in_run!r}: keep one"
        )
        return algo_raw
    name = in_algo if in_algo is not None else in_run
    if name is None:
        return algo_raw
    run_raw["algo_preset"] = name
    raw["run"] = run_raw
    try:
        preset = load_algo_preset(str(name))
    except ConfigError as e:
        ctx.error(("algo", "preset"), str(e))
        return algo_raw
    return {**dataclasses.asdict(preset), **algo_raw}


def load_algo_preset(name: str) -> AlgoConfig:
    """An algorithm preset by name (:func:`veriloop.configs.presets.load_preset`), errors as ConfigError."""
    try:
        return load_preset(name)
    except (KeyError, ValueError, FileNotFoundError) as e:
        raise ConfigError(f"algorithm preset {name!r}: {e}") from e


# ----------------------------------------------------------------------------- typed building


def _build(cls: type, data: Any, key: _Key, ctx: _Context) -> Any:
    """Instantiate dataclass ``cls`` from a mapping, checking every key and value type."""
    if not isinstance(data, Mapping):
        ctx.error(key, f"expects a mapping of {cls.__name__} fields, got {_shown(data)}")
        return cls()
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for name, value in data.items():
        if name not in hints or name not in names:
            ctx.error((*key, str(name)), _unknown_key_message((*key, str(name)), names))
            continue
        kwargs[name] = _convert(hints[name], value, (*key, name), ctx)
    return cls(**kwargs)


def _convert(tp: Any, value: Any, key: _Key, ctx: _Context) -> Any:
    """Check ``value`` against type ``tp`` (recursively) and return it in that type."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return value
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return _build(tp, value, key, ctx)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        options = [a for a in args if a is not type(None)]
        probe = _Context(sources=ctx.sources)
        for option in options:
            probe.errors.clear()
            out = _convert(option, value, key, probe)
            if not probe.errors:
                return out
        if len(options) == 1:  # X | None: report X's own message
            ctx.errors.extend(probe.errors)
            return value
    elif origin is Literal:
        if value in args:
            return value
        close = difflib.get_close_matches(str(value), [str(a) for a in args], n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        ctx.error(key, f"must be one of {', '.join(str(a) for a in args)}; got {_shown(value)}{hint}")
        return value
    elif origin is list and isinstance(value, list):
        return [_convert(args[0], v, (*key, str(i)), ctx) for i, v in enumerate(value)]
    elif origin is dict and isinstance(value, Mapping):
        bad = [k for k in value if not isinstance(k, str)]
        if not bad:
            return {k: _convert(args[1], v, (*key, k), ctx) for k, v in value.items()}
    elif tp is bool and isinstance(value, bool):
        return value
    elif tp is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    elif tp is float and isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    elif tp is float and isinstance(value, str) and _NUMBER.fullmatch(value.strip()):
        return float(value)  # YAML reads 1e-5 (no dot) as a string
    elif tp is str and isinstance(value, str):
        return value
    quote = " (quote it to make it a string)" if tp is str and value is not None else ""
    ctx.error(key, f"expects {type_name(tp)}, got {_shown(value)} ({type(value).__name__}){quote}")
    return value


def _all_keys() -> list[str]:
    return [row[0] for row in describe(ExperimentConfig)] + ["algo.preset"]


def _unknown_key_message(key: _Key, valid_here: list[str]) -> str:
    """Unknown-key message with the closest valid keys, here and anywhere in the schema."""
    dotted, everywhere = ".".join(key), _all_keys()
    close = difflib.get_close_matches(key[-1], valid_here, n=2, cutoff=0.6)
    suggestions = [".".join((*key[:-1], c)) for c in close]
    suggestions += [k for k in everywhere if k.rsplit(".", 1)[-1] == key[-1] and k not in suggestions]
    suggestions += [
        k for k in difflib.get_close_matches(dotted, everywhere, n=2, cutoff=0.75) if k not in suggestions
    ]
    hint = f" Did you mean {' or '.join(suggestions[:3])}?" if suggestions else ""
    return f"unknown key.{hint} Valid keys here: {', '.join(valid_here)}"


def _shown(value: Any, limit: int = 100) -> str:
    """``repr(value)``, cut to ``limit`` characters: an error message never prints a huge value."""
    if isinstance(value, str | bytes) and len(value) > limit:
        return f"{value[: limit // 2]!r}... ({len(value)} characters)"
    if isinstance(value, list | dict | tuple) and len(value) > 20:
        return f"a {type(value).__name__} of {len(value)} items"
    return _shorten(repr(value), limit)


def _shorten(text: str, limit: int) -> str:
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def _summary(errors: list[str]) -> str:
    head = "invalid config" if len(errors) == 1 else f"invalid config ({len(errors)} problems)"
    return head + ":\n  " + "\n  ".join(errors)
