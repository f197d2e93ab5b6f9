"""Tests for veriloop.algos.run.checkpoint: atomic saves, crash recovery, bitwise-exact resume."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from veriloop.algos.run.checkpoint import (
    CheckpointError,
    NonFiniteParametersError,
    capture_rng,
    latest_checkpoint,
    load_checkpoint,
    restore_rng,
    save_checkpoint,
)

# A tiny training run that resumes from its latest checkpoint and checkpoints after every step.
# Dropout and torch/numpy/python random data: every RNG matters for the result. The script is a
# fork server: it imports torch once, then forks one training process per JSON command read from
# stdin and reports its pid, so the test can SIGKILL real processes without paying the import
# each time. ``delay`` sleeps around every write so that a kill very likely lands mid-save.
TRAIN_SERVER = r"""
import json, os, random, sys, time, traceback
from pathlib import Path
import numpy as np, torch
from veriloop.algos.run import checkpoint as ck

torch.set_num_threads(1)
torch.optim.AdamW(torch.nn.Linear(1, 1).parameters())  # warm up lazy imports once, before forking

def slow(fn, delay):
    def wrapped(*a, **kw):
        time.sleep(delay)
        out = fn(*a, **kw)
        time.sleep(delay)
        return out
    return wrapped

def train(run_dir, total, trace=None, delay=0.0):
    run_dir = Path(run_dir)
    if delay:
        ck._torch_save, ck._write_file, ck.fsync_dir = (
            slow(ck._torch_save, delay), slow(ck._write_file, delay), slow(ck.fsync_dir, delay))
    torch.manual_seed(0); np.random.seed(0); random.seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Dropout(0.3), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    start, losses = 0, []
    latest = ck.latest_checkpoint(run_dir)
    if latest is not None:
        state = ck.load_checkpoint(latest)
        model.load_state_dict(state["model_state"])
        opt.load_state_dict(state["optimizer"])
        sched.load_state_dict(state["scheduler"])
        start, losses = state["trainer_state"]["step"], state["trainer_state"]["losses"]
    print(json.dumps({"ready": start}), flush=True)
    for step in range(start, total):
        x = torch.randn(32, 4)
        y = x.sum(1, keepdim=True) + float(np.random.normal()) * 0.1
        loss = ((model(x) - y) ** 2).mean() * random.uniform(0.5, 1.5)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        losses.append(loss.item())
        if trace is not None:
            torch.save(model.state_dict(), Path(trace) / f"{step + 1}.pt")
        ck.save_checkpoint(run_dir, step + 1, model=model, optimizer=opt, scheduler=sched,
                           trainer_state={"step": step + 1, "losses": losses}, keep_last=2)
    torch.save({"model": model.state_dict(), "losses": losses}, run_dir / "final.pt")

for line in sys.stdin:
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            train(**json.loads(line))
        except BaseException:
            traceback.print_exc()
            code = 1
        sys.stdout.flush()
        os._exit(code)
    print(json.dumps({"pid": pid}), flush=True)
    _, status = os.waitpid(pid, 0)
    print(json.dumps({"exit": os.waitstatus_to_exitcode(status)}), flush=True)
"""

# Each save sleeps >= 9 x 2 x 5 ms, so a process killed 0.15 s after it is ready commits at most
# 2 steps: 12 kills can never reach the end, and the run only finishes after the last kill.
TOTAL_STEPS = 30


class TrainServer:
    """Drives TRAIN_SERVER: start a training process, optionally SIGKILL it, get its exit code."""

    def __init__(self) -> None:
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen(
            [sys.executable, "-c", TRAIN_SERVER],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )

    def _read(self) -> dict[str, int]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line, "the training server died"
        return json.loads(line)

    def run(self, kill_after: float | None = None, **cmd: object) -> int:
        """Start ``train(**cmd)``; SIGKILL it ``kill_after`` seconds after it is ready."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        seen: dict[str, int] = {}
        while not ("pid" in seen and "ready" in seen):  # the two lines may come in either order
            msg = self._read()
            if "exit" in msg:  # failed before getting ready
                return msg["exit"]
            seen.update(msg)
        if kill_after is not None:
            time.sleep(kill_after)
            try:
                os.kill(seen["pid"], signal.SIGKILL)
            except ProcessLookupError:
                pass  # already finished
        return self._read()["exit"]

    def close(self) -> None:
        if self.proc.stdin:
            self.proc.stdin.close()
        self.proc.wait(timeout=30)


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_sigkill_at_any_moment_then_resume_is_bitwise_exact(tmp_path: Path) -> None:
    server = TrainServer()
    try:
        trace, ref_dir = tmp_path / "trace", tmp_path / "reference"
        trace.mkdir()
        assert server.run(run_dir=str(ref_dir), total=TOTAL_STEPS, trace=str(trace)) == 0
        reference = torch.load(ref_dir / "final.pt", weights_only=True)

        run_dir, timing = tmp_path / "crashy", random.Random(1234)
        kills, mid_save_kills, finished = 0, 0, False
        for _attempt in range(60):
            kill_after = timing.uniform(0.0, 0.15) if kills < 12 else None
            code = server.run(kill_after=kill_after, run_dir=str(run_dir), total=TOTAL_STEPS, delay=0.005)
            if code == 0:
                finished = True
                break
            assert code == -signal.SIGKILL, f"training process failed with exit code {code}"
            kills += 1
            root = run_dir / "checkpoints"
            mid_save_kills += root.is_dir() and any(p.name.startswith(".tmp-") for p in root.iterdir())
            latest = latest_checkpoint(run_dir)
            if latest is not None:
                # the newest complete checkpoint loads and equals the uninterrupted run at that step
                state = load_checkpoint(latest, restore_rng_states=False)
                assert state["step"] == int(latest.name.split("-")[1])
                assert _same(
                    state["model_state"], torch.load(trace / f"{state['step']}.pt", weights_only=True)
                )
                assert state["trainer_state"]["losses"] == reference["losses"][: state["step"]]
                assert not [p for p in root.iterdir() if p.name.startswith(".")]  # stale temp dirs cleaned
    finally:
        server.close()
    assert finished, "the resumed run never finished"
    assert kills >= 12
    assert mid_save_kills >= 1, "no kill landed in the middle of a save; the test did not exercise it"
    final = torch.load(run_dir / "final.pt", weights_only=True)
    assert _same(final["model"], reference["model"])
    assert final["losses"] == reference["losses"]
    assert len(list((run_dir / "checkpoints").iterdir())) == 2  # keep_last


def _model() -> torch.nn.Module:
    return torch.nn.Linear(3, 2)


def test_rng_round_trip() -> None:
    snapshot = capture_rng()
    first = (random.random(), float(np.random.rand()), float(torch.rand(1)))
    restore_rng(snapshot)
    assert (random.random(), float(np.random.rand()), float(torch.rand(1))) == first


def test_refuses_non_finite_parameters_and_keeps_previous(tmp_path: Path) -> None:
    model = _model()
    good = save_checkpoint(tmp_path, 1, model=model)
    with torch.no_grad():
        model.weight[0, 0] = float("nan")
    with pytest.raises(NonFiniteParametersError, match=r"weight"):
        save_checkpoint(tmp_path, 2, model=model)
    assert latest_checkpoint(tmp_path) == good
    assert not (tmp_path / "checkpoints" / "step-000002").exists()


def test_keep_last_prunes_oldest(tmp_path: Path) -> None:
    model = _model()
    for step in range(1, 6):
        save_checkpoint(tmp_path, step, model=model, keep_last=2)
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == ["step-000004", "step-000005"]


def test_latest_ignores_incomplete_and_cleans_stale_temp(tmp_path: Path) -> None:
    model = _model()
    good = save_checkpoint(tmp_path, 3, model=model, trainer_state={"step": 3})
    root = tmp_path / "checkpoints"
    (root / "step-000009").mkdir()  # no marker
    broken = save_checkpoint(tmp_path, 7, model=model, keep_last=5)
    with open(broken / "rng.pt", "r+b") as f:  # truncated after commit: manifest size mismatch
        f.truncate(10)
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    stale = root / f".tmp-step-000010-{int(dead.stdout)}"
    stale.mkdir()
    ours = root / f".tmp-step-000011-{os.getpid()}"
    ours.mkdir()
    assert latest_checkpoint(tmp_path) == good
    assert not stale.exists() and ours.exists()  # a live process's save is left alone
    with pytest.raises(CheckpointError, match="not a complete checkpoint"):
        load_checkpoint(broken)
    assert latest_checkpoint(tmp_path / "nothing-here") is None


def test_custom_save_model_and_state(tmp_path: Path) -> None:
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(1, 3)).sum().backward()
    opt.step()

    def save_adapter(folder: Path) -> None:
        (folder / "adapter.json").write_text(json.dumps({"r": 4}))

    path = save_checkpoint(
        tmp_path,
        5,
        model=model,
        save_model=save_adapter,
        optimizer=opt,
        trainer_state={"step": 5, "seed_position": 40},
    )
    state = load_checkpoint(path)
    assert json.loads((state["model_dir"] / "adapter.json").read_text()) == {"r": 4}
    assert state["model_state"] is None and state["scheduler"] is None
    assert state["trainer_state"] == {"step": 5, "seed_position": 40}
    assert torch.equal(state["optimizer"]["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])
    # re-saving an existing step replaces it atomically
    again = save_checkpoint(tmp_path, 5, model=model, trainer_state={"step": 5, "seed_position": 41})
    assert load_checkpoint(again)["trainer_state"]["seed_position"] == 41
