"""Solve → verify → correct (S2R) as an environment: ``veriloop/SolveVerify-v0``.

Each step the model takes one action:

* **solve**: any response without a ``<verify>`` tag; its answer (math ``\\boxed{}``, Points24 JSON
  formula) is checked by the task's verifier. The check is hidden: the next observation is the
  neutral :data:`VERIFY_PROMPT`.
* **verify**: a response containing ``<verify>correct</verify>`` or ``<verify>incorrect</verify>``
  (case-insensitive, spaces inside the tag allowed; if several tags appear the last one wins). It
  judges the immediately preceding solve. ``correct`` ends the episode (``terminated``);
  ``incorrect`` is answered with :data:`SOLVE_AGAIN` while solve attempts remain.
* **invalid**: a verify with no solve to judge (first action, or right after another verify), an
  unclosed ``<verify>`` tag, a tag holding anything but correct/incorrect, or a solve after
  ``max_attempts`` solves were used (it is not checked; the episode is truncated). Process reward -1.

``truncated`` is set when a verify says "incorrect" after ``max_attempts`` solves, when the model
tries to solve again after ``max_attempts`` solves, when
``max_steps`` actions were taken (default ``2 * max_attempts``), or when the verifier failed
(``verdict.error``: reward 0, ``info["verifier_error"]``). ``I give up`` has no special meaning here.

Rewards (Ma et al. 2025). Process reward per action: solve +1 if its answer is correct else -1;
verify +1 if its verdict matches the truth of the solve it checks else -1; invalid -1. Outcome
reward, on the final step only: +1 if the last solve was correct else -1 (no solve: -1).
``reward_mode="process"`` (default) returns the process reward as the step reward;
``"outcome"`` returns 0 on every step but the last, which gets the outcome reward.

``info`` at step: ``action_kind`` ("solve"/"verify"/"invalid"), ``action_index`` (0-based),
``attempt`` (solves so far), ``verdict`` (solve steps, else ``None``), ``solve_correct`` (the
solve's correctness, for a verify the correctness of the solve it checks; ``None`` when invalid),
``verify_says_correct`` and ``verify_matches_truth`` (verify steps, else ``None``),
``process_reward``, ``outcome_reward`` (final step only, else ``None``), ``reward_components``
(``{"process": p}`` or ``{"outcome": o}``), ``history`` (list of per-action dicts: ``kind``,
``correct`` / ``says_correct`` / ``matches``), ``task``, and on the final step ``stats`` =
:func:`correction_stats` (wrong→right and right→wrong counts, verification accuracy).
At reset: ``{"task": ...}`` as in the underlying task env.

The learner contract (``info["signal"]``, :class:`~veriloop.envs.base.LearnerSignal`) carries both
rewards whatever ``reward_mode`` is: ``process_reward`` on every action and ``outcome_reward`` = +1
if the last solve so far was right, else -1 (on a step before the end: the outcome of an episode a
rollout limit cut there; ``None`` when the verifier failed). ``reward_class`` is, on a verify, the
truth of the solve it judges (``"right"`` / ``"wrong"``), so that ``algo.balance_reward_classes`` can
make the verify reward balanced accuracy rather than plain accuracy. ``action_kind`` is ``"solve"`` or
``"verify"``; an invalid action is counted as a failed attempt at the action the protocol expected
(a verify right after a valid solve, a solve otherwise), so it is baselined against those actions
and the model is taught to stop emitting it. ``demonstration_episode`` writes S2R
behaviour-initialisation traces.

Evaluation metrics (per split; :func:`verification_summary` computes the last group):

* ``verify_acc`` -- the share of verify actions whose verdict matches the truth of the solve;
  ``verify_recall_right`` / ``verify_recall_wrong`` -- the same share among verifies of a right /
  of a wrong solve (per-class recall);
* ``wrong_to_right``, ``right_to_wrong`` -- the share of episodes with at least one such transition
  between consecutive solves; ``attempts`` -- solve actions per episode;
* ``verify_balanced_acc`` (the mean of the two recalls: 0.5 for a verifier that always says the same
  thing, whatever the share of wrong solves), ``verify_f1_right``, ``verify_f1_wrong`` (F1 with "the
  solve was right" / "was wrong" as the positive class) and ``verify_macro_f1``, over the split's
  pooled verifies; ``verify_wrong_share`` -- the share of verified solves that were wrong (the accuracy
  of always saying "incorrect"); ``verify_count``; ``wrong_to_right/ci95_low`` and ``/ci95_high`` -- a
  95% Wilson interval of the per-episode wrong→right rate; ``verify_balanced_acc/ci95_low`` and
  ``/ci95_high`` -- ``± 1.96`` standard errors of the balanced accuracy, judgements taken as
  independent (see :mod:`veriloop.envs.judgement_metrics`); ``verify_balanced_acc/cluster_ci95_low``,
  ``/cluster_ci95_high``, ``wrong_to_right/cluster_ci95_low`` and ``/cluster_ci95_high`` -- the same
  intervals with the episodes of one problem taken as correlated (cluster-robust standard errors by
  problem; an evaluation plays each problem ``eval.n_samples`` times, so these are the honest ones).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar, Literal

from veriloop.envs.base import SIGNAL_KEY, LearnerSignal, VerifierEnv
from veriloop.envs.datasets import Part
from veriloop.envs.judgement_metrics import (
    Z95,
    clustered_balanced_accuracy_se,
    clustered_wilson_interval,
    judgement_metrics,
    wilson_interval,
)
from veriloop.envs.verifiers import Verdict
from veriloop.envs.verifiers.guarded import guarded_check

TaskName = Literal["math", "points24"]
RewardMode = Literal["process", "outcome"]
ActionKind = Literal["solve", "verify", "invalid"]

VERIFY_PROMPT = (
    "Now verify your solution. Reply with <verify>correct</verify> if it is right, "
    "or <verify>incorrect</verify> if it is wrong."
)
SOLVE_AGAIN = "Solve again."
NO_SOLVES_LEFT = "No solve attempts left: you could only verify your last solution. Episode over."
VERIFY_OPEN, VERIFY_CLOSE = "<verify>", "</verify>"


def last_verify_tag(text: str) -> str | None:
    """Content of the last ``<verify>...</verify>`` pair (case-insensitive), ``None`` if none closes.

    Pairs are read left to right, each ``<verify>`` closed by the nearest ``</verify>`` after it (what
    the regex ``<verify>(.*?)</verify>`` finds), but in one linear pass of ``str.find``: a lazy regex
    rescans to the end from every unclosed ``<verify>``, which takes minutes on a megabyte of them.
    """
    lower = text.lower()
    content, start = None, 0
    while True:
        open_ = lower.find(VERIFY_OPEN, start)
        if open_ < 0:
            return content
        close = lower.find(VERIFY_CLOSE, open_ + len(VERIFY_OPEN))
        if close < 0:  # no later pair can close either
            return content
        content, start = lower[open_ + len(VERIFY_OPEN) : close], close + len(VERIFY_CLOSE)


def parse_action(response: str) -> tuple[ActionKind, bool | None]:
    """Classify a response: ``("verify", True/False)``, ``("solve", None)`` or ``("invalid", None)``."""
    tag = last_verify_tag(response)
    if tag is None:
        return ("invalid", None) if VERIFY_OPEN in response.lower() else ("solve", None)
    word = tag.strip()
    if word in ("correct", "incorrect"):
        return "verify", word == "correct"
    return "invalid", None


def correction_stats(history: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Episode summary from ``info["history"]``.

    Returns ``solves``, ``verifies``, ``final_correct`` (last solve right), ``wrong_to_right`` and
    ``right_to_wrong`` (transitions between consecutive solves) and ``verify_accuracy``
    (fraction of verifies matching the truth, ``None`` without verifies).
    """
    solves = [bool(h["correct"]) for h in history if h["kind"] == "solve"]
    verifies = [bool(h["matches"]) for h in history if h["kind"] == "verify"]
    pairs = list(zip(solves, solves[1:]))
    return {
        "solves": len(solves),
        "verifies": len(verifies),
        "final_correct": bool(solves and solves[-1]),
        "wrong_to_right": sum(1 for a, b in pairs if not a and b),
        "right_to_wrong": sum(1 for a, b in pairs if a and not b),
        "verify_accuracy": sum(verifies) / len(verifies) if verifies else None,
    }


def s2r_trainable_actions(kinds: Sequence[ActionKind], solve_correct: Sequence[bool | None]) -> list[bool]:
    """Which actions of a solve/verify trace are trained in S2R behaviour initialisation.

    A solve action is trained only if its answer is correct; every verify action is trained (the
    model learns to judge and to decide to correct). ``solve_correct[k]`` is ignored for verify
    actions (pass None).
    """
    if len(kinds) != len(solve_correct):
        raise ValueError(f"got {len(kinds)} action kinds but {len(solve_correct)} correctness flags")
    out = []
    for kind, ok in zip(kinds, solve_correct):
        if kind == "verify":
            out.append(True)
        elif kind == "solve":
            out.append(bool(ok))
        else:
            raise ValueError(f"action kind must be 'solve' or 'verify', got {kind!r}")
    return out


def _verify_metrics(matches: bool | None, solve_correct: bool | None) -> dict[str, float]:
    """One step's verification metrics: ``nan`` where the step is not a verify of that class."""
    hit = math.nan if matches is None else float(matches)
    return {
        "verify_acc": hit,
        "verify_recall_right": hit if solve_correct is True else math.nan,
        "verify_recall_wrong": hit if solve_correct is False else math.nan,
    }


def verification_summary(
    episodes: Sequence[Sequence[LearnerSignal]], problems: Sequence[int]
) -> dict[str, float]:
    """The split-level metrics of the module docstring, from every episode's signals and problem.

    A verify step is one with a ``verify_acc`` value; its solve was right when it has a
    ``verify_recall_right`` value; it said "correct" when it matched a right solve or missed a wrong
    one. The wrong→right interval counts the episodes whose last signal reports ``wrong_to_right``.
    The ``cluster_ci95`` intervals group both by ``problems[i]``, episode ``i``'s problem.
    """
    if len(problems) != len(episodes):
        raise ValueError(
            f"verification_summary needs one problem per episode, got {len(problems)} for {len(episodes)}"
        )
    pairs = []  # (says "the solve was wrong", the solve was wrong): "wrong" is the positive class
    # per problem: right verdicts on wrong solves, wrong solves, right verdicts on right solves, right solves
    by_problem: dict[int, list[int]] = {}
    transitions: dict[int, list[int]] = {}  # episodes with a wrong→right transition, episodes
    for signals, problem in zip(episodes, problems):
        counts = by_problem.setdefault(problem, [0, 0, 0, 0])
        for sig in signals:
            hit = sig.step_metrics.get("verify_acc", math.nan)
            if math.isnan(hit):
                continue
            wrong = math.isnan(sig.step_metrics.get("verify_recall_right", math.nan))
            pairs.append((wrong == bool(hit), wrong))
            counts[0 if wrong else 2] += int(bool(hit))
            counts[1 if wrong else 3] += 1
        if signals and "wrong_to_right" in signals[-1].episode_metrics:
            moved = transitions.setdefault(problem, [0, 0])
            moved[0] += int(signals[-1].episode_metrics["wrong_to_right"] > 0)
            moved[1] += 1
    judged = judgement_metrics(pairs)
    moved_hits, moved_counts = [m[0] for m in transitions.values()], [m[1] for m in transitions.values()]
    low, high = wilson_interval(sum(moved_hits), sum(moved_counts))
    cluster_low, cluster_high = clustered_wilson_interval(moved_hits, moved_counts)
    balanced = judged["balanced_accuracy"]
    cluster_se = clustered_balanced_accuracy_se([(a, b, c, d) for a, b, c, d in by_problem.values()])
    return {
        "verify_balanced_acc": balanced,
        "verify_balanced_acc/ci95_low": balanced - Z95 * judged["balanced_accuracy_se"],
        "verify_balanced_acc/ci95_high": balanced + Z95 * judged["balanced_accuracy_se"],
        "verify_balanced_acc/cluster_ci95_low": balanced - Z95 * cluster_se,
        "verify_balanced_acc/cluster_ci95_high": balanced + Z95 * cluster_se,
        "verify_f1_right": judged["f1_negative"],
        "verify_f1_wrong": judged["f1_positive"],
        "verify_macro_f1": judged["macro_f1"],
        "verify_wrong_share": judged["positive_share"],
        "verify_count": judged["n"],
        "wrong_to_right/ci95_low": low,
        "wrong_to_right/ci95_high": high,
        "wrong_to_right/cluster_ci95_low": cluster_low,
        "wrong_to_right/cluster_ci95_high": cluster_high,
    }


class SolveVerifyEnv(VerifierEnv[Any]):
    """S2R's solve/verify/correct loop over a math or Points24 (text) task; see the module docstring.

    Args:
        task: ``"math"`` (a :class:`~veriloop.envs.math_env.MathVerifyEnv` task source) or ``"points24"``.
        max_attempts: Solve actions allowed (default 3).
        max_steps: Actions allowed in all (default ``2 * max_attempts``).
        reward_mode: ``"process"`` or ``"outcome"``.
        part: With ``task="math"`` and ``data``, which rows (``train`` / ``heldout`` / ``all``, see
            :mod:`veriloop.envs.datasets`); the generated tasks ignore it (seeds keep them apart).
        **task_kwargs: Passed to the task env (e.g. ``level=3``, ``data=...``, ``face_cards=...``).
    """

    #: A math dataset's rows are split into a training and a held-out part (``part``).
    heldout_parts: ClassVar[bool] = True

    def __init__(
        self,
        *,
        task: TaskName = "math",
        max_attempts: int = 3,
        max_steps: int | None = None,
        reward_mode: RewardMode = "process",
        max_text_chars: int | None = None,
        render_mode: str | None = None,
        part: Part = "train",
        **task_kwargs: Any,
    ) -> None:
        base: dict[str, Any] = {"render_mode": render_mode}
        if max_text_chars is not None:
            base["max_text_chars"] = max_text_chars
        super().__init__(max_attempts=max_attempts, **base)
        if reward_mode not in ("process", "outcome"):
            raise ValueError(f"reward_mode must be 'process' or 'outcome', got {reward_mode!r}")
        if task == "math":
            from veriloop.envs.math_env import MathVerifyEnv

            self.inner: VerifierEnv[Any] = MathVerifyEnv(part=part, **task_kwargs)
        elif task == "points24":
            if task_kwargs.get("vision"):
                raise ValueError("SolveVerify-v0 supports the text Points24 task only (vision=False)")
            from veriloop.envs.points24.env import Points24Env

            self.inner = Points24Env(**task_kwargs)
        else:
            raise ValueError(f"task must be 'math' or 'points24', got {task!r}")
        self.task_name = task
        self.part_source: str | None = getattr(self.inner, "part_source", None)
        self.reward_mode: RewardMode = reward_mode
        self.max_steps = int(max_steps) if max_steps is not None else 2 * self.max_attempts
        self._history: list[dict[str, Any]] = []
        self._last_correct: bool | None = None
        self._awaiting_verify = False
        self._expected: ActionKind = "solve"
        self._steps = 0

    # ------------------------------------------------------------------ task plumbing
    def sample_task(self) -> Any:
        self.inner.np_random = self.np_random  # one generator: the seed of this env fixes the task
        self._history, self._last_correct, self._awaiting_verify, self._steps = [], None, False, 0
        return self.inner.sample_task()

    def task_from_options(self, spec: Any) -> Any:
        self._history, self._last_correct, self._awaiting_verify, self._steps = [], None, False, 0
        return self.inner.task_from_options(spec)

    def task_info(self, task: Any) -> dict[str, Any]:
        return self.inner.task_info(task)

    def prompt(self, task: Any) -> str:
        protocol = (
            "Work in turns. To SOLVE, write your solution in the format above. After each solution you "
            "will be asked to verify it: reply <verify>correct</verify> if it is right (this ends the "
            "episode) or <verify>incorrect</verify> to solve again. "
            f"You may solve at most {self.max_attempts} times."
        )
        return f"{self.inner.prompt(task)}\n\n{protocol}"

    def check(self, response: str, task: Any) -> Verdict:
        return self.inner.check(response, task)

    def reward(self, verdict: Verdict, task: Any) -> tuple[float, dict[str, float]]:
        """Process reward of a solve action: +1 correct, -1 otherwise."""
        value = 1.0 if verdict.correct else -1.0
        return value, {"process": value}

    # ------------------------------------------------------------------ demonstrations (SFT)
    #: ``demonstration_episode`` writes S2R's solve/verify/correct traces (``sft.source: s2r``).
    demonstration_source = "s2r"

    def demonstration(self, task: Any) -> str | None:
        """The inner task env's correct answer (the right solve of a trace)."""
        return self.inner.demonstration(task)

    def demonstration_episode(
        self, task: Any, rng: Any, p_wrong_first: float = 0.0
    ) -> list[tuple[str, bool]] | None:
        """An S2R behaviour-initialisation trace (Ma et al. 2025) as ``(response, trainable)`` pairs.

        With probability ``p_wrong_first`` the problem is treated as hard: ``k ~ U{1, max_attempts-1}``
        pairs (wrong solve, ``<verify>incorrect</verify>``) come before (right solve,
        ``<verify>correct</verify>``); otherwise the trace is just the last pair. Wrong solves come
        from the task env's ``wrong_demonstration`` and are context, not targets: every other action
        is trained (the model learns to judge and to decide to correct). Each verify writes the task
        env's ``verification_demonstration`` (a worked check, for Points24) before its tag."""
        if not 0.0 <= p_wrong_first <= 1.0:
            raise ValueError(f"p_wrong_first must be a probability in [0, 1], got {p_wrong_first}")
        if p_wrong_first > 0 and self.max_attempts < 2:
            raise ValueError(
                "hard traces need max_attempts >= 2 (a wrong solve, then a right one); raise it or set p_wrong_first=0"
            )
        n_wrong = int(rng.integers(1, self.max_attempts)) if rng.random() < p_wrong_first else 0
        right = self.demonstration(task)
        if right is None:
            return None
        used: set[str] = set()
        plan: list[tuple[str, bool]] = []
        for _ in range(n_wrong):
            wrong = self.inner.wrong_demonstration(task, rng, used)
            if wrong is None:
                return None
            plan += [(wrong, False), (self._judged(task, wrong, "incorrect"), True)]
        return [*plan, (right, True), (self._judged(task, right, "correct"), True)]

    def _judged(self, task: Any, solve: str, verdict: str) -> str:
        """A verify action of a trace: the task env's written check of ``solve`` (if it writes one),
        then the verdict tag."""
        check = self.inner.verification_demonstration(task, solve)
        tag = VERIFY_OPEN + verdict + VERIFY_CLOSE
        return tag if check is None else f"{check}\n{tag}"

    # ------------------------------------------------------------------ the loop
    def step(self, action: str) -> tuple[Any, float, bool, bool, dict[str, Any]]:
        task = self._check_can_step(action)
        self._expected = "verify" if self._awaiting_verify else "solve"  # what the protocol asks for now
        kind, says = parse_action(action)
        out_of_solves = kind == "solve" and self._attempt >= self.max_attempts
        if (kind == "verify" and not self._awaiting_verify) or out_of_solves:
            kind = "invalid"
        info: dict[str, Any] = {
            "action_kind": kind,
            "action_index": self._steps,
            "verdict": None,
            "solve_correct": None,
            "verify_says_correct": None,
            "verify_matches_truth": None,
        }
        self._steps += 1
        terminated = truncated = False
        if kind == "solve":
            verdict = guarded_check(self, action, task)  # a check that raises is a verifier error
            self._attempt += 1
            info["verdict"] = verdict
            if verdict.error is not None:
                info["verifier_error"] = verdict.error
                process, truncated, text = (
                    0.0,
                    True,
                    f"The verifier failed ({verdict.error}); episode stopped.",
                )
            else:
                process = self.reward(verdict, task)[0]
                self._last_correct, self._awaiting_verify = verdict.correct, True
                self._history.append({"kind": "solve", "correct": verdict.correct})
                info["solve_correct"], text = verdict.correct, VERIFY_PROMPT
        elif kind == "verify":
            matches = says == self._last_correct
            process = 1.0 if matches else -1.0
            self._awaiting_verify = False
            self._history.append({"kind": "verify", "says_correct": says, "matches": matches})
            info.update(
                solve_correct=self._last_correct, verify_says_correct=says, verify_matches_truth=matches
            )
            terminated = bool(says)
            truncated = not terminated and self._attempt >= self.max_attempts
            text = "Episode over." if terminated or truncated else SOLVE_AGAIN
        elif out_of_solves:  # the solve budget is a limit outside the task: truncate
            process, truncated, text = -1.0, True, NO_SOLVES_LEFT
            self._history.append({"kind": "invalid"})
        else:
            process = -1.0
            self._history.append({"kind": "invalid"})
            text = (
                "Invalid action: a <verify>correct</verify> or <verify>incorrect</verify> judges the solution "
                "you just gave; " + ("solve first." if not self._awaiting_verify else "use exactly that tag.")
            )
        if not (terminated or truncated) and self._steps >= self.max_steps:
            truncated, text = True, "Step budget used up. Episode over."
        self._transcript.append(f"[action]\n{action}")
        return self._finish(text, process, terminated, truncated, info, task)

    def _signal(
        self,
        info: dict[str, Any],
        process: float,
        failed: bool,
        terminated: bool,
        truncated: bool,
        stats: dict[str, Any],
    ) -> LearnerSignal:
        """The learner contract of one action (see the module docstring). ``solved``: a finished
        episode whose last solve was right and that the model ended itself (``terminated``); before
        the end, this action is a right solve."""
        kind, matches = info["action_kind"], info["verify_matches_truth"]
        if terminated or truncated:
            solved = bool(stats["final_correct"]) and terminated
        else:
            solved = kind == "solve" and info["solve_correct"] is True
        return LearnerSignal(
            process_reward=process,
            outcome_reward=None if failed else (1.0 if self._last_correct else -1.0),
            action_kind=self._expected if kind == "invalid" else kind,
            reward_class=None if kind != "verify" else ("right" if info["solve_correct"] else "wrong"),
            solved=solved,
            imitate=kind == "verify" or (kind == "solve" and bool(info["solve_correct"])),
            step_metrics=_verify_metrics(matches, info["solve_correct"]),
            episode_metrics={
                "wrong_to_right": float(stats["wrong_to_right"] > 0),
                "right_to_wrong": float(stats["right_to_wrong"] > 0),
                "attempts": float(stats["solves"]),
            },
            summarize=verification_summary,
        )

    def _finish(
        self, text: str, process: float, terminated: bool, truncated: bool, info: dict[str, Any], task: Any
    ) -> tuple[Any, float, bool, bool, dict[str, Any]]:
        done = terminated or truncated
        failed = "verifier_error" in info
        outcome = None if failed or not done else (1.0 if self._last_correct else -1.0)
        if self.reward_mode == "process":
            reward, components = process, {"process": process}
        else:
            reward = outcome if outcome is not None else 0.0
            components = {"outcome": reward}
        info.update(
            attempt=self._attempt,
            process_reward=process,
            outcome_reward=outcome,
            reward_components=components,
            history=[dict(h) for h in self._history],
            task=self.task_info(task),
        )
        stats = correction_stats(self._history)
        if done:
            info["stats"] = stats
        info[SIGNAL_KEY] = self._signal(info, process, failed, terminated, truncated, stats)
        self._done = done
        self._transcript.append(f"[observation]\n{text}")
        return self.observation(text), float(reward), terminated, truncated, info
