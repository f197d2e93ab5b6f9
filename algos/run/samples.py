"""What the model wrote, for the user to read: a few episodes as plain JSON records.

Training appends, at every RL step, the first ``run.log_samples`` episodes of the step's batch to
``RUN/samples.jsonl`` (:class:`SampleLog`, rank 0 only); each evaluation report keeps, per split,
the first sample of each of its first ``run.log_samples`` problems under ``samples``
(``veriloop.algos.eval.loop``). Both hold
:func:`episode_record`'s records. They are for the user: nothing in them is shown to the policy.

Model output is hostile: its text is only ever stored as a JSON string, never interpreted, and
every stored text is cut at :data:`MAX_SAMPLE_CHARS` characters (the cut marked with
:data:`CUT_MARK`), so a response of a megabyte cannot fill the disk.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from veriloop.agents.trajectory import Trajectory
from veriloop.algos.run.log import keep_steps_before
from veriloop.envs.json_safe import json_safe

#: The most characters of one stored text (a message, a response, a parsed answer); longer ones are cut.
MAX_SAMPLE_CHARS = 4000
#: What follows a cut text: ``"... [cut: N more characters]"`` with N the characters dropped.
CUT_MARK = "... [cut: {} more characters]"
#: The most characters of a task identifier (its ``id``) in a record.
MAX_ID_CHARS = 200


def capped(text: str, limit: int = MAX_SAMPLE_CHARS) -> str:
    """``text``, or its first ``limit`` characters followed by :data:`CUT_MARK` when it is longer."""
    return text if len(text) <= limit else text[:limit] + CUT_MARK.format(len(text) - limit)


def _content(content: Any) -> str:
    """A message's content as text: a string as it is, a multimodal part list as its text parts
    (an image part as ``[image]``), capped."""
    if isinstance(content, str):
        return capped(content)
    if isinstance(content, list):
        parts = [
            str(p.get("text", "")) if p.get("type") == "text" else f"[{p.get('type')}]"
            for p in content
            if isinstance(p, Mapping)
        ]
        return capped("".join(parts))
    return capped("" if content is None else str(content))


def _messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, str]]:
    return [{"role": str(m.get("role", "")), "content": _content(m.get("content"))} for m in messages]


def _task_id(task: Any) -> str | None:
    """The task's ``id`` (its own or its row's ``meta``), cut to :data:`MAX_ID_CHARS`; None without one."""
    if not isinstance(task, Mapping):
        return None
    meta = task.get("meta")
    found = task.get("id", meta.get("id") if isinstance(meta, Mapping) else None)
    return None if found is None else capped(str(found), MAX_ID_CHARS)


def _components(trajectory: Trajectory) -> dict[str, float]:
    """The environment's reward components (``info["reward_components"]``), summed over the turns."""
    out: dict[str, float] = {}
    for turn in trajectory.turns:
        parts = turn.info.get("reward_components")
        if isinstance(parts, Mapping):
            for name, value in parts.items():
                if isinstance(value, int | float) and not isinstance(value, bool):
                    out[str(name)] = out.get(str(name), 0.0) + float(value)
    return out


def episode_record(trajectory: Trajectory) -> dict[str, Any]:
    """One episode for the user, JSON-ready, every text capped (:func:`capped`).

    Keys: ``env`` (id), ``seed`` (the env seed that made the problem), ``task_id`` (the task's id,
    or None), ``group`` (the episode's group: its problem within the step or split), ``prompt``
    (the messages the policy saw before its first action, ``[{role, content}]``), ``responses``
    (the policy's text, one per turn), ``conversation`` (multi-turn episodes only: every message
    after the prompt, the environment's replies included), ``reward`` (summed over turns),
    ``reward_components`` (the environment's, summed over turns; empty when it gives none),
    ``correct`` / ``reason`` / ``verifier_error`` (the last judged verdict's; None without one),
    ``hit_token_limit`` (a turn stopped at ``rollout.max_new_tokens``), ``stop_reason`` (the
    rollout's own limit: ``max_turns``, ``max_context``, or None), ``turns`` and
    ``response_tokens`` (tokens the policy generated).
    """
    t = trajectory
    first = next((i for i, m in enumerate(t.messages) if m.get("role") == "assistant"), len(t.messages))
    verdict = next((turn.verdict for turn in reversed(t.turns) if turn.verdict is not None), None)
    record: dict[str, Any] = {
        "env": str(t.env_id),
        "seed": int(t.seed),
        "task_id": _task_id(t.task),
        "group": int(t.group_id),
        "prompt": _messages(t.messages[:first]),
        "responses": [capped(turn.text) for turn in t.turns],
    }
    if t.num_turns > 1:
        record["conversation"] = _messages(t.messages[first:])
    record.update(
        {
            "reward": t.total_reward,
            "reward_components": _components(t),
            "correct": None if verdict is None else bool(verdict.correct),
            "reason": None if verdict is None else capped(verdict.reason, MAX_ID_CHARS),
            "verifier_error": None if verdict is None else verdict.error,
            "hit_token_limit": any(turn.hit_token_limit for turn in t.turns),
            "stop_reason": t.stop_reason,
            "turns": t.num_turns,
            "response_tokens": t.num_generated_tokens,
        }
    )
    return record


def sample_records(trajectories: Sequence[Trajectory], k: int) -> list[dict[str, Any]]:
    """:func:`episode_record` of the first ``k`` episodes in the order given (none for ``k`` 0)."""
    return [episode_record(t) for t in trajectories[: max(k, 0)]]


class SampleLog:
    """``RUN/samples.jsonl``: at every RL step, the first ``k`` episodes of the step's batch, one
    JSON object a line: ``{"step": s, "kept": bool, **episode_record}``.

    Which episodes: the first ``k`` the step played, in the batch's order, which is group by group
    (the first problem's samples, then the next problem's), so with ``k`` up to
    ``rollout.group_size`` the lines are one group's samples, the contrast its advantages are made
    of. Several ranks: rank 0 alone writes, from the batch it holds (every rank's groups when the
    ranks gather them). ``kept``: whether this step trained on the episode (dynamic sampling drops
    groups without reward variance; with ``train.max_staleness`` > 0 the episodes are those that
    finished since the last step, and a group may be trained a step later). ``step`` counts as
    ``metrics.jsonl`` does (after the step's update: the first RL step is 1). On resume, lines of steps after the checkpoint's are dropped, as
    ``metrics.jsonl``'s are (:func:`~veriloop.algos.run.log.keep_steps_before`).
    """

    def __init__(self, run_dir: str | Path, k: int, *, resume_from_step: int | None = None) -> None:
        self.path = Path(run_dir) / "samples.jsonl"
        self.k = k
        if resume_from_step is not None:
            keep_steps_before(self.path, resume_from_step)

    def write(self, step: int, played: Sequence[Trajectory], trained: Iterable[Trajectory] = ()) -> None:
        """Append the first ``k`` of ``played`` under ``step``; ``trained``: the episodes the step trained on."""
        if self.k <= 0 or not played:
            return
        kept = {id(t) for t in trained}
        rows = [{"step": step, "kept": id(t) in kept, **episode_record(t)} for t in played[: self.k]]
        with self.path.open("a", encoding="utf-8") as f:
            f.write("".join(json.dumps(json_safe(r), allow_nan=False) + "\n" for r in rows))


def read_samples(run_dir: str | Path) -> list[dict[str, Any]]:
    """Every line of a run's ``samples.jsonl`` (a torn last line from a killed run skipped)."""
    path = Path(run_dir) / "samples.jsonl"
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows
