"""``kill -9`` a training run at a bad moment, ``--resume`` it, and get bitwise the same run.

The run under test is a subprocess on the tiny model (3 steps, a checkpoint after every step).
``VERILOOP_TEST_SAVE_DELAY`` (read in ``algos/loop/train.py``) makes every checkpoint save pause after
writing the weights, so the test can kill the process while a save is half done. The resumed
run must end with exactly the weights and metrics of an uninterrupted run.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from veriloop.agents.testing import TINY_MATH_GRPO
from veriloop.algos.loop.parts import SAVE_DELAY_ENV
from veriloop.algos.run.log import read_metrics

STEPS = 3
OVERRIDES = [
    *TINY_MATH_GRPO,
    f"train.steps={STEPS}",
    "train.micro_batch_size=2",
    "train.lr=1e-2",
    "train.mini_batch_size=2",
    "eval.num_problems=1",
    "eval.n_samples=1",
    "eval.k_list=[1]",
    "eval.greedy=false",
    "eval.every=0",
    "run.tensorboard=false",
    "run.checkpoint_every=1",
    "run.keep_last=2",
]
RUNNER = (
    "import sys; from veriloop.configs.loader import load_config; from veriloop.algos.loop.train import train; "
    "train(load_config(None, sys.argv[1:]), resume=True, quiet=True)"
)
#: Wall-clock values differ between any two runs; everything else must match exactly.
TIMING = ("time", "time/", "throughput/")


def start(out: Path, name: str, delay: float = 0.0, extra: tuple[str, ...] = ()) -> subprocess.Popen[bytes]:
    env = {**os.environ, SAVE_DELAY_ENV: str(delay), "OMP_NUM_THREADS": "1"}  # same threads => same sums
    args = [sys.executable, "-c", RUNNER, *OVERRIDES, *extra, f"run.out_dir={out}", f"run.name={name}"]
    return subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def finish(proc: subprocess.Popen[bytes], timeout: float = 240) -> None:
    _, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, err.decode()[-3000:]


def wait_for(proc: subprocess.Popen[bytes], found, timeout: float = 240) -> None:  # type: ignore[no-untyped-def]
    end = time.monotonic() + timeout
    while not found():
        assert proc.poll() is None, (
            f"the run ended before the kill point: {proc.stderr.read().decode()[-3000:]}"
        )  # type: ignore[union-attr]
        assert time.monotonic() < end, "the run never reached the kill point"
        time.sleep(0.02)


def kill9(proc: subprocess.Popen[bytes]) -> None:
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()


def final_state(run_dir: Path) -> tuple[dict[str, torch.Tensor], list[dict]]:
    weights = torch.load(
        run_dir / "checkpoints" / f"step-{STEPS:06d}" / "model" / "model.pt", weights_only=True
    )
    rows = [{k: v for k, v in r.items() if not k.startswith(TIMING)} for r in read_metrics(run_dir)]
    return weights, rows


def assert_same_run(a: Path, b: Path) -> None:
    (wa, ra), (wb, rb) = final_state(a), final_state(b)
    assert wa.keys() == wb.keys()
    differ = [k for k in wa if not torch.equal(wa[k], wb[k])]
    assert not differ, f"resumed weights differ in {differ[:3]}"
    assert ra == rb
    assert [r["step"] for r in rb] == [0, 1, 2, 3]  # one row per step, none twice


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("reference")
    finish(start(out, "ref"))
    return out / "ref"


def test_kill_during_checkpoint_save_then_resume(tmp_path: Path, reference: Path) -> None:
    """Killed while step 2's checkpoint is half written: resumes from step 1, ends identical."""
    ckpts = tmp_path / "run" / "checkpoints"
    proc = start(tmp_path, "run", delay=3.0)  # every save pauses 3 s after writing the weights
    wait_for(proc, lambda: any(ckpts.glob(".tmp-step-000002-*/model/model.pt")))
    kill9(proc)
    assert [p.name for p in ckpts.glob("step-*")] == ["step-000001"]  # step 2 never committed
    assert any(ckpts.glob(".tmp-step-000002-*"))
    finish(start(tmp_path, "run"))
    assert not any(ckpts.glob(".tmp-*")), "the half-written save was not cleaned up"
    assert sorted(p.name for p in ckpts.glob("step-*")) == ["step-000002", "step-000003"]  # keep_last=2
    assert_same_run(reference, tmp_path / "run")


def test_resume_from_a_late_checkpoint_is_bit_exact(tmp_path: Path, reference: Path) -> None:
    """Killed while step 3's checkpoint is half written: resumes from step 2 (after two LoRA
    merge/unmerge cycles of sampling), ends identical to the uninterrupted run."""
    ckpts = tmp_path / "run" / "checkpoints"
    proc = start(tmp_path, "run", delay=3.0)
    wait_for(proc, lambda: any(ckpts.glob(".tmp-step-000003-*/model/model.pt")))
    kill9(proc)
    assert sorted(p.name for p in ckpts.glob("step-*")) == ["step-000001", "step-000002"]
    finish(start(tmp_path, "run"))
    assert_same_run(reference, tmp_path / "run")


@pytest.mark.slow
def test_kill_between_checkpoints_then_resume(tmp_path: Path, reference: Path) -> None:
    """Killed right after step 1's checkpoint (during step 2's rollout), twice resumed: identical."""
    ckpts = tmp_path / "run" / "checkpoints"
    proc = start(tmp_path, "run")
    wait_for(proc, lambda: (ckpts / "step-000001" / "COMPLETE").exists())
    kill9(proc)
    finish(start(tmp_path, "run"))
    assert_same_run(reference, tmp_path / "run")


#: The same run with an SFT warm-up first (2 steps on the generator's worked solutions).
SFT = ("sft.source=generator", "sft.steps=2", "sft.examples=4")


def test_a_run_cut_after_its_warm_up_resumes_without_redoing_it(tmp_path: Path) -> None:
    """The warm-up is checkpointed as step 0: killed right after that save, the resumed run skips the
    warm-up (its log is untouched) and ends bitwise where an uncut run with the same warm-up ends."""
    finish(start(tmp_path, "ref", extra=SFT))
    ckpts = tmp_path / "run" / "checkpoints"
    proc = start(tmp_path, "run", extra=SFT)
    wait_for(proc, lambda: (ckpts / "step-000000" / "COMPLETE").exists())
    kill9(proc)
    sft_log = tmp_path / "run" / "sft" / "metrics.jsonl"
    before = sft_log.stat().st_mtime_ns
    finish(start(tmp_path, "run", extra=SFT))
    assert sft_log.stat().st_mtime_ns == before, "the resumed run redid the SFT warm-up"
    assert_same_run(tmp_path / "ref", tmp_path / "run")
