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
reads its rows. DCP reshards on load, so a run may resume on a different number of ranks (not
tested here). Every rank must see the same ``run_dir`` (a shared file system across nodes).
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

        final = save_checkpoint(run_dir, step, save_model=move_shards, scheduler=scheduler,
                                trainer_state=trainer_state, keep_last=keep_last)  # fmt: skip
    return Path(dist.broadcast_object(str(final)))


def newest_sharded(run_dir: str | Path) -> Path | None:
    """The newest checkpoint of ``run_dir`` that is complete and whose checksums verify (one that
    is not is reported on stderr in one line and the previous one tried); None when the run has
    no checkpoint. Raises :class:`CheckpointError` when every checkpoint fails, or when the one
    found was written without sharding (``train.parallel: data``)."""
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
        if not (folder / "model" / SHARDS).is_dir():
            raise CheckpointError(
                f"{folder} was written by an unsharded run (train.parallel: data): resume it with "
                "train.parallel=data, or start a new run.name"
            )
        return folder
    if failures:
        raise CheckpointError(
            f"no checkpoint of {run_dir} could be resumed ({'; '.join(failures)}); start again with --overwrite"
        )
    return None


def load_sharded(
    run_dir: str | Path, *, dist: DistContext, modules: nn.Module, optimizer: torch.optim.Optimizer
) -> tuple[Path, dict[str, Any]] | None:
    """Load the newest sharded checkpoint into ``modules`` and ``optimizer`` on every rank.

    Returns ``(folder, loaded)``, ``loaded`` as :func:`checkpoint.load_checkpoint` gives it (the
    scheduler, trainer state; the RNG states are restored), or None when the run has none.

    Raises:
        CheckpointError: the checkpoint verifies but does not fit ``modules`` (it was written
            with another model or config); one line saying so, on every rank.
    """
    chosen = dist.broadcast_object(_pick(run_dir) if dist.is_main else None)
    if chosen[0] == "error":  # every rank stops with rank 0's one line (none waits for the others)
        raise CheckpointError(chosen[1])
    if not chosen[1]:
        return None
    folder = Path(chosen[1])
    loaded = load_checkpoint(folder)  # every rank: checksums, scheduler, trainer state, RNG states
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException

    try:
        _load_shards(folder / "model" / SHARDS, modules, optimizer)
    except CheckpointError:
        raise
    except (Exception, CheckpointException) as e:  # DCP and load_state_dict say "does not fit" in many ways
        raise CheckpointError(
            f"checkpoint {folder} is intact (its checksums verify) but does not fit this model "
            f"({_first_failure(e)}); resume with the config it was saved with (RUN/config.yaml), or "
            "start again with --overwrite"
        ) from None
    return folder, loaded


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


def _load_shards(shards: Path, modules: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Read this rank's rows of the trained weights and AdamW's state from ``shards`` (collective).

    The checkpoint holds the trained weights only (a LoRA base model is frozen, left out on save),
    so the model is loaded non-strictly and then checked: every trainable weight must have been
    in the checkpoint, and nothing in it may be unknown to the model.
    """
    from torch.distributed import checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

    model_state, optim_state = get_state_dict(modules, optimizer, options=_options())
    dcp.load({"model": model_state, "optimizer": optim_state}, checkpoint_id=str(shards))
    keys = set_state_dict(modules, optimizer, model_state_dict=model_state, optim_state_dict=optim_state,
                          options=StateDictOptions(ignore_frozen_params=True, strict=False))  # fmt: skip
    trainable = {n for n, p in modules.named_parameters() if p.requires_grad}
    lost = sorted(trainable.intersection(keys.missing_keys))
    if lost or keys.unexpected_keys:
        raise CheckpointError(
            f"the checkpoint in {shards.parent.parent} does not fit this model (missing trained weights "
            f"{lost[:3]}, unexpected {sorted(keys.unexpected_keys)[:3]}); resume with the config it was "
            "saved with (RUN/config.yaml), or start again with --overwrite"
        )
