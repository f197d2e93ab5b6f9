"""``veriloop/ReasoningGym-v0``: any reasoning-gym dataset as a veriloop verifier environment.

reasoning-gym (``pip install 'veriloop[reasoning-gym]'``) has ~100 procedural task generators, each
with its own scorer. This env draws one of a dataset's items per episode and scores the model's
answer with that dataset's own ``score_answer``::

    env = gymnasium.make("veriloop/ReasoningGym-v0", dataset="chain_sum", config={"size": 1000})
    obs, info = env.reset(seed=0)        # obs: the question + the answer format
    env.step("... <answer>-6299</answer>")   # reward = reasoning-gym's score in [0, 1]

* **Which item.** The dataset is built once with ``config`` (reasoning-gym's own options for that
  dataset, e.g. ``size``, ``min_terms``); its ``seed`` defaults to 0 so the item list is fixed, and
  an episode draws an index from ``self.np_random`` within its ``part``: ``train`` (default) the first
  80% of ``[0, size)``, ``heldout`` (the ``id`` evaluation's) the rest (reasoning-gym's default size is
  usually 500; pass ``config={"size": N}`` for more variety).
* **Answer format.** The model's final answer is read with veriloop's hardened extractor
  (:func:`veriloop.envs.verifiers.extract_answer`): the last ``<answer>...</answer>`` or ``\\boxed{...}``
  (text after ``</think>`` only, size-capped). No answer: reason ``"no_answer"``, reward 0.
* **Scoring is untrusted code on hostile text, so it runs jailed.** Many reasoning-gym scorers hand
  the answer to ``eval`` or sympy's ``parse_expr``. ``puzzle24`` and ``countdown`` are scored by our
  own safe formula checks instead (:mod:`veriloop.interop.reasoning_gym_scorers`; ``puzzle24`` also
  checks the dealt numbers). Every other answer goes to a scorer worker
  (:func:`veriloop.envs.verifiers.pool.get_scorer_pool`, apart from the math workers, almost empty
  environment), which rebuilds the same dataset, regenerates item ``index``, checks the question
  matches (a dataset that is not reproducible is a ``"crash"``, never a silently wrong score) and
  runs ``score_answer`` in a fresh jail (:mod:`veriloop.envs.verifiers.sandbox`: no network, no
  file outside a private folder, no environment, no reply channel, deadline ``timeout_s``). A
  timeout / crash / memory error is a ``Verdict.error`` (episode truncated, reward 0, excluded by
  trainers), never a wrong answer. Code running in the jail could still write the jail's reply, so
  no model text reaches an ``eval``-based parser (:mod:`veriloop.interop.reasoning_gym_guard`): an
  answer to a ``parse_expr`` scorer must pass a strict math grammar (else reason ``"unparseable"``,
  reward 0, no scorer called), and scorers that ``eval`` a list read it with ``ast.literal_eval``.
* **Reward** = the score (partial credit kept: reason ``"partial"`` for ``0 < score < 1``);
  ``correct`` means a score of 1. ``info["reward_components"] == {"score": score}``. Except a
  hedge: many scorers pay an answer that offers several candidates (``"350 or 0"`` scored 1.0 in
  ``gsm_symbolic``; reasoning-gym's *default* scorer gives ``len(gold) / len(answer)`` to any answer
  that merely *contains* the gold). A hedge is scored 0 before any scorer runs (reason ``"hedged"``;
  :func:`~veriloop.interop.reasoning_gym_guard.is_hedge`: a separator the gold does not use, such as
  ``or``, ``;``, a comma or a second line; two numbers where the gold is one; two words side by side
  where the gold has none; or the gold next to other text), and where the default
  rule is the scorer any partial score is 0 too; ``substring_credit=True`` keeps the scorers' own
  credit for hedges.
* **Multi-turn.** ``max_attempts > 1`` gives retries with "Incorrect" feedback (the gold is never
  shown), as every :class:`~veriloop.envs.VerifierEnv`.

``info["task"]``: ``{"dataset", "index", "question", "answer", "metadata"}`` (reasoning-gym's entry,
made JSON-safe; not for the policy). ``reset(options={"task": {"index": i}})`` pins item ``i``.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
from functools import lru_cache
from typing import Any, ClassVar

from veriloop.envs.base import MAX_TEXT_CHARS, VerifierEnv
from veriloop.envs.datasets import DEFAULT_HELDOUT_FRACTION, Part, index_range
from veriloop.envs.json_safe import json_safe
from veriloop.envs.verifiers import Verdict, VerifierError, extract_answer
from veriloop.envs.verifiers import stats as verifier_stats
from veriloop.envs.verifiers.pool import get_scorer_pool
from veriloop.interop._extras import require
from veriloop.interop.reasoning_gym_guard import disarm_eval, is_hedge, math_screen
from veriloop.interop.reasoning_gym_scorers import SAFE_SCORERS, safe_score

ENV_ID = "veriloop/ReasoningGym-v0"
DEFAULT_TIMEOUT_S = 10.0
SCORER_GRACE_S = 2.0  # the scorer worker kills a late jail itself; the pool kills the worker after this
#: The scorer worker's task: this module's :func:`score_in_worker`, named as an entry point (the worker,
#: in ``veriloop.envs``, imports it on first use and names no upper package itself).
SCORER_TASK = "veriloop.interop.reasoning_gym_env:score_in_worker"
FORMAT_LINE = "Put your final answer alone inside <answer></answer> tags at the end of your reply."
NO_ANSWER_FEEDBACK = "No final answer found: put it inside <answer></answer> tags."
HEDGE_FEEDBACK = "Incorrect: give exactly one answer, nothing around it."
NOT_MATH_FEEDBACK = "Incorrect: the answer must be one expression of numbers, operators and math functions."
_ERRORS: dict[str, verifier_stats.StatName] = {
    "timeout": "timeouts",
    "memory": "memory_errors",
    "crash": "crashes",
}


def _build(name: str, config_json: str) -> Any:
    rg = require("reasoning_gym", "reasoning-gym", ENV_ID)
    return rg.create_dataset(name, **json.loads(config_json))


@lru_cache(maxsize=16)
def _cached_dataset(name: str, config_json: str) -> Any:
    """One dataset per (name, config) in a worker process: rebuilt once, reused for every request."""
    return _build(name, config_json)


_WARMED: set[tuple[str, str]] = set()


def _warm(name: str, config_json: str, data: Any, entry: Any) -> None:
    """Score the item's own gold answer once per dataset, in the scorer worker (trusted text): the
    modules a scorer imports lazily are imported here, before any jail is locked in its ``chroot``."""
    if (name, config_json) in _WARMED:
        return
    try:
        data.score_answer(str(entry.get("answer", "")), entry)
    except Exception:  # noqa: BLE001 - a warm-up only: the jailed call reports real failures
        pass
    _WARMED.add((name, config_json))


def score_in_worker(
    name: str, config_json: str, index: int, question: str, answer: str, timeout: float = DEFAULT_TIMEOUT_S
) -> list[Any]:
    """Runs INSIDE the scorer worker: reasoning-gym's score of ``answer`` on item ``index``, as
    ``[status, value]`` (``["ok", score]``, or ``"timeout"`` / ``"memory"`` / ``"crash"`` and a message).

    The dataset is rebuilt in the worker (trusted code on a trusted config); ``score_answer``, which
    sees the model's text, runs in a jail of its own (:func:`~veriloop.envs.verifiers.sandbox.run_jailed`)
    under the deadline ``timeout``, and never ``eval``'s it: an answer outside a math dataset's
    grammar scores 0 here without reaching the scorer, and a literal dataset's ``eval`` is
    :func:`ast.literal_eval` (:mod:`veriloop.interop.reasoning_gym_guard`). Raises (reported as a ``"crash"`` verdict) when the regenerated
    item's question is not ``question``: the dataset is not reproducible from its config.
    """
    from veriloop.envs.verifiers.sandbox import run_jailed

    if not math_screen(name, answer):  # no model text reaches parse_expr, whoever calls this task
        return ["ok", 0.0]
    data = _cached_dataset(name, config_json)
    entry = data[index]
    if entry["question"] != question:
        raise RuntimeError(
            f"{name}[{index}] regenerated a different question: the dataset is not reproducible"
        )
    _warm(name, config_json, data, entry)
    disarm_eval(data, name)  # a scorer that eval's a list the model wrote reads it as a literal
    status, value = run_jailed(data.score_answer, (answer, entry), timeout)
    if status == "ok" and not 0.0 <= value <= 1.0:
        return ["crash", f"{name}.score_answer returned {value!r}, expected a number in [0, 1]"]
    return [status, value]


class ReasoningGymEnv(VerifierEnv[dict]):
    """A reasoning-gym dataset behind the veriloop verify loop (see the module docstring).

    Args:
        dataset: reasoning-gym dataset name (``reasoning_gym.factory.DATASETS``), e.g. ``"chain_sum"``.
        config: That dataset's options (its config dataclass fields); must be JSON-serialisable.
            ``seed`` defaults to 0 when the config has one.
        part, heldout_fraction: Which items: ``train`` (default) draws from the first
            ``1 - heldout_fraction`` of ``[0, size)``, ``heldout`` (the ``id`` evaluation) from the
            rest, ``all`` from every index (:func:`veriloop.envs.datasets.index_range`).
        max_attempts: Answers allowed per episode (1 = single turn).
        substring_credit: Pay hedges (several candidates, or the gold among other text) what the
            dataset's scorer pays them; off by default (a hedge scores 0, see the module docstring).
            Never lets a non-math answer reach a ``parse_expr`` scorer.
        timeout_s: Wall-clock deadline of one scoring call in the worker.
        max_text_chars: See :class:`~veriloop.envs.VerifierEnv`.
        render_mode: ``None`` or ``"ansi"``.
    """

    heldout_parts: ClassVar[bool] = True  # items split into train / heldout (``part``)

    def __init__(
        self,
        dataset: str = "basic_arithmetic",
        config: dict[str, Any] | None = None,
        *,
        part: Part = "train",
        heldout_fraction: float = DEFAULT_HELDOUT_FRACTION,
        max_attempts: int = 1,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        max_text_chars: int = MAX_TEXT_CHARS,
        render_mode: str | None = None,
        substring_credit: bool = False,
    ) -> None:
        super().__init__(max_attempts=max_attempts, max_text_chars=max_text_chars, render_mode=render_mode)
        rg = require("reasoning_gym", "reasoning-gym", ENV_ID)
        names = sorted(rg.factory.DATASETS)
        if dataset not in names:
            close = difflib.get_close_matches(dataset, names, n=3)
            hint = f" Did you mean {close}?" if close else ""
            raise KeyError(f"unknown reasoning-gym dataset {dataset!r} ({len(names)} known).{hint}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0 seconds, got {timeout_s!r}")
        config = dict(config or {})
        config_cls = rg.factory.DATASETS[dataset][1]
        if "seed" in {f.name for f in dataclasses.fields(config_cls)}:
            config.setdefault("seed", 0)  # a fixed item list: the env's np_random picks the item
        try:
            self.config_json = json.dumps(config, sort_keys=True)
        except TypeError as exc:
            raise TypeError(
                f"config for {dataset!r} must be JSON-serialisable (it is sent to the worker): {exc}"
            ) from exc
        self.dataset = dataset
        self.timeout_s = float(timeout_s)
        self._data = _build(dataset, self.config_json)
        # reasoning-gym's default scorer: its only partial credit is "the gold is inside the answer"
        self._hedge_credit = type(self._data).score_answer is rg.dataset.ProceduralDataset.score_answer
        self.substring_credit = bool(substring_credit)
        if len(self._data) < 1:
            raise ValueError(f"reasoning-gym dataset {dataset!r} with config {config} has no items")
        if dataset not in SAFE_SCORERS:  # the scorer workers import reasoning-gym while the model loads
            get_scorer_pool().start()
        self._indices = index_range(len(self._data), part, heldout_fraction)
        self.part_source = f"items {self._indices.start}..{self._indices.stop - 1} of {dataset} ({part} part)"

    # ------------------------------------------------------------------ VerifierEnv API
    def sample_task(self) -> dict:
        return self._item(self._indices[int(self.np_random.integers(len(self._indices)))])

    def task_from_options(self, spec: Any) -> dict:
        """``{"index": i}`` (or a full ``info["task"]`` dict, or a bare int) pins item ``i``."""
        index = spec["index"] if isinstance(spec, dict) else spec
        if not isinstance(index, int) or not 0 <= index < len(self._data):
            raise ValueError(f"task index must be an int in [0, {len(self._data)}), got {index!r}")
        return self._item(index)

    def prompt(self, task: dict) -> str:
        return f"{task['question']}\n\n{FORMAT_LINE}"

    def check(self, response: str, task: dict) -> Verdict:
        verifier_stats.count("checks")
        answer = extract_answer(response)
        if answer is None:
            return Verdict(correct=False, reason="no_answer", feedback=NO_ANSWER_FEEDBACK)
        screened = self._screen(answer, task)
        if screened is not None:
            return screened
        status, value = self._score(answer, task)
        if status != "ok":
            error: VerifierError = (
                "timeout" if status == "timeout" else "memory" if status == "memory" else "crash"
            )
            verifier_stats.count(_ERRORS[error])
            return Verdict(
                correct=False,
                error=error,
                parsed=answer,
                reason="verifier_error",
                feedback=f"The verifier failed ({error}); this episode is stopped.",
                details={"message": str(value)[:300]},
            )
        score = float(value)
        if 0 < score < 1 and self._hedge_credit and not self.substring_credit:
            return Verdict(
                correct=False, parsed=answer, reason="hedged", details={"score": 0.0}, feedback=HEDGE_FEEDBACK
            )
        correct = score >= 1.0
        reason = "correct" if correct else ("partial" if score > 0 else "wrong_value")
        feedback = "Correct." if correct else ("Partly correct." if score > 0 else "Incorrect.")
        return Verdict(
            correct=correct, parsed=answer, reason=reason, feedback=feedback, details={"score": score}
        )

    def _screen(self, answer: str, task: dict) -> Verdict | None:
        """A wrong verdict, scored 0 without calling any scorer, for an answer outside a math
        dataset's grammar or a hedge (:mod:`veriloop.interop.reasoning_gym_guard`); else ``None``."""
        if not math_screen(self.dataset, answer):
            return Verdict(
                correct=False,
                parsed=answer,
                reason="unparseable",
                feedback=NOT_MATH_FEEDBACK,
                details={"score": 0.0, "guard": "math_grammar"},
            )
        if not self.substring_credit and is_hedge(self.dataset, answer, task["answer"]):
            return Verdict(
                correct=False, parsed=answer, reason="hedged", details={"score": 0.0}, feedback=HEDGE_FEEDBACK
            )
        return None

    def _score(self, answer: str, task: dict) -> tuple[str, Any]:
        """``(status, score or message)``: our safe scorer where we have one, else reasoning-gym's,
        jailed in the scorer pool (the pool's own deadline is a backstop a little after the jail's)."""
        ours = safe_score(self.dataset, answer, task["metadata"], self.config_json)
        if ours is not None:
            return "ok", ours
        args = (self.dataset, self.config_json, task["index"], task["question"], answer, self.timeout_s)
        status, value = get_scorer_pool().run(SCORER_TASK, args, self.timeout_s + SCORER_GRACE_S)
        if status == "ok":  # the worker ran: the jail's own outcome
            status, value = value
        return status, value

    def reward(self, verdict: Verdict, task: dict) -> tuple[float, dict[str, float]]:
        score = float(verdict.details.get("score", 0.0))
        return score, {"score": score}

    # ------------------------------------------------------------------ helpers
    def _item(self, index: int) -> dict:
        entry = self._data[index]
        return {
            "dataset": self.dataset,
            "index": index,
            "question": str(entry["question"]),
            "answer": json_safe(entry.get("answer")),
            "metadata": json_safe(entry.get("metadata", {})),
        }
