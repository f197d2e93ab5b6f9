"""Evaluation beside asynchronous training: neither generation nor the update waits for it.

When an evaluation is due after step s, the trainer copies its trained weights (version s) into an
evaluation copy of the policy and goes on; a thread evaluates that copy with the HF engine and the
trainer logs the result, tagged ``async/eval_version = s``, in its own row with ``step = s`` as soon
as it is done (the synchronous loop logs the same numbers in step s's row). One evaluation runs at
a time: a new one waits for the previous one to finish. The last step's evaluation is the
trainer's own, in that step's row, after every earlier one is logged.

A kill loses an evaluation in flight. The checkpoint taken at step s records that the evaluation of
version s was pending; a run resumed from that checkpoint holds exactly those weights and evaluates
them first. An evaluation of weights no checkpoint kept is not redone.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from veriloop.agents.policy import Policy
from veriloop.algos.loop.async_worker import HFWeights
from veriloop.configs.schema import ExperimentConfig

#: ``(policy, version) -> eval metrics``: the trainer's evaluation of one weight version.
Evaluate = Callable[[Policy, int], dict[str, float]]


class EvalBeside:
    """Evaluates weight versions of ``policy`` on a thread of its own (see the module docstring).

    Args:
        policy: the trainer's policy (copied once, lazily; the copy never trains).
        evaluate: runs the evaluation of a policy at a version (``in_training.evaluate_step`` in the loop).
    """

    def __init__(self, policy: Policy, evaluate: Evaluate) -> None:
        self._policy, self._evaluate = policy, evaluate
        self._weights: HFWeights | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._done: list[tuple[int, dict[str, float]]] = []
        self._error: BaseException | None = None
        self._version: int | None = None

    def start(self, version: int) -> None:
        """Trainer thread, right after step ``version``: snapshot the weights and evaluate them."""
        self.wait()
        if self._weights is None:
            self._weights = HFWeights(self._policy, version)  # a copy of the weights as they are now
        else:
            self._weights.publish(version, self._policy)
            self._weights.load(version)
            self._weights.keep_only({version})
        self._version = version
        self._thread = threading.Thread(target=self._run, args=(version,), name="veriloop-eval", daemon=True)
        self._thread.start()

    def _run(self, version: int) -> None:
        try:
            assert self._weights is not None
            metrics = dict(self._evaluate(self._weights.policy, version))
            metrics["async/eval_version"] = float(version)
            with self._lock:
                self._done.append((version, metrics))
        except BaseException as err:  # handed to the trainer, which raises it
            with self._lock:
                self._error = err

    def finished(self) -> list[tuple[int, dict[str, float]]]:
        """Evaluations done since the last call, as ``(version, metrics)``; raises an evaluation's error."""
        with self._lock:
            if self._error is not None:
                raise RuntimeError(f"the evaluation beside training failed: {self._error!r}") from self._error
            done, self._done = self._done, []
        return done

    @property
    def in_flight(self) -> int | None:
        """The version being evaluated now, or None."""
        alive = self._thread is not None and self._thread.is_alive()
        return self._version if alive else None

    def wait(self) -> None:
        """Block until the evaluation in flight (if any) is done."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        with self._lock:
            if self._error is not None:
                raise RuntimeError(f"the evaluation beside training failed: {self._error!r}") from self._error


def eval_due(cfg: ExperimentConfig, step: int) -> bool:
    """Evaluate after ``step`` steps? Every ``eval.every`` steps, and after the last."""
    return bool(cfg.eval.every and step % cfg.eval.every == 0) or step == cfg.train.steps
