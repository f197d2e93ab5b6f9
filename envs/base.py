"""The reusable multi-turn verify loop: :class:`VerifierEnv`.

An episode is one task (a math problem, a hand of cards ...) and up to ``max_attempts`` model
responses. Each response is checked by a verifier; the verifier's feedback is the next observation:

    reset()            -> obs_0 = prompt(task)
    step(response_t)   -> verdict_t = check(response_t, task)
                          r_t, components_t = reward(verdict_t, task)
                          obs_{t+1} = feedback_t (+ "Try again" line while attempts remain)

Episode ends (exactly one of the two flags is set on the last step):

* ``terminated=True`` -- the task is decided: the response is correct, or the model gives up,
  or the env is single-turn (``max_attempts == 1``: the one answer is the task, right or wrong;
  this also keeps Gymnasium's ``check_env`` rule "no truncation after one step").
  Giving up: the last non-empty line of the response is ``I give up`` (case-insensitive,
  trailing punctuation ignored); it is scored by :meth:`reward` with a verdict of reason
  ``"gave_up"``.
* ``truncated=True`` -- a budget outside the task ran out: in multi-turn mode ``max_attempts``
  responses were used without success; or the verifier itself failed (``verdict.error`` set:
  reward 0.0, ``info["verifier_error"]`` = the error kind; the task was not decided, so it is
  not terminated).

A ``check`` that raises is a verifier failure, never a crash of the caller: the step gets a verdict
with ``error="crash"`` (the exception in ``details["message"]``; logged once per environment
class). A ``check`` that overruns its deadline gets ``error="timeout"``: every environment whose
``check`` is not one of veriloop's built-in checks runs it under :attr:`VerifierEnv.check_timeout_s`
(default :data:`veriloop.envs.verifiers.guarded.DEFAULT_CHECK_TIMEOUT_S`, 5 s, the math verifier's;
set it with the ``check_timeout_s`` argument); the built-in checks bound their own time (worker
processes with deadlines, or linear-time pure Python). Python cannot stop a thread, so
an overrunning user check is abandoned, not killed: keep checks pure and quick, or run slow ones in a
process of your own.

``info`` contents (every subclass documents its extras):

* at reset: ``{"task": {...}}`` -- JSON-ready task metadata (gold answer, level, cards, reference
  solution ...). It is for SFT data, evaluation and replay and must NOT be shown to the policy.
* at step: ``{"verdict": Verdict, "reward_components": dict[str, float], "attempt": int
  (1-based), "task": {...}, "signal": LearnerSignal}`` plus ``"verifier_error": str`` when the
  verifier failed.

The learner contract (``info["signal"]``, a :class:`LearnerSignal`): every step also reports, as
one typed record, everything a learning algorithm may read about it beyond the step reward. The
algorithms in ``veriloop.algos`` read only this record, the :class:`Verdict` and the step reward,
never an environment's own ``info`` keys, so a new environment needs no change there:

* ``process_reward`` / ``outcome_reward`` -- the reward of this action alone (process supervision)
  and the episode's outcome reward if it ended after this action (``None``: use the step reward);
* ``action_kind`` -- which kind of action this was, for estimators that baseline each kind on its
  own (S2R's solve vs verify); ``None`` when the env has one kind;
* ``reward_class`` -- the class of the truth a judgement action's process reward is scored against
  (S2R: a verify of a ``"right"`` or of a ``"wrong"`` solve), for rewards balanced over those classes
  (``algo.balance_reward_classes``); ``None`` for other actions;
* ``solved`` / ``imitate`` -- the episode, if it ended here, solved its task; this response is worth
  imitating (rejection-sampled SFT keeps its tokens as targets);
* ``step_metrics`` / ``episode_metrics`` -- evaluation metrics: a step metric is averaged over the
  steps that report it (``nan`` = "this step has no value"), an episode metric is read from each
  episode's last step and averaged over episodes (``"attempts"`` replaces the turn count);
* ``summarize`` -- the environment's own function from a whole split's signals (one list per
  episode) and each episode's problem to metrics that are not means, e.g. balanced accuracy or a
  confidence interval clustered by problem; the evaluator calls it once per split and reports what
  it returns beside the means.

The defaults come from the verdict (:meth:`VerifierEnv.signal`); override :meth:`signal` or
:meth:`step_metrics`, or build the record yourself in a custom ``step``. Supervised warm-up data
come from the same contract: :meth:`VerifierEnv.demonstration` (a correct response),
:meth:`VerifierEnv.wrong_demonstration` (a plausible wrong one, for correction traces) and
:meth:`VerifierEnv.demonstration_episode` (a whole multi-turn demonstration with target flags).

``reset(options={"task": t})`` pins the episode to task ``t`` (a task object or its
``info["task"]`` dict), e.g. to evaluate a fixed problem set or to replay an episode.

Writing your own environment takes four methods::

    class Capitals(VerifierEnv):
        def sample_task(self):
            return {"country": "France", "answer": "Paris"}   # draw only from self.np_random

        def prompt(self, task):
            return f"What is the capital of {task['country']}?"

        def check(self, response, task):
            ok = task["answer"].lower() in response.lower()
            return Verdict(correct=ok, reason="correct" if ok else "wrong_value",
                           feedback="Correct." if ok else "That is not right.")

        def reward(self, verdict, task):
            r = 1.0 if verdict.correct else 0.0
            return r, {"accuracy": r}

Optionally ``demonstration(task)`` (a correct answer, for ``sft.source: solver``) and
``step_metrics(verdict, task)`` (named evaluation metrics of one response).
"""

from __future__ import annotations

import copy
import dataclasses
from abc import abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Generic, Literal, Protocol, TypeVar

import gymnasium

from veriloop.envs.spaces import UnicodeText
from veriloop.envs.verifiers import Verdict
from veriloop.envs.verifiers.guarded import guarded_check

TaskT = TypeVar("TaskT")

#: The phrase that ends an episode as "given up" when it is the response's last non-empty line.
GIVE_UP_PHRASE = "i give up"

#: Default bound on response and observation lengths (characters).
MAX_TEXT_CHARS = 65536


#: How far from the end :func:`gave_up` looks: the phrase, its punctuation and trailing blank lines.
GIVE_UP_WINDOW = 4096
_LINE_BREAKS = "\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"  # what str.splitlines splits on


def gave_up(response: str) -> bool:
    """True when the last non-empty line of ``response`` is ``I give up`` (any case, trailing ``.!``).

    Reads ``response`` from the end in slices of :data:`GIVE_UP_WINDOW` characters (constant memory
    whatever its size): trailing whitespace is skipped slice by slice, then only the last window
    before it is split into lines. A last line that starts before that window is not a give-up.
    """
    end = len(response)
    while end > 0 and response[max(0, end - GIVE_UP_WINDOW) : end].isspace():
        end = max(0, end - GIVE_UP_WINDOW)
    start = max(0, end - GIVE_UP_WINDOW)
    lines = response[start:end].splitlines()
    while lines and not lines[-1].strip():
        lines.pop()
    if not lines:
        return False
    if len(lines) == 1 and start > 0 and response[start - 1] not in _LINE_BREAKS:
        return False  # the line began before the window: it is longer than any give-up line
    return lines[-1].strip().lower().rstrip(".! ") == GIVE_UP_PHRASE


#: The ``info`` key of the learner contract (:class:`LearnerSignal`), set on every step.
SIGNAL_KEY = "signal"

#: Which ``sft.source`` an environment's demonstrations serve: an exact ``"solver"``, the task
#: ``"generator"``'s worked solutions, or ``"s2r"`` solve/verify/correct traces.
DemonstrationSource = Literal["solver", "generator", "s2r"]


class SplitSummary(Protocol):
    """``LearnerSignal.summarize``: each episode's signals in step order, and each episode's problem
    (its index in the split: episodes of one problem are correlated, for clustered intervals) ->
    named metrics of the split."""

    def __call__(
        self, episodes: Sequence[Sequence[LearnerSignal]], problems: Sequence[int]
    ) -> Mapping[str, float]: ...


@dataclass(frozen=True)
class LearnerSignal:
    """What one step gives a learner besides the step reward (``info[SIGNAL_KEY]``).

    Attributes:
        process_reward: The reward of this action alone (process supervision); ``None`` = the
            step reward.
        outcome_reward: The episode's outcome reward if it ended after this action (on the final
            step: its outcome; earlier: what a rollout limit cutting it here leaves it with);
            ``None`` = the step reward (e.g. the verifier failed).
        action_kind: The kind of action this was, for per-kind baselines (at most two kinds per
            environment); an invalid action names the kind it was expected to be. ``None`` when
            the environment has a single kind of action.
        reward_class: For a judgement action, the class of the truth its process reward is scored
            against (S2R's verify: ``"right"`` or ``"wrong"``, the truth of the solve it judges), so
            that ``algo.balance_reward_classes`` can weigh the classes equally; ``None`` otherwise.
        solved: The episode, if it ended after this action, solved its task.
        imitate: This response is worth imitating (its tokens are SFT targets when a rejection-
            sampled episode is kept).
        step_metrics: Named evaluation metrics of this step, averaged over the steps that report
            them; ``nan`` = no value at this step (the metric still appears in the report).
        episode_metrics: Named evaluation metrics of the episode so far, read from its last step
            and averaged over episodes; ``"attempts"`` replaces the turn count in ``attempts/*``.
        summarize: Metrics of a whole split that are not means of the above (ratios of pooled
            counts, confidence intervals), as a function of every episode's signals and problem
            (:class:`SplitSummary`); ``None`` = none.
            A module-level function, so that signals stay picklable.
    """

    process_reward: float | None = None
    outcome_reward: float | None = None
    action_kind: str | None = None
    reward_class: str | None = None
    solved: bool = False
    imitate: bool = False
    step_metrics: Mapping[str, float] = field(default_factory=dict)
    episode_metrics: Mapping[str, float] = field(default_factory=dict)
    summarize: SplitSummary | None = None

    @classmethod
    def from_verdict(cls, verdict: Verdict | None) -> LearnerSignal:
        """The default for any step: solved and worth imitating exactly when the verdict is correct."""
        correct = verdict is not None and verdict.correct
        return cls(solved=correct, imitate=correct)


def signal_of(info: Mapping[str, Any]) -> LearnerSignal:
    """The :class:`LearnerSignal` of a step's ``info`` (built from its verdict when the environment,
    e.g. one not derived from :class:`VerifierEnv`, reports none)."""
    signal = info.get(SIGNAL_KEY)
    if isinstance(signal, LearnerSignal):
        return signal
    verdict = info.get("verdict")
    return LearnerSignal.from_verdict(verdict if isinstance(verdict, Verdict) else None)


class EpisodeOverError(RuntimeError):
    """Raised by ``step`` after the episode ended, or before the first ``reset``."""


class VerifierEnv(gymnasium.Env, Generic[TaskT]):
    """Base class for single- and multi-turn verifier environments (see the module docstring).

    Args:
        max_attempts: Responses allowed per episode (1 = single turn).
        max_text_chars: Upper bound on response and observation length; longer observations
            are cut (never silently for responses: the action space rejects them in ``check_env``,
            ``step`` itself accepts any ``str``).
        render_mode: ``None`` or ``"ansi"`` (``render()`` returns the transcript so far).
        check_timeout_s: Deadline of one :meth:`check` call in seconds (``math.inf``: none);
            ``None`` keeps the class's :attr:`check_timeout_s`.

    Subclasses implement :meth:`sample_task`, :meth:`prompt`, :meth:`check` and :meth:`reward`;
    they may override :meth:`task_info`, :meth:`task_from_options`, :meth:`feedback`,
    :meth:`observation` and :meth:`step_info`.
    """

    metadata: dict[str, Any] = {"render_modes": ["ansi"], "render_fps": 1}

    #: Deadline (seconds) of one :meth:`check` call; ``None`` = automatic: the built-in checks bound
    #: their own time, any other gets ``guarded.DEFAULT_CHECK_TIMEOUT_S`` (5 s); ``math.inf`` = none.
    #: Set it on your class, or with the ``check_timeout_s`` argument (see the module docstring).
    check_timeout_s: float | None = None

    def __init__(
        self,
        *,
        max_attempts: int = 1,
        max_text_chars: int = MAX_TEXT_CHARS,
        render_mode: str | None = None,
        check_timeout_s: float | None = None,
    ) -> None:
        if max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {max_attempts}")
        if check_timeout_s is not None:
            if not check_timeout_s > 0:
                raise ValueError(
                    f"check_timeout_s must be > 0 seconds (math.inf: none), got {check_timeout_s!r}"
                )
            self.check_timeout_s = float(check_timeout_s)
        if render_mode is not None and render_mode not in self.metadata["render_modes"]:
            raise ValueError(
                f"render_mode {render_mode!r} is not supported; choose one of "
                f"{self.metadata['render_modes']} or None"
            )
        self.max_attempts = int(max_attempts)
        self.max_text_chars = int(max_text_chars)
        self.render_mode = render_mode
        self.action_space = UnicodeText(max_length=self.max_text_chars)
        self.observation_space: gymnasium.spaces.Space[Any] = UnicodeText(max_length=self.max_text_chars)
        self._task: TaskT | None = None
        self._attempt = 0
        self._done = True
        self._transcript: list[str] = []

    # ------------------------------------------------------------------ subclass API
    @abstractmethod
    def sample_task(self) -> TaskT:
        """Draw a new task using ONLY ``self.np_random`` (so a seed fixes the episode)."""

    @abstractmethod
    def prompt(self, task: TaskT) -> str:
        """The first observation's text: the task statement and the answer format."""

    @abstractmethod
    def check(self, response: str, task: TaskT) -> Verdict:
        """Verify one response against the task."""

    @abstractmethod
    def reward(self, verdict: Verdict, task: TaskT) -> tuple[float, dict[str, float]]:
        """Scalar reward of a (non-failed) verdict and its named components."""

    def task_info(self, task: TaskT) -> dict[str, Any]:
        """JSON-ready metadata for ``info["task"]``; a fresh dict on every call."""
        if hasattr(task, "to_dict"):
            return task.to_dict()  # type: ignore[no-any-return]
        if dataclasses.is_dataclass(task) and not isinstance(task, type):
            return dataclasses.asdict(task)
        if isinstance(task, Mapping):
            return copy.deepcopy(dict(task))
        raise TypeError(f"cannot describe task of type {type(task).__name__}; override task_info()")

    def demonstration(self, task: TaskT) -> str | None:
        """A correct response to ``task`` for the supervised warm-up (``sft.source: solver``), or
        None when the environment has no solver (the default). Override it to let ``solver`` SFT
        work on your environment; each demonstration is checked by :meth:`check` before use."""
        return None

    #: The ``sft.source`` that :meth:`demonstration` / :meth:`demonstration_episode` serve (when overridden).
    demonstration_source: ClassVar[DemonstrationSource] = "solver"

    def privileged_context(self, task: TaskT) -> str | None:
        """Text that only a *teacher* may read about ``task`` (the gold answer, a verified solution),
        for on-policy self-distillation: the policy, given this text beside the prompt, scores the
        tokens the student sampled without it. None (the default): the environment has none. The
        trainer builds the teacher's context from it; it never enters a student prompt, an
        observation or an evaluation."""
        return None

    def wrong_demonstration(self, task: TaskT, rng: Any, used: set[str]) -> str | None:
        """A plausible wrong response to ``task`` not in ``used`` (added to it), drawn from ``rng``
        (a ``numpy.random.Generator``), for correction traces; None when the env cannot make one."""
        return None

    def verification_demonstration(self, task: TaskT, response: str) -> str | None:
        """A written check of ``response`` for correction traces, which ends before the verdict (the
        verdict is the verifier's), or None to judge without one (the default)."""
        return None

    def demonstration_episode(
        self, task: TaskT, rng: Any, p_wrong_first: float = 0.0
    ) -> list[tuple[str, bool]] | None:
        """A whole demonstration episode as ``(response, trainable)`` pairs, played in order from
        the reset state (default: the single :meth:`demonstration`, trainable; None without one).
        ``rng`` (a ``numpy.random.Generator``) draws what the demonstration leaves to chance, e.g.
        whether it first shows wrong attempts being corrected (probability ``p_wrong_first``)."""
        answer = self.demonstration(task)
        return None if answer is None else [(answer, True)]

    def step_metrics(self, verdict: Verdict, task: TaskT) -> dict[str, float]:
        """Named evaluation metrics of one judged response (``LearnerSignal.step_metrics``; default none)."""
        return {}

    def signal(self, verdict: Verdict, task: TaskT) -> LearnerSignal:
        """The step's :class:`LearnerSignal` (default: from the verdict, plus :meth:`step_metrics`)."""
        correct = verdict.correct and verdict.error is None
        return LearnerSignal(solved=correct, imitate=correct, step_metrics=self.step_metrics(verdict, task))

    def task_from_options(self, spec: Any) -> TaskT:
        """Turn ``options["task"]`` into a task (default: used as given)."""
        return spec  # type: ignore[no-any-return]

    def feedback(self, verdict: Verdict, task: TaskT, attempts_left: int, done: bool) -> str:
        """Text of the next observation after a response."""
        text = verdict.feedback or ("Correct." if verdict.correct else "Incorrect.")
        if not done:
            plural = "s" if attempts_left != 1 else ""
            text += f"\nTry again. You have {attempts_left} attempt{plural} left."
        return text

    def observation(self, text: str) -> Any:
        """Wrap observation text into the observation space (vision envs add the image)."""
        return self._clip(text)

    def step_info(self, verdict: Verdict, task: TaskT) -> dict[str, Any]:
        """Extra per-step ``info`` entries (default: none)."""
        return {}

    # ------------------------------------------------------------------ Gymnasium API
    @property
    def task(self) -> TaskT:
        """The current episode's task (raises before the first reset)."""
        if self._task is None:
            raise EpisodeOverError("no task yet: call reset() first")
        return self._task

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[Any, dict]:
        """Start an episode; ``options={"task": t}`` pins the task instead of sampling one."""
        super().reset(seed=seed)
        if options and "task" in options:
            self._task = self.task_from_options(options["task"])
        else:
            self._task = self.sample_task()
        self._attempt = 0
        self._done = False
        text = self.prompt(self._task)
        self._transcript = [f"[observation]\n{text}"]
        return self.observation(text), {"task": self.task_info(self._task)}

    def step(self, action: str) -> tuple[Any, float, bool, bool, dict[str, Any]]:
        """Verify one response; see the module docstring for rewards, flags and ``info``."""
        task = self._check_can_step(action)
        self._attempt += 1
        if gave_up(action):
            verdict = Verdict(correct=False, reason="gave_up", feedback="You gave up. The episode is over.")
        else:
            verdict = guarded_check(self, action, task)
        info: dict[str, Any] = {"verdict": verdict, "attempt": self._attempt, "task": self.task_info(task)}
        if verdict.error is not None:
            reward, components = 0.0, dict[str, float]()
            terminated, truncated = False, True
            info["verifier_error"] = verdict.error
            text = verdict.feedback or f"The verifier failed ({verdict.error}); this episode is stopped."
        else:
            reward, components = self.reward(verdict, task)
            # single turn: the one answer IS the task, so it is decided whatever its verdict
            terminated = verdict.correct or verdict.reason == "gave_up" or self.max_attempts == 1
            truncated = not terminated and self._attempt >= self.max_attempts
            text = self.feedback(verdict, task, self.max_attempts - self._attempt, terminated or truncated)
        info["reward_components"] = dict(components)
        info.update(self.step_info(verdict, task))
        info[SIGNAL_KEY] = self.signal(verdict, task)
        self._done = terminated or truncated
        self._transcript += [f"[action]\n{action}", f"[observation]\n{text}"]
        return self.observation(text), float(reward), bool(terminated), bool(truncated), info

    def render(self) -> str | None:
        """``"ansi"``: the transcript of the current episode as one string."""
        if self.render_mode == "ansi":
            return "\n".join(self._transcript)
        return None

    # ------------------------------------------------------------------ helpers
    def _check_can_step(self, action: Any) -> TaskT:
        if self._task is None:
            raise EpisodeOverError("step() called before reset(); call env.reset() first")
        if self._done:
            raise EpisodeOverError(
                "step() called after the episode ended (terminated or truncated); call env.reset()"
            )
        if not isinstance(action, str):
            raise TypeError(f"action must be the model's response as a str, got {type(action).__name__}")
        return self._task

    def _clip(self, text: str) -> str:
        if len(text) <= self.max_text_chars:
            return text
        marker = "\n[... cut ...]"
        return text[: self.max_text_chars - len(marker)] + marker


def split_source(env_id: str, kwargs: Mapping[str, Any], seeds: Sequence[int]) -> str:
    """What an evaluation split's problems are drawn from, in words (for reports)."""
    env = gymnasium.make(env_id, **dict(kwargs))
    try:
        rows = getattr(env.unwrapped, "part_source", None)
        size = _part_size(env.unwrapped)
    finally:
        env.close()
    where = f"env seeds {seeds[0]}..{seeds[-1]}" if seeds else "no seeds"
    if not rows:
        return f"generator, {where}"
    repeats = (
        f"; {len(seeds)} problems from {size} rows, so some rows repeat" if size and size < len(seeds) else ""
    )
    return f"{rows}, drawn by {where}{repeats}"


def _part_size(env: Any) -> int | None:
    """How many rows (or items) an env's part holds, when it says."""
    pool = getattr(getattr(env, "inner", env), "problems", None) or getattr(env, "tasks", None)
    if pool is None:
        pool = getattr(env, "_indices", None)
    return None if pool is None else len(pool)
