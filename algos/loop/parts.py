"""One run's records: what the loop reads and updates (:class:`RunParts`), what a resumed run needs
besides the weights (:class:`TrainerState`), and saving both (``checkpoint_run``).
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from veriloop.agents.backends.base import ServingBackend
from veriloop.agents.policy import Policy
from veriloop.algos.learner.algorithm import Algorithm
from veriloop.algos.learner.critic import ValueModel
from veriloop.algos.run.checkpoint import check_finite, save_checkpoint
from veriloop.algos.run.distributed import DistContext
from veriloop.algos.run.log import RunLog
from veriloop.algos.run.samples import SampleLog
from veriloop.algos.run.setup import trainable_state
from veriloop.configs.schema import ExperimentConfig

if TYPE_CHECKING:
    from veriloop.algos.run.fsdp import Sharded


@dataclass
class TrainerState:
    """Everything besides weights/optimizer that a resumed run needs to continue exactly."""

    step: int = 0
    next_seed: int = 0
    consecutive_nonfinite: int = 0
    skipped_steps: int = 0
    uninformative_in_a_row: int = 0
    truncation_warned: bool = False
    sft_done: bool = False
    history: dict[str, Any] = field(default_factory=dict)


@dataclass
class RunParts:
    """Everything one run's loop reads and updates, built once by ``train``."""

    cfg: ExperimentConfig
    algo: Algorithm  # cfg.algo's parts, looked up once (algorithm.resolve)
    policy: Policy
    critic: ValueModel | None
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    state: TrainerState
    generator: torch.Generator  # mini-batch shuffling; checkpointed with the state
    run_dir: Path
    dist: DistContext
    quiet: bool
    log: RunLog | None = None  # rank 0 only
    samples: SampleLog | None = None  # rank 0 only: run.log_samples episodes of every step as text
    backend: ServingBackend | None = None  # vLLM (in-process or servers); None = the HF engine
    sharded: Sharded | None = None  # under train.parallel=fsdp with several ranks, else None


def whole_weights(run: RunParts, needed: bool = True) -> contextlib.AbstractContextManager[None]:
    """Sharded runs: every rank holds the policy's whole weights inside (``fsdp.Sharded.gathered``),
    so a rank may generate, evaluate or send weights alone. Otherwise (or not ``needed``): nothing."""
    return run.sharded.gathered() if run.sharded is not None and needed else contextlib.nullcontext()


def eval_backend(run: RunParts) -> ServingBackend | None:
    """The engine in-line evaluations sample with: the rollouts' (``eval.backend: rollout``) or HF (None)."""
    return run.backend if run.cfg.eval.backend == "rollout" else None


#: Test hook: seconds to sleep inside a checkpoint save, after the weights are written and before
#: the rest, so a test can ``kill -9`` the process mid-save (tests/algos/loop/test_train_resume.py).
SAVE_DELAY_ENV = "VERILOOP_TEST_SAVE_DELAY"


def checkpoint_run(run: RunParts) -> None:
    """Atomic save (see ``algos/run/checkpoint.py``); refuses non-finite weights, keeps the last K."""
    state = run.state
    trainer_state = {"state": dict(state.__dict__), "generator": run.generator.get_state().tolist()}
    delay = float(os.environ.get(SAVE_DELAY_ENV, "0") or 0)
    if run.sharded is not None:  # every rank: its shards, then rank 0 commits (sharded_checkpoint.py)
        from veriloop.algos.run.fsdp import state_modules
        from veriloop.algos.run.sharded_checkpoint import save_sharded

        save_sharded(
            run.run_dir,
            state.step,
            dist=run.dist,
            modules=state_modules(run.policy, run.critic),
            optimizer=run.optimizer,
            scheduler=run.scheduler,
            trainer_state=trainer_state,
            keep_last=run.cfg.run.keep_last,
            delay_s=delay,
        )
        return
    weights = trainable_state(run.policy, run.critic)
    check_finite(weights.items())  # the critic too; save_checkpoint checks the policy model again

    def save_model(folder: Path) -> None:
        torch.save(weights, folder / "model.pt")
        if delay > 0:  # test hook (SAVE_DELAY_ENV): a window to kill the process mid-save
            time.sleep(delay)

    save_checkpoint(
        run.run_dir,
        state.step,
        model=run.policy.model,
        save_model=save_model,
        optimizer=run.optimizer,
        scheduler=run.scheduler,
        trainer_state=trainer_state,
        keep_last=run.cfg.run.keep_last,
    )
