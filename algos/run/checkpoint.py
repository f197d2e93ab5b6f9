"""Crash-safe training checkpoints: save atomically, find the newest complete one, resume exactly.

Layout of one run::

    run_dir/checkpoints/
        step-000120/            a complete checkpoint (contains COMPLETE)
            model/              whatever ``save_model(folder)`` wrote (LoRA adapter, state dict...)
            optimizer.pt        optimizer.state_dict()
            scheduler.pt        scheduler.state_dict()
            rng.pt              python ``random``, numpy global, torch CPU and CUDA generator states
            trainer_state.json  step counter, data/env seed position, metrics so far
            COMPLETE            JSON manifest: step, and the size and SHA-256 of every file above
        .tmp-step-000123-4711/  a save in progress (or killed mid-way) by process 4711

Atomicity. Everything, the ``COMPLETE`` manifest included, is written into a temporary folder
inside ``checkpoints/``; every file and folder is fsynced; then one ``os.rename`` gives the folder
its ``step-NNNNNN`` name, and ``checkpoints/`` itself is fsynced. The rename is the single commit
point: a kill before it leaves only a ``.tmp-*`` folder (ignored, later deleted), a kill after it
leaves a complete checkpoint. We write the marker *before* the rename (not after) so that there is
no moment when a ``step-*`` folder exists without its marker. Readers still demand the marker and
check the manifest's file sizes, which also rejects folders damaged or copied partially by other
tools; :func:`load_checkpoint` also checks every file's SHA-256, so a same-size flipped byte is
caught too, and :func:`resume_latest` then falls back to the previous checkpoint. Old checkpoints are removed only after the new one is committed, and each is first renamed
to ``.trash-*`` so that a kill during deletion never leaves a half-deleted ``step-*`` folder.

Loading uses ``torch.load(weights_only=True)``: a checkpoint can never execute code.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import pickle
import random
import re
import shutil
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from veriloop.agents.atomic import fsync_dir, fsync_tree

CHECKPOINTS = "checkpoints"
MARKER = "COMPLETE"
_STEP_DIR = re.compile(r"^step-(\d{6,})$")
_TEMP_DIR = re.compile(r"^\.(tmp|trash)-.*-(\d+)$")


class NonFiniteParametersError(ValueError):
    """Raised instead of saving a model whose parameters hold NaN or inf."""


class CheckpointError(ValueError):
    """A checkpoint folder is incomplete, damaged (a checksum differs) or cannot be read."""


# ----------------------------------------------------------------------------------------- RNG


def capture_rng() -> dict[str, Any]:
    """Snapshot of every process-global random generator a training step may touch.

    Environments draw from their own ``np_random`` (seeded by ``reset``); their position is part
    of ``trainer_state``, not of this snapshot.
    """
    version, state, gauss = random.getstate()
    np_state = np.random.get_state(legacy=False)
    return {
        "python": [version, list(state), gauss],
        "numpy": {
            "bit_generator": np_state["bit_generator"],
            "key": torch.from_numpy(np_state["state"]["key"].astype(np.int64)),
            "pos": int(np_state["state"]["pos"]),
            "has_gauss": int(np_state["has_gauss"]),
            "gauss": float(np_state["gauss"]),
        },
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }


def restore_rng(states: Mapping[str, Any]) -> None:
    """Put back a snapshot made by :func:`capture_rng`."""
    version, state, gauss = states["python"]
    random.setstate((version, tuple(state), gauss))
    npy = states["numpy"]
    np.random.set_state(
        {
            "bit_generator": npy["bit_generator"],
            "state": {"key": npy["key"].numpy().astype(np.uint32), "pos": npy["pos"]},
            "has_gauss": npy["has_gauss"],
            "gauss": npy["gauss"],
        }
    )
    torch.set_rng_state(states["torch"])
    if states["cuda"]:
        if not torch.cuda.is_available():
            raise RuntimeError(
                "this checkpoint holds CUDA RNG states but CUDA is not available; resume on a GPU "
                "machine or pass restore_rng=False (the run will then not reproduce bitwise)"
            )
        torch.cuda.set_rng_state_all(states["cuda"])


# ---------------------------------------------------------------------------------------- save


def check_finite(named_parameters: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Raise :class:`NonFiniteParametersError` naming the first parameters holding NaN/inf."""
    bad = [name for name, p in named_parameters if not bool(torch.isfinite(p.detach()).all())]
    if bad:
        shown = ", ".join(bad[:5]) + (f" and {len(bad) - 5} more" if len(bad) > 5 else "")
        raise NonFiniteParametersError(
            f"refusing to save a checkpoint: non-finite values (NaN/inf) in {shown}. The previous "
            "checkpoint is kept; lower train.lr or train.max_grad_norm, or resume from it"
        )


def save_checkpoint(
    run_dir: str | Path,
    step: int,
    *,
    model: torch.nn.Module | None = None,
    save_model: Callable[[Path], None] | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Any = None,
    trainer_state: Mapping[str, Any] | None = None,
    keep_last: int = 3,
) -> Path:
    """Atomically write checkpoint ``step`` and prune all but the newest ``keep_last``.

    Args:
        run_dir: The run's folder; checkpoints go to ``run_dir/checkpoints``.
        step: Number of completed optimizer steps (the step to resume *from*).
        model: Checked for non-finite parameters before anything is written; when ``save_model``
            is None its ``state_dict()`` is saved to ``model/model.pt``.
        save_model: Writes the model into the folder it is given (e.g. a peft adapter's
            ``save_pretrained``). Every file it writes is fsynced afterwards.
        optimizer, scheduler: Objects with ``state_dict()``; saved when given.
        trainer_state: JSON-serialisable loop state (step counter, seed position, metrics).
        keep_last: Complete checkpoints to keep, the new one included (>= 1).

    Returns:
        The committed ``step-NNNNNN`` folder.
    """
    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1 (checkpoints to keep), got {keep_last}")
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    if model is not None:
        check_finite(model.named_parameters())
    if model is None and save_model is None:
        raise ValueError("save_checkpoint needs the model: pass model=..., save_model=... or both")
    root = Path(run_dir) / CHECKPOINTS
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step-{step:06d}"
    tmp = root / f".tmp-{final.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        _write_contents(tmp, model, save_model, optimizer, scheduler, trainer_state)
        _write_file(tmp / MARKER, json.dumps({"step": step, "files": _manifest(tmp)}, indent=1).encode())
        fsync_tree(tmp)
    except BaseException as e:
        full = isinstance(e, OSError | RuntimeError) and _disk_full(root, e)
        shutil.rmtree(tmp, ignore_errors=True)  # a cut save leaves nothing behind (and frees its space)
        if full:
            raise OSError(
                errno.ENOSPC, f"no space left on the device while saving {final.name}", str(root)
            ) from e
        raise
    if final.exists():  # re-saving a step (resumed from an older one): retire the old copy first
        _retire(final)
    os.rename(tmp, final)
    fsync_dir(root)
    _prune(root, keep=keep_last, protect=final)
    return final


def _disk_full(folder: Path, error: BaseException) -> bool:
    """Whether a failed write ran out of space (``torch.save`` reports it as a RuntimeError)."""
    if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    try:
        return shutil.disk_usage(folder).free < 1 << 20
    except OSError:
        return False


def _write_contents(
    folder: Path,
    model: torch.nn.Module | None,
    save_model: Callable[[Path], None] | None,
    optimizer: Any,
    scheduler: Any,
    trainer_state: Mapping[str, Any] | None,
) -> None:
    (folder / "model").mkdir()
    if save_model is not None:
        save_model(folder / "model")
    else:
        assert model is not None
        _torch_save(model.state_dict(), folder / "model" / "model.pt")
    if optimizer is not None:
        _torch_save(optimizer.state_dict(), folder / "optimizer.pt")
    if scheduler is not None:
        _torch_save(scheduler.state_dict(), folder / "scheduler.pt")
    _torch_save(capture_rng(), folder / "rng.pt")
    state = json.dumps(dict(trainer_state or {}), indent=1, allow_nan=True)
    _write_file(folder / "trainer_state.json", state.encode())


def _torch_save(obj: Any, path: Path) -> None:
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def _write_file(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _manifest(folder: Path) -> dict[str, dict[str, Any]]:
    """Relative path -> ``{"size": bytes, "sha256": hex digest}``, for every file under ``folder``."""
    return {
        p.relative_to(folder).as_posix(): {"size": p.stat().st_size, "sha256": sha256_file(p)}
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name != MARKER
    }


def sha256_file(path: Path) -> str:
    """Hex SHA-256 of a file, read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def _retire(folder: Path) -> None:
    """Delete a checkpoint folder: rename it away first, so it never looks half-complete."""
    trash = folder.with_name(f".trash-{folder.name}-{os.getpid()}")
    shutil.rmtree(trash, ignore_errors=True)
    os.rename(folder, trash)
    fsync_dir(folder.parent)
    shutil.rmtree(trash, ignore_errors=True)


def _prune(root: Path, keep: int, protect: Path) -> None:
    """Keep the ``keep`` newest complete checkpoints (always including ``protect``)."""
    complete = [p for p in _complete_checkpoints(root) if p != protect]
    for old in complete[: max(0, len(complete) - (keep - 1))]:
        _retire(old)


# ---------------------------------------------------------------------------------------- load


def _expected(entry: Any) -> tuple[int, str | None]:
    """``(size, sha256 or None)`` of a manifest entry (older checkpoints recorded the size only)."""
    if isinstance(entry, dict):
        return int(entry["size"]), str(entry["sha256"])
    return int(entry), None


#: Files every checkpoint holds (besides its model): a manifest that lists none of them is refused.
REQUIRED = ("rng.pt", "trainer_state.json")


def is_complete(folder: Path) -> bool:
    """True when ``folder`` holds a readable manifest whose every file exists with its size
    (cheap: no file is read; :func:`verify_checkpoint` checks the contents)."""
    return incomplete_reason(folder) is None


def incomplete_reason(folder: Path) -> str | None:
    """Why ``folder`` is not a complete checkpoint, in a few words (None when it is): the marker
    is missing or unreadable, its manifest lists nothing (or not the model, ``rng.pt`` and
    ``trainer_state.json``), or a listed file is missing or has another size. Reads no file but
    the marker."""
    try:
        manifest = json.loads((folder / MARKER).read_bytes())
    except FileNotFoundError:
        return f"its {MARKER} marker is missing"
    except (OSError, ValueError) as e:
        return f"its {MARKER} manifest cannot be read ({type(e).__name__}: {str(e)[:120]})"
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, dict) or not isinstance(manifest.get("step"), int):
        return f"its {MARKER} manifest is not one veriloop writes (no step, or no files table)"
    listed = set(files)
    if not any(rel.startswith("model/") for rel in listed) or not listed.issuperset(REQUIRED):
        return f"its {MARKER} manifest does not list the model, {' and '.join(REQUIRED)}"
    for rel, entry in files.items():
        try:
            size = _expected(entry)[0]
            if Path(rel).is_absolute() or ".." in Path(rel).parts:
                return f"its {MARKER} manifest names {rel[:100]!r}, outside the checkpoint"
            actual = (folder / rel).stat().st_size
        except FileNotFoundError:
            return f"{rel} is missing"
        except (OSError, ValueError, KeyError, TypeError) as e:
            return f"{rel[:100]} cannot be checked ({type(e).__name__})"
        if actual != size:
            return f"{rel} is truncated or changed ({actual} bytes, the manifest says {size})"
    return None


def verify_checkpoint(folder: str | Path) -> None:
    """Raise :class:`CheckpointError` unless every file of ``folder``'s manifest exists with its
    recorded size and SHA-256 (a checkpoint written before checksums is checked by size only)."""
    folder = Path(folder)
    reason = incomplete_reason(folder)
    if reason is not None:
        raise CheckpointError(f"{folder} is not a complete checkpoint: {reason}")
    files = json.loads((folder / MARKER).read_text())["files"]
    for rel, entry in files.items():
        digest = _expected(entry)[1]
        if digest is not None and sha256_file(folder / rel) != digest:
            raise CheckpointError(f"{folder}: {rel} is damaged (its SHA-256 differs from the one saved)")


def step_folders(run_dir: str | Path) -> list[Path]:
    """Every ``step-*`` folder of a run, complete or not, oldest step first (resume tries each
    and reports why one cannot be used)."""
    root = Path(run_dir) / CHECKPOINTS
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_DIR.match(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found)]


def complete_checkpoints(run_dir: str | Path) -> list[Path]:
    """Complete (size-checked) ``step-*`` folders of a run, oldest step first."""
    return _complete_checkpoints(Path(run_dir) / CHECKPOINTS)


def _complete_checkpoints(root: Path) -> list[Path]:
    """Complete ``step-*`` folders under ``root``, oldest step first."""
    return [p for p in step_folders(root.parent) if is_complete(p)]


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The newest complete checkpoint of a run, or None.

    Also deletes leftovers of saves that were killed (``.tmp-*`` / ``.trash-*`` folders whose
    process is gone); folders of a live process are left alone.
    """
    root = Path(run_dir) / CHECKPOINTS
    if not root.is_dir():
        return None
    for p in root.iterdir():
        m = _TEMP_DIR.match(p.name)
        if m and not _pid_alive(int(m.group(2))):
            shutil.rmtree(p, ignore_errors=True)
    complete = _complete_checkpoints(root)
    return complete[-1] if complete else None


def load_checkpoint(path: str | Path, *, restore_rng_states: bool = True) -> dict[str, Any]:
    """Read a checkpoint folder and (by default) restore the global RNG states it holds.

    Returns:
        ``step``; ``model_dir`` (the folder ``save_model`` wrote to; load it with the matching
        loader); ``model_state`` (the state dict when the default ``model.pt`` was used, else
        None); ``optimizer`` / ``scheduler`` state dicts (None when not saved);
        ``trainer_state`` (dict); ``rng`` (the snapshot).

    Raises:
        CheckpointError: the folder is incomplete, a file's checksum differs, or a file cannot be
            read (nothing has been restored then).
    """
    folder = Path(path)
    verify_checkpoint(folder)
    try:
        loaded = _read(folder)
    except (OSError, RuntimeError, ValueError, KeyError, EOFError, pickle.UnpicklingError) as e:
        raise CheckpointError(f"{folder} cannot be read: {type(e).__name__}: {str(e)[:300]}") from e
    if restore_rng_states:
        restore_rng(loaded["rng"])
    return loaded


def _read(folder: Path) -> dict[str, Any]:
    step = int(json.loads((folder / MARKER).read_text())["step"])
    rng = _torch_load(folder / "rng.pt")
    model_pt = folder / "model" / "model.pt"
    return {
        "step": step,
        "model_dir": folder / "model",
        "model_state": _torch_load(model_pt) if model_pt.exists() else None,
        "optimizer": _torch_load(folder / "optimizer.pt") if (folder / "optimizer.pt").exists() else None,
        "scheduler": _torch_load(folder / "scheduler.pt") if (folder / "scheduler.pt").exists() else None,
        "trainer_state": json.loads((folder / "trainer_state.json").read_text()),
        "rng": rng,
    }


def resume_latest(
    run_dir: str | Path,
    apply: Callable[[dict[str, Any]], None],
    *,
    restore_rng_states: bool = True,
    warn: Callable[[str], None] = print,
    fatal: tuple[type[BaseException], ...] = (),
) -> tuple[Path, dict[str, Any]] | None:
    """Load the newest checkpoint of ``run_dir`` that verifies, reads and applies; None if none.

    Each complete checkpoint is tried, newest first: :func:`load_checkpoint` (checksums, then
    ``torch.load``), then ``apply(loaded)`` (which puts it into the model, optimizer...; it raises
    when the checkpoint does not fit). A checkpoint that fails is reported through ``warn`` (one
    line, no traceback) and the previous one is tried; its RNG states are restored only once a
    checkpoint has applied. When every checkpoint fails, :class:`CheckpointError` lists why.
    Exceptions of the ``fatal`` types (``apply`` saying the checkpoint belongs to another run,
    say) are not damage: they propagate at once.

    Returns:
        ``(folder, loaded)`` of the checkpoint resumed from, or None when the run has none.
    """
    latest_checkpoint(run_dir)  # removes the leftovers of killed saves
    candidates = step_folders(run_dir)  # an incomplete one is reported too, not skipped in silence
    failures: list[str] = []
    for folder in reversed(candidates):
        try:
            loaded = load_checkpoint(folder, restore_rng_states=False)
            apply(loaded)
        except fatal:
            raise
        except (CheckpointError, KeyError, ValueError, RuntimeError, TypeError) as e:
            reason = str(e.args[0]) if isinstance(e, KeyError) and e.args else str(e)
            failures.append(f"{folder.name}: {reason[:400]}")
            older = "trying the previous checkpoint" if folder != candidates[0] else "no older checkpoint"
            warn(f"checkpoint {folder} cannot be resumed ({reason[:400]}); {older}")
            continue
        if restore_rng_states:
            restore_rng(loaded["rng"])
        return folder, loaded
    if failures:
        raise CheckpointError(
            f"no checkpoint of {run_dir} could be resumed ({'; '.join(failures)}). If the config changed, "
            "resume with the saved one (RUN/config.yaml); otherwise start again with --overwrite"
        )
    return None


def _torch_load(path: Path) -> Any:
    return torch.load(path, map_location="cpu", weights_only=True)


__all__ = [
    "CheckpointError",
    "NonFiniteParametersError",
    "capture_rng",
    "check_finite",
    "complete_checkpoints",
    "incomplete_reason",
    "is_complete",
    "latest_checkpoint",
    "load_checkpoint",
    "restore_rng",
    "resume_latest",
    "save_checkpoint",
    "sha256_file",
    "step_folders",
    "verify_checkpoint",
]


def missing_trained(modules: Any, missing: Any) -> list[str]:
    """The trainable weights of ``modules`` among a load's ``missing`` keys, sorted: a checkpoint or
    state that leaves any of them out was saved with another model or config (frozen weights,
    e.g. a LoRA run's base, are never saved, so their absence is expected)."""
    trainable = {n for n, p in modules.named_parameters() if p.requires_grad}
    return sorted(trainable.intersection(missing))
