"""Asynchronous training (``train.max_staleness`` K > 0) with several trainer ranks (torchrun /
accelerate, data parallel).

One admission controller for the whole run: rank 0 runs the
:class:`~veriloop.algos.loop.async_loop.AsyncSource` (the generation worker, the staleness
scheduler, the prompt ledger ``prompts.jsonl``, the evaluations beside training) exactly as one
process does, and holds the run's only engine or server connection. A step on every rank::

    rank 0     takes the step's groups from the scheduler (oldest first, under the bound K)
    all        broadcast_object: rank 0's batch (episodes, each tagged with its weight version),
               its sampling metrics and its resume point (data cursor, pending problems)
    all        train rows r, r + W, ... of every mini-batch, as the synchronous data-parallel step
               does (the summed gradient is the single-process one; the weights stay identical)
    rank 0     hands the trained weights to its worker (HF copy, or a sync to the vLLM
               engine / servers, probed); the others go on to the next broadcast, which is their
               barrier: no rank trains step t + 1 before rank 0 has the batch of step t + 1

With ``train.parallel=fsdp`` (against vLLM servers only) every rank gathers the whole weights while
rank 0 pushes them, and evaluations run in line (rank 0, whole weights) instead of beside training.

So every admitted problem is trained exactly once (one scheduler takes it, every rank trains its
share of it), and the admission capacity ``(K + v + 1) n`` counts groups over all ranks. A failure
on rank 0 (the worker, the sampler probe) is broadcast, so every rank stops with its message.
"""

from __future__ import annotations

from typing import Any

from veriloop.algos.loop.async_loop import AsyncSource
from veriloop.algos.loop.parts import RunParts, whole_weights
from veriloop.algos.loop.source import BatchSource, StepBatch


class _NoEvals:
    """The ranks other than 0 evaluate nothing; this stands for rank 0's ``EvalBeside`` so that
    every rank takes the same branches of the step body (and the same collectives)."""

    in_flight = None

    def start(self, version: int) -> None:
        return None

    def wait(self) -> None:
        return None

    def finished(self) -> list[tuple[int, dict[str, float]]]:
        return []


class RankedAsyncSource(BatchSource):
    """K > 0 on several ranks: rank 0's :class:`AsyncSource`, its batches broadcast (module docstring)."""

    def __init__(self, run: RunParts) -> None:
        self.run = run
        self.main = AsyncSource(run) if run.dist.is_main else None
        self.evals = self.main.evals if self.main is not None else _NoEvals()  # type: ignore[assignment]
        if run.sharded is not None:  # the copy an evaluation beside training takes needs whole weights:
            self.evals = None  # sharded, rank 0 evaluates in line (all ranks gather)
        self.eval_backend = None

    def start(self) -> None:
        if self.main is not None:
            self.main.start()

    def next_batch(self, step: int) -> StepBatch:
        """Rank 0 takes the batch; every rank gets it, and rank 0's resume point, in one broadcast."""
        run = self.run
        box: tuple[StepBatch, int, dict[str, Any] | None] | None = None
        error: str | None = None
        if self.main is not None:
            try:
                box = (self.main.next_batch(step), run.state.next_seed, run.state.history.get("async"))
            except Exception as err:  # every rank stops, with rank 0's message
                error = f"{type(err).__name__}: {err}"
                run.dist.broadcast_object((None, error))
                raise
        box, error = run.dist.broadcast_object((box, error))
        if error is not None:
            raise RuntimeError(f"rank 0 stopped at step {step}: {error}")
        assert box is not None
        batch, run.state.next_seed, pending = box
        if pending is not None:
            run.state.history["async"] = pending
        return batch

    def hand_over(self, step: int, trained: bool) -> dict[str, float]:
        """Rank 0 hands the weights to its worker; the others wait at the next step's broadcast.
        Sharded (``train.parallel=fsdp``, vLLM servers only): every rank gathers the whole weights
        while rank 0 pushes them."""
        with whole_weights(self.run):
            return self.main.hand_over(step, trained) if self.main is not None else {}

    def step_metrics(self, step: int, batch: StepBatch, wall_s: float) -> dict[str, float | None]:
        return self.main.step_metrics(step, batch, wall_s) if self.main is not None else {}

    def step_note(self, metrics: dict[str, Any]) -> str:
        return self.main.step_note(metrics) if self.main is not None else ""

    def before_checkpoint(self) -> None:
        if self.main is not None:
            self.main.before_checkpoint()

    def close(self, finished: bool) -> None:
        if self.main is not None:
            self.main.close(finished)
