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
    complete_checkpoints,
    load_checkpoint,
    save_checkpoint,
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
    """The newest complete checkpoint of ``run_dir`` whose checksums verify (a damaged one is
    reported on stderr and the previous one tried). Raises :class:`CheckpointError` when that
    checkpoint was written without sharding (``train.parallel: data``)."""
    for folder in reversed(complete_checkpoints(run_dir)):
        try:
            verify_checkpoint(folder)
        except CheckpointError as e:
            print(
                f"veriloop: checkpoint {folder} cannot be resumed ({e}); trying the previous one",
                file=sys.stderr,
            )
            continue
        if not (folder / "model" / SHARDS).is_dir():
            raise CheckpointError(
                f"{folder} was written by an unsharded run (train.parallel: data): resume it with "
                "train.parallel=data, or start a new run.name"
            )
        return folder
    return None


def load_sharded(
    run_dir: str | Path, *, dist: DistContext, modules: nn.Module, optimizer: torch.optim.Optimizer
) -> tuple[Path, dict[str, Any]] | None:
    """Load the newest sharded checkpoint into ``modules`` and ``optimizer`` on every rank.

    Returns ``(folder, loaded)``, ``loaded`` as :func:`checkpoint.load_checkpoint` gives it (the
    scheduler, trainer state; the RNG states are restored), or None when the run has none.
    """
    from torch.distributed import checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    chosen = dist.broadcast_object(str(newest_sharded(run_dir) or "") if dist.is_main else None)
    if not chosen:
        return None
    folder = Path(chosen)
    loaded = load_checkpoint(folder)  # every rank: checksums, scheduler, trainer state, RNG states
    model_state, optim_state = get_state_dict(modules, optimizer, options=_options())
    dcp.load({"model": model_state, "optimizer": optim_state}, checkpoint_id=str(folder / "model" / SHARDS))
    set_state_dict(
        modules, optimizer, model_state_dict=model_state, optim_state_dict=optim_state, options=_options()
    )
    return folder, loaded
