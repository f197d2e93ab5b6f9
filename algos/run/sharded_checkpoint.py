"""Checkpoints of sharded training (``train.parallel: fsdp``): every rank writes its own shards.

The folder is an ordinary crash-safe checkpoint of :mod:`veriloop.algos.run.checkpoint` (atomic
rename, ``COMPLETE`` manifest with every file's size and SHA-256, the newest ``keep_last`` kept);
only its ``model/`` differs::

    step-000120/
        model/shards/       torch.distributed.checkpoint (DCP): .metadata + one file per rank,
                            holding the trained weights and AdamW's state, each rank its own rows
        model/sharded.json  {"format": "torch.distributed.checkpoint", "world_size": W}
        scheduler.pt  rng.pt  trainer_state.json  COMPLETE      as in any checkpoint

Saving (all ranks): the ranks agree that the weights are finite, DCP writes into a staging folder
``checkpoints/.tmp-shards-step-NNNNNN-<pid>`` (a leftover of a killed save is removed like any
``.tmp-*``), then rank 0 moves it into the checkpoint and commits it with ``save_checkpoint``.
Only the committed rename makes the checkpoint exist, so a kill at any point leaves the previous
one. Loading (all ranks): rank 0 picks the newest checkpoint whose checksums verify, every rank
reads its rows. DCP reshards on load, so a run resumes on any number of ranks: a checkpoint of W
ranks on W' ranks, on one process (:func:`load_into_whole`, no process group), and a one-process
checkpoint (whole tensors) on W ranks (docs/scaling.md says what carries over). Every rank must
see the same ``run_dir`` (a shared file system across nodes).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from veriloop.algos.run.checkpoint import (
    CHECKPOINTS,
    CheckpointError,
    NonFiniteParametersError,
    latest_checkpoint,
    load_checkpoint,
    missing_trained,
    save_checkpoint,
    step_folders,
    verify_checkpoint,
)
from veriloop.algos.run.distributed import DistContext

SHARDS = "shards"
INFO = "sharded.json"
FORMAT = "torch.distributed.checkpoint"


def _options() -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(ignore_frozen_params=True)  # a LoRA base model is not checkpointed


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def check_finite_sharded(dist: DistContext, modules: nn.Module) -> None:
    """Raise :class:`NonFiniteParametersError` on every rank when any rank's shard of a trained
    weight holds NaN/inf (collective: the ranks decide together, so none waits for the others)."""
    bad = [
        n
        for n, p in modules.named_parameters()
        if p.requires_grad and not bool(torch.isfinite(_local(p)).all())
    ]
    flag = torch.tensor([float(len(bad) > 0)])
    if dist.enabled:
        torch.distributed.all_reduce(flag)
    if flag.item() > 0:
        where = f"on this rank in {', '.join(bad[:5])}" if bad else "on another rank"
        raise NonFiniteParametersError(
            f"refusing to save a checkpoint: non-finite values (NaN/inf) {where}. The previous "
            "checkpoint is kept; lower train.lr or train.max_grad_norm, or resume from it"
        )


def save_sharded(
    run_dir: str | Path,
    step: int,
    *,
    dist: DistContext,
    modules: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    trainer_state: Mapping[str, Any],
    keep_last: int,
    delay_s: float = 0.0,
) -> Path:
    """Write checkpoint ``step`` of a sharded run; call on every rank. Returns its folder.

    ``modules``: everything trained (``fsdp.state_modules``); ``delay_s``: a test hook, seconds
    rank 0 sleeps after the shards are in place and before the commit (a window to kill it).
    """
    from torch.distributed import checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    check_finite_sharded(dist, modules)
    root = Path(run_dir) / CHECKPOINTS
    staging = Path(dist.broadcast_object(str(root / f".tmp-shards-step-{step:06d}-{os.getpid()}")))
    if dist.is_main:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(staging, ignore_errors=True)
    dist.barrier()
    model_state, optim_state = get_state_dict(modules, optimizer, options=_options())
    dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=str(staging))
    dist.barrier()  # every rank's shard is written
    final = None
    if dist.is_main:

        def move_shards(folder: Path) -> None:
            os.rename(staging, folder / SHARDS)
            (folder / INFO).write_text(json.dumps({"format": FORMAT, "world_size": dist.world_size}) + "\n")
            if delay_s > 0:
                time.sleep(delay_s)

        final = save_checkpoint(
            run_dir,
            step,
            save_model=move_shards,
            scheduler=scheduler,
            trainer_state=trainer_state,
            keep_last=keep_last,
        )
    return Path(dist.broadcast_object(str(final)))


def newest_sharded(run_dir: str | Path) -> Path | None:
    """The newest checkpoint of ``run_dir`` that is complete and whose checksums verify (one that
    is not is reported on stderr in one line and the previous one tried); None when the run has
    no checkpoint. Raises :class:`CheckpointError` when every checkpoint fails. The one found may
    be sharded or, written by one process, whole (:func:`load_sharded` reads either)."""
    latest_checkpoint(run_dir)  # removes the leftovers of killed saves
    candidates = step_folders(run_dir)
    failures: list[str] = []
    for folder in reversed(candidates):
        try:
            verify_checkpoint(folder)
        except CheckpointError as e:
            older = "trying the previous checkpoint" if folder != candidates[0] else "no older checkpoint"
            print(f"veriloop: checkpoint {folder} cannot be resumed ({e}); {older}", file=sys.stderr)
            failures.append(f"{folder.name}: {str(e)[:300]}")
            continue
        return folder
    if failures:
        raise CheckpointError(
            f"no checkpoint of {run_dir} could be resumed ({'; '.join(failures)}); start again with --overwrite"
        )
    return None


def load_sharded(
    run_dir: str | Path,
    *,
    dist: DistContext,
    modules: nn.Module,
    optimizer: torch.optim.Optimizer,
    whole_keys: Mapping[str, nn.Parameter],
) -> tuple[Path, dict[str, Any]] | None:
    """Load the newest checkpoint into the sharded ``modules`` and ``optimizer`` on every rank.

    The checkpoint may have been written by any number of ranks (DCP reshards the rows), or by one
    process (whole tensors in ``model/model.pt`` and ``optimizer.pt``: every rank reads them and
    keeps its rows). ``whole_keys``: the keys of such a ``model.pt`` (``setup.trainable_parameters``)
    and the parameters they name. Returns ``(folder, loaded)``, ``loaded`` as
    :func:`checkpoint.load_checkpoint` gives it (the scheduler, trainer state; every rank restores
    the RNG states rank 0 saved), or None when the run has none.

    Raises:
        CheckpointError: the checkpoint verifies but does not fit ``modules`` (it was written
            with another model or config); one line saying so, on every rank.
    """
    chosen = dist.broadcast_object(_pick(run_dir) if dist.is_main else None)
    assert chosen is not None  # rank 0 always picks, and every rank receives its pick
    if chosen[0] == "error":  # every rank stops with rank 0's one line (none waits for the others)
        raise CheckpointError(chosen[1])
    if not chosen[1]:
        return None
    folder = Path(chosen[1])
    loaded = load_checkpoint(folder)  # every rank: checksums, scheduler, trainer state, RNG states
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException

    try:
        if is_sharded(folder):
            _load_shards(folder / "model" / SHARDS, modules, optimizer)
        else:  # written by one process: whole tensors, every rank keeps its rows
            _load_whole(loaded, modules, optimizer, whole_keys)
    except CheckpointError:
        raise
    except (Exception, CheckpointException) as e:  # DCP and load_state_dict say "does not fit" in many ways
        raise _misfit(folder, e) from None
    return folder, loaded


def is_sharded(folder: str | Path) -> bool:
    """Whether checkpoint ``folder`` was written by a sharded run (its model is a DCP folder)."""
    return (Path(folder) / "model" / SHARDS).is_dir()


def written_by(folder: str | Path) -> int:
    """How many ranks wrote checkpoint ``folder`` (1 for a whole one)."""
    info = Path(folder) / "model" / INFO
    return int(json.loads(info.read_text()).get("world_size", 0)) if info.is_file() else 1


def _misfit(folder: Path, e: BaseException) -> CheckpointError:
    return CheckpointError(
        f"checkpoint {folder} is intact (its checksums verify) but does not fit this model "
        f"({_first_failure(e)}); resume with the config it was saved with (RUN/config.yaml), or "
        "start again with --overwrite"
    )


def load_into_whole(folder: str | Path, modules: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Read sharded checkpoint ``folder`` into ``modules`` and ``optimizer`` that are not sharded
    (a run resumed by one process): every tensor is read whole from all the ranks' files, without
    a process group. Raises :class:`CheckpointError` when it does not fit."""
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException

    try:
        _load_shards(Path(folder) / "model" / SHARDS, modules, optimizer, no_dist=True)
    except CheckpointError:
        raise
    except (Exception, CheckpointException) as e:
        raise _misfit(Path(folder), e) from None


def _first_failure(e: BaseException) -> str:
    """``Type: message`` of the error, in one line; of the first rank's for DCP's collected ones."""
    failures = getattr(e, "failures", None)  # CheckpointException: rank -> (exception, traceback)
    if isinstance(failures, dict) and failures:
        first = failures[min(failures)]
        e = first[0] if isinstance(first, tuple) and isinstance(first[0], BaseException) else e
    return f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"


def _pick(run_dir: str | Path) -> tuple[str, str]:
    """Rank 0's choice, to broadcast: ``("ok", folder or "")`` or ``("error", message)``."""
    try:
        return "ok", str(newest_sharded(run_dir) or "")
    except CheckpointError as e:
        return "error", str(e)


def _load_shards(
    shards: Path, modules: nn.Module, optimizer: torch.optim.Optimizer, *, no_dist: bool = False
) -> None:
    """Read this rank's rows of the trained weights and AdamW's state from ``shards`` (collective;
    with ``no_dist`` this process alone reads whole tensors into a model that is not sharded).

    The checkpoint holds the trained weights only (a LoRA base model is frozen, left out on save),
    so the model is loaded non-strictly and then checked: every trainable weight must have been
    in the checkpoint, and nothing in it may be unknown to the model.
    """
    from torch.distributed import checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

    model_state, optim_state = get_state_dict(modules, optimizer, options=_options())
    dcp.load({"model": model_state, "optimizer": optim_state}, checkpoint_id=str(shards), no_dist=no_dist)
    keys = set_state_dict(
        modules,
        optimizer,
        model_state_dict=model_state,
        optim_state_dict=optim_state,
        options=StateDictOptions(ignore_frozen_params=True, strict=False),
    )
    _check_keys(shards.parent.parent, modules, keys.missing_keys, keys.unexpected_keys)


def _check_keys(folder: Path, modules: nn.Module, missing: Any, unexpected: Any) -> None:
    """Every trainable weight came from the checkpoint, and nothing in it is unknown to the model."""
    lost = missing_trained(modules, missing)
    if lost or unexpected:
        raise CheckpointError(
            f"the checkpoint in {folder} does not fit this model (missing trained weights "
            f"{lost[:3]}, unexpected {sorted(unexpected)[:3]}); resume with the config it was "
            "saved with (RUN/config.yaml), or start again with --overwrite"
        )


def _load_whole(
    loaded: Mapping[str, Any],
    modules: nn.Module,
    optimizer: torch.optim.Optimizer,
    whole_keys: Mapping[str, nn.Parameter],
) -> None:
    """A one-process checkpoint (``model.pt``: whole tensors under ``setup.trainable_state``'s keys;
    ``optimizer.pt``: ``optimizer.state_dict()``, parameters numbered in the optimizer's order) into
    sharded ``modules``: both are renamed to the modules' names, then every rank keeps its rows."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    folder = Path(loaded["model_dir"]).parent
    if loaded["model_state"] is None or loaded["optimizer"] is None:
        raise CheckpointError(f"{folder} holds neither shards nor model/model.pt and optimizer.pt")
    fqn = {id(p): n for n, p in modules.named_parameters()}
    rename = {k: fqn[id(p)] for k, p in whole_keys.items() if id(p) in fqn}
    unknown = sorted(set(loaded["model_state"]) - set(rename))
    model_state = {rename[k]: v for k, v in loaded["model_state"].items() if k in rename}
    order = [fqn.get(id(p), "?") for group in optimizer.param_groups for p in group["params"]]
    optim_state = _named_optimizer_state(loaded["optimizer"], order, folder)
    keys = set_state_dict(
        modules,
        optimizer,
        model_state_dict=model_state,
        optim_state_dict=optim_state,
        options=StateDictOptions(full_state_dict=True, ignore_frozen_params=True, strict=False),
    )
    _check_keys(folder, modules, keys.missing_keys, [*keys.unexpected_keys, *unknown])


def _named_optimizer_state(state: Mapping[str, Any], order: list[str], folder: Path) -> dict[str, Any]:
    """``optimizer.state_dict()`` (parameters numbered 0, 1, ... in param-group order) with the
    numbers replaced by ``order``'s names, as ``set_state_dict`` reads it."""
    groups = state["param_groups"]
    numbered = [i for g in groups for i in g["params"]]
    if numbered != list(range(len(order))):
        raise CheckpointError(
            f"the optimizer state in {folder} is for {len(numbered)} parameters, this model trains "
            f"{len(order)}; resume with the config it was saved with (RUN/config.yaml), or start again "
            "with --overwrite"
        )
    return {
        "state": {order[i]: dict(v) for i, v in state["state"].items()},
        "param_groups": [{**g, "params": [order[i] for i in g["params"]]} for g in groups],
    }
