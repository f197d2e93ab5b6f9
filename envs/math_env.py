"""Math with a rule verifier: ``veriloop/MathVerify-v0`` (one attempt) and ``MathVerifyRetry-v0``.

Reward schemes (``reward=`` kwarg; components go to ``info["reward_components"]``):

* ``"dapo"`` (default): ``+1`` if the final answer is equivalent to the gold answer, else ``-1``
  (DAPO's rule reward). Components: ``{"accuracy": ±1}``.
* ``"r1"``: DeepSeek-R1-Zero style, ``accuracy`` (1 or 0) plus ``format`` =
  ``format_reward`` (default 0.1) when the whole response is shaped
  ``<think>…</think><answer>…</answer>`` (whitespace around the tags allowed), else 0.
  Components: ``{"accuracy": 0|1, "format": 0|format_reward}``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from fractions import Fraction
from pathlib import Path
from typing import Any, ClassVar, Literal

from veriloop.envs.base import VerifierEnv
from veriloop.envs.datasets import (
    DEFAULT_HELDOUT_FRACTION,
    Extract,
    FieldMap,
    Part,
    check_part,
    describe_part,
    select_part,
)
from veriloop.envs.math_data import (
    KINDS,
    Kind,
    MathProblem,
    generate_problem,
    latex,
    load_problems,
    normalize_levels,
)
from veriloop.envs.presets import checked_answers, preset_fields
from veriloop.envs.verifiers import Verdict, check_math, r1_format_ok
from veriloop.envs.verifiers.math_check import DEFAULT_FLOAT_ROUNDING, check_float_rounding
from veriloop.envs.verifiers.pool import get_pool

RewardScheme = Literal["dapo", "r1"]


class MathVerifyEnv(VerifierEnv[MathProblem]):
    """Answer a math problem; the final answer (in ``\\boxed{}``) is checked by ``check_math``.

    Args:
        data: A dataset of problems: a JSONL / JSON / CSV / Parquet file, a ``save_to_disk`` folder
            or a Hub dataset id (see :mod:`veriloop.envs.datasets`); ``None`` uses the built-in
            generator.
        question_key, answer_key, answer_extract: Which row fields hold the question and the gold
            answer (see :class:`~veriloop.envs.datasets.FieldMap`), e.g. ``problem`` and ``solution``
            with ``answer_extract: last_boxed`` for MATH-style rows.
        preset: A benchmark file layout that sets those three: ``math500``, ``gsm8k``, ``aime``
            (integer answers) or ``boxed`` (see :mod:`veriloop.envs.presets`).
        part: With ``data``, which rows: ``train`` (default), ``heldout`` (the ``id`` evaluation's)
            or ``all``; the held-out rows are ``heldout_fraction`` of the distinct questions, picked
            by question hash, or the rows of ``heldout_data``. Ignored by the generator, whose
            evaluation is kept apart by seeds.
        split, revision, subset: Of a ``DatasetDict`` folder or a Hub dataset (``subset``: its config
            name, e.g. GSM8K's ``main``).
        level: Difficulty ``1``-``3``, a list of levels, or ``None`` for a uniform mix. With
            ``data``, keeps only rows with these levels.
        kinds: Generator kinds to draw from (default all: integer, fraction, linear, word).
        reward: ``"dapo"`` or ``"r1"`` (see the module docstring).
        format_reward: The ``"r1"`` format bonus.
        max_attempts: 1 = single turn; more = the model sees the verifier's feedback (which says
            the answer was wrong and never reveals the gold answer) and may try again.
        timeout: Seconds allowed to ``check_math`` per response.
        float_rounding: Decimal places a decimal answer must share with the gold (default 6, as
            math-verify: ``0.333333`` is paid for ``\\frac{1}{3}``); see
            :func:`~veriloop.envs.verifiers.math_check.check_math`.

    Observation: the prompt, then after each response the feedback text. Action: the response.

    ``info``: at reset ``{"task": MathProblem.to_dict()}`` (question, answer = gold, level, solution,
    kind, source, meta; not for the policy). At step: ``verdict``, ``reward_components``,
    ``attempt``, ``task`` and ``verifier_error`` when ``check_math`` failed (see
    :class:`~veriloop.envs.base.VerifierEnv`).
    """

    #: Rows of ``data`` are split into a training and a held-out part (``part``).
    heldout_parts: ClassVar[bool] = True

    def __init__(
        self,
        *,
        data: str | Path | None = None,
        question_key: str = "question",
        answer_key: str = "answer",
        answer_extract: Extract | None = None,
        preset: str | None = None,
        part: Part = "train",
        heldout_fraction: float = DEFAULT_HELDOUT_FRACTION,
        heldout_data: str | Path | None = None,
        split: str = "train",
        revision: str | None = None,
        subset: str | None = None,
        level: int | Sequence[int] | None = None,
        kinds: Sequence[Kind] | None = None,
        reward: RewardScheme = "dapo",
        format_reward: float = 0.1,
        max_attempts: int = 1,
        timeout: float = 5.0,
        float_rounding: int = DEFAULT_FLOAT_ROUNDING,
        **base_kwargs: Any,
    ) -> None:
        super().__init__(max_attempts=max_attempts, **base_kwargs)
        if reward not in ("dapo", "r1"):
            raise ValueError(f"reward must be 'dapo' or 'r1', got {reward!r}")
        self.levels = normalize_levels(level)
        self.kinds: tuple[Kind, ...] = tuple(kinds) if kinds is not None else KINDS
        unknown = [k for k in self.kinds if k not in KINDS]
        if unknown or not self.kinds:
            raise ValueError(f"kinds must be a non-empty subset of {KINDS}, got {kinds!r}")
        self.reward_scheme: RewardScheme = reward
        self.format_reward = float(format_reward)
        self.timeout = float(timeout)
        self.float_rounding = check_float_rounding(float_rounding)
        self._last_format_ok = False
        self.problems: list[MathProblem] | None = None
        self.part_source: str | None = None
        check_part(part, heldout_fraction)
        self.part: Part | None = part if data is not None else None
        self.preset = preset
        if data is not None:
            fields = preset_fields(preset, question_key, answer_key, answer_extract)
            self._load(
                data,
                fields,
                part,
                heldout_fraction,
                heldout_data,
                split=split,
                revision=revision,
                subset=subset,
            )
        # launch the verifier workers now (without waiting): their ~2-4 s import and warm-up then
        # overlaps with model loading instead of delaying the first check that needs one
        get_pool().start()

    def _load(
        self,
        data: str | Path,
        fields: FieldMap,
        part: Part,
        fraction: float,
        heldout_data: str | Path | None,
        **where: Any,
    ) -> None:
        """``self.problems``: the rows of ``part``, then those of the chosen levels."""
        rows = checked_answers(self.preset, load_problems(data, fields=fields, **where), str(data))
        held = None if heldout_data is None else load_problems(heldout_data, fields=fields)
        held = None if held is None else checked_answers(self.preset, held, str(heldout_data))
        if part == "heldout" and held is not None:
            kept = held
        else:
            kept = select_part(
                rows,
                [p.question for p in rows],
                part=part,
                heldout_fraction=fraction,
                heldout_questions=None if held is None else [p.question for p in held],
            )
        if self.levels is not None:
            present = sorted({p.level for p in kept}, key=str)
            kept = [p for p in kept if p.level in self.levels]
            if not kept:
                raise ValueError(
                    f"{data}: no problem of the {part} part has a level in {self.levels} (levels present: "
                    f"{present}); set env.kwargs.level=null (level: null) to use every row"
                )
        if not kept:
            raise ValueError(f"{data}: the {part} part has no rows")
        self.problems = kept
        self.part_source = describe_part(
            str(data),
            part,
            len(kept),
            len(rows),
            fraction,
            None if heldout_data is None else str(heldout_data),
        )

    def sample_task(self) -> MathProblem:
        if self.problems is not None:
            return self.problems[int(self.np_random.integers(len(self.problems)))]
        level = None if self.levels is None else self.levels[int(self.np_random.integers(len(self.levels)))]
        kind = self.kinds[int(self.np_random.integers(len(self.kinds)))]
        return generate_problem(self.np_random, level=level, kind=kind)

    def task_from_options(self, spec: Any) -> MathProblem:
        if isinstance(spec, MathProblem):
            return spec
        if isinstance(spec, Mapping):
            return MathProblem.from_dict(spec)
        raise TypeError(f'options["task"] must be a MathProblem or its dict, got {type(spec).__name__}')

    def prompt(self, task: MathProblem) -> str:
        if self.reward_scheme == "r1":
            how = (
                "Think step by step inside <think> </think>, then write the final answer inside "
                "<answer> </answer> as \\boxed{...}."
            )
        else:
            how = "Reason step by step, then give the final answer in \\boxed{...}."
        return f"Solve the following math problem. {how}\n\n{task.question}"

    def check(self, response: str, task: MathProblem) -> Verdict:
        return check_math(response, task.answer, timeout=self.timeout, float_rounding=self.float_rounding)

    def reward(self, verdict: Verdict, task: MathProblem) -> tuple[float, dict[str, float]]:
        if self.reward_scheme == "dapo":
            accuracy = 1.0 if verdict.correct else -1.0
            return accuracy, {"accuracy": accuracy}
        accuracy = 1.0 if verdict.correct else 0.0
        fmt = self.format_reward if self._last_format_ok else 0.0
        return accuracy + fmt, {"accuracy": accuracy, "format": fmt}

    # ------------------------------------------------------------------ demonstrations (SFT)
    #: ``demonstration`` is the generator's worked solution (``sft.source: generator``), not a solver.
    demonstration_source = "generator"

    def demonstration(self, task: MathProblem) -> str | None:
        """The generator's worked solution (ending in ``\\boxed{answer}``), shaped as the prompt asks."""
        if not task.solution:
            raise ValueError(
                f"math task {task.question!r:.60} has no 'solution'; generator examples need "
                "generated problems (data=None) or JSONL rows with a 'solution' field"
            )
        if self.reward_scheme != "r1":
            return str(task.solution)
        return f"<think>\n{task.solution}\n</think>\n<answer>\\boxed{{{task.answer}}}</answer>"

    def privileged_context(self, task: MathProblem) -> str:
        """For a self-distillation teacher only: the gold answer (and the worked solution when the
        problem has one). Never shown to the policy being trained or evaluated."""
        text = f"The correct final answer is \\boxed{{{task.answer}}}."
        return f"{text}\nA worked solution:\n{task.solution}" if task.solution else text

    def demonstrations_missing(self) -> str | None:
        """Why some tasks cannot be demonstrated (rows without a ``solution``), or None."""
        if self.problems is None:
            return None
        lacking = [p for p in self.problems if not p.solution]
        if not lacking:
            return None
        return (
            f"{len(lacking)} of its {len(self.problems)} training rows ({self.part_source}) have no 'solution' "
            f"field, e.g. {lacking[0].question!r:.60}. Add a worked solution ending in \\boxed{{answer}} "
            "to every row, or use sft.source=rejection, or sft.steps=0"
        )

    def wrong_demonstration(self, task: MathProblem, rng: Any, used: set[str]) -> str | None:
        """A plausible wrong solve: the worked steps, but a final answer off by a small amount
        (±1..3, or ±1..3 over the gold answer's denominator)."""
        raw = (task.meta or {}).get("value") or task.answer
        try:
            gold = Fraction(str(raw))
        except (ValueError, ZeroDivisionError):
            raise ValueError(
                f"cannot make a wrong answer near gold {task.answer!r}: not a plain number"
            ) from None
        steps = str(task.solution or "").splitlines()[:-1]
        for _ in range(100):
            delta = Fraction(
                int(rng.choice([-3, -2, -1, 1, 2, 3])), gold.denominator if rng.random() < 0.5 else 1
            )
            wrong = latex(gold + delta)
            if wrong not in used:
                used.add(wrong)
                return "\n".join([*steps, f"The answer is $\\boxed{{{wrong}}}$."])
        raise RuntimeError(f"no fresh wrong answer near {task.answer!r} after 100 draws")

    def step(self, action: str) -> tuple[Any, float, bool, bool, dict[str, Any]]:
        self._last_format_ok = isinstance(action, str) and r1_format_ok(action)
        return super().step(action)
