"""The teacher of on-policy distillation: log-probs of the student's own tokens under a teacher.

The teacher is another model, or the policy itself with *privileged context*: the environment's
``privileged_context(task)`` (the gold answer for math, the solver's formula for Points24) added
to the first user message. The student's prompt never holds that text; only the teacher's
context, built here after the episode was played, does. Evaluation never calls this module.

The teacher reads the student's episode with its prompt swapped: teacher ids = the privileged
prompt's ids, then every token of the episode after the student's prompt, unchanged. The
teacher's log-prob of each sampled token is moved back to the student's position of that token,
so the result lines up with the episode's ``logprobs`` (0 off the sampled tokens).

Text episodes of one sample only (no image, no template rewrite or compaction): others are
refused with the reason.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import gymnasium as gym
import torch

from veriloop.agents.chat import ChatFormat
from veriloop.agents.forward import first_loss_position, token_logprobs, usable_shared_prefix
from veriloop.agents.trajectory import Trajectory
from veriloop.envs.json_safe import jsonable

#: How the privileged text is put after the task in the teacher's first user message.
PRIVILEGED_HEADER = "\n\nReference for you only (a correct answer to the task above):\n"


def privileged_text(traj: Trajectory) -> str:
    """The environment's ``privileged_context`` for the episode's task (its env, kwargs and seed).

    Raises:
        ValueError: when the environment has none, or its reset no longer gives the episode's task.
    """
    env = gym.make(traj.env_id, **traj.env_kwargs)
    try:
        _, info = env.reset(seed=traj.seed)
        base: Any = env.unwrapped  # a VerifierEnv (its task and privileged_context), or another env
        if jsonable(info.get("task", {})) != traj.task:
            raise ValueError(f"{traj.env_id} seed {traj.seed} resets to another task than the episode's")
        hint = getattr(base, "privileged_context", lambda task: None)(base.task)
    finally:
        env.close()
    if not hint:
        raise ValueError(
            f"{traj.env_id} has no privileged_context for self-distillation: implement "
            "VerifierEnv.privileged_context, or use algo.distill_teacher=model with a teacher model"
        )
    return str(hint)


def _prompt_length(traj: Trajectory) -> int:
    """Tokens of the student's first prompt (turn index -1 at the start)."""
    n = 0
    while n < len(traj.turn_index) and traj.turn_index[n] == -1:
        n += 1
    return n


def teacher_episode(traj: Trajectory, fmt: ChatFormat, hint: str | None) -> tuple[Trajectory, int]:
    """The episode as the teacher reads it, and how far its tokens moved (teacher - student).

    ``hint`` None keeps the student's prompt (a separate teacher model reads the same context).
    """
    if traj.num_samples != 1 or traj.extras or fmt.processor is not None:
        raise ValueError(
            "on-policy distillation reads text episodes of one sample (no images, template rewrites or "
            f"compactions); episode of {traj.env_id} seed {traj.seed} has {traj.num_samples} samples"
        )
    p = _prompt_length(traj)
    users = [i for i, m in enumerate(traj.messages) if m.get("role") == "user"]
    if not users or fmt.prompt_ids(traj.messages[: users[0] + 1]) != traj.token_ids[:p]:
        raise ValueError(
            "the episode's first prompt does not re-render to its tokens: distil with the chat format "
            "(tokenizer, system prompt) that played it"
        )
    if hint is None:
        return traj, 0
    first = dict(traj.messages[users[0]])
    first["content"] = f"{first['content']}{PRIVILEGED_HEADER}{hint}"
    prompt = fmt.prompt_ids([*traj.messages[: users[0]], first])
    rest = slice(p, None)
    shifted = replace(
        traj,
        token_ids=prompt + traj.token_ids[rest],
        loss_mask=[0] * len(prompt) + traj.loss_mask[rest],
        logprobs=[0.0] * len(prompt) + traj.logprobs[rest],
        turn_index=[-1] * len(prompt) + traj.turn_index[rest],
        turns=(),
        messages=[],
    )
    return shifted, len(prompt) - p


def teacher_logprobs(
    model: Any,
    trajs: Sequence[Trajectory],
    fmt: ChatFormat,
    *,
    privileged: bool,
    temperature: float = 1.0,
    pad_id: int = 0,
    micro_batch: int = 8,
) -> list[list[float]]:
    """Per episode, the teacher's log-prob of each token, at the student's positions.

    Args:
        model: The teacher (the policy's model for self-distillation), run without gradient.
        trajs: The student's episodes.
        fmt: The chat format that played them.
        privileged: Add the environment's ``privileged_context`` to the teacher's prompt.
        temperature: The rollout's sampling temperature (log-probs of softmax(logits / T)).
        pad_id: Padding token id.
        micro_batch: Episodes per forward pass; they go by prompt, then length, each pass padded
            to its own longest (memory bounded like a training micro-batch, little padding), and a
            prompt that every episode of a pass shares is run once for all of them (as in the update).

    Returns:
        One list per episode, of its length: log pi_T(x_t | teacher context) on sampled tokens, 0 elsewhere.
    """
    if micro_batch < 1:
        raise ValueError(f"micro_batch must be >= 1, got {micro_batch}")
    views = [teacher_episode(t, fmt, privileged_text(t) if privileged else None) for t in trajs]
    # by prompt, then length: a group's episodes share their (teacher's) prompt in a pass, run once
    prompts = [tuple(v.token_ids[: v.loss_mask.index(1) if 1 in v.loss_mask else 0]) for v, _ in views]
    order = sorted(range(len(views)), key=lambda i: (prompts[i], len(views[i][0].token_ids)))
    out: list[list[float]] = [[] for _ in trajs]
    for start in range(0, len(order), micro_batch):
        rows = order[start : start + micro_batch]
        width = max(len(views[i][0].token_ids) for i in rows)
        ids = torch.tensor(
            [_padded(views[i][0].token_ids, width, pad_id) for i in rows]
        )  # [b, T] right-padded
        attn = torch.tensor([_padded([1] * len(views[i][0].token_ids), width, 0) for i in rows])  # [b, T]
        mask = torch.tensor([_padded(views[i][0].loss_mask, width, 0) for i in rows])  # [b, T]
        first = first_loss_position(mask)
        with torch.no_grad():
            lp, _ = token_logprobs(
                model,
                ids,
                attn,
                temperature=temperature,
                first_position=first,
                shared_prefix=usable_shared_prefix(ids, attn, first),
            )
        for row, i in enumerate(rows):
            shift = views[i][1]
            mine = lp[row].tolist()
            out[i] = [mine[pos + shift] if on else 0.0 for pos, on in enumerate(trajs[i].loss_mask)]
    return out


def _padded(values: list[int], width: int, pad: int) -> list[int]:
    return values + [pad] * (width - len(values))


@functools.lru_cache(maxsize=2)
def _loaded_teacher(path: str) -> Any:
    """A separate teacher model, loaded once per run (frozen, evaluation mode)."""
    from veriloop.agents.loading import load_policy

    teacher = load_policy(path)
    teacher.model.eval()
    return teacher


def score_with_teacher(
    policy: Any,
    trajs: Sequence[Trajectory],
    *,
    teacher: str,
    teacher_model: str | None,
    temperature: float,
    micro_batch: int = 8,
) -> list[list[float]]:
    """:func:`teacher_logprobs` with a run's teacher (``algo.distill_teacher``).

    Args:
        policy: The student (its tokenizer formats the teacher's context).
        teacher: ``privileged`` = ``policy.model`` itself with the environment's privileged context;
            ``model`` = ``teacher_model`` (a saved policy folder) on the student's context; its
            vocabulary must be the student's.
        temperature: The rollout's sampling temperature.
        micro_batch: Episodes per forward pass (the run's ``train.micro_batch_size``).
    """
    if teacher == "privileged":
        model, privileged = policy.model, True
    else:
        loaded = _loaded_teacher(str(teacher_model))
        if len(loaded.tokenizer) != len(policy.tokenizer):
            raise ValueError(
                f"the teacher {teacher_model} has a vocabulary of {len(loaded.tokenizer)} tokens, the student "
                f"{len(policy.tokenizer)}: on-policy distillation scores the student's token ids, so they must share one"
            )
        model, privileged = loaded.model, False
    pad = policy.tokenizer.pad_token_id or 0
    fmt = ChatFormat(policy.tokenizer, processor=getattr(policy, "processor", None))
    return teacher_logprobs(
        model, trajs, fmt, privileged=privileged, temperature=temperature, pad_id=pad, micro_batch=micro_batch
    )
