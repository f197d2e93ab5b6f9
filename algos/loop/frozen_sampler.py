"""The frozen initial student: rollouts sampled, for the whole run, with the weights RL started from.

``algo.sampler_weights=initial`` (preset ``semi_opd``): the student being trained is distilled
toward its teacher on rollouts of the *initial* student (the policy after any SFT warm-up), not on
its own. Every step still draws new problems, sampled by the same frozen weights: the same
distribution as one fixed offline set of the initial student's rollouts, drawn as the run needs it.

:class:`InitialSampler` holds those weights (``initial_weights``) and serves them, by engine:

* HF engine: a frozen copy of the policy (``frozen_copy``, one more copy of the model in memory)
  samples every step; the trainer's policy never generates.
* vLLM in-process or on servers: the engine is never handed the trained weights after an update
  (``SyncSource.hand_over`` skips the sync). A resumed run's engine, built from the restored
  (trained) weights, is loaded with the initial ones (``load_engine``); an in-line evaluation on
  the engine (``eval.backend: rollout``) loads the trained weights for the evaluation and the
  initial ones back after it (``trained_on_engine``). Each load of the initial weights is probed
  against them (``sync_probe``: the sampler must serve the initial student, not the trained one).

Resume: a fresh run saves the initial weights (the trainable tensors, a checkpoint's
``model.pt`` keys) to ``RUN/initial_sampler.pt`` before its first step; a run resumed after step 0
reads them back, so its sampler restarts from the initial weights, never from the checkpoint's.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from veriloop.agents.policy import Policy
from veriloop.algos.loop.parts import RunParts
from veriloop.configs.schema import ConfigError

#: The initial weights of a frozen-sampler run, in its folder.
INITIAL_FILE = "initial_sampler.pt"
#: What the sampler must serve, in the sync probe's message.
SERVES = "the initial student's weights (algo.sampler_weights=initial)"


def policy_weights(policy: Policy) -> dict[str, torch.Tensor]:
    """A copy of the policy's trainable tensors (LoRA adapters, or all weights), by parameter name."""
    return {n: p.detach().clone() for n, p in policy.model.named_parameters() if p.requires_grad}


def _put(model: torch.nn.Module, weights: dict[str, torch.Tensor]) -> None:
    params = dict(model.named_parameters())
    missing = sorted(set(weights) - set(params))
    if missing:
        raise KeyError(f"the initial sampler's weights name parameters this model lacks: {missing[:3]}")
    with torch.no_grad():
        for name, tensor in weights.items():
            params[name].copy_(tensor)


@contextlib.contextmanager
def holding(policy: Policy, weights: dict[str, torch.Tensor]) -> Iterator[None]:
    """``policy`` holds ``weights`` inside; its own are put back after, also when the body raises."""
    own = {n: p.detach().clone() for n, p in policy.model.named_parameters() if n in weights}
    _put(policy.model, weights)
    try:
        yield
    finally:
        _put(policy.model, own)


def frozen_copy(policy: Policy, weights: dict[str, torch.Tensor]) -> Policy:
    """A copy of ``policy`` holding ``weights``, in eval mode and without gradients (it never trains)."""
    frozen = policy.frozen_copy()
    _put(frozen.model, weights)
    return frozen


def initial_weights(run: RunParts) -> dict[str, torch.Tensor]:
    """Before the first RL step (``state.step`` 0): the policy's weights now, saved when the run can be
    resumed (``run.checkpoint_every`` > 0). After it: the saved ones, or a clear error."""
    path = Path(run.run_dir) / INITIAL_FILE
    if run.state.step == 0:
        weights = policy_weights(run.policy)
        if run.dist.is_main and run.cfg.run.checkpoint_every > 0:
            tmp = path.with_suffix(".tmp")
            torch.save(weights, tmp)
            os.replace(tmp, path)  # whole or absent: a kill mid-save leaves the previous file
        return weights
    if not path.is_file():
        raise ConfigError(
            f"cannot resume {run.run_dir} at step {run.state.step} with algo.sampler_weights=initial: "
            f"{path} (the initial student's weights the sampler keeps) is missing; start the run again "
            "(--overwrite)"
        )
    loaded: dict[str, torch.Tensor] = torch.load(path, weights_only=True)
    return loaded


class InitialSampler:
    """What samples a frozen-sampler run's rollouts (module docstring).

    Attributes:
        weights: the initial student's trainable tensors.
        policy: the policy the rollouts are played with: the frozen copy (HF engine), or the
            trainer's own (a vLLM engine generates; the policy only formats the chat).
        metrics: ``sync/probe_gap`` and the load's time, until the source logs them.
    """

    def __init__(self, run: RunParts) -> None:
        self.run = run
        self.weights = initial_weights(run)
        self.policy = frozen_copy(run.policy, self.weights) if run.backend is None else run.policy
        self.metrics: dict[str, float] = {}
        if run.backend is not None and run.state.step > 0:  # resumed: the engine holds trained weights
            self.load_engine()

    def load_engine(self) -> None:
        """Push the initial weights to the engine and probe that it serves them (``sync_probe``,
        against the policy while it holds them: the check is the same, of other weights)."""
        run, t0 = self.run, time.perf_counter()
        assert run.backend is not None
        with holding(run.policy, self.weights):
            run.backend.sync()
            self.metrics = {"time/weight_sync_s": time.perf_counter() - t0}
            if run.cfg.train.sync_probe:
                from veriloop.algos.run.sync_probe import check_sampler

                t1 = time.perf_counter()
                gap = check_sampler(
                    run.policy,
                    run.backend,
                    version=run.state.step,
                    tolerance=run.cfg.train.sync_probe_tolerance,
                    serves=SERVES,
                )
                self.metrics.update({"sync/probe_gap": gap, "time/sync_probe_s": time.perf_counter() - t1})

    @contextlib.contextmanager
    def trained_on_engine(self) -> Iterator[None]:
        """The engine serves the trained weights inside (an evaluation), the initial ones after."""
        backend = self.run.backend
        if backend is None:  # the HF engine: evaluations use the trainer's policy itself
            yield
            return
        backend.sync()
        try:
            yield
        finally:
            self.load_engine()
